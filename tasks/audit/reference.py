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
  (tensor name, digest, soft-cap), sizes: read and written as ``tasks.audit.manifest.Manifest``.
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
from dataclasses import dataclass
from dataclasses import replace as replace_field
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from tasks.audit.head_said import save_stored_head, stored_head
from tasks.audit.manifest import MANIFEST_JSON as MANIFEST  # the file's name, as the references' tests read it
from tasks.audit.manifest import (DRIFT_TOLERANCE, REFERENCE_FORMAT, Draft, Head, Hidden, Identity, Manifest, Scores,
                                  Slice, Unreadable, created, head_and_softcap, load)
from tasks.config import EvaluationConfig, Rescore
from tasks.core import console, sealed
from tasks.core.errors import DamagedReference, InputError
from tasks.core.files import discard, file_digest, read_json, scratch, write_atomically
from tasks.core.places import references_dir
from tasks.core.versions import versions
from tasks.engine.logits_head import LogitsHead
from tasks.engine.perplexity import PerplexityResult, token_stats
from tasks.engine.baseline import Baseline, BaselineBatch
from tasks.engine.stream import TokenStream
from tasks.models.gguf_file import read_header, tensor_data
from tasks.models.quantize import model_digest
from tasks.models.resolve import DTYPES, model_files

HIDDEN, SCORES, HEAD = "hidden.bin", "scores.npz", "head.safetensors"
SLICE = "slice.json"  # what a slice of a reference holds, beside its hidden states (``Writer.seal``)
SLICES_KEPT_SECONDS = 86_400  # an audit's slices are joined within a day, or it stopped: ``prune_references`` removes them
USED = "used"  # touched on each reuse: pruning goes by it
STORED_AS = {torch.float32: np.float32, torch.float64: np.float64, torch.bfloat16: np.int16, torch.float16: np.int16}


