"""Quantize a baseline with GPTQ or AWQ (gptqmodel), with calibration kept apart from evaluation.

auto-gptq and autoawq are abandoned and do not build against current torch; gptqmodel is their
maintained successor for both methods, on CPU and CUDA. Each checkpoint gets a ``ppl-audit.json``
manifest saying how it was made, so an audit can check its calibration against what it evaluates.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.config import CalibrationConfig
from tasks.core import console, sealed
from tasks.core.errors import InputError, one_line
from tasks.core.files import file_digest, publish, read_json, sample_digest, scratch, write_atomically
from tasks.core.places import cache_dir
from tasks.core.versions import versions
from tasks.data.corpus import cached_tokenize, corpus_text
from tasks.methods.registry import method_of
from tasks.engine import abandon
from tasks.models.formats import import_package
from tasks.models.loading import WEIGHT_SUFFIXES
from tasks.models.patches import clip_search_by_matmul, failures_raised, logs_in
from tasks.models.quantize_said import RememberedDigest
from tasks.models.resolve import Located, model_files

MANIFEST = "ppl-audit.json"


@dataclass(frozen=True)
class Calibration:
    """Calibration samples and where they came from.

    Attributes:
        samples: token id lists, ``seq_len`` tokens each.
        corpus_digest: sha256 of the calibration corpus text.
        token_ranges: ``[start, end)`` of each sample in that corpus's token stream.
    """

    samples: list[list[int]]
    source: str
    corpus_digest: str
    token_ranges: list[tuple[int, int]]
    seq_len: int
    seed: int

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.samples).encode()).hexdigest()

    def describe(self) -> dict:
        return {"source": self.source, "corpus_digest": self.corpus_digest, "samples": len(self.samples),
                "seq_len": self.seq_len, "seed": self.seed, "digest": self.digest,
                "token_ranges": [list(r) for r in self.token_ranges]}


def draw_calibration(ids: torch.Tensor, samples: int, seq_len: int, seed: int, source: str, corpus_digest: str,
                     exclude: tuple[int, int] | None = None) -> Calibration:
    """Draw non-overlapping ``seq_len``-token blocks at random (seeded), none inside ``exclude``.

    Args:
        ids: ``[N]`` token stream of the calibration corpus.
        exclude: ``[start, end)`` token range that must not be used (the evaluated tokens when the
            calibration corpus is the evaluation corpus).
    """
    n = len(ids)
    free = [(0, n)] if exclude is None else [(0, exclude[0]), (exclude[1], n)]
    blocks = [(s, s + seq_len) for lo, hi in free for s in range(lo, hi - seq_len + 1, seq_len)]
    if not blocks:
        raise InputError(
            f"no {seq_len}-token calibration block lies outside the evaluated tokens of {source}; "
            "evaluate fewer tokens (max_tokens), shorten calibration.seq_len, or give calibration.corpus"
        )
    if len(blocks) < samples:  # fewer drawn would quantize with less than asked, said only in gptqmodel's log
        room = "outside the evaluated tokens of " if exclude is not None else "in "
        raise InputError(f"calibration: {samples} samples of {seq_len} tokens cannot be drawn: there is room for "
                         f"{len(blocks)} {room}{source}; ask for at most {len(blocks)} samples, shorten seq_len, or "
                         "give a longer calibration corpus")
    chosen = sorted(random.Random(seed).sample(blocks, samples))
    return Calibration([ids[s:e].tolist() for s, e in chosen], source, corpus_digest, chosen, seq_len, seed)


def calibration_of(tokenizer, calibration: CalibrationConfig, holdout_tokens: int = 0) -> Calibration:
    """``calibration.samples`` × ``seq_len`` tokens of its ``corpus`` drawn for quantizing a model of ``tokenizer``
    (``quantize``), never its first ``holdout_tokens``; tokenizing is cached, so the command's check before Prefect
    starts costs the flow nothing."""
    corpus = calibration.corpus
    stream = cached_tokenize(corpus_text(corpus), tokenizer, bos="none", progress="tokenize calibration")
    holdout = (0, holdout_tokens) if holdout_tokens > 0 else None
    return draw_calibration(stream.ids, calibration.samples, calibration.seq_len, calibration.seed, corpus.source,
                            stream.text_digest, holdout)


def check_disjoint(manifest: dict, corpus_digest: str, evaluated: tuple[int, int], name: str) -> None:
    """Refuse a checkpoint calibrated on tokens this audit evaluates (same corpus, overlapping range)."""
    calibration = manifest.get("calibration") or {}
    if calibration.get("corpus_digest") != corpus_digest:
        return
    for start, end in calibration.get("token_ranges", []):
        if start < evaluated[1] and evaluated[0] < end:
            raise InputError(f"variant '{name}' was calibrated on tokens {start}-{end} of the evaluated corpus, "
                             f"which this audit scores ({evaluated[0]}-{evaluated[1]}); recalibrate on other text")


def model_digest(path: str) -> str:
    """sha256 over a model folder's config and weight files, or over a single-file checkpoint (``.gguf``).

    Remembered by the files' names, sizes, modification times and a sample of their bytes (``sample_digest``): an
    audit asks for it every run, and reading a 70B checkpoint again would take minutes. What is remembered keeps those (what it was made
    from) and a digest of itself, checked when read: an entry changed, or another model's copied over it,
    is never used (one line; the files are read again).
    """
    files = [Path(path)] if Path(path).is_file() else [
        file for file in sorted(Path(path).iterdir()) if file.name == "config.json" or file.suffix in WEIGHT_SUFFIXES]
    single = Path(path).is_file()
    # a sample of each file's bytes too: one changed in place with its time set back is not the file remembered
    stamp = [single] + [[str(file.resolve()), file.stat().st_size, file.stat().st_mtime_ns, sample_digest(file)]
                        for file in files]
    remembered = cache_dir() / "digests" / hashlib.sha256(json.dumps(stamp).encode()).hexdigest()
    if remembered.is_file():
        entry = sealed.read_entry(remembered)
        problem = sealed.damage(entry, "its entry", {"files": stamp})
        # read once it is sound: a damaged entry may be no mapping at all
        if problem is None and (kept := RememberedDigest.of_entry(entry).sha256) is not None:
            return kept
        sealed.warn_remade("remembered model digest", remembered, problem or "it holds no sha256",
                           f"{path} is read again")
    if single:  # its bytes alone: a renamed copy is the same model
        found = file_digest(Path(path))
    else:
        digest = hashlib.sha256()
        for file in files:
            digest.update(file.name.encode())
            with file.open("rb") as handle:
                while chunk := handle.read(1 << 24):
                    digest.update(chunk)
        found = digest.hexdigest()
    remembered.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(remembered, json.dumps(sealed.seal({"files": stamp, "sha256": found})))
    return found


def _prepare_gptqmodel() -> None:
    # gptqmodel's model-loader pool wants 2 workers; its default on a 2-core machine gives it 1.
    if (os.cpu_count() or 1) < 4:
        os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    import_package("gptqmodel")


def _with_pad(source: str, tokenizer, staging: Path) -> str:
    """``source`` as gptqmodel can load it: with a pad id in its config when its tokenizer has none.

    gptqmodel passes the tokenizer to tokenicer, which refuses one without a pad token unless it can
    borrow ``<pad>``, ``<unk>`` or eos, and gptqmodel passes on none of tokenicer's options
    (``pad_tokens``); a base model whose tokenizer has only a BOS token then cannot be quantized.
    tokenicer takes the config's ``pad_token_id`` instead, unless it is BOS or EOS. Calibration rows
    all have ``seq_len`` tokens and go in one at a time, so nothing is padded and any other id does.
    The baseline is left untouched: ``staging`` links to its files beside the amended config.
    """
    if tokenizer.pad_token_id is not None:
        return source
    config = json.loads((Path(source) / "config.json").read_text())
    special = (config.get("bos_token_id"), config.get("eos_token_id"), tokenizer.bos_token_id, tokenizer.eos_token_id)
    amended = config | {"pad_token_id": next(i for i in range(len(tokenizer)) if i not in special)}
    for file in Path(source).iterdir():
        if file.name != "config.json":
            (staging / file.name).symlink_to(file.resolve())
    (staging / "config.json").write_text(json.dumps(amended, indent=2))
    return str(staging)


@contextmanager
def _layer_progress(quantizer, label: str, enabled: bool) -> Iterator[None]:
    """A progress bar over the decoder layers gptqmodel quantizes, one after the other: a layer's first
    forward pass means those before it are done. Each pass also asks whether the result is still wanted
    (``abandon``): a cluster's task whose audit stopped ends there, not hours later."""
    from gptqmodel.utils.model import get_layers_with_prefixes

    layers = get_layers_with_prefixes(quantizer.model, quantizer.extract_layers_node())[0]
    with console.bar(len(layers), label, "layer", enabled) as bar:
        def started(index: int) -> None:
            abandon.check()
            bar.update(max(0, index - bar.n))

        hooks = [layer.register_forward_pre_hook(lambda module, args, i=i: started(i)) for i, layer in enumerate(layers)]
        try:
            yield
            bar.update(len(layers) - bar.n)
        finally:
            for hook in hooks:
                hook.remove()


