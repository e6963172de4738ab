"""The baseline reference: what scoring the baseline gave, kept so that later audits do not score it again.

``references/<key>/`` (``tasks.core.places.references_dir``) holds:

- ``hidden.bin``: ``[n_scored, H]`` final hidden states (the LM head's input) at the scored positions, in
  the dtype the model computes in, row ``i`` for scored token ``i``; d numbers a token, not a vocabulary's.
  A variant's KL, top-1 and Δp are exact: the baseline's own LM head turns them into its log-probabilities
  in the same chunked loop as the variant's (``tasks.engine.perplexity.token_stats``).
- ``scores.npz``: per-token NLL (float32), per-window NLL sums (float64) and token counts: the baseline's
  PPL, bit for bit.
- ``manifest.json``: what it was made from (``identity``: model, tokenizer, token stream, settings, dtype;
  ``environment``: library versions, device kind), the baseline's result and load facts, its LM head
  (tensor name, digest, soft-cap), sizes.
- ``head.safetensors`` only for a model whose head cannot be read back from its checkpoint by name.

It is written in a scratch folder while the baseline is scored, batch by batch, and renamed into place
whole, so a killed run leaves nothing a later run could pick up, and of two audits building the same
reference one keeps its own and the other uses it. The key digests identity and environment: a reference
is reused only where both match (``rescore: auto``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
import zipfile
from contextlib import AbstractContextManager
from dataclasses import MISSING, asdict, dataclass, field, fields
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from tasks.config import EvaluationConfig, Rescore
from tasks.core import console, sealed
from tasks.core.errors import DamagedReference, InputError
from tasks.core.files import discard, file_digest, read_json, scratch, write_atomically
from tasks.core.places import references_dir
from tasks.core.versions import versions
from tasks.engine.logits_head import LogitsHead
from tasks.engine.perplexity import PerplexityResult, token_stats
from tasks.engine.baseline import Baseline, BaselineBatch
from tasks.engine.settings import BOS_POLICIES, MODES, BosPolicy, Mode
from tasks.engine.stream import TokenStream
from tasks.models.gguf_file import read_header, tensor_data
from tasks.models.quantize import model_digest
from tasks.models.resolve import DTYPES, model_files

REFERENCE_FORMAT = 2  # of the files below; a reference in another format is never matched (1: no digests)
MANIFEST, HIDDEN, SCORES, HEAD = "manifest.json", "hidden.bin", "scores.npz", "head.safetensors"
SLICE = "slice.json"  # what a slice of a reference holds, beside its hidden states (``Writer.seal``)
SLICES_KEPT_SECONDS = 86_400  # an audit's slices are joined within a day, or it stopped: ``prune_references`` removes them
USED = "used"  # touched on each reuse: pruning goes by it
STORED_AS = {torch.float32: np.float32, torch.float64: np.float64, torch.bfloat16: np.int16, torch.float16: np.int16}
# Beyond float noise, per dtype: (largest |ΔNLL| of one token, |Δ mean NLL|) between two scorings of the
# same model on the same tokens. A batch size or kernel choice moves float32 tokens by ~1e-6 and 16-bit
# ones by up to ~0.1 (the mean far less); a changed model computation moves the mean.
DRIFT_TOLERANCE = {"float64": (1e-9, 1e-12), "float32": (1e-3, 1e-6), "bfloat16": (0.5, 1e-3), "float16": (0.25, 5e-4)}


def stream_digest(stream: TokenStream) -> str:
    """sha256 of exactly what is scored: the token ids, the prefix before every window and the BOS id."""
    digest = hashlib.sha256(stream.ids.numpy().astype(np.int64).tobytes())
    digest.update(json.dumps([list(stream.prefix), stream.bos, stream.bos_id]).encode())
    return digest.hexdigest()


def _valid(check, default=MISSING):
    """A field of ``Identity`` that carries the check ``parse`` makes of what a manifest holds for it."""
    return field(default=default, metadata={"valid": check})


def _digest(value: object) -> bool:
    return isinstance(value, str) and len(value) > 0


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class Identity:
    """What a baseline's numbers are a function of, but for the environment: a manifest's ``identity``, written
    (``identity``) and read back (``parse``) by this one type, so that a manifest holding anything less than a whole,
    valid one is told as damaged where it is read (``_unreadable``), and never fails a variant later.

    Attributes:
        model: ``model_digest`` of its files; tokenizer: ``tasks.data.corpus.tokenizer_digest`` of its tokenizer;
        stream: ``stream_digest`` of the tokens scored; mode, window, stride, bos: how they were scored;
        dtype: what the model computed in (a key of ``DRIFT_TOLERANCE``);
        runtime, llama_cpp: a baseline llama.cpp scored (``tasks.audit.scoring.baseline_identity``): its version and
        the settings that move its logits.
    """

    format: int = _valid(lambda value: value == REFERENCE_FORMAT)
    model: str = _valid(_digest)
    tokenizer: str = _valid(_digest)
    stream: str = _valid(_digest)
    mode: Mode = _valid(lambda value: value in MODES)
    window: int = _valid(_count)
    stride: int = _valid(_count)
    bos: BosPolicy = _valid(lambda value: value in BOS_POLICIES)
    dtype: str = _valid(lambda value: isinstance(value, str) and value in DRIFT_TOLERANCE)
    runtime: str | None = _valid(_digest, None)
    llama_cpp: dict | None = _valid(lambda value: isinstance(value, dict), None)

    @classmethod
    def parse(cls, raw: object) -> Identity:
        """The identity ``raw`` holds; ``ValueError`` saying which field is missing, wrong or unknown when it does not
        hold exactly one (a field no ppl-audit writes was put there by hand)."""
        if not isinstance(raw, dict):
            raise ValueError("is not a mapping")
        for about in fields(cls):
            value = raw.get(about.name)
            if value is None and about.default is MISSING:
                raise ValueError(f"lacks its {about.name!r}")
            if value is not None and not about.metadata["valid"](value):
                raise ValueError(f"has {about.name} {value!r}, which no baseline has")
        unknown = sorted(set(raw) - {about.name for about in fields(cls)})
        if unknown:
            raise ValueError(f"holds {unknown[0]!r}, which no identity has")
        return cls(**raw)

    def as_dict(self) -> dict:
        """As the manifest and the reference's key hold it: a field a baseline does not have (``runtime``) left out."""
        return {name: value for name, value in asdict(self).items() if value is not None}


