"""The audit's steps as Prefect tasks: thin wrappers over the plain modules, one job each.

Tasks that take or load models never hash their inputs (``NO_CACHE``): hashing a model costs
seconds and gigabytes. Tokenizing is cached by corpus digest, tokenizer digest and settings.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.states import Failed

from tasks.audit import Evaluation, VariantResult, audit_evaluation, score_variant
from tasks.config import AuditConfig, CorpusConfig, VariantSpec
from tasks.errors import TransientError
from tasks.models import load_tokenizer
from tasks.spool import claim, mark_synced, spool_dir, synced_dir, token_arrays, write_record
from tasks.tracking import is_tracking_outage, replay
from tasks.corpus import tokenizer_digest


def _transient(task, run, state) -> bool:
    """Retry only network and remote-storage failures: the rest fails the same way again."""
    return isinstance(state.result(raise_on_failure=False), TransientError)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10, retry_condition_fn=_transient)
def read_corpus(corpus: CorpusConfig) -> str:
    """The corpus as one text (a Hub dataset download is retried, a bad source is not)."""
    return corpus.text()


@task(cache_policy=NO_CACHE)
def tokenize_corpus(text: str, config: AuditConfig) -> Evaluation:
    """Tokenize the corpus once for every model of the audit.

    The stream is cached on disk by corpus digest, tokenizer digest and settings (``cached_tokenize``),
    so a later audit of the same corpus reads it back; no model is ever hashed.
    """
    return audit_evaluation(config, text, progress=True)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=10, task_run_name="score-{spec.name}",
      retry_condition_fn=_transient)
def score(spec: VariantSpec, config: AuditConfig, evaluation_: Evaluation,
          baseline_outcome: VariantResult | None = None) -> VariantResult:
    """Load (or make) one variant and score it; a failure is a failed result, not a failed task.

    Variants get the baseline's outcome, to measure their divergence from it.
    """
    baseline = config.baseline.path
    return score_variant(spec, baseline, tokenizer_digest(load_tokenizer(baseline)), evaluation_,
                         corpus_text_of=CorpusConfig.text, progress=True,
                         baseline_outcome=baseline_outcome, baseline_spec=config.baseline)


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
