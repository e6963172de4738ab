"""Where the variants of an audit run: one after another here, or on Dask or Ray workers.

Sequential is the default: one device, one model in memory at a time. Dask and Ray run variants
concurrently, one per worker; with ``gpus_per_variant`` each variant asks its worker for GPUs.
"""

from __future__ import annotations

from contextlib import nullcontext

from prefect import flow

from tasks.audit import Evaluation, VariantResult
from tasks.config import AuditConfig
from tasks.errors import InputError
from tasks.steps import score


def _failed(spec, error: BaseException) -> VariantResult:
    return VariantResult(spec.name, spec.method, "failed", f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")


def task_runner(config: AuditConfig):
    runner = config.runner
    if runner.kind == "dask":
        from prefect_dask import DaskTaskRunner

        resources = {"GPU": runner.gpus_per_variant} if runner.gpus_per_variant else {}
        return DaskTaskRunner(cluster_kwargs={"n_workers": runner.workers, "threads_per_worker": 1,
                                              "resources": resources})
    if runner.kind == "ray":
        try:
            from prefect_ray import RayTaskRunner
        except ImportError:
            raise InputError("runner.kind ray needs prefect-ray: pip install prefect-ray") from None
        return RayTaskRunner()
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


def _concurrently(config: AuditConfig, scored: Evaluation) -> list[VariantResult]:
    specs = [config.baseline, *config.variants]
    with _placement(config):
        futures = [score.submit(spec, config, scored) for spec in specs]
    results = []
    for spec, future in zip(specs, futures):
        outcome = future.result(raise_on_failure=False)
        results.append(_failed(spec, outcome) if isinstance(outcome, BaseException) else outcome)
    return results


def score_all(config: AuditConfig, scored: Evaluation) -> tuple[VariantResult, list[VariantResult]]:
    """Score the baseline and every variant; a variant whose task failed becomes a failed result."""
    runner = task_runner(config)
    if runner is None:
        results = []
        for spec in [config.baseline, *config.variants]:
            state = score(spec, config, scored, return_state=True)
            outcome = state.result(raise_on_failure=False)
            results.append(_failed(spec, outcome) if isinstance(outcome, BaseException) else outcome)
    else:
        results = flow(name="ppl-audit-variants", task_runner=runner)(_concurrently)(config, scored)
    return results[0], results[1:]