def identity(folder: Path, tokenizer: str, stream: TokenStream, settings: EvaluationConfig, dtype: torch.dtype) -> dict:
    """What a baseline's numbers are a function of, but for the environment (``Identity``, as its manifest holds it).

    Args:
        folder: the model's local files (``model_files``).
        tokenizer: the digest of its tokenizer (``tasks.data.corpus.tokenizer_digest``).
    """
    return Identity(format=REFERENCE_FORMAT, model=model_digest(str(folder)), tokenizer=tokenizer, stream=stream_digest(stream),
                    mode=settings.mode, window=settings.window,
                    stride=settings.stride if settings.mode == "sliding" else settings.window, bos=stream.bos,
                    dtype=str(dtype).removeprefix("torch.")).as_dict()


def environment(device: torch.device) -> dict:
    """What else can change a model's numbers: the libraries that compute them and the kind of device."""
    kind = f"cuda {torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type
    return {**versions(), "device": kind}


def key_of(identity_: dict, environment_: dict) -> str:
    return hashlib.sha256(json.dumps([identity_, environment_], sort_keys=True).encode()).hexdigest()[:16]


def baseline_key(identity_: dict) -> str:
    """What makes audits comparable (``ppl-audit compare``): their baselines scored the same tokens the same way.
    Unlike the reference's key it leaves out the library versions, which change while the audits stay comparable."""
    return hashlib.sha256(json.dumps(identity_, sort_keys=True).encode()).hexdigest()[:16]


