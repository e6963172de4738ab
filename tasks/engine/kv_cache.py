"""A quantized key/value cache, as serving runtimes store it: every query attends to keys and values that went through
the cache's number format. Plain PyTorch (and transformers' cache interface, which the attention layers call).

The layouts are the runtimes' own:

- ``int8``: llama.cpp's ``q8_0`` (``-ctk q8_0``): blocks of ``group_size`` values (32 there) along each token's head
  vector, a float16 scale ``d = max|x| / 127``, ``q = round(x / d)``;
- ``int4``: llama.cpp's ``q4_0``: blocks along the head vector, ``d = m / -8`` with ``m`` the value of largest
  magnitude (its sign kept), ``q = min(15, trunc(x / d + 8.5))``, read back as ``(q - 8) · d``;
- ``fp8_e4m3``, ``fp8_e5m2``: vLLM's ``kv_cache_dtype=fp8`` / ``fp8_e5m2`` with its default scale of 1.0 (a
  checkpoint without calibrated ``k_scale``/``v_scale``): a cast, saturated at the format's largest value;
- ``float32``, ``bfloat16``, ``float16``: a cache kept in that float type (in the model's own, it changes nothing).

Keys are quantized after the rotary embedding, as they are stored. A window is scored in one forward pass, so what
the runtimes do token by token is done for all of a window's tokens at once, as llama.cpp does it: the current
token's own key and value are quantized too (transformers' ``QuantizedCache`` keeps its most recent 128 to 256 tokens
in full precision instead; that is not offered). Each token's blocks are its own, so a token's quantized key does not
depend on what else is in the window: contexts are scored as without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INTS = {"int8": 8, "int4": 4}
SCALE_BITS = 16  # llama.cpp's blocks keep a float16 scale
RUNTIME = {"int8": "llama.cpp q8_0", "int4": "llama.cpp q4_0", "fp8_e4m3": "vLLM fp8 (e4m3), scale 1.0",
           "fp8_e5m2": "vLLM fp8_e5m2, scale 1.0", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass(frozen=True)
class KVCacheFormat:
    """How a cache stores keys and values: ``dtype`` (a key of ``RUNTIME``) and ``group_size`` (int8/int4 blocks
    along the head vector)."""

    dtype: str
    group_size: int = 32

    def bits(self) -> float:
        """Bits a cached number takes, its block's scale included."""
        if self.dtype in INTS:
            return INTS[self.dtype] + SCALE_BITS / self.group_size
        return 8.0 if self.dtype in FP8 else float(torch.finfo(FLOATS[self.dtype]).bits)

    def describe(self) -> str:
        blocks = f" g{self.group_size}" if self.dtype in INTS else ""
        return f"{self.dtype}{blocks} ({RUNTIME[self.dtype]})"

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., head_dim]`` as the cache gives it back, in ``x``'s dtype."""
        if self.dtype in FLOATS:
            return x.to(FLOATS[self.dtype]).to(x.dtype)
        if self.dtype in FP8:
            largest = torch.finfo(FP8[self.dtype]).max
            return x.clamp(-largest, largest).to(FP8[self.dtype]).to(x.dtype)
        blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // self.group_size, self.group_size)
        if self.dtype == "int8":
            d = blocks.abs().amax(-1, keepdim=True) / 127
            inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
            scaled = blocks * inverse
            q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # C's roundf: halves away from zero
        else:  # q4_0: the scale carries the sign of the value of largest magnitude
            at = blocks.abs().argmax(-1, keepdim=True)
            d = blocks.gather(-1, at) / -8
            inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
            q = torch.clamp(torch.trunc(blocks * inverse + 8.5), max=15) - 8
        return (q * d.half().float()).reshape(x.shape).to(x.dtype)  # the scale is stored as float16


def head_dim(config) -> int:
    """The width of one attention head of a model of transformers ``config``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def bytes_per_token(config, bits: float) -> float:
    """Bytes one token's keys and values take in every layer of a model of transformers ``config``, at ``bits``
    per number."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim(config) * bits / 8


def cache(form: KVCacheFormat):
    """A transformers ``Cache`` for one forward pass of a window: pass it as ``past_key_values``."""
    from transformers.cache_utils import Cache, DynamicLayer

    class Layer(DynamicLayer):
        """One attention layer's cache: holds nothing (a window is attended at once) and gives back the window's
        keys and values as the format stores them."""

        def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
            return form.round_trip(keys), form.round_trip(values)

    return Cache(layer_class_to_replicate=Layer)



def attach(model, form: KVCacheFormat) -> None:
    """Score ``model`` with its keys and values stored in ``form`` (``tasks.engine.perplexity.hidden_states``)."""
    model.ppl_audit_kv_cache = form


def for_forward(model):
    """The ``past_key_values`` for one forward pass of ``model``: a quantized cache where one is attached, else None."""
    form = getattr(model, "ppl_audit_kv_cache", None)
    return None if form is None else cache(form)