def stream_digest(stream: TokenStream) -> str:
    """sha256 of exactly what is scored: the token ids, the prefix before every window and the BOS id."""
    digest = hashlib.sha256(stream.ids.numpy().astype(np.int64).tobytes())
    digest.update(json.dumps([list(stream.prefix), stream.bos, stream.bos_id]).encode())
    return digest.hexdigest()


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


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@dataclass(frozen=True)
class Reference:
    """A reference in its folder (see the module's docstring), its manifest read once and checked (``read``).

    Attributes:
        manifest: None where it cannot be matched to a baseline (``Manifest.of_json``): such a folder is only listed
            (``listed``) and removed, never opened (``open``).
        problem: why its manifest cannot describe it, None when it can: it is unreadable or was changed after it was
            written (its own digest). Reading nothing but the manifest, it is cheap enough for every listing.
        dated: when its manifest says it was made, even one that cannot be read (``created``).
    """

    folder: Path
    manifest: Manifest | None
    problem: str | None = None
    dated: float | None = None

    @classmethod
    def read(cls, folder: Path) -> Reference:
        """The folder's reference as its manifest describes it, read without a warning."""
        raw = load(folder)
        try:
            return cls(folder, Manifest.of_json(raw, folder.name), sealed.damage(raw, MANIFEST), created(raw))
        except Unreadable as why:
            return cls(folder, None, str(why), created(raw))

    @classmethod
    def open(cls, folder: Path) -> Reference | None:
        """The reference in ``folder``; None where its manifest cannot be matched to a baseline."""
        found = cls.read(folder)
        return None if found.manifest is None else found

    @property
    def key(self) -> str:
        return self.folder.name

    @cached_property  # measured once, while its files are there: `reference rm` says what it freed after
    def size_bytes(self) -> int:
        return sum(file.stat().st_size for file in self.folder.iterdir() if file.is_file())

    @property
    def created(self) -> float:
        """When it was made; a folder whose manifest does not say (``dated``) says when it was put in place."""
        return self.folder.stat().st_mtime if self.dated is None else self.dated

    @property
    def last_used(self) -> float:
        used = self.folder / USED
        return used.stat().st_mtime if used.exists() else self.created

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.manifest.identity.dtype]

    @property
    def tolerance(self) -> float:
        """How far its head on its hidden states may give a token's NLL from the stored one: float noise."""
        return DRIFT_TOLERANCE[self.manifest.identity.dtype][0]

    def touch(self) -> None:
        (self.folder / USED).touch()

    def scores(self) -> Scores:
        return Scores.read(self.folder / SCORES)

    def result(self) -> PerplexityResult:
        """The baseline's result as it was scored: the same arrays, so the same PPL to the last bit."""
        scores = self.scores()
        return PerplexityResult(**self.manifest.result.summary, token_nll=scores.token_nll,
                                window_nll=scores.window_nll, window_tokens=scores.window_tokens)

    def damage(self) -> str | None:
        """What is wrong with the reference's files, None when they hold what was written: the manifest's own
        digest (``problem``), each file's size and sha256, and the stored result against the stored scores. It reads
        every file once (a hidden.bin of 5 GB takes seconds: far less than scoring the baseline again)."""
        if self.problem:
            return self.problem
        try:
            return sealed.files_damage(self.folder, self.manifest.files, (HIDDEN, SCORES)) or self._inconsistency()
        except (KeyError, TypeError, IndexError) as error:  # scores lacking what they hold: written by hand
            return f"{MANIFEST} lacks what a reference holds ({type(error).__name__}: {error})"

    def _inconsistency(self) -> str | None:
        """Where the manifest's result, the hidden states' shape and the per-token scores disagree."""
        result, scores = self.manifest.result, self.scores()
        n = int(scores.window_tokens.sum())
        sizes = {"tokens counted": n, "token NLLs": len(scores.token_nll), "targets": len(scores.targets),
                 "hidden rows": self.manifest.hidden.rows}
        if len(set(sizes.values())) > 1 or n != result.n_tokens:
            return f"its sizes disagree ({', '.join(f'{k} {v}' for k, v in sizes.items())}; result {result.n_tokens})"
        counted = scores.window_tokens > 0
        starts = np.cumsum(scores.window_tokens) - scores.window_tokens
        sums = np.add.reduceat(scores.token_nll.astype(np.float64), starts[counted])
        nll_sum = float(scores.window_nll.sum())
        if not (all(map(_close, sums, scores.window_nll[counted]))
                and _close(nll_sum, result.nll_sum) and _close(math.exp(nll_sum / n), result.ppl)):
            return f"its result (PPL {result.ppl:.6g}) is not what its scores give (PPL {math.exp(nll_sum / n):.6g})"
        return None

    def verify(self) -> str | None:
        """``damage``, and the stored head applied to every stored hidden state checked to give back the stored
        NLL of every token (within the float noise of its dtype). None when it is intact."""
        problem = self.damage()
        if problem:
            return problem
        head, softcap, scores = self.head(self.manifest.source, torch.device("cpu")), self.manifest.softcap, self.scores()
        hidden, nll = self._hidden(), torch.from_numpy(scores.token_nll)
        targets = torch.from_numpy(scores.targets).long()
        for start in range(0, len(nll), 4096):
            rows = slice(start, start + 4096)
            states = torch.from_numpy(np.array(hidden[rows])).view(self.dtype)
            batch = BaselineBatch(head, states, softcap, nll[rows], self.tolerance, f"baseline reference {self.key}")
            try:
                batch.check(token_stats(head, states, targets[rows], softcap).nll, 0)
            except DamagedReference:
                return f"its LM head on its hidden states does not give back its stored NLL (tokens {start}…)"
        return None

    def head(self, source: str, device: torch.device) -> torch.nn.Linear:
        """The baseline's LM head, stored beside the reference or read from ``source`` (its folder or Hub id),
        checked against the digest it was made with, on ``device`` in the reference's dtype."""
        return _head(self.manifest.head, self.folder / HEAD, source, device, self.dtype,
                     f"rebuild its reference: ppl-audit reference rm {self.key}")

    def _hidden(self) -> np.memmap:
        """``hidden.bin`` mapped, after its size is checked: a short file must not be mapped (a SIGBUS or a
        ValueError far from here), a long one not read as if it were this reference's."""
        hidden = self.manifest.hidden
        path = self.folder / HIDDEN
        size = path.stat().st_size if path.is_file() else 0
        if size != _hidden_bytes(hidden, self.dtype):
            raise DamagedReference(f"baseline reference {self.key} is damaged: {HIDDEN} holds {size} bytes, not the "
                                   f"{_hidden_bytes(hidden, self.dtype)} of {hidden.rows} rows of {hidden.width} "
                                   "numbers; the next audit scores the baseline again")
        return np.memmap(path, dtype=STORED_AS[self.dtype], mode="r", shape=hidden.shape)

    def baseline(self, source: str, device: torch.device) -> Baseline:
        """The baseline as a variant meets it: its LM head on ``device``, its stored hidden states, and its stored
        NLL, which each batch checks the two against (``tasks.engine.perplexity.BaselineBatch.check``).

        Args:
            source: the baseline's folder or Hub id (its head is read from there).
        """
        head, hidden, dtype = self.head(source, device), self._hidden(), self.dtype
        nll = torch.from_numpy(self.scores().token_nll)

        def states(slots: torch.Tensor, inputs: tuple) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(hidden[slots.numpy()])).view(dtype)

        def stored_nll(slots: torch.Tensor) -> torch.Tensor:
            return nll[slots]

        return Baseline(head, self.manifest.softcap, states, stored_nll, self.tolerance,
                        f"baseline reference {self.key}")