def tensor_digest(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _head_tensors(head: torch.nn.Module) -> list[torch.Tensor]:
    return [head.weight] + ([head.bias] if getattr(head, "bias", None) is not None else [])


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    return linear


def _checkpoint_tensor(folder: Path, names: list[str]) -> torch.Tensor | None:
    """The first of ``names`` found in the checkpoint's safetensors or .bin files, read alone."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    for file in files:
        if file.suffix == ".safetensors":
            with safe_open(file, "pt") as handle:
                found = next((name for name in names if name in handle.keys()), None)
                if found:
                    return handle.get_tensor(found)
        else:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            found = next((name for name in names if name in state), None)
            if found:
                return state[found].clone()
    return None


def _gguf_head(path: Path) -> tuple[str, torch.Tensor, None] | None:
    """A GGUF file's LM head, dequantized as transformers' GGUF loader does (gguf-py's ``dequantize``): its
    ``output.weight``, or the token embeddings a tied head shares."""
    import gguf

    header = read_header(path)
    tensors = {tensor.name: tensor for tensor in header.tensors}
    name = next((name for name in ("output.weight", "token_embd.weight") if name in tensors), None)
    if name is None:
        return None
    values = gguf.quants.dequantize(tensor_data(header, tensors[name]), tensors[name].tensor_type)
    return name, torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)), None


def read_head(folder: Path) -> tuple[str, torch.Tensor, torch.Tensor | None] | None:
    """The LM head's weight (and bias) read from the checkpoint by tensor name, not the whole model: the
    names come from the model's skeleton on the meta device (a tied head is stored as the embeddings).

    Args:
        folder: the checkpoint's folder, or its ``.gguf`` file.
    Returns:
        ``(name, weight [V, H], bias [V] or None)`` as stored; None when no name is found.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if folder.suffix == ".gguf" and folder.is_file():
        return _gguf_head(folder)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    head = skeleton.get_output_embeddings()
    own = next(name for name, module in skeleton.named_modules() if module is head)
    names = [f"{own}.weight"] + [name for name, parameter in skeleton.named_parameters(remove_duplicate=False)
                                 if parameter is head.weight and name != f"{own}.weight"]
    weight = _checkpoint_tensor(folder, names)
    if weight is None:
        return None
    bias = _checkpoint_tensor(folder, [f"{own}.bias"]) if getattr(head, "bias", None) is not None else None
    return names[0], weight, bias


manifest_digest = sealed.fields_digest  # of a manifest but its own ``digest``: an edited one is told from the one written


# what every manifest of this format holds, and as what: one that lacks any was edited or copied badly, and is as
# unreadable as one that is not JSON (a missing ``created`` once failed every audit of every baseline)
FIELDS = {"format": int, "key": str, "created": (int, float), "source": str, "identity": dict, "environment": dict,
          "facts": dict, "result": dict, "hidden": dict, "head": dict, "files": dict, "size_bytes": int, "digest": str}


def manifest_problem(folder: Path, manifest: dict | None) -> str | None:
    """Why ``manifest`` (``_manifest(folder)``) cannot describe the reference in ``folder``, None when it can: it is
    unreadable (``_unreadable``) or was changed after it was written (its own digest). Reading nothing but the
    manifest, it is cheap enough for every listing."""
    return _unreadable(folder, manifest) or sealed.damage(manifest, MANIFEST)


def _unreadable(folder: Path, manifest: dict | None) -> str | None:
    """Why ``manifest`` cannot even be matched to a baseline: missing, not JSON or of another format, lacking a
    field, without a whole, valid ``Identity``, or naming another reference (a manifest swapped or copied from another folder: the key is the folder's
    name). One that can is found, and its damage then said (``find_intact``), or refused under ``rescore: never``."""
    if manifest is None:
        return f"{MANIFEST} is missing, not JSON or not a format-{REFERENCE_FORMAT} manifest (an older ppl-audit's: never used)"
    wrong = next((name for name, kind in FIELDS.items() if not isinstance(manifest.get(name), kind)), None)
    if wrong is not None:
        return f"{MANIFEST} lacks its {wrong!r}" if manifest.get(wrong) is None else f"{MANIFEST}'s {wrong!r} is damaged"
    try:
        Identity.parse(manifest["identity"])
    except ValueError as wrong_identity:
        return f"{MANIFEST}'s identity {wrong_identity}"
    if manifest["key"] != folder.name:
        return f"{MANIFEST} is reference {manifest['key']}'s, not {folder.name}'s (swapped or copied)"
    return None


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@dataclass(frozen=True)
class Reference:
    """A complete reference in its folder (see the module's docstring)."""

    folder: Path
    manifest: dict

    @property
    def key(self) -> str:
        return self.folder.name

    @cached_property  # measured once, while its files are there: `reference rm` says what it freed after
    def size_bytes(self) -> int:
        return sum(file.stat().st_size for file in self.folder.iterdir() if file.is_file())

    @property
    def created(self) -> float:
        """When it was made; a damaged manifest's (``manifest_problem``) folder says when it was put in place."""
        created = self.manifest.get("created")
        return created if isinstance(created, (int, float)) else self.folder.stat().st_mtime

    @property
    def last_used(self) -> float:
        used = self.folder / USED
        return used.stat().st_mtime if used.exists() else self.created

    @cached_property
    def identity(self) -> Identity:
        """Its manifest's identity, read once: whole and valid in every reference ``open`` gives (``_unreadable``)."""
        return Identity.parse(self.manifest.get("identity"))

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.identity.dtype]

    @property
    def tolerance(self) -> float:
        """How far its head on its hidden states may give a token's NLL from the stored one: float noise."""
        return DRIFT_TOLERANCE[self.identity.dtype][0]

    @classmethod
    def open(cls, folder: Path) -> Reference | None:
        """The reference in ``folder``; None where its manifest cannot be matched to a baseline (``_unreadable``)."""
        manifest = _manifest(folder)
        return None if _unreadable(folder, manifest) else cls(folder, manifest)

    def touch(self) -> None:
        (self.folder / USED).touch()

    def scores(self) -> dict[str, np.ndarray]:
        with np.load(self.folder / SCORES) as scores:
            return {name: scores[name] for name in scores.files}

    def result(self) -> PerplexityResult:
        """The baseline's result as it was scored: the same arrays, so the same PPL to the last bit."""
        arrays = {name: array for name, array in self.scores().items() if name != "targets"}
        return PerplexityResult(**self.manifest["result"], **arrays)

    def damage(self) -> str | None:
        """What is wrong with the reference's files, None when they hold what was written: the manifest's own
        digest, each file's size and sha256, and the stored result against the stored scores. It reads every
        file once (a hidden.bin of 5 GB takes seconds: far less than scoring the baseline again)."""
        problem = manifest_problem(self.folder, self.manifest)
        if problem:
            return problem
        try:
            return sealed.files_damage(self.folder, self.manifest["files"], (HIDDEN, SCORES)) or self._inconsistency()
        except (KeyError, TypeError, IndexError) as error:  # a field within lacking or of the wrong kind, sealed again
            return f"{MANIFEST} lacks what a reference holds ({type(error).__name__}: {error})"

    def _inconsistency(self) -> str | None:
        """Where the manifest's result, the hidden states' shape and the per-token scores disagree."""
        result, scores = self.manifest["result"], self.scores()
        n = int(scores["window_tokens"].sum())
        sizes = {"tokens counted": n, "token NLLs": len(scores["token_nll"]), "targets": len(scores["targets"]),
                 "hidden rows": self.manifest["hidden"]["shape"][0]}
        if len(set(sizes.values())) > 1 or n != result["n_tokens"]:
            return f"its sizes disagree ({', '.join(f'{k} {v}' for k, v in sizes.items())}; result {result['n_tokens']})"
        starts = np.cumsum(scores["window_tokens"]) - scores["window_tokens"]
        sums = np.add.reduceat(scores["token_nll"].astype(np.float64), starts[scores["window_tokens"] > 0])
        nll_sum = float(scores["window_nll"].sum())
        if not (all(map(_close, sums, scores["window_nll"][scores["window_tokens"] > 0]))
                and _close(nll_sum, result["nll_sum"]) and _close(math.exp(nll_sum / n), result["ppl"])):
            return f"its result (PPL {result['ppl']:.6g}) is not what its scores give (PPL {math.exp(nll_sum / n):.6g})"
        return None

    def verify(self) -> str | None:
        """``damage``, and the stored head applied to every stored hidden state checked to give back the stored
        NLL of every token (within the float noise of its dtype). None when it is intact."""
        problem = self.damage()
        if problem:
            return problem
        head, softcap = self.head(self.manifest["source"], torch.device("cpu")), self.manifest["head"]["softcap"]
        hidden, nll = self._hidden(), torch.from_numpy(self.scores()["token_nll"])
        targets = torch.from_numpy(self.scores()["targets"]).long()
        for start in range(0, len(nll), 4096):
            rows = slice(start, start + 4096)
            states = torch.from_numpy(np.array(hidden[rows])).view(self.dtype)
            batch = BaselineBatch(head, states, softcap, nll[rows], self.tolerance, f"baseline reference {self.key}")
            try:
                batch.check(token_stats(head, states, targets[rows], softcap)["nll"], 0)
            except DamagedReference:
                return f"its LM head on its hidden states does not give back its stored NLL (tokens {start}…)"
        return None

    def head(self, source: str, device: torch.device) -> torch.nn.Linear:
        """The baseline's LM head, stored beside the reference or read from ``source`` (its folder or Hub id),
        checked against the digest it was made with, on ``device`` in the reference's dtype."""
        return _head(self.manifest["head"], self.folder / HEAD, source, device, self.dtype,
                     f"rebuild its reference: ppl-audit reference rm {self.key}")

    def _hidden(self) -> np.memmap:
        """``hidden.bin`` mapped, after its size is checked: a short file must not be mapped (a SIGBUS or a
        ValueError far from here), a long one not read as if it were this reference's."""
        shape = tuple(self.manifest["hidden"]["shape"])
        stored_as = np.dtype(STORED_AS[self.dtype])
        path = self.folder / HIDDEN
        size = path.stat().st_size if path.is_file() else 0
        if size != math.prod(shape) * stored_as.itemsize:
            raise DamagedReference(f"baseline reference {self.key} is damaged: {HIDDEN} holds {size} bytes, not the "
                                   f"{math.prod(shape) * stored_as.itemsize} of {shape[0]} rows of {shape[1]} "
                                   "numbers; the next audit scores the baseline again")
        return np.memmap(path, dtype=stored_as, mode="r", shape=shape)

    def baseline(self, source: str, device: torch.device) -> Baseline:
        """The baseline as a variant meets it: its LM head on ``device``, its stored hidden states, and its stored
        NLL, which each batch checks the two against (``tasks.engine.perplexity.BaselineBatch.check``).

        Args:
            source: the baseline's folder or Hub id (its head is read from there).
        """
        head, hidden, dtype = self.head(source, device), self._hidden(), self.dtype
        nll = torch.from_numpy(self.scores()["token_nll"])

        def states(slots: torch.Tensor, inputs: tuple) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(hidden[slots.numpy()])).view(dtype)

        def stored_nll(slots: torch.Tensor) -> torch.Tensor:
            return nll[slots]

        return Baseline(head, self.manifest["head"]["softcap"], states, stored_nll, self.tolerance,
                        f"baseline reference {self.key}")