@dataclass(frozen=True)
class Scheme:
    """How gptqmodel quantizes: ``method`` (``gptq`` or ``awq``), ``bits``, columns per group (``group_size``, which
    must divide the layers' widths; -1: per channel), symmetric or not (``sym``); ``dynamic``: gptqmodel's per-module
    overrides of those (``+:REGEX``: other bits or group size, ``-:REGEX``: left unquantized), a recipe
    (``ppl-audit tune``)."""

    method: str
    bits: int
    group_size: int
    sym: bool
    dynamic: dict[str, dict] | None = None


def quantize(model: Located, scheme: Scheme, calibration: Calibration, out: Path, tokenizer,
             name: str | None = None, progress: bool = False) -> dict:
    """Quantize ``model`` with gptqmodel and save it to ``out`` with its manifest.

    Args:
        model: baseline folder (or ``embedded``).
        scheme: the method and how it quantizes.
        calibration: samples drawn by ``draw_calibration``.
        out: folder for the checkpoint.
        name: the variant's name, recorded for audits triggered by this checkpoint's event.
        progress: show a progress bar over the layers (``quantize <name>``).

    Returns:
        The manifest, also written to ``out / "ppl-audit.json"``; gptqmodel's per-layer logs (losses,
        timings) are kept in ``out / "quantize-logs"``.
    """
    _prepare_gptqmodel()
    from gptqmodel import BACKEND, AWQConfig, GPTQConfig, GPTQModel

    method, bits, group_size, sym, dynamic = scheme.method, scheme.bits, scheme.group_size, scheme.sym, scheme.dynamic

    source = str(model_files(model.source, fetch=True))  # gptqmodel and the digest read its files
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    # ours, so that a killed run's offloaded layers are removed next time (gptqmodel's own go to /tmp for good);
    # the checkpoint is made beside `out` (one rename away) and appears there whole, with its manifest, or not at all
    partials = _partials(out)
    try:
        with scratch(cache_dir() / "scratch") as staging, scratch(partials) as partial:
            made = partial / "checkpoint"
            made_with = {"gptq": GPTQConfig, "awq": AWQConfig}[method]  # gptqmodel's config of each method made here
            settings = made_with(bits=bits, group_size=group_size, sym=sym, dynamic=dynamic or None,
                                 offload_to_disk_path=str(staging / "offload"))
            quantizer = GPTQModel.load(_with_pad(source, tokenizer, staging), settings, device=device)
            # awq's kernel that quantizes on a CPU: gptqmodel picks a GPU one otherwise
            options = {"awq": {"backend": BACKEND.AWQ_TORCH}}.get(method, {}) if device == "cpu" else {}
            rows = [{"input_ids": ids, "attention_mask": [1] * len(ids)} for ids in calibration.samples]
            with logs_in(made / "quantize-logs"), _layer_progress(quantizer, f"quantize {name or method}", progress), \
                    clip_search_by_matmul(), failures_raised():
                quantizer.quantize(rows, batch_size=1, **options)
            made.mkdir(exist_ok=True)
            quantizer.save(str(made))
            # gptqmodel saves its tokenizer with the pad token it set; a pad token that was not special
            # before comes back from disk as an added special token, a different tokenizer from the baseline's
            tokenizer.save_pretrained(made)
            manifest = {
                "name": name, "method": method, "bits": bits, "group_size": group_size, "sym": sym,
                **({"dynamic": dynamic} if dynamic else {}),
                "source_model": model.name, "source_model_digest": model_digest(source),
                "calibration": calibration.describe(), "versions": versions("gptqmodel", "optimum"),
                "device": device, "seconds": round(time.perf_counter() - started, 2),
                # what loading it reads, to be checked when a cached one is reused (``checkpoint_damage``)
                "files": sealed.files_entry(made, [f.name for f in made.iterdir() if f.is_file()]),
            }
            manifest = sealed.seal(manifest)
            write_atomically(made / MANIFEST, json.dumps(manifest, indent=2))
            publish(made, out)
    finally:
        with suppress(OSError):  # left empty, also by a failed or stopped run, unless another is making one there
            partials.rmdir()
    return manifest