def _hidden_bytes(hidden: Hidden, dtype: torch.dtype) -> int:
    """The size of ``hidden.bin`` holding ``hidden`` computed in ``dtype``."""
    return math.prod(hidden.shape) * np.dtype(STORED_AS[dtype]).itemsize


def _head(about: Head, stored: Path, source: str, device: torch.device, dtype: torch.dtype, rebuild: str
          ) -> torch.nn.Module:
    """The LM head a reference's (or its first slice's) ``head`` entry names: ``stored`` beside it, or read from
    ``source`` by name; checked against its digest, on ``device`` in ``dtype``. ``rebuild``: what to do when it
    is gone or changed. A runtime's reference (``logits``: the vocabulary) keeps its logits as states: the identity."""
    if about.logits is not None:
        return LogitsHead(about.logits)
    if about.stored:
        weight, bias = stored_head(stored)
    else:
        found = read_head(model_files(source) or Path(source))
        if found is None:
            raise InputError(f"the baseline's LM head ({about.name}) is no longer in {source}; {rebuild}")
        _, weight, bias = found
    weight, bias = (None if t is None else t.to(device=device, dtype=dtype) for t in (weight, bias))
    if tensor_digest(*(t for t in (weight, bias) if t is not None)) != about.digest:
        raise InputError(f"the baseline's LM head in {source} is not the one its reference was made with; {rebuild}")
    return _linear(weight, bias)


def _slice_about(folder: Path) -> Slice | None:
    """What a slice's ``SLICE`` says it holds; None when it is missing or damaged (read_json says which)."""
    return Slice.of_json(read_json(folder / SLICE, "baseline reference slice"))


def _opened_slice(folder: Path) -> Slice:
    about = _slice_about(folder)
    if about is None:
        raise DamagedReference(f"the baseline reference's slice {folder.name} is missing or damaged")
    return about


def _named_head(folder: Path, first: Slice) -> Head:
    """The LM head the first slice names: only that one does."""
    if first.head is None:
        raise DamagedReference(f"the baseline reference's first slice {folder.name} does not name its LM head")
    return first.head


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
    first, own = _opened_slice(slices[0]), _opened_slice(slices[-1])
    start, dtype = own.first, DTYPES[own.hidden.dtype]
    path = slices[-1] / HIDDEN
    if own.hidden.rows != own.stop - start or own.hidden.rows != len(nll) or not path.is_file() \
            or path.stat().st_size != _hidden_bytes(own.hidden, dtype) or file_digest(path) != own.sha256:
        raise _not_as_written(slices[-1])
    head = _head(_named_head(slices[0], first), slices[0] / HEAD, source, device, dtype, "score the baseline again")
    hidden = np.memmap(path, dtype=STORED_AS[dtype], mode="r", shape=own.hidden.shape)

    def states(slots: torch.Tensor, inputs: tuple) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(hidden[(slots - start).numpy()])).view(dtype)

    def stored_nll(slots: torch.Tensor) -> torch.Tensor:
        return nll[slots - start]

    return Baseline(head, first.softcap, states, stored_nll, DRIFT_TOLERANCE[own.hidden.dtype][0],
                    f"the baseline reference's slice {slices[-1].name}")


