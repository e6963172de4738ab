"""Checks of an audit before any model is loaded (``tasks.audit.plan.open_audit`` makes them): each mistake is one
line naming what to change."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tasks.audit.checkpoints import Lineup, calibration_for
from tasks.audit.cluster import check_local_cluster, check_reachable, check_workers
from tasks.audit.reference import find_intact
from tasks.audit.scoring import baseline_identity
from tasks.config import DEFAULT_CALIBRATION, AuditConfig, VariantSpec, check_tracking
from tasks.core import console
from tasks.core.errors import InputError
from tasks.core.places import references_dir
from tasks.data.corpus import corpus_text
from tasks.data.evaluation import Evaluation
from tasks.engine.kv_cache import INTS, head_dim, kv_problem
from tasks.engine.model_facts import check_logits, max_positions
from tasks.engine.paired import MIN_WINDOWS
from tasks.engine.windows import check_window
from tasks.models import llama_cpp
from tasks.models.formats import check_files, check_kernel, require
from tasks.models.loading import check_checkpoint
from tasks.models.quantize_request import check_calibration_length
from tasks.models.resolve import device_problem, resolve_device, visible_gpus
from tasks.models.variants import check_same_tokenizer
from tasks.record.figures import GATED


def check_audit_settings(config: AuditConfig) -> str:
    """What an audit's settings decide before any model is found: its tracking server (returned: the registry of
    its ``models:/`` names), its runner, and each model's device. Raises ``InputError``."""
    # models:/ names are the audit's tracking server's; one MLflow could never reach is refused before the scoring
    registry = check_tracking(config.tracking.uri, "tracking.uri")
    if config.runner.kind == "ray" and importlib.util.find_spec("prefect_ray") is None:
        raise InputError("runner.kind ray needs prefect-ray and ray: pip install 'ppl-audit[ray]'")
    if config.runner.address:
        check_reachable(config.runner.address)
    elif config.runner.kind != "sequential":
        check_local_cluster(config.runner)
    for spec in [config.baseline, *config.variants]:
        try:
            device = resolve_device(spec.device)  # this machine's, to check it: each model resolves its own as it loads
            _check_device_map(spec)
        except InputError as error:
            raise InputError(f"{spec.name}: {error}") from None
        if "liger" in config.evaluation.body and device.type != "cuda":
            raise InputError(f"evaluation.body {config.evaluation.body}: liger-kernel's fused ops run on CUDA, and "
                             f"{spec.name} runs on {device.type}; use compile (or eager) there")
    for spec in [config.baseline, *config.variants]:  # llama.cpp runs it or makes its file: installed, its types
        if spec.runtime_backend.llama_cpp or spec.type is not None:
            settings = spec.llama_cpp_settings
            llama_cpp.check_llama_cpp_settings(f"{spec.role} '{spec.name}'", settings.type_k, settings.type_v, spec.type)
            _check_threads(f"{spec.role} '{spec.name}'", settings.threads)
            if spec.runtime_backend.llama_cpp and settings.gpu_layers and not llama_cpp.gpu_offload():
                # llama.cpp runs them on the CPU without a word; the record keeps both (gpu_layers 0, _asked N)
                print(f"ppl-audit: warning: {spec.role} '{spec.name}': llama_cpp.gpu_layers {settings.gpu_layers} is "
                      "ignored: this llama.cpp build cannot offload to a GPU (llama_supports_gpu_offload() is false); "
                      "it runs on the CPU", file=console.err())
    if "liger" in config.evaluation.body and importlib.util.find_spec("liger_kernel") is None:
        raise InputError(f"evaluation.body {config.evaluation.body} needs liger-kernel: pip install liger-kernel")
    return registry


def _check_device_map(spec: VariantSpec) -> None:
    """Each GPU a ``device_map`` names is one this machine has, as ``device`` is checked."""
    if not isinstance(spec.device_map, dict):
        return
    for module, device in spec.device_map.items():
        problem = device not in ("cpu", "disk") and device_problem(
            f"cuda:{device}" if isinstance(device, int) else device, visible_gpus())
        if problem:
            raise InputError(f"device_map puts '{module}' on '{device}': {problem}")


def _check_threads(where: str, threads: int | None) -> None:
    """llama.cpp's threads wait on each other at every step: more than the machine's CPUs only slows each step down
    (the config bounds them by what llama.cpp can run at all)."""
    cpus = os.cpu_count() or 1
    if threads is not None and threads > cpus:
        raise InputError(f"{where}: llama_cpp.threads {threads} is more than this machine's {cpus} CPUs; llama.cpp's "
                         f"threads wait on each other: use {cpus} or fewer (or leave threads out: the cores it may use)")