def per_module(config) -> dict:
    """gptqmodel's per-module overrides (``dynamic``) a checkpoint's config holds, empty when it has none."""
    settings = getattr(config, "quantization_config", None)
    settings = settings if isinstance(settings, dict) or settings is None else settings.to_dict()
    return dict((settings or {}).get("dynamic") or {})


def load_per_module(model: Located, dtype: torch.dtype, device: torch.device):
    """A gptq checkpoint with per-module overrides (``per_module``: a recipe's), loaded by gptqmodel itself, in eval
    mode: transformers with optimum gives every module the checkpoint's one bit width and group size and fails on
    the others' shapes; gptqmodel reads the overrides (a ``-:`` module a plain Linear, a ``+:`` one at its own bits).

    gptqmodel's kernels take float16 or bfloat16 only: a float32 audit's model is loaded in float16 (the scales' own
    dtype, so each weight is what its scale gives) and cast to float32. transformers' route rounds the scales to
    bfloat16 instead; on the demo's GPTQ 4-bit the two differ by KL 0.0007 against a KL of 0.46 from the baseline."""
    _prepare_gptqmodel()
    from gptqmodel import BACKEND, GPTQModel

    # on a CPU gptqmodel would pick its fused kernel, which takes 4-bit modules only: a recipe's 8-bit ones need Torch's
    backend = BACKEND.TORCH if device.type == "cpu" else BACKEND.AUTO
    loaded_in = torch.float16 if dtype == torch.float32 else dtype
    loaded = GPTQModel.load(model.source, device=str(device), dtype=loaded_in, backend=backend).model
    return loaded.to(dtype).eval()