def _head(about: dict, stored: Path, source: str, device: torch.device, dtype: torch.dtype, rebuild: str
          ) -> torch.nn.Module:
    """The LM head a reference's (or its first slice's) ``head`` entry names: ``stored`` beside it, or read from
    ``source`` by name; checked against its digest, on ``device`` in ``dtype``. ``rebuild``: what to do when it
    is gone or changed. A runtime's reference (``logits``: the vocabulary) keeps its logits as states: the identity."""
    if "logits" in about:
        return LogitsHead(about["logits"])
    if about["stored"]:
        from safetensors.torch import load_file

        tensors = load_file(stored)
        weight, bias = tensors["weight"], tensors.get("bias")
    else:
        found = read_head(model_files(source) or Path(source))
        if found is None:
            raise InputError(f"the baseline's LM head ({about['name']}) is no longer in {source}; {rebuild}")
        _, weight, bias = found
    weight, bias = (None if t is None else t.to(device=device, dtype=dtype) for t in (weight, bias))
    if tensor_digest(*(t for t in (weight, bias) if t is not None)) != about["digest"]:
        raise InputError(f"the baseline's LM head in {source} is not the one its reference was made with; {rebuild}")
    return _linear(weight, bias)


def _slice_about(folder: Path) -> dict:
    about = read_json(folder / SLICE, "baseline reference slice")
    if not about:
        raise DamagedReference(f"the baseline reference's slice {folder.name} is missing or damaged")
    return about