def save_scores(path: Path, **arrays: np.ndarray) -> None:
    """``np.savez`` with no time in it: the same arrays make the same bytes, so that a reference written in slices
    on a cluster's workers equals, byte for byte, the one written whole (``np.savez`` stamps each member)."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, array in arrays.items():
            with archive.open(zipfile.ZipInfo(f"{name}.npy"), "w", force_zip64=True) as file:
                np.lib.format.write_array(file, np.asanyarray(array), allow_pickle=False)


def lm_head(source: Path, head: torch.nn.Module, staging: Path) -> Head:
    """The manifest's ``head`` of the scored model's LM head: read back from the checkpoint by name when that gives
    the same tensor, else stored as ``head.safetensors`` in ``staging``. A runtime that gives logits (``LogitsHead``,
    llama.cpp) has none: its logits are the reference's states."""
    if isinstance(head, LogitsHead):
        return Head("", f"logits of {head.out_features}", False, logits=head.out_features)
    tensors = [t.detach() for t in _head_tensors(head)]
    found = read_head(source)
    read_back = found is not None and tensor_digest(*(t.to(tensors[0].dtype) for t in found[1:] if t is not None)) \
        == tensor_digest(*tensors)
    if not read_back:
        save_stored_head(staging / HEAD, tensors)
    return Head(found[0] if found else "", tensor_digest(*tensors), not read_back)


def head_entry(source: Path, head: torch.nn.Module, staging: Path) -> dict:
    """``lm_head`` as a slice's entry holds it (``Writer.seal``), but its soft-cap."""
    return lm_head(source, head, staging).to_json()


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

    def _closed(self) -> Hidden:
        """The hidden states, written out."""
        if self.problem:
            raise OSError(self.problem)
        self.hidden.flush()
        rows, width = self.hidden.shape
        self.hidden = None
        return Hidden(rows, width, str(self.dtype).removeprefix("torch."))

    def publish(self, key: str, manifest: dict, result: PerplexityResult, head: torch.nn.Module,
                replace: bool) -> Reference:
        """Finish the files and rename the folder to ``references/<key>``.

        Args:
            manifest: what it is made from (``Draft``: identity, environment, facts, source, softcap); the result,
                head and sizes are added here.
            head: the scored model's LM head (``lm_head``).
            replace: put this one in place of an existing reference of the same key (a rescore);
                otherwise an existing one (built meanwhile by another audit) is kept and returned.
        """
        hidden, draft = self._closed(), Draft.of_json(manifest)
        return _finish(self.staging, key, _Made(draft, hidden, lm_head(Path(draft.source), head, self.staging), result,
                                                self.targets), replace)

    def seal(self, head_of: dict | None, out: Path) -> Path:
        """Finish a slice: its hidden states and what it holds (``SLICE``; ``head_of``: the first slice's
        ``head_entry`` and soft-cap) beside them, put at ``out`` in one rename. Returns ``out``."""
        about = Slice(self.offset, self.offset + self.n_scored, self._closed(), file_digest(self.staging / HIDDEN),
                      *head_and_softcap(head_of))
        write_atomically(self.staging / SLICE, json.dumps(about.to_json()))
        out.parent.mkdir(parents=True, exist_ok=True)
        os.rename(self.staging, out)
        return out


@dataclass(frozen=True)
class _Made:
    """What a reference holds once its hidden states are written, before it is put in place: its draft manifest, the
    hidden states' shape, its LM head, the baseline's scores and every scored token's id (``targets``)."""

    draft: Draft
    hidden: Hidden
    head: Head
    result: PerplexityResult
    targets: torch.Tensor


