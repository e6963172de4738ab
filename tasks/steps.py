"""The audit's steps as Prefect tasks: thin wrappers over the plain modules, one job each.

Tasks that take or load models never hash their inputs (``NO_CACHE``): hashing a model costs
seconds and gigabytes. The plan (``open_plan``) is made by ``tasks.audit.plan.open_audit``; tokenizing is cached by
corpus digest, tokenizer digest and settings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed

from tasks.audit.checkpoints import Checkpoint, Lineup
from tasks.audit.cluster import let_go
from tasks.audit import scoring
from tasks.audit.diagnose import Bench, Examination, Restored, examine, restore
from tasks.audit.pieces import WHOLE, Against, Piece, Whole
from tasks.audit.plan import AuditPlan, Event, open_audit
from tasks.audit.recipe import measure, proof
from tasks.audit.recipe.plan import Prepared
from tasks.audit.scoring import BaselineSlice, Lookup, join_reference, look_up, make_variant
from tasks.config import AuditConfig
from tasks.core.errors import TransientError
from tasks.core.places import spool_dir, synced_dir
from tasks.data.corpus import corpus_text
from tasks.data.evaluation import Evaluation
from tasks.engine.abandon import asking
from tasks.engine.windows import Window
from tasks.models.patches import prefect_sigterm_outside_finalizers
from tasks.models.quantize import calibration_of, quantize
from tasks.models.quantize_request import QuantizeRequest
from tasks.record.reference_said import ReferenceSaid
from tasks.record.results import VariantResult
from tasks.record.spool import claim, mark_synced, write_record
from tasks.record.tracking import is_tracking_outage, replay, track_diagnosis, track_tune
from tasks.task_run_said import task_run

# every flow runs the tasks below, so every process that runs a flow (the command, a served run, a worker) imports
# this module first: a SIGTERM that lands in a finalizer during a flow run is sent again, not lost
prefect_sigterm_outside_finalizers()


def _transient(task, run, state) -> bool:
    """Retry only network and remote-storage failures: the rest fails the same way again."""
    return isinstance(state.result(raise_on_failure=False), TransientError)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10, retry_condition_fn=_transient)
def open_plan(path: str, overrides: list[str], event: Event | None = None,
              narrow: Callable[[AuditConfig], AuditConfig] | None = None) -> AuditPlan:
    """The plan of a run Prefect started from plain parameters (a deployment, a served or scheduled run), made on
    entry by ``open_audit`` as the CLI makes it; a variant that cannot be scored fails alone there. A Hub model or
    dataset download is retried when the network blips, a bad config is not."""
    return open_audit(path, overrides, event, narrow, strict=False)


def _score_name() -> str:
    """``score-<model>``, and a shard's windows or a sequential run's sample after it."""
    run = task_run()
    return f"score-{run.model}{(run.piece or WHOLE).named()}"


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10, task_run_name=_score_name,
      retry_condition_fn=_transient)
def score_baseline(checkpoint: Checkpoint, evaluation_: Evaluation, piece: Whole | BaselineSlice = WHOLE
                   ) -> VariantResult:
    """Load the baseline and score it, or read it from its stored reference; or score a shard of it (``piece``),
    writing its slice of the reference under what ``look_up_baseline`` found. A failure is a failed result, not a
    failed task."""
    with asking(let_go):  # on a cluster, stops between batches once the audit no longer waits for it
        return scoring.baseline_outcome(checkpoint, evaluation_, piece, progress=True)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10, task_run_name=_score_name,
      retry_condition_fn=_transient)
def score_variant(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, against: Against = None,
                  piece: Piece = WHOLE) -> VariantResult:
    """Load (or make) one variant and score it, or only a ``piece`` of it (a shard's windows, a sequential run's
    sample); a failure is a failed result, not a failed task.

    It measures its divergence ``against`` the baseline's outcome or, while the baseline is scored in shards beside
    it, the slices of its reference that the baseline's shards wrote (``Slices``).
    """
    with asking(let_go):  # on a cluster, stops between batches once the audit no longer waits for it
        return scoring.variant_outcome(checkpoint, lineup, evaluation_, against, piece, corpus_text, progress=True)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10, retry_condition_fn=_transient)
def look_up_baseline(checkpoint: Checkpoint, evaluation_: Evaluation) -> Lookup:
    """On a worker, which sees the model's files and the references: the baseline's stored reference, or the key
    its shards write one under (a Hub model's snapshot is looked for, retried when the network blips)."""
    return look_up(checkpoint, evaluation_)


@task(cache_policy=NO_CACHE, task_run_name="join-reference-{lookup.key}")
def join_baseline_reference(lookup: Lookup, baseline: VariantResult, shards: list[VariantResult],
                            evaluation_: Evaluation) -> ReferenceSaid | None:
    """On a worker: the baseline reference joined from its shards' slices and put in place (what the record says)."""
    return join_reference(lookup, baseline, shards, evaluation_)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10, task_run_name="make-{checkpoint.name}",
      retry_condition_fn=_transient)
def make(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation) -> Checkpoint:
    """Quantize a gptq/awq variant made here, once, before its shards load it (a failure is its ``problem``)."""
    with asking(let_go):
        return make_variant(checkpoint, lineup, evaluation_, corpus_text_of=corpus_text, progress=True)