def _partials(out: Path) -> Path:
    """Where a checkpoint for ``out`` is made, beside it: one rename away from its place."""
    return out.parent / f".{out.name}.partial"


def check_quantizable(model: Located) -> None:
    """Refuse a GGUF file as the model gptq or awq is made from, in one line before anything loads: gptqmodel
    quantizes a Hugging Face checkpoint; given a GGUF file it fails after the baseline is scored, and swaps the
    ``gguf`` module under transformers for its own, so that every GGUF model loaded in that process afterwards
    fails too."""
    if model.source.endswith(".gguf"):
        raise InputError(f"{model.name} is a GGUF file; gptq and awq are made from a Hugging Face checkpoint (a folder "
                         "with config.json, or a Hub id): give that model, or a gptq/awq checkpoint's path")


def quantized_widths(model: Located) -> list[int] | None:
    """The input widths of the linear layers gptqmodel quantizes in ``model``'s decoder layers (attention's inputs,
    its output projection's, the MLP's up and down projections'), from its config alone; None for a model whose
    config is not on this machine (a Hub id not fetched)."""
    from tasks.engine.kv_cache import head_dim

    if not (Path(model.source) / "config.json").is_file():
        return None
    config = model.config.get_text_config()
    try:
        widths = {config.hidden_size, config.num_attention_heads * head_dim(config)}
    except AttributeError:  # not a decoder whose config names these: gptqmodel's own checks are all there is
        return None
    mlp = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
    return sorted(widths | {getattr(config, key) for key in mlp if isinstance(getattr(config, key, None), int)})


