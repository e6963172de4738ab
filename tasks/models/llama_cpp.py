"""llama.cpp as a runtime: a GGUF file scored by llama.cpp's own kernels and tokenizer (``runtime: llama.cpp``).

Transformers dequantizes a GGUF file and measures what its weights lost. A user who ships the file runs it in
llama.cpp, whose quantized matmuls also round each activation row to 8 bits and whose tokenizer splits runs of
whitespace its own way; this module runs llama.cpp itself (llama-cpp-python's bindings of the llama.cpp it was built
from, ``.ci/llama-cpp``) in a process of its own (``tasks.models.llama_cpp_worker``), so that a native crash fails
that variant alone and every way of stopping ends it.

What the engine gets is a model whose logits llama.cpp computes: ``LlamaCppModel.scored_logits`` gives them at the
positions a batch scores, each window evaluated as a fresh sequence, and its head is the identity. Every figure after
that (float64 sums, KL against the baseline's reference, top-1, the statistics block) is the audit's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tasks.core.errors import InputError
from tasks.core.files import file_digest, once_per_file_state
from tasks.engine.logits_head import LogitsHead
from tasks.models import llama_cpp_worker
from tasks.models.llama_cpp_said import (Answer, Close, Detokenize, Done, Failed, Open, Opened, Request, Score, Tokenize,
                                       Tokenized, receive, reply_of, send)

SETUP = "bash .ci/llama-cpp"  # builds llama.cpp once per machine and installs its bindings into .venv
CLOSE_SECONDS = 2.0  # a worker asked to close gets this long before it is killed


def version() -> str | None:
    """llama-cpp-python's version where it is installed, else None (nothing native is loaded to find out)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    from importlib.util import find_spec

    try:
        if find_spec("llama_cpp") is None:
            return None
        return installed("llama_cpp_python")
    except (ImportError, ValueError, PackageNotFoundError):
        return None


def require_llama_cpp(where: str) -> None:
    """Refuse, in one line, a use of the llama.cpp runtime where it is not installed."""
    if version() is None:
        raise InputError(f"{where}: the llama.cpp runtime is not installed; run `{SETUP}` (it builds llama.cpp once, "
                         "about 10 minutes on 2 cores, then installs in a second)")


def _constants(prefix: str) -> dict[str, int]:
    import llama_cpp

    return {name.removeprefix(prefix): getattr(llama_cpp, name) for name in dir(llama_cpp)
            if name.startswith(prefix) and isinstance(getattr(llama_cpp, name), int)}


def cache_types() -> list[str]:
    """The key/value cache types llama.cpp has (``type_k``/``type_v``: f16, q8_0, q4_0, ...), lower case."""
    return sorted(name.lower() for name in _constants("GGML_TYPE_") if name != "COUNT")


def file_types() -> dict[str, int]:
    """The file types llama.cpp's quantizer makes, as llama-quantize names them (``Q4_K_M``, ``Q8_0``, ``F32``)."""
    return {"F32" if name == "ALL_F32" else name.removeprefix("MOSTLY_"): value
            for name, value in _constants("LLAMA_FTYPE_").items() if name.startswith("MOSTLY_") or name == "ALL_F32"}


def check_llama_cpp_settings(where: str, type_k: str, type_v: str, file_type: str | None = None) -> None:
    """Refuse, in one line, a cache type or a file type llama.cpp lacks (the runtime installed)."""
    require_llama_cpp(where)
    known = cache_types()
    for key, value in (("type_k", type_k), ("type_v", type_v)):
        if value not in known:
            raise InputError(f"{where}: {key} {value} is not a llama.cpp cache type; use one of f16, bf16, f32, q8_0, "
                             "q5_1, q5_0, q4_1, q4_0, iq4_nl")
    if file_type is not None and file_type not in file_types():
        raise InputError(f"{where}: type {file_type} is not a type llama.cpp's quantizer makes; use one of "
                         f"{', '.join(sorted(file_types()))}")


class RuntimeCrash(RuntimeError):
    """The llama.cpp process ended without answering: a native crash, or it was killed."""