def preflight(config: AuditConfig, lineup: Lineup, strict: bool = True) -> None:
    """Check an audit's window and checkpoints, as its ``lineup`` found them, before any model is loaded.

    Args:
        strict: also refuse a variant that cannot be scored (the CLI does, before a run; a run Prefect starts does
            not, so that a checkpoint gone missing fails its variant, not the audit).
    """
    baseline = lineup.baseline
    _check_window(config, baseline.model.config, "the baseline")
    check_checkpoint(baseline.model)
    # what the workers of an existing cluster must see: the baseline's files (a variant quantized at load
    # reads them) and its stored references (a variant's KL), and each variant's own files
    references = references_dir()
    local = {"the baseline": baseline.source, "baseline references": references}
    for checkpoint in lineup.variants if strict else []:
        spec, model = checkpoint.spec, checkpoint.model
        if checkpoint.problem:  # a variant made here names itself; a checkpoint's files name themselves
            raise InputError(f"{spec.name}: {checkpoint.problem}" if spec.quantize_here else checkpoint.problem)
        if spec.path is not None:
            local[spec.name] = model.source
            check_checkpoint(model)
            if Path(model.source).exists():  # its own positions bound the window too, and its tokens must be the baseline's
                _check_window(config, model.config, spec.name)
                check_same_tokenizer(spec.name, baseline.tokenizer, checkpoint.tokenizer)
            check_files(spec, model)  # its method's checks of its files: a saved HQQ one, a compressed-tensors config
        try:
            require(spec.method, resolve_device(spec.device).type)
            if spec.kernel is not None and spec.backend.gptqmodel_kernels:
                check_kernel(spec.method, spec.kernel)
        except InputError as error:
            raise InputError(f"{spec.name}: {error}") from None
        if spec.kv_cache is not None and (model is not None and Path(model.source).exists() or spec.path is None):
            check_kv_cache(spec, (model or baseline.model).config)
    if config.runner.address:
        references.mkdir(parents=True, exist_ok=True)
        check_workers(config.runner, {whose: str(path) for whose, path in local.items()
                                      if Path(path).exists()})  # a Hub id: each worker fetches it


def check_kv_cache(spec: VariantSpec, model_config) -> None:
    """The model's layers all attend (a recurrent layer keeps no keys and values), and an int8/int4 cache's blocks
    lie within one head's vector: its group size divides the head dimension."""
    problem = kv_problem(model_config)
    if problem:
        raise InputError(f"{spec.name}: kv_cache: {problem}")
    width = head_dim(model_config.get_text_config())
    if spec.kv_cache.dtype in INTS and width % spec.kv_cache.group_size:
        raise InputError(f"{spec.name}: kv_cache.group_size {spec.kv_cache.group_size} does not divide the model's "
                         f"head dimension {width}; use a divisor of it (llama.cpp's blocks are 32)")


def _check_window(config: AuditConfig, model_config, whose: str) -> None:
    """The window within the model's positions, and a head the engine scores as the model's own forward does."""
    check_logits(model_config, whose)
    try:
        check_window(config.evaluation.window, max_positions(model_config), whose)
    except InputError as error:
        raise InputError(f"evaluation.{error}") from None


def any_gated(config: AuditConfig) -> bool:
    """Whether any variant of the audit has a limit to be judged against."""
    return any(getattr(config.thresholds.for_variant(spec.name), figure.limit) is not None
               for spec in config.variants for figure in GATED)


def check_stream(config: AuditConfig, lineup: Lineup, scored: Evaluation) -> None:
    """What the audit's token stream decides, checked before anything starts: a gate needs at least
    ``MIN_WINDOWS`` windows for a paired interval (one window shows no error bar, and a gate never passes what
    it cannot show); under ``rescore: never`` the stored reference is all there is, and a damaged one is refused
    (with ``auto`` the audit removes it and scores the baseline again)."""
    settings = scored.settings
    windows = len(scored.windows)
    if windows < MIN_WINDOWS and any_gated(config):
        raise InputError(f"evaluation: the token stream ({len(scored.stream.ids)} tokens) makes {windows} window(s) "
                         f"of {settings.window}; a gate's paired interval needs at least {MIN_WINDOWS}: use a longer "
                         "corpus, more max_tokens or chunks, or a shorter window")
    if config.baseline.rescore == "never":
        _, identity, environment = baseline_identity(lineup.baseline, scored)
        if identity is not None:
            find_intact(identity, environment, "never")


def check_calibration_room(config: AuditConfig, lineup: Lineup, scored: Evaluation) -> None:
    """Draw the calibration of every variant quantized here: one longer than the baseline's positions, or without room,
    is refused now, not after the baseline is scored. Tokenizing is cached, so the audit reads the same stream back."""
    for spec in [spec for spec in config.variants if spec.quantize_here or spec.imatrix]:
        try:
            check_calibration_length(lineup.baseline.model, (spec.calibration or DEFAULT_CALIBRATION).seq_len)
            calibration_for(spec, lineup, scored, corpus_text, progress=True)
        except InputError as error:
            raise InputError(f"{spec.name}: {error}") from None