def _slice_bytes(about: dict) -> int:
    """The size of the hidden states a slice's entry says it holds."""
    return math.prod(about["hidden"]["shape"]) * np.dtype(STORED_AS[DTYPES[about["hidden"]["dtype"]]]).itemsize


def _not_as_written(folder: Path) -> DamagedReference:
    return DamagedReference(f"the baseline reference's slice {folder.name} does not hold what was written")


def slice_baseline(slices: list[Path], nll: torch.Tensor, source: str, device: torch.device) -> Baseline:
    """The baseline as a variant's shard meets it before its reference is joined: the LM head named in the first
    slice (``slices[0]``), the hidden states of the shard's own slice (``slices[-1]``, which its baseline shard
    wrote over the same windows), checked as they are read, as ``assemble`` checks them (size, sha256), and every
    batch against ``nll``, the NLL that baseline shard gave those tokens (``Baseline.nll``).

    Args:
        source: the baseline's folder or Hub id (its head is read from there unless the slice stores it).
    """
    first, own = _slice_about(slices[0]), _slice_about(slices[-1])
    (start, stop), shape = own["rows"], tuple(own["hidden"]["shape"])
    dtype = DTYPES[own["hidden"]["dtype"]]
    path, stored_as = slices[-1] / HIDDEN, np.dtype(STORED_AS[dtype])
    if shape[0] != stop - start or shape[0] != len(nll) or not path.is_file() \
            or path.stat().st_size != _slice_bytes(own) or file_digest(path) != own["sha256"]:
        raise _not_as_written(slices[-1])
    about = dict(first["head"])
    softcap = about.pop("softcap")
    head = _head(about, slices[0] / HEAD, source, device, dtype, "score the baseline again")
    hidden = np.memmap(path, dtype=stored_as, mode="r", shape=shape)

    def states(slots: torch.Tensor, inputs: tuple) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(hidden[(slots - start).numpy()])).view(dtype)

    def stored_nll(slots: torch.Tensor) -> torch.Tensor:
        return nll[slots - start]

    return Baseline(head, softcap, states, stored_nll, DRIFT_TOLERANCE[own["hidden"]["dtype"]][0],
                    f"the baseline reference's slice {slices[-1].name}")


def save_scores(path: Path, **arrays: np.ndarray) -> None:
    """``np.savez`` with no time in it: the same arrays make the same bytes, so that a reference written in slices
    on a cluster's workers equals, byte for byte, the one written whole (``np.savez`` stamps each member)."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, array in arrays.items():
            with archive.open(zipfile.ZipInfo(f"{name}.npy"), "w", force_zip64=True) as file:
                np.lib.format.write_array(file, np.asanyarray(array), allow_pickle=False)


def head_entry(source: Path, head: torch.nn.Module, staging: Path) -> dict:
    """The manifest's ``head`` of the scored model's LM head (but its soft-cap): read back from the checkpoint by name
    when that gives the same tensor, else stored as ``head.safetensors`` in ``staging``. A runtime that gives logits
    (``LogitsHead``, llama.cpp) has none: its logits are the reference's states."""
    if isinstance(head, LogitsHead):
        return {"name": "", "logits": head.out_features, "digest": f"logits of {head.out_features}", "stored": False}
    tensors = [t.detach() for t in _head_tensors(head)]
    found = read_head(source)
    read_back = found is not None and tensor_digest(*(t.to(tensors[0].dtype) for t in found[1:] if t is not None)) \
        == tensor_digest(*tensors)
    if not read_back:
        from safetensors.torch import save_file

        save_file(dict(zip(("weight", "bias"), (t.cpu().contiguous() for t in tensors))), staging / HEAD)
    return {"name": found[0] if found else "", "digest": tensor_digest(*tensors), "stored": not read_back}