class Process:
    """One llama.cpp worker process and its requests, one at a time."""

    def __init__(self, what: str):
        self.what = what
        self.log = tempfile.NamedTemporaryFile(prefix="llama-cpp-", suffix=".log", delete=False)  # noqa: SIM115
        self.child = subprocess.Popen([sys.executable, llama_cpp_worker.__file__], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self.log,
                                      env=os.environ | {"PYTHONNOUSERSITE": "1"})
        self.lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _end, self.child, self.log.name)

    def request(self, request: Request, answered_by: type[Answer], payload: bytes = b"") -> tuple[Answer, bytes]:
        """``request``'s reply (of the kind ``answered_by``) and its payload; a failure raised in one line."""
        with self.lock:
            try:
                send(self.child.stdin, request, payload)
                header, data = receive(self.child.stdout)
            except (EOFError, BrokenPipeError, OSError):
                raise RuntimeCrash(self._crash(request.op)) from None
        reply = reply_of(header, answered_by)
        if isinstance(reply, Failed):
            raise RuntimeError(f"llama.cpp ({self.what}): {reply.error}")
        return reply, data

    def _crash(self, op: str) -> str:
        try:
            code = self.child.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}" if code is not None else "stopped answering")
        last = _last_line(Path(self.log.name).read_text(errors="replace"))
        return f"llama.cpp {how} during {op} of {self.what}" + (f"; its last words: {last}" if last else "")

    def close(self) -> None:
        self._finalizer()


def _last_line(said: str) -> str:
    """What a llama.cpp process said last (its log or stderr), "" when nothing."""
    return next((line.strip() for line in reversed(said.splitlines()) if line.strip()), "")


def _end(child: subprocess.Popen, log: str) -> None:
    """Ask the worker to close, and kill it if it does not within ``CLOSE_SECONDS``; remove its log."""
    try:
        if child.poll() is None:
            try:
                send(child.stdin, Close())
                child.stdin.close()
            except OSError:
                pass
            try:
                child.wait(timeout=CLOSE_SECONDS)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
    finally:
        Path(log).unlink(missing_ok=True)


def described(settings, facts: Opened | None = None) -> dict:
    """What llama.cpp runs a file with (``LlamaCppSettings``), as the record and MLflow's params keep it; with the
    ``facts`` of the model it opened (``open_model``), what ran: the flash attention llama.cpp chose where ``auto``
    let it (it moves a figure: 1.1% of Q4_K_M's PPL on C headers on a CPU), the context's sizes (``n_ctx``,
    ``n_batch``, ``n_ubatch``), threads, and the layers on a GPU (none on a build without one); each setting that ran
    otherwise than asked keeps what was asked beside it (``flash_attn_asked: auto``)."""
    asked = {"threads": settings.threads or "default", "batch": settings.batch, "type_k": settings.type_k,
             "type_v": settings.type_v, "flash_attn": settings.flash_attn, "gpu_layers": settings.gpu_layers}
    if facts is None or facts.loaded is None:
        return asked
    took = facts.loaded.ran
    ran = {"flash_attn": took.flash_attn or "unknown",  # llama.cpp said neither: its log changed
           "n_ctx": took.n_ctx, "n_batch": took.n_batch, "n_ubatch": took.n_ubatch, "threads": took.threads,
           "threads_batch": took.threads_batch, "gpu_layers": took.gpu_layers, "batch": took.n_batch}
    return asked | ran | {f"{key}_asked": value for key, value in asked.items() if key in ran and ran[key] != value}


def gpu_offload() -> bool:
    """Whether the llama.cpp the binding was built from can offload layers to a GPU (``gpu_layers``)."""
    import llama_cpp

    return bool(llama_cpp.llama_supports_gpu_offload())


class _Inputs(torch.nn.Module):
    """Where the engine puts input ids for this model: host memory (llama.cpp takes them from there)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("weight", torch.empty(0), persistent=False)


class _NoConfig:
    """The engine reads a softcap off a model's config: llama.cpp has applied it to the logits it gives."""

    final_logit_softcapping = None


