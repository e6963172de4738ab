"""Every change this project makes to a library's own code at run time, in one place: gptqmodel's and Prefect's.

Each is for a library that has no setting for what it changes; gptqmodel's are context managers that put the
library's attribute back on leaving, Prefect's is made once for the process's life. Each names what it was written
against (``WRITTEN_AGAINST``: the library's functions it replaces or relies on, with the sha256 of their source in
the pinned release); tests/test_patches.py fails when an upgrade changes one of them, so that the patch is read
again before it runs against new code.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tasks.core.signals import outside_finalizers

GPTQMODEL = "7.6.0"  # the releases the patches below were written against: pyproject.toml's pins
PREFECT = "3.8.8"

# ``module:qualified name`` of each function a patch replaces or relies on -> sha256 of its source in GPTQMODEL
WRITTEN_AGAINST = {
    # logs_in: the one reader of loop_processor._PROJECT_LOG_DIR, which it reads at each call, not at import
    "gptqmodel.looper.loop_processor:LoopProcessor._build_log_file_path":
        "35832f685e161775955881e269c15cb49f398881daf309c6fb1e8e332589519f",
    # clip_search_by_matmul: the function replaced, its one caller (how it is called), the pseudo-quantizer it uses
    "gptqmodel.looper.awq_processor:AWQProcessor._compute_best_clip":
        "1a4e491ca33691b09e87b4cd49ef43a2cc0d4f0d9ca4e8e52edb301eac1a07e7",
    "gptqmodel.looper.awq_processor:AWQProcessor._search_best_clip":
        "b3b6af36998feadbb3e11bf8b0b8975edb618772489af29be283e927e5f6683d",
    "gptqmodel.looper.awq_processor:AWQProcessor._pseudo_quantize_tensor_into":
        "a09ed24d30bbe74425c982f456f49540c8610eaa3aa53002131dcb6fa9fc808d",
    # failures_raised: the method replaced, and the worker loop that calls it (the task's future holds the exception
    # before it is called; a failed warm-up, which has none, still ends the process)
    "gptqmodel.utils.threadx:_DeviceWorker._abort_process":
        "038fd3c7b8601d108f3026dfc0204e8d599047ec4615ce97be62262a027b0047",
    "gptqmodel.utils.threadx:_DeviceWorker._run":
        "a89c375f72cb27e24d2ce88fecb18686bfc70df1131087436809b20d1fa7ef68",
    # prefect_sigterm_outside_finalizers: the handler wrapped, and its readers, which look it up by its module name
    # at each call (so the wrapped one is what a flow run installs, reuses and recognises)
    "prefect.utilities.engine:_prefect_sigterm_handler":
        "8ebd7beaf895b9cbdc6c30fcbeeec90fb729f900ea29785b0df8df18beab4a6f",
    "prefect.utilities.engine:capture_sigterm":
        "6d08563e05e9c12debf7df4a674857403c91c2c970e0ccae8df07966d15c1ed9",
    "prefect.utilities.engine:is_prefect_sigterm_handler_installed":
        "610901b700b710e39a183afaddfdeffd151145ae818d7afffdad35f2d4a9a751",
}


@contextmanager
def logs_in(folder: Path) -> Iterator[None]:
    """gptqmodel writes each quantizer's per-layer log under ``./logs``, in whatever folder the user is in; it has
    no setting for that (no argument, no environment variable: ``_PROJECT_LOG_DIR`` is a module constant), so the
    constant is pointed at ``folder`` meanwhile."""
    from gptqmodel.looper import loop_processor

    kept = loop_processor._PROJECT_LOG_DIR
    loop_processor._PROJECT_LOG_DIR = folder
    try:
        yield
    finally:
        loop_processor._PROJECT_LOG_DIR = kept


@torch.inference_mode()
def best_clip_by_matmul(processor, w: torch.Tensor, input_feat: torch.Tensor, n_grid: int = 20,
                        max_shrink: float = 0.5, n_sample_token: int = 512) -> torch.Tensor:
    """gptqmodel 7.6.0's AWQ clip search (``AWQProcessor._compute_best_clip``: the clipping of each weight group
    that best keeps the layer's outputs on up to 512 of its calibration tokens), with each grid step's outputs
    taken as one batched matmul per group in float32.

    gptqmodel forms them as a broadcast product ``[out channels, tokens, groups, group size]`` summed in the
    weights' dtype (bfloat16 on CPU): 95% of AWQ's time here (~17 s of each SmolLM2 layer's 18 s; 9 of the demo's
    cold 14 minutes), and it does not depend on the calibration's size. The same sums as matmuls are ~16x faster
    on this machine's CPU, and exact to float32, where gptqmodel's are to bfloat16. Same grid, same tokens, same
    pseudo-quantizer (``processor``'s own), same result shape ``[out channels, groups, 1]``.
    """
    group_size = processor.qcfg.group_size if processor.qcfg.group_size > 0 else w.shape[1]
    x = input_feat.reshape(-1, input_feat.shape[-1])
    x = x[::max(1, x.shape[0] // n_sample_token)].to(w.device, torch.float32)
    x = x.reshape(x.shape[0], -1, group_size).transpose(0, 1)  # [groups, tokens, group size]
    best = []
    for rows in w.reshape(w.shape[0], -1, group_size).split(1024):  # [rows, groups, group size]: bounded memory
        original_max = rows.abs().amax(dim=-1, keepdim=True)
        original_out = torch.bmm(x, rows.float().permute(1, 2, 0))  # [groups, tokens, rows]
        best_max = original_max.clone()
        least = torch.full(original_max.shape, torch.inf, device=w.device)
        quantized = torch.empty_like(rows)
        for step in range(int(max_shrink * n_grid)):
            max_val = original_max * (1 - step / n_grid)
            processor._pseudo_quantize_tensor_into(torch.clamp(rows, -max_val, max_val), quantized)
            out = torch.bmm(x, quantized.float().permute(1, 2, 0))
            error = (out - original_out).pow(2).mean(dim=1).T.unsqueeze(-1)  # [rows, groups, 1]
            better = error < least
            least[better] = error[better]
            best_max[better] = max_val[better]
        best.append(best_max)
    return torch.cat(best)


@contextmanager
def clip_search_by_matmul() -> Iterator[None]:
    """gptqmodel's AWQ runs ``best_clip_by_matmul`` for its clip search meanwhile: gptqmodel has no setting or hook
    for how the search sums (the processor is made inside the quantizer's ``quantize``, so no subclass of it can be
    put in), hence its method is replaced on the class."""
    from gptqmodel.looper.awq_processor import AWQProcessor

    stock = AWQProcessor._compute_best_clip
    AWQProcessor._compute_best_clip = best_clip_by_matmul
    try:
        yield
    finally:
        AWQProcessor._compute_best_clip = stock


@contextmanager
def failures_raised() -> Iterator[None]:
    """gptqmodel runs a quantization's steps on its own worker threads, and a step that raises ends the whole process
    (``os._exit(1)`` after printing the traceback): an AWQ of a family its code does not know (Gemma 3's rotary
    embedding wants a layer type) took the audit, every other variant and its record with it. The worker has set the
    exception on the task's future first, so the step's caller raises it; meanwhile the process is ended only where
    no future holds it (a worker's failed warm-up). gptqmodel has no setting for this."""
    from gptqmodel.utils.threadx import _DeviceWorker

    stock = _DeviceWorker._abort_process

    def abort_unless_raised(worker, error: BaseException) -> None:
        task = sys._getframe(1).f_locals.get("fut")  # the worker loop's future of the failed task
        if task is None or not task.done():
            stock(worker, error)

    _DeviceWorker._abort_process = abort_unless_raised
    try:
        yield
    finally:
        _DeviceWorker._abort_process = stock


def prefect_sigterm_outside_finalizers() -> None:
    """During a flow run Prefect's own SIGTERM handler replaces the command's (``flows.lifetime``) and raises
    ``TerminationSignal``; raised inside a ``__del__`` it was only printed, and the audit went on scoring and wrote
    the record of an audit its user had stopped, until the supervisor killed it 6 s later (seen in the suite: the
    signal landed in an asyncio transport's finalizer). Prefect has no setting for its handler, so the module's
    function is wrapped (``tasks.core.signals.outside_finalizers``): the signal is sent again once the finalizer has
    returned. For the process's life, once: every flow run installs the handler anew."""
    from prefect.utilities import engine

    if not getattr(engine._prefect_sigterm_handler, "outside_finalizers", False):
        engine._prefect_sigterm_handler = outside_finalizers(engine._prefect_sigterm_handler)