def _finish(staging: Path, key: str, made: _Made, replace: bool, known: dict[str, str] | None = None) -> Reference:
    """Write the scores and the manifest beside ``staging``'s hidden states (and head), and rename it into place.
    ``known``: the sha256 of files already hashed as they were written (not read again)."""
    result = made.result
    save_scores(staging / SCORES, token_nll=result.token_nll, window_nll=result.window_nll,
                window_tokens=result.window_tokens, targets=made.targets.numpy().astype(np.int32))
    written = time.time()
    files = sealed.files_entry(staging, [f.name for f in staging.iterdir()], known)
    write_atomically(staging / MANIFEST, Manifest.made(made.draft, key, written, result.summary(), made.hidden,
                                                       made.head, files).text())
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
        manifest, result, replace: as ``Writer.publish``'s (the soft-cap is the first slice's); ``targets``: every
            scored token's id.
    """
    abouts = [_slice_about(folder) for folder in slices]
    rows, width, dtype, joined = 0, None, None, hashlib.sha256()
    with open(staging / HIDDEN, "wb") as out:
        for folder, about in zip(slices, abouts):
            if about is None or about.first != rows or about.hidden.rows != about.stop - about.first \
                    or width not in (None, about.hidden.width) or dtype not in (None, about.hidden.dtype):
                raise DamagedReference(f"the baseline reference's slice {folder.name} is missing, damaged or out of "
                                       f"place (its rows should start at {rows})")
            width, dtype = about.hidden.width, about.hidden.dtype
            digest, start = hashlib.sha256(), out.tell()
            with open(folder / HIDDEN, "rb") as part:
                while block := part.read(1 << 24):
                    digest.update(block)
                    joined.update(block)
                    out.write(block)
            if digest.hexdigest() != about.sha256 or out.tell() - start != _hidden_bytes(about.hidden, DTYPES[dtype]):
                raise _not_as_written(folder)
            rows = about.stop
    if rows != len(targets):
        raise DamagedReference(f"the baseline reference's slices hold {rows} of its {len(targets)} tokens")
    head = _named_head(slices[0], abouts[0])
    if head.stored:
        shutil.copyfile(slices[0] / HEAD, staging / HEAD)
    draft = replace_field(Draft.of_json(manifest), softcap=abouts[0].softcap)
    return _finish(staging, key, _Made(draft, Hidden(rows, width, dtype), head, result, targets), replace,
                   {HIDDEN: joined.hexdigest()})


def building() -> AbstractContextManager[Path]:
    """A scratch folder for a ``Writer``: removed when done, and by the next build if this process dies."""
    return scratch(references_dir() / ".building")


def folders() -> dict[str, Path]:
    """Every reference's folder by key, whether or not it opens (``stored`` gives those that do)."""
    root = references_dir()
    return {f.name: f for f in root.iterdir() if f.is_dir() and not f.name.startswith(".")} if root.is_dir() else {}


def verify(folder: Path) -> str | None:
    """What is wrong with the reference in ``folder`` (``Reference.verify``), None when it is intact; read
    without the warning an audit prints, as the caller says it."""
    found = Reference.read(folder)
    try:
        return found.verify()
    except (KeyError, TypeError, IndexError) as error:  # a file lacking what it holds: written by hand
        return f"{MANIFEST} lacks what a reference holds ({type(error).__name__}: {error})"


def listed() -> list[tuple[Reference, str | None]]:
    """Every reference folder, with what keeps its manifest from describing it (``Reference.problem``; None: nothing),
    most recently made first. One whose manifest cannot be read holds none (``Reference.manifest``)."""
    found = [Reference.read(folder) for folder in folders().values()]
    return [(r, r.problem) for r in sorted(found, key=lambda r: r.created, reverse=True)]


def stored() -> list[Reference]:
    """Every complete reference whose manifest can be matched to a baseline, most recently made first. One whose
    manifest cannot is left out, never read as another's: the audit of its own baseline removes it (``find_intact``)."""
    return [found for found, _ in listed() if found.manifest is not None]


def find(identity_: dict, environment_: dict, rescore: Rescore) -> tuple[Reference | None, Reference | None]:
    """``(reference to reuse, reference a rescore is compared with)`` for a baseline.

    ``auto`` reuses the reference made in this environment; ``never`` any of this identity (the newest);
    ``always`` reuses none. A baseline that is scored is compared with this environment's reference,
    else the newest of its identity made elsewhere (another torch, say).
    """
    same = [r for r in stored() if r.manifest.identity.as_dict() == identity_]
    here = next((r for r in same if r.manifest.environment == environment_), None)
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
    kept in when its manifest cannot even be matched (``Reference.read``: no search finds it).

    Returns:
        ``find``'s pair, and a ``"<key>: <damage>"`` line for each reference removed (for the record).
    """
    removed = []
    own = Reference.read(references_dir() / key_of(identity_, environment_))
    # left in place, it would fail every listing that trusted its manifest and keep the new one from taking its place
    if own.folder.is_dir() and own.manifest is None:
        _damaged(own, own.problem, rescore)
        removed.append(f"{own.key}: {own.problem}")
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
    delta = result.token_nll.astype(np.float64) - previous.scores().token_nll.astype(np.float64)
    token_limit, mean_limit = DRIFT_TOLERANCE[previous.manifest.identity.dtype]
    mean_delta = result.mean_nll - previous.manifest.result.mean_nll
    then = previous.manifest.environment
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
    now = Reference.read(found.folder).manifest
    if now is None or now.digest != found.manifest.digest:
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