class LlamaCppModel(torch.nn.Module):
    """A GGUF file run by llama.cpp, as the engine scores it (``tasks.engine.perplexity.hidden_states`` asks
    ``scored_logits``). ``facts``: what llama.cpp said of it when it opened ``path``."""

    def __init__(self, process: Process, facts: Opened, settings, path: Path):
        super().__init__()
        self.process, self.facts, self.settings = process, facts, settings
        self.name_or_path = str(path)
        self.config = _NoConfig()
        self.head = LogitsHead(facts.n_vocab)
        self.inputs = _Inputs()

    @property
    def device(self) -> torch.device:
        """Where its inputs and logits are: host memory (llama.cpp places its own weights)."""
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        """What its logits come as (llama.cpp's own compute types are the file's and its kernels')."""
        return torch.float32

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.inputs

    def scored_logits(self, input_ids: torch.Tensor, mask: torch.Tensor | None, row_index: torch.Tensor,
                      columns: torch.Tensor) -> torch.Tensor:
        """The logits ``[T, V]`` at ``(row_index, columns)``: each row of ``input_ids`` (its unpadded length) a
        fresh sequence in llama.cpp, its scored columns one ascending run, rows in order, as ``batch_inputs`` makes
        them."""
        lengths = mask.sum(1) if mask is not None else torch.full((input_ids.shape[0],), input_ids.shape[1])
        rows, tokens = [], []
        for i in range(input_ids.shape[0]):
            wanted = columns[row_index == i]
            if len(wanted) and not bool((wanted.diff() == 1).all()):
                raise ValueError("scored columns of a window are not one run")
            rows.append((int(lengths[i]), int(wanted[0]) if len(wanted) else 0, len(wanted)))
            tokens.append(input_ids[i, : int(lengths[i])].to(torch.int32).numpy())
        _, data = self.process.request(Score(rows=tuple(rows), n_batch=self.settings.batch), Done,
                                       np.concatenate(tokens).tobytes())
        logits = np.frombuffer(data, dtype=np.float32).reshape(-1, self.head.out_features)
        return torch.from_numpy(logits.copy())

    def close(self) -> None:
        self.process.close()


def open_model(path: Path, name: str, settings, n_ctx: int) -> LlamaCppModel:
    """``path`` loaded by llama.cpp with ``settings`` (``LlamaCppSettings``), a context of ``n_ctx`` tokens (the
    audit's window)."""
    process = Process(f"variant '{name}'")
    try:
        facts, _ = process.request(Open(path=str(path), n_ctx=n_ctx, n_batch=min(settings.batch, n_ctx),
                                        threads=settings.threads, type_k=settings.type_k, type_v=settings.type_v,
                                        flash_attn=settings.flash_attn, gpu_layers=settings.gpu_layers), Opened)
    except BaseException:
        process.close()
        raise
    return LlamaCppModel(process, facts, settings, path)