class Writer:
    """Collects a reference in a scratch folder while the baseline is scored (``keep_hidden``), then
    ``publish`` puts it in place. A failure to write (a full disk) stops the writing, not the scoring.

    Args:
        staging: an empty folder of its own, on the references' file system.
        targets: ``[n_scored]`` the scored tokens' ids, in the token arrays' order: kept beside their NLL, so
            that ``Reference.verify`` can check the head and hidden states against it with no corpus at hand.
        offset: the first scored token it holds: a slice of the reference (``seal``) holds the tokens
            ``offset … offset + len(targets)`` of the stream's (their ids ``targets``).
    """

    def __init__(self, staging: Path, targets: torch.Tensor, offset: int = 0):
        self.staging, self.targets, self.n_scored, self.offset = staging, targets, len(targets), offset
        self.hidden: np.memmap | None = None
        self.dtype: torch.dtype | None = None
        self.problem = ""

    def __call__(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        if self.problem:
            return
        try:
            if self.hidden is None:
                self.dtype = hidden.dtype
                shape = (self.n_scored, hidden.shape[1])
                # the blocks are taken now: a full disk is an OSError here, not a SIGBUS on a later page write
                with open(self.staging / HIDDEN, "wb") as file:
                    os.posix_fallocate(file.fileno(), 0, math.prod(shape) * hidden.element_size())
                self.hidden = np.memmap(self.staging / HIDDEN, dtype=STORED_AS[hidden.dtype], mode="r+", shape=shape)
            rows = hidden.view(torch.int16) if hidden.dtype in (torch.bfloat16, torch.float16) else hidden
            self.hidden[(slots - self.offset).numpy()] = rows.numpy()
        except OSError as error:
            self.problem = f"could not write the baseline reference in {self.staging.parent}: {error}"

    def _closed(self) -> tuple[list[int], str]:
        """The hidden states' shape and dtype, written out."""
        if self.problem:
            raise OSError(self.problem)
        self.hidden.flush()
        shape = list(self.hidden.shape)
        self.hidden = None
        return shape, str(self.dtype).removeprefix("torch.")

    def publish(self, key: str, manifest: dict, result: PerplexityResult, head: torch.nn.Module,
                replace: bool) -> Reference:
        """Finish the files and rename the folder to ``references/<key>``.

        Args:
            manifest: identity, environment, facts, source, softcap; the result, head and sizes are added here.
            head: the scored model's LM head (``head_entry``).
            replace: put this one in place of an existing reference of the same key (a rescore);
                otherwise an existing one (built meanwhile by another audit) is kept and returned.
        """
        shape, dtype = self._closed()
        entry = head_entry(Path(manifest["source"]), head, self.staging)
        manifest |= {"hidden": {"shape": shape, "dtype": dtype}, "head": entry}
        return _finish(self.staging, key, manifest, result, self.targets, replace)

    def seal(self, head_of: dict | None, out: Path) -> Path:
        """Finish a slice: its hidden states and what it holds (``SLICE``; ``head_of``: the first slice's
        ``head_entry`` and soft-cap) beside them, put at ``out`` in one rename. Returns ``out``."""
        shape, dtype = self._closed()
        about = {"rows": [self.offset, self.offset + self.n_scored], "hidden": {"shape": shape, "dtype": dtype},
                 "sha256": file_digest(self.staging / HIDDEN), "head": head_of}
        write_atomically(self.staging / SLICE, json.dumps(about))
        out.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.staging, out)
        return out


def _finish(staging: Path, key: str, manifest: dict, result: PerplexityResult, targets: torch.Tensor, replace: bool,
            known: dict[str, str] | None = None) -> Reference:
    """Write the scores and the manifest beside ``staging``'s hidden states (and head), and rename it into place.
    ``manifest`` holds the entries of the hidden states (``hidden``: shape, dtype) and of the head (``head``), and the
    model's ``softcap``, which goes into the head's; ``known``: the sha256 of files already hashed as they were
    written (not read again)."""
    save_scores(staging / SCORES, token_nll=result.token_nll, window_nll=result.window_nll,
                window_tokens=result.window_tokens, targets=targets.numpy().astype(np.int32))
    manifest |= {"format": REFERENCE_FORMAT, "key": key, "created": time.time(), "result": result.summary(),
                 "head": manifest["head"] | {"softcap": manifest.pop("softcap")}}
    manifest["files"] = sealed.files_entry(staging, [f.name for f in staging.iterdir()], known)
    manifest["size_bytes"] = sum(f["bytes"] for f in manifest["files"].values()) + len(json.dumps(manifest))
    manifest |= sealed.seal(manifest)
    write_atomically(staging / MANIFEST, json.dumps(manifest, indent=1))
    final = references_dir() / key
    if final.exists() and (replace or Reference.open(final) is None):  # a rescore, or one too damaged to open
        discard(final)
    try:
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():  # else another audit put the same reference in place first: use it
            raise
    return Reference.open(final)