def check_group_fits(model: Located, method: str, group_size: int) -> None:
    """Refuse a group size that does not divide the input width of every linear layer gptq/awq quantizes, before
    anything loads: gptqmodel quantizes and saves such a checkpoint, and no kernel can then score it
    (``_weight_int4pack_mm_cpu: expect K to be divisible by qGroupSize``)."""
    widths = quantized_widths(model) if group_size > 0 else None
    if not widths or all(width % group_size == 0 for width in widths):
        return
    fits = [size for size in method_of(method).kernel_group_sizes if size < 0 or all(width % size == 0 for width in widths)]
    raise InputError(f"group_size {group_size} does not divide the input widths of {model.name}'s layers "
                     f"({', '.join(map(str, widths))}); use one of {', '.join(map(str, fits))} (-1: per channel)")


# torch's int4 matmul on a CPU (aten._weight_int4pack_mm_for_cpu) takes groups of these sizes alone ("expect
# qGroupSize to be 32, 64, 128 or 256"); gptqmodel 7.6.0 picks a kernel on it for 4-bit modules on a CPU (TorchAtenLinear
# for groups of 16 to 128, TorchFusedLinear for one group a row, whose size is then the row's width), and both declare
# group size 16 all the same: a checkpoint of those loads, and fails at its first forward pass
# (tests/test_tune.py checks both against the installed gptqmodel and torch)
INT4PACK_CPU_GROUPS = (32, 64, 128, 256)
INT4PACK_CPU_KERNELS = ("TorchAtenLinear", "TorchFusedLinear")


@functools.cache
def gptq_kernel_problem(bits: int, group_size: int, sym: bool, widths: tuple[int, ...], device_type: str) -> str | None:
    """Why the kernel gptqmodel picks for gptq modules of ``bits`` in groups of ``group_size`` (-1: one a row) whose
    input widths are ``widths`` cannot run them on a device of ``device_type``; None when it can. Asked of gptqmodel's
    own choice (``select_quant_linear``, as loading asks it), before anything is quantized. On a GPU its kernels say
    what they cannot run as they load (``tasks.models.kernel_start``): None."""
    if device_type != "cpu":
        return None
    _prepare_gptqmodel()
    from gptqmodel.utils.importer import select_quant_linear

    try:
        kernel = select_quant_linear(bits, group_size, False, sym, "cpu", format="gptq", quant_method="gptq",
                                     pack_dtype=torch.int32).__name__
    except (ValueError, NotImplementedError) as error:
        return f"no gptqmodel kernel runs it on this CPU ({one_line(error)[:200]})"
    groups = {group_size} if group_size > 0 else set(widths)  # one group a row: the row's width
    if kernel in INT4PACK_CPU_KERNELS and not groups <= set(INT4PACK_CPU_GROUPS):
        sizes = ", ".join(map(str, INT4PACK_CPU_GROUPS[:-1])) + f" or {INT4PACK_CPU_GROUPS[-1]}"
        of = f"group size {group_size}" if group_size > 0 else f"groups of its rows' widths ({', '.join(map(str, sorted(groups)))})"
        return (f"gptqmodel runs it on this CPU with {kernel}, whose matmul (torch's _weight_int4pack_mm_for_cpu) "
                f"takes groups of {sizes} inputs, not {of}")
    return None


def check_destination(out: Path) -> None:
    """Refuse an output folder beside which no checkpoint can be made (``_partials``), before the model loads and
    calibration runs: a read-only or special file system, a parent that is a file, no permission."""
    partials = _partials(out)
    try:
        partials.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkdtemp(dir=partials)).rmdir()
    except OSError as error:
        raise InputError(f"output folder {out}: nothing can be written in {out.parent} "
                         f"({error.strerror or error}); give a folder you can write") from None
    finally:
        with suppress(OSError):  # left empty, unless another run is making a checkpoint there
            partials.rmdir()


def read_manifest(path: str) -> dict | None:
    return read_json(Path(path) / MANIFEST, "quantization manifest")


def checkpoint_damage(folder: Path, manifest: dict, made_from: dict) -> str | None:
    """What is wrong with a checkpoint quantized here, None when it holds what was written from ``made_from`` (the
    manifest's ``source_model_digest``, ``method``, ``bits``, …): its manifest's own digest, those fields, and each file's
    size and sha256 (a bit flipped in a scale, a truncated ``model.safetensors``). It reads every file once."""
    return sealed.damage(manifest, MANIFEST, made_from) or sealed.files_damage(folder, manifest.get("files"))
