"""Where the variants of an audit run: one after another here, or on Dask or Ray workers.

Sequential is the default: one device, one model in memory at a time. Dask and Ray run variants
concurrently, one per worker, on a local cluster started for the audit or on an existing one
(``runner.address``); with ``gpus_per_variant`` each variant asks its worker for GPUs.
"""

from __future__ import annotations

from contextlib import nullcontext

from prefect import flow

from tasks.checkpoints import Lineup
from tasks.config import AuditConfig
from tasks.errors import InputError, one_line
from tasks.evaluation import Evaluation
from tasks.results import VariantResult
from tasks.steps import score


def dask_cluster(workers: int, resources: dict) -> dict:
    """A local Dask cluster reachable from this machine only (its dashboard binds every interface by default)."""
    return {"n_workers": workers, "threads_per_worker": 1, "resources": resources, "host": "127.0.0.1",
            "dashboard_address": "127.0.0.1:8787"}


def task_runner(config: AuditConfig):
    runner = config.runner
    if runner.kind == "dask":
        from prefect_dask import DaskTaskRunner

        if runner.address:  # the user's cluster: its workers declare their own resources
            return DaskTaskRunner(address=runner.address)
        resources = {"GPU": runner.gpus_per_variant} if runner.gpus_per_variant else {}
        return DaskTaskRunner(cluster_kwargs=dask_cluster(runner.workers, resources))
    if runner.kind == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError:
            raise InputError("runner.kind ray needs prefect-ray: pip install prefect-ray") from None
        return RayTaskRunner(address=runner.address)
    return None


def _placement(config: AuditConfig):
    """What each variant asks of its worker: GPUs, where configured."""
    gpus = config.runner.gpus_per_variant
    if not gpus:
        return nullcontext()
    if config.runner.kind == "dask":
        import dask

        return dask.annotate(resources={"GPU": gpus})
    from prefect_ray.context import remote_options

    return remote_options(num_gpus=gpus)


def _outcome(checkpoint, value) -> VariantResult:
    """A task's result, or a failed result for a task that raised (retries exhausted)."""
    if isinstance(value, BaseException):
        spec = checkpoint.spec
        return VariantResult(spec.name, spec.method, "failed", f"{type(value).__name__}: {one_line(value)}")
    return value


@flow(name="ppl-audit-variants", validate_parameters=False)  # it takes the audit's own objects, checked already
def score_concurrently(config: AuditConfig, lineup: Lineup, scored: Evaluation, baseline: VariantResult
                       ) -> list[VariantResult]:
    """Every variant at once, one task each, on the task runner this flow is given (Dask or Ray)."""
    with _placement(config):
        futures = [score.submit(checkpoint, lineup, scored, baseline) for checkpoint in lineup.variants]
    return [_outcome(checkpoint, future.result(raise_on_failure=False))
            for checkpoint, future in zip(lineup.variants, futures)]


def score_all(config: AuditConfig, lineup: Lineup, scored: Evaluation) -> tuple[VariantResult, list[VariantResult]]:
    """Score the baseline, then every variant against it; a variant whose task failed becomes a failed result."""
    baseline = _outcome(lineup.baseline, score(lineup.baseline, lineup, scored, return_state=True)
                        .result(raise_on_failure=False))
    runner = task_runner(config)
    if runner is None:
        variants = [_outcome(checkpoint, score(checkpoint, lineup, scored, baseline, return_state=True)
                             .result(raise_on_failure=False)) for checkpoint in lineup.variants]
    else:
        variants = score_concurrently.with_options(task_runner=runner)(config, lineup, scored, baseline)
    return baseline, variants