class Tokenizer:
    """llama.cpp's tokenizer of a GGUF file, as ``tasks.data.corpus`` calls a tokenizer: ids of a text with
    character offsets (from each token's bytes), its BOS and whether it adds one; ``digest`` names it (the file's
    vocabulary and the llama.cpp that tokenizes) as part of the stream's identity."""

    is_fast = False
    unk_token_id = None  # llama.cpp's tokenizers fall back to bytes: any text encodes

    def __init__(self, path: Path, vocabulary_digest: str):
        self.path = path
        self._process: Process | None = None
        self._lock = threading.Lock()
        with self._lock:
            facts = self._start()
        self.bos_token_id, self.add_bos, self.vocabulary = facts.bos, facts.add_bos, facts.n_vocab
        self.digest = f"llama.cpp {version()}:{vocabulary_digest}"

    def _start(self) -> Opened:
        """A tokenizer worker for this file (the last one closed): what llama.cpp says of its vocabulary."""
        if self._process is not None:
            self._process.close()
        self._process = Process(f"the tokenizer of {self.path.name}")
        return self._process.request(Open(path=str(self.path), vocab_only=True), Opened)[0]

    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False) -> dict:
        ids, offsets = self.encode_with_offsets(text, add_special_tokens)
        return _Encoding(ids, offsets if return_offsets_mapping else None)

    def encode_with_offsets(self, text: str, add_special: bool) -> tuple[list[int], list[tuple[int, int]]]:
        encoded = text.encode("utf-8")
        reply, data = self._ask(Tokenize(add_special=add_special), Tokenized, encoded)
        count = reply.count
        both = np.frombuffer(data, dtype=np.int32)
        ids, lengths = both[:count], both[count:]
        return ids.tolist(), _char_offsets(text, encoded, lengths)

    def __len__(self) -> int:
        return self.vocabulary

    @property
    def named(self) -> str:
        """What made a stream it tokenized, as the record and MLflow say it."""
        return f"llama.cpp {version()} ({self.path.name})"

    def decode(self, ids) -> str:
        """The text of ``ids``: their pieces' bytes joined (a piece may end inside a character), as UTF-8."""
        return self._ask(Detokenize(), Done, np.asarray(ids, dtype=np.int32).tobytes())[1].decode("utf-8", "replace")

    def _ask(self, request: Request, answered_by: type[Answer], payload: bytes) -> tuple[Answer, bytes]:
        """One request to this file's tokenizer worker, started on first use and kept (an audit decodes tokens by the
        hundred); started again where it has ended (it dies with the thread that started it)."""
        with self._lock:
            if self._process is None or self._process.child.poll() is not None:
                self._start()
            return self._process.request(request, answered_by, payload)

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
            self._process = None

    def __getstate__(self) -> dict:  # a plan sent to a Dask or Ray worker: it starts its own tokenizer there
        return {k: v for k, v in self.__dict__.items() if k not in ("_process", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _process=None, _lock=threading.Lock())


class _Encoding(dict):
    """What a transformers tokenizer's call gives: a mapping of ``input_ids`` and, where asked, ``offset_mapping``;
    its ids are also an attribute."""

    def __init__(self, input_ids: list[int], offset_mapping: list[tuple[int, int]] | None):
        given = {"input_ids": input_ids, "offset_mapping": offset_mapping}
        super().__init__((key, value) for key, value in given.items() if value is not None)
        self.input_ids = input_ids


def _char_offsets(text: str, encoded: bytes, lengths: np.ndarray) -> list[tuple[int, int]]:
    """Each token's ``(start, end)`` in characters of ``text`` from its bytes: a token that ends inside a character
    (a byte-fallback piece) ends where that character does."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    char_at = np.zeros(len(encoded) + 1, dtype=np.int64)  # byte index -> the character it belongs to
    lead = np.frombuffer(encoded, dtype=np.uint8)
    starts_char = (lead & 0xC0) != 0x80
    char_at[:-1] = np.cumsum(starts_char) - 1
    char_at[-1] = len(text)
    starts = np.minimum(starts, len(encoded))
    ends = np.minimum(ends, len(encoded))
    # a token ending mid-character ends at that character's end
    end_chars = np.where(ends < len(encoded), char_at[ends] + (~starts_char[np.minimum(ends, len(encoded) - 1)]), len(text))
    return list(zip(char_at[starts].tolist(), end_chars.tolist()))


def stream_difference(ours: list[int], theirs: list[int]) -> dict | None:
    """Where two tokenizations of one text part: None where they agree; else each one's count and the first index
    where they differ."""
    if ours == theirs:
        return None
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    return {"transformers_tokens": len(ours), "llama_cpp_tokens": len(theirs), "first_difference": first}


def _built(record: str, name: str) -> Path:
    """``name`` under the folder ``.ci/llama-cpp`` wrote into ``record`` in the environment it installs into."""
    where = Path(sys.prefix) / record
    found = Path(where.read_text().strip()) / name if where.is_file() else None
    if found is None or not found.exists():
        raise InputError(f"llama.cpp's {name} is not here; run `{SETUP}` (it builds the binding and the tools)")
    return found


def tool(name: str) -> Path:
    """One of llama.cpp's own programs built beside the binding from the same source: ``llama-imatrix``,
    ``llama-quantize``, ``llama-perplexity``, ``llama-tokenize``."""
    return _built("llama-cpp-tools", name)


def _run(name: str, command: list[str], what: str) -> None:
    """``command`` (llama.cpp's program or script ``name``) run in a process of its own; a failure raised with its
    last words."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's {name} failed {what} (exit {done.returncode}): "
                           f"{_last_line(done.stderr) or '(nothing said)'}")


def _run_tool(name: str, args: list[str], what: str) -> None:
    """The tool ``name`` run with ``args`` (``_run``)."""
    _run(name, [str(tool(name)), *args], what)


def llama_quantize(source: Path, target: Path, file_type: str, importance: Path | None = None,
             tensor_types: tuple[str, ...] = ()) -> None:
    """``source`` (a GGUF file) quantized to ``file_type`` by llama.cpp's quantizer (``llama_model_quantize``,
    requantizing a quantized file as llama-quantize --allow-requantize does), in a process of its own; with
    ``importance`` (an importance matrix file) or ``tensor_types`` (``--tensor-type`` entries, PATTERN=TYPE) by
    llama-quantize, which reads them (the binding cannot pass either)."""
    what = f"making {file_type} from {source.name}"
    if importance is not None or tensor_types:
        extra = ["--imatrix", str(importance)] if importance is not None else []
        with tempfile.TemporaryDirectory() as scratch:
            listed = Path(scratch) / "tensor-types.txt"  # a file: a recipe of hundreds of entries outgrows argv
            listed.write_text("".join(f"{entry}\n" for entry in tensor_types))
            extra += ["--tensor-type-file", str(listed)] if tensor_types else []
            _run_tool("llama-quantize", ["--allow-requantize", *extra, str(source), str(target), file_type], what)
        return
    code = ("import sys, llama_cpp as l\n"
            "p = l.llama_model_quantize_default_params()\n"
            f"p.ftype = {file_types()[file_type]}\n"
            "p.allow_requantize = True\n"
            "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n")
    _run("quantizer", [sys.executable, "-c", code, str(source), str(target)], what)


@dataclass(frozen=True)
class ImportanceText:
    """The text an importance matrix is computed from (a variant's calibration samples, joined), the context
    llama-imatrix reads it in (the samples' length) and the digest that names the samples."""

    text: str
    context: int
    digest: str


def importance_matrix(source: Path, calibration: ImportanceText) -> Path:
    """llama-imatrix's importance matrix of ``source`` over ``calibration``'s text in chunks of its context, made on
    first use and kept (``$PPL_AUDIT_CACHE/gguf``) by the source's digest, the samples' and the llama.cpp version."""
    made_from = {"source": _source_digest(source), "calibration": calibration.digest, "llama_cpp": version()}

    def make(target: Path) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            text = Path(scratch) / f"calibration-{calibration.digest[:16]}.txt"  # the file names it as its dataset
            text.write_text(calibration.text, encoding="utf-8")
            _run_tool("llama-imatrix", ["-m", str(source), "-f", str(text), "-c", str(calibration.context),
                                        "-o", str(target), "--no-ppl", "-t", str(len(os.sched_getaffinity(0)))],
                      f"computing the importance matrix of {source.name}")

    return _kept(_cached_path(source, "imatrix", made_from), made_from, make, "importance matrix")


# a ladder of types made from one file hashes it once per process (and again once it changes), not once per type
_source_digest = once_per_file_state(maxsize=8)(file_digest)


def _cached_path(source: Path, kind: str, made_from: dict) -> Path:
    from tasks.core.places import cache_dir

    key = hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{source.stem}.{kind}.{key}.gguf"


def _kept(target: Path, made_from: dict, make, what: str) -> Path:
    """``target``, made by ``make(path)`` on first use and kept with a sealed entry of ``made_from`` and the file's
    sha256, checked when read: a damaged or replaced file is made again, never used."""
    from tasks.core import sealed

    entry = target.with_suffix(".json")
    if target.is_file() or entry.is_file():
        found = sealed.read_entry(entry)
        problem = sealed.damage(found, "its entry", made_from)
        if problem is None:
            problem = sealed.files_damage(target.parent, found.get("files"), [target.name])
        if problem is None:
            return target
        sealed.warn_remade(f"{what} {target.name}", target, problem)
        target.unlink(missing_ok=True)
        entry.unlink(missing_ok=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")
    try:
        make(partial)
        partial.rename(target)
    finally:
        partial.unlink(missing_ok=True)
    entry.write_text(json.dumps(sealed.seal(made_from | {"files": sealed.files_entry(target.parent, [target.name])})))
    return target


# what a checkpoint's weights are stored as -> the GGUF type that keeps them as they are
OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def converted_file(folder: Path, digest: str) -> Path:
    """A transformers checkpoint ``folder`` (its ``model_digest``: ``digest``) as a GGUF file, converted by the
    convert_hf_to_gguf.py of the llama.cpp source the binding was built from, its weights kept in the type they are
    stored in; made on first use and kept (``$PPL_AUDIT_CACHE/gguf``) by the digest and the llama.cpp version."""
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    outtype = OUTTYPES.get(config.get("torch_dtype") or config.get("dtype"), "f16")  # f16: the converter's default
    made_from = {"source": digest, "outtype": outtype, "llama_cpp": version()}
    converter = _built("llama-cpp-source", "convert_hf_to_gguf.py")

    def make(target: Path) -> None:
        _run(converter.name, [sys.executable, str(converter), str(folder), "--outfile", str(target), "--outtype",
                              outtype], f"converting {folder.name}")

    return _kept(_cached_path(folder, outtype.upper(), made_from), made_from, make, "GGUF file")


def made_file(source: Path, file_type: str, calibration: ImportanceText | None = None,
              tensor_types: tuple[str, ...] = ()) -> Path:
    """The GGUF file of type ``file_type`` llama.cpp's quantizer makes from ``source`` (with ``calibration``: with the
    importance matrix of that text; with ``tensor_types``: those tensors in the types they name), made on first use
    and kept (``$PPL_AUDIT_CACHE/gguf``) by the digest of the source, the type, the calibration samples, the tensor
    types and the llama.cpp version."""
    made_from = ({"source": _source_digest(source), "type": file_type, "llama_cpp": version()}
                 | ({"imatrix": calibration.digest} if calibration is not None else {})
                 | ({"tensor_types": list(tensor_types)} if tensor_types else {}))
    importance = None if calibration is None else importance_matrix(source, calibration)
    return _kept(_cached_path(source, file_type, made_from), made_from,
                 lambda target: llama_quantize(source, target, file_type, importance, tuple(tensor_types)), "GGUF file")