def assemble(slices: list[Path], staging: Path, key: str, manifest: dict, result: PerplexityResult,
             targets: torch.Tensor, replace: bool) -> Reference:
    """A reference from the slices the baseline's shards wrote (``Writer.seal``), as ``Writer.publish`` puts one in
    place: their hidden states joined in order, each slice checked as it is read (rows that follow on, its
    size and sha256), so that a damaged or missing slice makes no reference (``DamagedReference``).

    Args:
        slices: the shards' slice folders, in window order; the first holds the head's entry.
        staging: an empty folder of its own, on the references' file system.
        manifest, result, replace: as ``Writer.publish``'s; ``targets``: every scored token's id.
    """
    abouts = [read_json(folder / SLICE, "baseline reference slice") for folder in slices]
    rows, width, dtype, joined = 0, None, None, hashlib.sha256()
    with open(staging / HIDDEN, "wb") as out:
        for folder, about in zip(slices, abouts):
            (first, stop), (n, across) = (about["rows"], about["hidden"]["shape"]) if about else ((None, 0), (0, 0))
            if first != rows or n != stop - first or width not in (None, across) or dtype not in (None, about["hidden"]["dtype"]):
                raise DamagedReference(f"the baseline reference's slice {folder.name} is missing, damaged or out of "
                                       f"place (its rows should start at {rows})")
            width, dtype = across, about["hidden"]["dtype"]
            digest, start = hashlib.sha256(), out.tell()
            with open(folder / HIDDEN, "rb") as part:
                while block := part.read(1 << 24):
                    digest.update(block)
                    joined.update(block)
                    out.write(block)
            if digest.hexdigest() != about["sha256"] or out.tell() - start != _slice_bytes(about):
                raise _not_as_written(folder)
            rows = stop
    if rows != len(targets):
        raise DamagedReference(f"the baseline reference's slices hold {rows} of its {len(targets)} tokens")
    if not abouts[0]["head"]:
        raise DamagedReference(f"the baseline reference's first slice {slices[0].name} does not name its LM head")
    head = dict(abouts[0]["head"])
    manifest["softcap"] = head.pop("softcap")
    if head["stored"]:
        shutil.copyfile(slices[0] / HEAD, staging / HEAD)
    manifest |= {"hidden": {"shape": [rows, width], "dtype": dtype}, "head": head}
    return _finish(staging, key, manifest, result, targets, replace, {HIDDEN: joined.hexdigest()})


def building() -> AbstractContextManager[Path]:
    """A scratch folder for a ``Writer``: removed when done, and by the next build if this process dies."""
    return scratch(references_dir() / ".building")


def folders() -> dict[str, Path]:
    """Every reference's folder by key, whether or not it opens (``stored`` gives those that do)."""
    root = references_dir()
    return {f.name: f for f in root.iterdir() if f.is_dir() and not f.name.startswith(".")} if root.is_dir() else {}


def _manifest(folder: Path) -> dict | None:
    """The folder's manifest when it is one of this format, read without a warning."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == REFERENCE_FORMAT else None


def verify(folder: Path) -> str | None:
    """What is wrong with the reference in ``folder`` (``Reference.verify``), None when it is intact; read
    without the warning an audit prints, as the caller says it."""
    manifest = _manifest(folder)
    if problem := manifest_problem(folder, manifest):
        return problem
    try:
        return Reference(folder, manifest).verify()
    except (KeyError, TypeError, IndexError) as error:  # a field missing or of the wrong kind: edited by hand
        return f"{MANIFEST} lacks what a reference holds ({type(error).__name__}: {error})"


def listed() -> list[tuple[Reference, str | None]]:
    """Every reference folder, with what keeps its manifest from describing it (``manifest_problem``; None: nothing),
    most recently made first. A damaged one holds whatever of its manifest could be read (``{}`` when nothing)."""
    found = []
    for folder in folders().values():
        manifest = _manifest(folder)
        found.append((Reference(folder, manifest or {}), manifest_problem(folder, manifest)))
    return sorted(found, key=lambda pair: pair[0].created, reverse=True)


def stored() -> list[Reference]:
    """Every complete reference whose manifest can be matched to a baseline, most recently made first. One whose
    manifest cannot is left out, never read as another's: the audit of its own baseline removes it (``find_intact``)."""
    return [found for found, _ in listed() if not _unreadable(found.folder, found.manifest)]


def find(identity_: dict, environment_: dict, rescore: Rescore) -> tuple[Reference | None, Reference | None]:
    """``(reference to reuse, reference a rescore is compared with)`` for a baseline.

    ``auto`` reuses the reference made in this environment; ``never`` any of this identity (the newest);
    ``always`` reuses none. A baseline that is scored is compared with this environment's reference,
    else the newest of its identity made elsewhere (another torch, say).
    """
    same = [r for r in stored() if r.manifest["identity"] == identity_]
    here = next((r for r in same if r.manifest["environment"] == environment_), None)
    if rescore == "auto" and here:
        return here, None
    if rescore == "never" and same:
        return here or same[0], None
    return None, here or (same[0] if same else None)


