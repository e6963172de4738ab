"""The audit's steps as Prefect tasks: thin wrappers over the plain modules, one job each.

Tasks that take or load models never hash their inputs (``NO_CACHE``): hashing a model costs
seconds and gigabytes. Tokenizing is cached by corpus digest, tokenizer digest and settings.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed

from tasks.audit.checkpoints import Checkpoint, Lineup, prepare
from tasks.audit.cluster import let_go
from tasks.audit.diagnose import Examination, Restored, examine, restore
from tasks.audit import scoring
from tasks.audit.pieces import WHOLE, Against, Piece, Whole
from tasks.audit.scoring import BaselineSlice, Lookup, join_reference, look_up, make_variant
from tasks.config import AuditConfig, CorpusConfig
from tasks.core.errors import TransientError
from tasks.core.places import spool_dir, synced_dir
from tasks.data.corpus import corpus_text
from tasks.data.evaluation import Evaluation, evaluation
from tasks.engine.abandon import asking
from tasks.engine.windows import Window
from tasks.models.quantize import calibration_of, quantize
from tasks.record.contents import token_arrays
from tasks.record.reference_said import ReferenceSaid
from tasks.record.results import VariantResult
from tasks.record.spool import claim, mark_synced, write_record
from tasks.record.tracking import is_tracking_outage, replay, track_diagnosis


def _transient(task, run, state) -> bool:
    """Retry only network and remote-storage failures: the rest fails the same way again."""
    return isinstance(state.result(raise_on_failure=False), TransientError)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10, retry_condition_fn=_transient)
def read_corpus(corpus: CorpusConfig) -> str:
    """The corpus as one text (a Hub dataset download is retried, a bad source is not)."""
    return corpus_text(corpus)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10, retry_condition_fn=_transient)
def prepare_models(config: AuditConfig) -> Lineup:
    """Resolve the baseline and every variant once (folders, tokenizer digests, manifests); a registered
    or Hub model is fetched here, retried when the network blips."""
    return prepare(config.baseline, config.variants, config.tracking.uri, config.thresholds)


@task(cache_policy=NO_CACHE)
def tokenize_corpus(text: str, config: AuditConfig, lineup: Lineup) -> Evaluation:
    """Tokenize the corpus once, with the baseline's tokenizer, for every model of the audit.

    The stream is cached on disk by corpus digest, tokenizer digest and settings (``cached_tokenize``),
    so a later audit of the same corpus reads it back; no model is ever hashed.
    """
    return evaluation(text, lineup.tokenizer, config.evaluation, progress=True)


def _score_name() -> str:
    """``score-<model>``, and a shard's windows or a sequential run's sample after it."""
    from prefect.runtime import task_run

    piece = task_run.parameters.get("piece") or WHOLE
    return f"score-{task_run.parameters['checkpoint'].name}{piece.named()}"


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10, task_run_name=_score_name,
      retry_condition_fn=_transient)
def score_baseline(checkpoint: Checkpoint, evaluation_: Evaluation, piece: Whole | BaselineSlice = WHOLE
                   ) -> VariantResult:
    """Load the baseline and score it, or read it from its stored reference; or score a shard of it (``piece``),
    writing its slice of the reference under what ``look_up_baseline`` found. A failure is a failed result, not a
    failed task."""
    with asking(let_go):  # on a cluster, stops between batches once the audit no longer waits for it
        return scoring.score_baseline(checkpoint, evaluation_, piece, progress=True)


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
        return scoring.score_variant(checkpoint, lineup, evaluation_, against, piece, corpus_text, progress=True)


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
def quantize_model(model: str, method: str, bits: int, group_size: int, sym: bool, calibration: CorpusConfig,
                   samples: int, seq_len: int, seed: int, holdout_tokens: int, out: str, name: str | None) -> dict:
    """Make a gptq/awq checkpoint of ``model`` in ``out``, calibrated on ``samples`` × ``seq_len`` tokens of
    ``calibration`` (never its first ``holdout_tokens``); returns its manifest."""
    drawn = calibration_of(model, calibration, samples, seq_len, seed, holdout_tokens)
    return quantize(model, method, bits, group_size, sym, drawn, Path(out), name=name, progress=True)


@task(cache_policy=NO_CACHE)
def spool_audit(record: dict, results: list[VariantResult]) -> Path:
    """Write the audit's record locally first: nothing computed is lost if tracking fails.

    A record that cannot be written (disk full, read-only, ...) ends the task Failed with one line
    naming the folder and the OS error, not a traceback: the flow then prints the record instead.
    """
    try:
        return write_record(record, token_arrays(results))
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


@task(cache_policy=NO_CACHE, task_run_name="examine-{checkpoint.name}")
def examine_variant(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, windows: list[Window]) -> Examination:
    """Both models on a diagnosis's sample: per-layer errors and per-token losses."""
    with asking(let_go):
        return examine(checkpoint, lineup, evaluation_, windows)


def _restore_name() -> str:
    from prefect.runtime import task_run

    parameters = task_run.parameters
    sets = parameters["sets"]
    return f"restore-{parameters['checkpoint'].name}-{len(sets)}-sets-from-{'-'.join(map(str, sets[0]))}"


@task(cache_policy=NO_CACHE, task_run_name=_restore_name)
def restore_layers(checkpoint: Checkpoint, lineup: Lineup, evaluation_: Evaluation, windows: list[Window],
                   sets: list[tuple[int, ...]]) -> list[Restored]:
    """The variant with each set of the baseline's decoder layers in ``sets`` in place, scored on the sample."""
    with asking(let_go):
        return restore(checkpoint, lineup, evaluation_, windows, sets, progress=True)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5,
      retry_condition_fn=lambda task, run, state: is_tracking_outage(state.result(raise_on_failure=False)))
def log_diagnosis(found: dict, uri: str | None, experiment: str) -> str:
    """Log a diagnosis to MLflow (retried: the tracking server may blip); returns the run id."""
    return track_diagnosis(found, uri, experiment)

