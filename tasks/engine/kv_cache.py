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
the runtimes do token by token is done for all of a window's tokens at once. With ``residual: 0`` (llama.cpp) every
query attends to quantized keys and values, its own token's included. With ``residual: R`` each query's R most recent
tokens (its own included) stay as computed, as transformers' ``QuantizedCache`` keeps its residual buffer (R = 128
there; it quantizes the buffer when it holds 2R, so there a query sees between R and 2R recent tokens unquantized:
R is the runtime's least). That is done without a second attention implementation: the cache gives back the window's
keys and values twice, quantized then as computed, and a mask lets query i see key j in the first copy when
``i - j >= R`` and in the second when ``0 <= i - j < R``. Each token's blocks are its own, so a token's quantized key
does not depend on what else is in the window: contexts are scored as without a cache setting.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tasks.core.errors import InputError

FLOATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
INTS = {"int8": 8, "int4": 4}
SCALE_BITS = 16  # llama.cpp's blocks keep a float16 scale
RUNTIME = {"int8": "llama.cpp q8_0", "int4": "llama.cpp q4_0", "fp8_e4m3": "vLLM fp8 (e4m3), scale 1.0",
           "fp8_e5m2": "vLLM fp8_e5m2, scale 1.0", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass(frozen=True)
class KVCacheFormat:
    """How a cache stores keys and values: ``dtype`` (a key of ``RUNTIME``), ``group_size`` (int8/int4 blocks
    along the head vector) and ``residual`` (each query's most recent tokens kept as computed)."""

    dtype: str
    group_size: int = 32
    residual: int = 0

    def bits(self) -> float:
        """Bits a cached number takes, its block's scale included."""
        if self.dtype in INTS:
            return INTS[self.dtype] + SCALE_BITS / self.group_size
        return 8.0 if self.dtype in FP8 else float(torch.finfo(FLOATS[self.dtype]).bits)

    def describe(self) -> str:
        blocks = f" g{self.group_size}" if self.dtype in INTS else ""
        kept = f", newest {self.residual} kept" if self.residual else ""
        return f"{self.dtype}{blocks} ({RUNTIME[self.dtype]}{kept})"

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


def window_bytes_per_token(form: KVCacheFormat | None, config, model_bits: int, window: int | None) -> float:
    """Bytes a token's keys and values take, on average over a cache of ``window`` tokens (None: a long one) in
    ``form``, its residual's newest tokens in the model's precision (``model_bits``); in the model's own without a
    format."""
    if form is None:
        return bytes_per_token(config, model_bits)
    kept = 0 if window is None else min(form.residual, window)
    stored = bytes_per_token(config, form.bits())
    return stored if not kept else ((window - kept) * stored + kept * bytes_per_token(config, model_bits)) / window


def bytes_per_token(config, bits: float) -> float:
    """Bytes one token's keys and values take in every layer of a model of transformers ``config``, at ``bits``
    per number."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim(config) * bits / 8


@functools.cache
def _eager(form: KVCacheFormat):
    """``form.round_trip``, eager even in a compiled body (evaluation.body): compiled, an int8 cache moved a tiny model's
    corpus NLL by 5.5e-6 (4.5e-5 with a residual) from the eager body's, against 1e-8 (6e-7) left eager. Wrapped
    here, when a cache is used, not where it is defined: ``torch.compiler.disable`` imports TorchDynamo (0.9 s of
    every process that imports the engine)."""
    return torch.compiler.disable(form.round_trip)


# a layer type's keys and values are what this cache stores; -> the config key of how far back its queries look
ATTENTION = {"full_attention": None, "sliding_attention": "sliding_window"}


def layer_types(config) -> list[str]:
    """Each layer's type, as transformers' own caches read it (``layer_types``, or inferred from a sliding window)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    return get_layer_types_and_kwargs(config.get_text_config())[0]


def check_cacheable(config) -> None:
    """Refuse a cache setting on a model of ``config`` that has no keys and values to keep (``kv_problem``): the
    audit's preflight says so before loading; a model scored some other way, once before its windows are."""
    problem = kv_problem(config)
    if problem:
        raise InputError(f"kv_cache: {problem}")


def kv_problem(config) -> str | None:
    """Why a model of ``config`` cannot be scored with a cache format here, or None: a layer that keeps a recurrent
    state (a hybrid's linear attention or Mamba layers) or attends in chunks has no keys and values this cache
    stores or a mask it writes."""
    others = sorted({kind for kind in layer_types(config) if kind not in ATTENTION})
    if not others:
        return None
    return (f"its layers of type {', '.join(others)} keep no keys and values of their own (a recurrent state or "
            "chunked attention) that this cache could store; kv_cache is measured on models whose layers all "
            "attend (full or sliding window): leave it out for this model")


def cache(form: KVCacheFormat):
    """A transformers ``Cache`` for one forward pass of a window: pass it as ``past_key_values``."""
    from transformers.cache_utils import Cache, DynamicLayer

    round_trip = _eager(form)

    class Layer(DynamicLayer):
        """One attention layer's cache: holds nothing (a window is attended at once) and gives back the window's
        keys and values as the format stores them (a sliding layer's whole window: the mask limits what each
        query sees)."""

        def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
            if form.residual:  # both copies: the mask picks one for each query and key (residual_mask)
                return torch.cat([round_trip(keys), keys], dim=-2), torch.cat([round_trip(values), values], dim=-2)
            return round_trip(keys), round_trip(values)

    return Cache(layer_class_to_replicate=Layer)


def residual_mask(padding: torch.Tensor | None, length: int, residual: int, batch: int, dtype: torch.dtype,
                  device: torch.device, window: int | None = None) -> torch.Tensor:
    """The additive ``[batch, 1, length, 2·length]`` mask over the two copies ``cache`` gives back with a residual:
    query i sees key j quantized when ``i - j >= residual``, as computed when ``0 <= i - j < residual``; a padded key
    (``padding`` 0) never, nor one ``window`` or more behind (a sliding layer's, as transformers' own sliding mask:
    ``i - j < window``), but every query sees its own key (a padded row must not be all masked)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    behind = i - j
    seen = torch.ones(batch, 1, 1, length, dtype=torch.bool, device=device) if padding is None else \
        padding.to(device=device, dtype=torch.bool)[:, None, None, :]
    if window is not None:
        seen = seen & (behind < window)
    old = (behind >= residual) & seen
    recent = ((behind >= 0) & (behind < residual) & seen) | (behind == 0)
    allowed = torch.cat([old.expand(batch, 1, length, length), recent.expand(batch, 1, length, length)], dim=-1)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def residual_masks(config, padding: torch.Tensor | None, length: int, residual: int, batch: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor | dict[str, torch.Tensor]:
    """``residual_mask`` for each kind of attention layer the model of ``config`` has, each with its own window: one
    mask where all its layers look as far back (Llama's, Mistral's), else one per layer type, as the models that mix
    full and sliding layers (Gemma 2 and 3, gpt-oss) take them. One mask for all would let a sliding layer see
    beyond its window: a float32 cache, which changes nothing, moved a tiny Gemma 2's loss by 6e-4."""
    text = config.get_text_config()
    masks = {kind: residual_mask(padding, length, residual, batch, dtype, device,
                                 getattr(text, ATTENTION[kind]) if ATTENTION[kind] else None)
             for kind in dict.fromkeys(layer_types(config))}
    return next(iter(masks.values())) if len(masks) == 1 else masks


def forward_arguments(model, form: KVCacheFormat | None, input_ids: torch.Tensor, padding: torch.Tensor | None,
                      device: torch.device) -> dict:
    """What one forward pass of ``model`` over ``input_ids`` ``[batch, length]`` takes besides them: its
    ``attention_mask`` (``padding``, or the residual's own mask) and, with a cache format ``form`` (None: keys and
    values as computed), the quantized cache as ``past_key_values``. The format is passed with each pass, never kept
    on the model: a model is the library's object, and one loaded model may be scored with and without a cache."""
    if form is None:
        return {"attention_mask": padding}
    if not form.residual:
        return {"attention_mask": padding, "past_key_values": cache(form)}
    batch, length = input_ids.shape
    return {"attention_mask": residual_masks(model.config, padding, length, form.residual, batch, model.dtype, device),
            "past_key_values": cache(form)}