def find_intact(identity_: dict, environment_: dict, rescore: Rescore
                ) -> tuple[Reference | None, Reference | None, list[str]]:
    """``find``, with what it finds checked first (``Reference.damage``): a damaged reference is never used. It is
    removed, with one warning line naming it and its damage, and the search made again; under ``rescore: never``,
    which forbids scoring the baseline again, it is refused instead. So is the folder this baseline's reference is
    kept in when its manifest cannot even be matched (``_unreadable``: no search finds it).

    Returns:
        ``find``'s pair, and a ``"<key>: <damage>"`` line for each reference removed (for the record).
    """
    removed = []
    own = references_dir() / key_of(identity_, environment_)
    manifest = _manifest(own)
    # left in place, it would fail every listing that trusted its manifest and keep the new one from taking its place
    if own.is_dir() and (problem := _unreadable(own, manifest)):
        _damaged(Reference(own, manifest or {}), problem, rescore)
        removed.append(f"{own.name}: {problem}")
    while True:
        found = find(identity_, environment_, rescore)
        damaged = next(((r, problem) for r in found if r is not None and (problem := r.damage())), None)
        if damaged is None:
            return *found, removed
        bad, problem = damaged
        _damaged(bad, problem, rescore)
        removed.append(f"{bad.key}: {problem}")


def _damaged(bad: Reference, problem: str, rescore: Rescore) -> None:
    """A damaged reference an audit found: removed, with one warning line; refused under ``rescore: never``."""
    if rescore == "never":
        raise DamagedReference(f"baseline reference {bad.key} is damaged: {problem}; rescore: never forbids making "
                               f"it again: set baseline.rescore to auto, or remove it (ppl-audit reference rm {bad.key})")
    print(f"ppl-audit: warning: baseline reference {bad.key} is damaged: {problem}; it is removed and not used",
          file=console.err())
    remove(bad)


def drift(previous: Reference, result: PerplexityResult, environment_: dict) -> dict:
    """How a rescored baseline's numbers differ from its stored reference's, and whether beyond float noise.

    Returns:
        ``reference`` (its key), ``max_abs_delta_nll`` and ``mean_abs_delta_nll`` (per token),
        ``delta_ppl_pct``, ``changed`` (environment entries that differ, ``then → now``) and ``drift``.
    """
    with np.load(previous.folder / SCORES) as scores:
        delta = result.token_nll.astype(np.float64) - scores["token_nll"].astype(np.float64)
    token_limit, mean_limit = DRIFT_TOLERANCE[previous.identity.dtype]
    mean_delta = result.mean_nll - previous.manifest["result"]["mean_nll"]
    then = previous.manifest["environment"]
    changed = {k: f"{then.get(k)} → {environment_.get(k)}" for k in sorted(set(then) | set(environment_))
               if then.get(k) != environment_.get(k)}
    largest = float(np.abs(delta).max()) if delta.size else 0.0
    return {"reference": previous.key, "max_abs_delta_nll": largest, "mean_abs_delta_nll": float(np.abs(delta).mean()),
            "delta_ppl_pct": 100 * math.expm1(mean_delta), "changed": changed,
            "drift": largest > token_limit or abs(mean_delta) > mean_limit}


def remove(reference: Reference) -> None:
    _ = reference.size_bytes  # measured before its files go
    discard(reference.folder)


def remove_damaged(found: Reference) -> bool:
    """Remove a reference that failed a check after it was found intact (a variant's batch: its head on its hidden
    states against its NLL), so that the next audit scores the baseline again instead of failing the same way. Only
    while its folder holds the manifest it was opened with: another audit may have put a new one in its place, and
    another variant's process may have removed it first. Returns whether this call removed it."""
    now = _manifest(found.folder)
    if now is None or now.get("digest") != found.manifest.get("digest"):
        return False
    try:
        discard(found.folder)
    except FileNotFoundError:
        return False
    return True


def prune_references(older_than_seconds: float | None = None, max_bytes: int | None = None) -> list[Reference]:
    """Remove references unused for longer than ``older_than_seconds``, then the least recently used until
    the rest take at most ``max_bytes``; and scratch folders of builds whose process died, and the slices of
    audits that stopped before joining them (untouched for ``SLICES_KEPT_SECONDS``). Returns the removed."""
    with building():  # clears dead builds' folders
        pass
    slices = references_dir() / ".slices"
    for folder in slices.iterdir() if slices.is_dir() else []:
        if time.time() - folder.stat().st_mtime > SLICES_KEPT_SECONDS:
            shutil.rmtree(folder, ignore_errors=True)
    kept = sorted((found for found, _ in listed()), key=lambda r: r.last_used)  # damaged ones too: by their age
    removed = []
    if older_than_seconds is not None:
        removed = [r for r in kept if time.time() - r.last_used > older_than_seconds]
        kept = [r for r in kept if r not in removed]
    if max_bytes is not None:
        total = sum(r.size_bytes for r in kept)
        while kept and total > max_bytes:
            total -= kept[0].size_bytes
            removed.append(kept.pop(0))
    for reference in removed:
        remove(reference)
    return removed