@task(cache_policy=NO_CACHE)
def quantize_model(request: QuantizeRequest) -> dict:
    """Make the gptq/awq checkpoint ``request`` asks for, calibrated on ``samples`` × ``seq_len`` tokens of its
    calibration corpus (never its first ``holdout_tokens``); returns its manifest."""
    model, tokenizer = request.found
    drawn = calibration_of(tokenizer, request.calibration, request.holdout_tokens)
    return quantize(model, request.scheme, drawn, Path(request.out), tokenizer, name=request.name, progress=True)


@task(cache_policy=NO_CACHE)
def spool_audit(record: dict, arrays: dict) -> Path:
    """Write the audit's record and its per-token ``arrays`` (by file name) locally first: nothing computed is lost if
    tracking fails.

    A record that cannot be written (disk full, read-only, ...) ends the task Failed with one line
    naming the folder and the OS error, not a traceback: the flow then prints the record instead.
    """
    try:
        return write_record(record, arrays)
    except OSError as error:
        return Failed(message=f"could not write the audit's record in {spool_dir()}: {error}")


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=lambda task, run, state: is_tracking_outage(state.result(raise_on_failure=False)))
def track(folder: Path) -> str:
    """Log the record to MLflow (retried: the tracking server may blip); returns the parent run id.

    A ``ppl-audit sync`` may be replaying this very record: then this waits for it, and when it did
    log the record, its run is found (``replay`` of a complete audit logs nothing) instead of made twice.
    """
    with claim(folder, wait=True) as state:
        if state == "mine":
            run_id = replay(folder)
            mark_synced(folder)
            return run_id
    return replay(synced_dir() / folder.name)


class WorkerBench(Bench):
    """The ``Bench`` a Dask or Ray worker's process keeps for the diagnosis tasks it runs: the one object here that
    outlives a task, and the one instance of it is ``WORKER_BENCH``.

    Why a process-wide object: a worker runs several restore tasks of one diagnosis, and loading the pair once per
    worker, not once per task, is most of a diagnosis's speed on a cluster. Prefect's task runners give a task
    nothing that lives as long as its worker process (Dask's worker plugins and Ray's actors would be a second way
    to reach the models, one per runner), and a bench given as a task's argument would reach the worker as a fresh
    copy with each task (every argument is pickled), loading the pair each time. So a task on a cluster, given no
    bench, takes this process's. It holds one pair at a time: the next diagnosis's pair
    takes its place, and the worker's end (a local cluster ends with the audit's runner) lets it go. Run here,
    without a cluster, the flow's own process is the worker (``flows.scheduler.LocalScheduler``): its tasks take this
    bench too, and the flow forgets it when the diagnosis ends (``flows.diagnose``), so that the pair does not outlive
    it; one process runs one diagnosis at a time (a served run is a process of its own)."""


WORKER_BENCH = WorkerBench()


@task(cache_policy=NO_CACHE, task_run_name="examine-{checkpoint.name}")
def examine_variant(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, windows: list[Window],
                    bench: Bench | None = None) -> Examination:
    """Both models on a diagnosis's sample: per-layer errors and per-token losses; the models are ``bench``'s
    (None: this worker's, ``WORKER_BENCH``)."""
    with asking(let_go):
        return examine(WORKER_BENCH if bench is None else bench, checkpoint, lineup, evaluation_, windows)


def _restore_name() -> str:
    run = task_run()
    return f"restore-{run.model}-{len(run.sets)}-sets-from-{'-'.join(map(str, run.sets[0]))}"


@task(cache_policy=NO_CACHE, task_run_name=_restore_name)
def restore_layers(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, windows: list[Window],
                   sets: list[tuple[int, ...]], bench: Bench | None = None) -> list[Restored]:
    """The variant with each set of the baseline's decoder layers in ``sets`` in place, scored on the sample; the
    models are ``bench``'s (None: this worker's, ``WORKER_BENCH``)."""
    with asking(let_go):
        return restore(WORKER_BENCH if bench is None else bench, checkpoint, lineup, evaluation_, windows, sets,
                       progress=True)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=lambda task, run, state: is_tracking_outage(state.result(raise_on_failure=False)))
def log_diagnosis(found: dict, uri: str | None, experiment: str) -> str:
    """Log a diagnosis to MLflow (retried: the tracking server may blip); returns the run id."""
    return track_diagnosis(found, uri, experiment)



@task(cache_policy=NO_CACHE, task_run_name="measure-{prepared.variant}")
def measure_tune(lineup: Lineup, evaluations: list[Evaluation], prepared: Prepared, windows: int | None,
                 seed: int) -> dict:
    """A tune's measuring: each unit at each option on the sample, the knapsack's choice scored and refined; the
    tune's report, with the recipe made (llama.cpp's quantizer, gptqmodel) and checked on what was made
    (``built``)."""
    with asking(let_go):
        tuning, donor_sizes, measured = measure.measure(lineup, evaluations, prepared, windows, seed)
        return proof.proven_report(tuning, prepared, donor_sizes, replace(lineup, variants=[measured]), evaluations[0])


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=lambda task, run, state: is_tracking_outage(state.result(raise_on_failure=False)))
def log_tune(found: dict, uri: str | None, experiment: str, parent: str | None) -> str:
    """Log a tune to MLflow, a child of the audit of its recipe (``parent``; retried: the tracking server may
    blip); returns the run id."""
    return track_tune(found, uri, experiment, parent)
