"""Where the variants of an audit run: one after another here, or on Dask or Ray workers.

Sequential is the default: one device, one model in memory at a time. Dask and Ray run variants
concurrently, one per worker, on a local cluster started for the audit or on an existing one
(``runner.address``); with ``gpus_per_variant`` each variant asks its worker for GPUs, and with ``shards``
each variant's windows are split across workers and merged exactly. The workers, this process's one included
(``LocalScheduler``), are reached through one ``flows.scheduler.Scheduler``: this module says what is scored where
and in which order, never how Dask or Ray do it.
"""

from __future__ import annotations

from dataclasses import replace

from prefect import get_run_logger

from flows.scheduler import Scheduler
from tasks.audit import floor
from tasks.audit.checkpoints import Lineup
from tasks.audit.judge import Scored
from tasks.audit.plan import Domain
from tasks.audit.pieces import Sample, Slices, Windows
from tasks.audit.scoring import BaselineSlice, Lookup, look_up, merge_shards
from tasks.config import AuditConfig
from tasks.core.errors import InputError, one_line
from tasks.data.evaluation import Evaluation
from tasks.engine.perplexity import shard_bounds
from tasks.engine.token_figures import TokenFigures
from tasks.record.reference_said import Divergence, ReferenceSaid
from tasks.record.results import VariantResult
from tasks.record.shard_said import ShardSaid
from tasks.steps import join_baseline_reference, look_up_baseline, make, score_baseline, score_variant

def _raised(error: BaseException) -> str:
    return one_line(error) if isinstance(error, InputError) else f"{type(error).__name__}: {one_line(error)}"


def _made(checkpoint, value):
    """What a ``make`` task gave: the made checkpoint, or ``checkpoint`` with what the task raised as its problem."""
    return replace(checkpoint, problem=_raised(value)) if isinstance(value, BaseException) else value


def _outcome(checkpoint, value) -> VariantResult:
    """A task's result, or a failed result for a task that raised (retries exhausted)."""
    if isinstance(value, BaseException):
        return VariantResult.failed(checkpoint.spec.name, checkpoint.spec.method, _raised(value))
    return value


def _nobody_left(failed: VariantResult) -> VariantResult:
    return replace(failed, shards=(), reason=f"{failed.reason}; no other worker is left to run it again")


def submit_makes(scheduler: Scheduler, lineup: Lineup, scored: Evaluation) -> dict:
    """A ``make`` task for each variant quantized here, by its place in the lineup: submitted before the baseline is
    scored, they quantize on the workers it leaves free (its shards need the GPUs a variant asks for, and so do
    they)."""
    with scheduler.placed():
        return {v: scheduler.submit(make, checkpoint=c, lineup=lineup, evaluation_=scored)
                for v, c in enumerate(lineup.variants) if c.source is None and not c.problem}


def score_concurrently(scheduler: Scheduler, lineup: Lineup, scored: Evaluation, making: dict
                       ) -> tuple[VariantResult, list[VariantResult]]:
    """The baseline and every variant at once on a started Dask or Ray task runner, each as ``runner.shards`` tasks
    over contiguous slices of its windows (one by default), merged exactly; a variant made here is quantized once
    first (``making``: ``submit_makes``'s).

    The baseline's stored reference is reused (``_baseline_found``), or the baseline is scored in shards beside the
    variants, each shard writing its slice of the reference: a variant's shard starts as soon as the slices it reads
    are written (its own windows' and the first, which names the LM head), or at once where it reads none
    (``evaluation.divergence`` off); the slices are joined into the reference once every shard is done. A variant's
    shard whose baseline shard failed waits for that one's retry; should the baseline fail, its variants are scored
    without divergence, as they are anywhere else.

    A task that failed in a way another worker may not (out of memory, a crash, a file missing there) is tried
    once more, elsewhere; the model fails only when it fails again. Tasks go to the scheduler's runner, not
    through a subflow: a subflow's parameters (the corpus text among them) are stored with its run, and
    Prefect refuses more than 512 KB of them.
    """
    run = _Concurrently(scheduler, lineup, scored, making)
    with scheduler.placed():
        run.first_tries()
        merged = run.baseline_merged() if run.done is None else None
        outcomes = run.outcomes()
    done = run.done if merged is None else run.joined(merged, outcomes)
    return done, [merge_shards(shards, scored) for shards in outcomes]


class _Concurrently:
    """What ``score_concurrently`` knows as it goes: the baseline's lookup (``found``) and outcome where settled
    (``done``), the variants ready to score (made), and each variant's shard submitted (``submitted``) with what it
    was given of the baseline (``given``), by (variant, shard); ``tried``: the baseline's shards' first tries."""

    def __init__(self, scheduler: Scheduler, lineup: Lineup, scored: Evaluation, making: dict):
        self.scheduler, self.lineup, self.scored, self.making = scheduler, lineup, scored, making
        self.bounds = _bounds(scheduler.settings.shards, scored)
        self.found, self.done = _baseline_found(scheduler, lineup, scored)
        self.reading = self.done is None and scored.settings.divergence
        self.ready = {v: c for v, c in enumerate(lineup.variants) if v not in making}
        self.submitted, self.given, self.tried = {}, {}, []

    def reads(self, n: int, shards: list) -> dict:
        """What a variant's shard ``n`` is given of the baseline (``shards``: the outcomes of the baseline's)."""
        if self.done is not None:
            return {"against": self.done}
        return {"against": Slices(tuple(shards[m] for m in dict.fromkeys((0, n))))} if self.reading else {}

    def shard(self, v: int, n: int, parameters: dict):
        self.given[v, n] = parameters
        return self.scheduler.submit(score_variant, checkpoint=self.ready[v], lineup=self.lineup,
                                     evaluation_=self.scored, piece=Windows(*self.bounds[n]), **parameters)

    def submit_ready(self) -> None:
        """Each shard of a variant made whose baseline slices (its own windows' and the first) are written."""
        for v in self.ready:
            for n in range(len(self.bounds)):
                written = not self.reading or all(self.tried[m] is not None and self.tried[m].ok for m in (0, n))
                if written and (v, n) not in self.submitted:
                    self.submitted[v, n] = self.shard(v, n, self.reads(n, self.tried))

    def first_tries(self) -> None:
        """The baseline's shards, and each variant's once it is made and the baseline's slices it reads are in."""
        first = [] if self.done is not None else [_baseline_shard(self.scheduler, self.lineup, self.scored, self.found,
                                                                  windows) for windows in self.bounds]
        self.tried = [None] * len(first)
        self.submit_ready()
        waiting = {future: ("baseline", n) for n, future in enumerate(first)} | \
                  {future: ("make", v) for v, future in self.making.items()}
        while waiting:
            future = self.scheduler.first_done(waiting)
            kind, i = waiting.pop(future)
            if kind == "baseline":
                self.tried[i] = _outcome(self.lineup.baseline, Scheduler.settled(future))
            else:
                self.ready[i] = _made(self.lineup.variants[i], Scheduler.settled(future))
            self.submit_ready()

    def baseline_merged(self) -> VariantResult:
        """The baseline merged from its shards (a failed one tried again elsewhere), and every variant's shard not
        submitted yet submitted against it: its slices, or the failed baseline (no divergence)."""
        self.tried, merged = _baseline_retried(self.scheduler, self.lineup, self.scored, self.found, self.bounds,
                                               self.tried)
        for v, n in [(v, n) for v in self.ready for n in range(len(self.bounds)) if (v, n) not in self.submitted]:
            self.submitted[v, n] = self.shard(v, n, self.reads(n, self.tried) if merged.ok else {"against": merged})
        return merged

    def outcomes(self) -> list[list[VariantResult]]:
        """Every variant's shards' outcomes, each failed one that another worker may not fail tried there once more."""
        outcomes = [[_outcome(c, Scheduler.settled(self.submitted[v, n])) for n in range(len(self.bounds))]
                    for v, c in enumerate(self.lineup.variants)]
        _tried_again(self.scheduler, self.lineup.variants, outcomes, lambda v, n: self.shard(v, n, self.given[v, n]))
        return outcomes

    def joined(self, merged: VariantResult, outcomes: list[list[VariantResult]]) -> VariantResult:
        """The baseline with the reference joined from its slices; a variant's shards measured against slices of a
        baseline that failed are left without divergence (they would hold a part of it)."""
        if not merged.ok:
            for v, n in [key for key, parameters in self.given.items() if isinstance(parameters.get("against"), Slices)]:
                outcomes[v][n] = _without_divergence(outcomes[v][n])
        return _joined(self.scheduler, self.found, merged, self.tried, self.scored)


def _without_divergence(outcome: VariantResult) -> VariantResult:
    """A variant's shard as if it had been scored against a baseline that failed: no divergence."""
    part = None if outcome.part is None else replace(outcome.part, scores=replace(outcome.part.scores, extra=TokenFigures()))
    return replace(outcome, part=part, divergence=Divergence.missing("the baseline was not scored"))


def _tried_again(scheduler: Scheduler, checkpoints: list, outcomes: list[list[VariantResult]], resubmit) -> None:
    """Each failed shard of ``outcomes`` (per model of ``checkpoints``, per shard) that another worker may not fail
    (``retry_elsewhere``) submitted once more (``resubmit(model, shard)`` in the context that holds it to the other workers), and its
    outcome replaced by the new try's, which keeps the failed try's rows before its own."""
    again = {}
    for v, shards in enumerate(outcomes):
        for n, failed in enumerate(shards):
            if failed.retry_elsewhere:
                others = scheduler.elsewhere(failed.shards[0].worker) if failed.shards else None
                with scheduler.held_to(others):  # none left: fail now, not hold it to nobody (Dask reads [] as anyone)
                    again[v, n] = (resubmit(v, n) if others != [] else None), others
    for (v, n), (future, others) in again.items():
        failed = outcomes[v][n]
        ran, settled = (False, None) if future is None else scheduler.settled_on(future, others)
        retried = _outcome(checkpoints[v], settled) if ran else _nobody_left(failed)
        outcomes[v][n] = replace(retried, shards=(*(replace(row, failed=failed.reason) for row in failed.shards),
                                                 *retried.shards))


def _baseline_found(scheduler: Scheduler, lineup: Lineup, scored: Evaluation) -> tuple[Lookup | None, VariantResult | None]:
    """What the stored references say of the baseline, looked up here (its files digested, the references read: no
    model loaded), or by a worker where this process cannot see the model's files: its ``Lookup``, and its outcome
    where that is already settled (reused from its reference, or failed)."""
    baseline = lineup.baseline
    if baseline.problem:
        return None, VariantResult.failed(baseline.name, baseline.spec.method, baseline.problem)
    try:
        found = look_up(baseline, scored)
    except Exception as error:  # noqa: BLE001 -- a damaged reference under rescore: never, say: the baseline fails
        return None, _outcome(baseline, error)
    if found.key is None and found.reused is None:  # a worker may see the files this process does not
        found = Scheduler.settled(scheduler.submit(look_up_baseline, checkpoint=baseline, evaluation_=scored))
        if isinstance(found, BaseException):
            return None, _outcome(baseline, found)
    if found.reused is not None:
        result, facts = found.reused
        return found, VariantResult(baseline.name, baseline.spec.method, "ok", result=result, facts=facts,
                                    manifest=baseline.manifest, reference=found.said)
    return found, None


def _baseline_shard(scheduler: Scheduler, lineup: Lineup, scored: Evaluation, found: Lookup,
                    windows: tuple[int, int]):
    """A task scoring the baseline's ``windows`` and writing their slice of its reference."""
    return scheduler.submit(score_baseline, checkpoint=lineup.baseline, evaluation_=scored,
                            piece=BaselineSlice(Windows(*windows), found))


def _baseline_retried(scheduler: Scheduler, lineup: Lineup, scored: Evaluation, found: Lookup,
                      bounds: list[tuple[int, int]], tried: list[VariantResult]
                      ) -> tuple[list[VariantResult], VariantResult]:
    """The baseline's shards (over ``bounds``) once each of ``tried`` (their first tries' outcomes) that failed where
    another worker may not has been tried again elsewhere, and the baseline merged from them."""
    outcomes = [list(tried)]
    _tried_again(scheduler, [lineup.baseline], outcomes,
                 lambda _, n: _baseline_shard(scheduler, lineup, scored, found, bounds[n]))
    return outcomes[0], merge_shards(outcomes[0], scored)


def _joined(scheduler: Scheduler, found: Lookup, merged: VariantResult, shards: list[VariantResult], scored: Evaluation
            ) -> VariantResult:
    """The baseline merged from its ``shards``, with the reference a worker joined from their slices (or why not)."""
    said = Scheduler.settled(scheduler.submit(join_baseline_reference, lookup=found, baseline=merged, shards=shards,
                                              evaluation_=scored))
    if isinstance(said, BaseException):  # a failed baseline has no reference to speak of (join_reference's None)
        said = replace(found.scored(merged.result), problem=f"its reference was not joined: {_raised(said)}") \
            if merged.ok else None
    return replace(merged, reference=said)


def baseline_on_cluster(scheduler: Scheduler, lineup: Lineup, scored: Evaluation) -> VariantResult:
    """The baseline alone on the cluster, for variants that need all of it before they start (a sequential run
    judges each piece against its windows): reused (``_baseline_found``), or scored in ``runner.shards`` tasks, each
    writing its slice of the reference, a failed one tried again elsewhere, merged here and joined by a worker."""
    found, done = _baseline_found(scheduler, lineup, scored)
    if done is not None:
        return done
    bounds = _bounds(scheduler.settings.shards, scored)
    with scheduler.placed():
        futures = [_baseline_shard(scheduler, lineup, scored, found, windows) for windows in bounds]  # all first
        tried, merged = _baseline_retried(scheduler, lineup, scored, found, bounds,
                                          [_outcome(lineup.baseline, Scheduler.settled(future)) for future in futures])
    return _joined(scheduler, found, merged, tried, scored)


def _bounds(shards: int, scored: Evaluation) -> list[tuple[int, int]]:
    """The windows of each of a model's ``shards`` shards (``runner.shards``; aligned to the batch size)."""
    settings = scored.settings
    batch = settings.batch_size if isinstance(settings.batch_size, int) else 1
    return shard_bounds(len(scored.windows), shards, batch)


PIECES_PER_SHARD = 4  # a sequential run on a cluster: its windows in this many pieces per shard, judged as each returns


def score_sampled(scheduler: Scheduler, lineup: Lineup, scored: Evaluation, baseline: VariantResult,
                  making: dict) -> list[VariantResult]:
    """A sequential audit on a cluster: each variant's windows, in its seeded random order, cut into
    ``PIECES_PER_SHARD × shards`` pieces, at most ``shards`` of them running at once; after each piece returns, the
    variant's ``Watch`` judges every window returned so far, and once its verdict is settled no piece of it is
    submitted again and those still running are cancelled. A failed piece fails its variant; a variant made here is
    quantized once first, all of them at once."""
    run = _Sampled(scheduler, lineup, scored, baseline, making)
    with scheduler.placed():
        for v in range(len(run.variants)):
            for _ in range(min(scheduler.settings.shards, len(run.queued[v]))):
                run.submit(v)
        while run.running:
            run.returned_piece(scheduler.first_done(run.running))
    return run.merged()


class _Sampled:
    """What ``score_sampled`` knows as it goes: per variant (made) its ``Watch`` (None without a baseline to judge
    against) and the ``Progress`` it judges, the pieces of its windows still ``queued`` and those ``returned``; the
    futures ``running``, by variant."""

    def __init__(self, scheduler: Scheduler, lineup: Lineup, scored: Evaluation, baseline: VariantResult, making: dict):
        import numpy as np
        import torch

        from tasks.audit.sequential import Watch
        from tasks.engine.progress import Progress
        from tasks.engine.sequential import window_order

        self.scheduler, self.lineup, self.scored, self.baseline = scheduler, lineup, scored, baseline
        settings, planned = scored.settings, scored.windows
        tokens = torch.tensor([w.n_scored for w in planned])
        batch = settings.batch_size if isinstance(settings.batch_size, int) else 1
        pieces = [piece.tolist() for piece in np.array_split(window_order(len(planned), settings.order_seed),
                                                             PIECES_PER_SHARD * scheduler.settings.shards) if len(piece)]
        self.variants = [_made(c, Scheduler.settled(making[v])) if v in making else c
                         for v, c in enumerate(lineup.variants)]
        self.watches = [Watch.against(c.gate, baseline.result, settings.order_seed) if baseline.ok else None
                        for c in self.variants]
        # each piece added as it returns, as a run in one place adds each batch: the watch judges every window so far
        self.progress = [Progress([], {}, tokens, batch) for _ in self.variants]
        self.returned: list[list[VariantResult]] = [[] for _ in self.variants]
        self.queued = [list(pieces) for _ in self.variants]
        self.running = {}

    def submit(self, v: int) -> None:
        piece = self.queued[v].pop(0)
        future = self.scheduler.submit(score_variant, checkpoint=self.variants[v], lineup=self.lineup,
                                       evaluation_=self.scored, against=self.baseline, piece=Sample(tuple(piece)))
        self.running[future] = v

    def returned_piece(self, future) -> None:
        """A piece back: its variant's watch judges every window returned so far; once settled (or failed) nothing
        more of it is submitted and its pieces still running are cancelled, else its next piece goes."""
        v = self.running.pop(future)
        outcome = _outcome(self.variants[v], Scheduler.settled(future))
        self.returned[v].append(outcome)
        done = not outcome.ok
        if outcome.ok and self.watches[v] is not None:
            scores = outcome.part.scores
            self.progress[v].add(scores.windows.tolist(), scores.stats())
            done = self.watches[v](self.progress[v])
        if done:
            self.queued[v].clear()
            for other in [f for f, owner in self.running.items() if owner == v]:
                self.scheduler.cancel(other)
                del self.running[other]
        elif self.queued[v]:
            self.submit(v)

    def merged(self) -> list[VariantResult]:
        """Each variant's pieces merged (a failed piece fails it), with its sequential state where it was watched."""
        merged = []
        for v, outcomes in enumerate(self.returned):
            failed = next((o for o in outcomes if not o.ok), None)
            outcome = merge_shards([failed] if failed else outcomes, self.scored)
            if outcome.ok and self.watches[v] is not None:
                outcome = replace(outcome, sequential=self.watches[v].said(outcome.result))
            merged.append(outcome)
        return merged


def score_domains(config: AuditConfig, lineup: Lineup, domains: tuple[Domain, ...]) -> list[Scored]:
    """Each domain's baseline, variants and noise floor, one domain after another on one scheduler (started once):
    every domain scored as its one-corpus audit (``Domain.config``) would be, its variants watched against its own
    gates."""
    with Scheduler.started(config.runner) as scheduler:
        scored = []
        for domain in domains:
            baseline, variants = score_all(scheduler, domain.config, lineup.gated(domain.config.thresholds),
                                           domain.evaluation)
            scored.append(Scored(baseline, variants, score_floors(scheduler, lineup, domain.evaluation, baseline)))
        return scored


def score_floors(scheduler: Scheduler, lineup: Lineup, scored: Evaluation, baseline: VariantResult
                 ) -> list[VariantResult]:
    """The noise floor the evaluation asks for (``evaluation.floor``): the baseline in each 16-bit dtype against its
    reference, kept with that reference once scored and reused with it (``tasks.audit.floor``); none when the
    baseline failed (there is nothing to be a floor of)."""
    if not scored.settings.floors or not baseline.ok:
        return []
    found, unmeasurable = [], floor.not_measurable(baseline)
    for checkpoint in floor.checkpoints(lineup, scored.settings.floors):
        if unmeasurable:
            found.append(VariantResult.failed(checkpoint.name, checkpoint.spec.method, unmeasurable))
            continue
        kept = floor.stored_floor(baseline, checkpoint.name)
        if kept is not None:
            found.append(kept)
            continue
        with scheduler.placed():
            done = Scheduler.settled(scheduler.submit(score_variant, checkpoint=checkpoint, lineup=lineup,
                                                      evaluation_=floor.whole(scored), against=baseline))
        outcome = _outcome(checkpoint, done)
        problem = floor.store(baseline, outcome)
        if problem:
            get_run_logger().warning(problem)
        found.append(replace(outcome, reference=ReferenceSaid(
            "scored", baseline.reference.key if baseline.reference else None, problem=problem))
                     if outcome.ok else outcome)
    return found


def score_in_turn(scheduler: Scheduler, lineup: Lineup, scored: Evaluation) -> tuple[VariantResult, list[VariantResult]]:
    """Each model whole, in one task (a variant quantized here is made in its task, then scored), one after another:
    the baseline, then every variant against it. What one worker in this process (``LocalScheduler``) runs: nothing to split into
    shards, nothing to start beside another, nowhere else to try a failed task again; a sequential run stops itself
    between batches (``tasks.audit.scoring``)."""
    baseline = _outcome(lineup.baseline, Scheduler.settled(scheduler.submit(score_baseline, checkpoint=lineup.baseline,
                                                                            evaluation_=scored)))
    return baseline, [_outcome(c, Scheduler.settled(scheduler.submit(score_variant, checkpoint=c, lineup=lineup,
                                                                     evaluation_=scored, against=baseline)))
                      for c in lineup.variants]


def score_all(scheduler: Scheduler, config: AuditConfig, lineup: Lineup, scored: Evaluation
              ) -> tuple[VariantResult, list[VariantResult]]:
    """Score the baseline, then every variant against it, on the scheduler's workers: in turn on this process's one
    (``score_in_turn``), else concurrently in shards, or in pieces for a sequential run in shards; a model whose task
    failed becomes a failed result."""
    if scheduler.scores_in_turn:
        return score_in_turn(scheduler, lineup, scored)
    making = submit_makes(scheduler, lineup, scored)
    if scored.settings.sequential and config.runner.shards > 1:
        baseline = baseline_on_cluster(scheduler, lineup, scored)
        variants = score_sampled(scheduler, lineup, scored, baseline, making)
    else:
        baseline, variants = score_concurrently(scheduler, lineup, scored, making)
    logger = get_run_logger()
    for outcome in [baseline, *variants]:
        logger.info(f"{outcome.name}: {where_it_ran(outcome.shards)}")
    return baseline, variants


def where_it_ran(shards: tuple[ShardSaid, ...]) -> str:
    """Which worker scored which windows, and which tries failed where, for the run's log."""
    def ran(row: ShardSaid) -> str:
        if row.sample is not None:
            return f"{len(row.sample)} windows from window {row.sample[0]} on {row.worker}" + (
                f" failed: {row.failed}" if row.failed is not None else "")
        first, stop = row.windows
        if row.failed is not None:
            return f"windows {first}-{stop - 1} failed on {row.worker}: {row.failed}"
        if row.tokens is not None:
            return f"windows {first}-{stop - 1} on {row.worker} ({row.tokens} tokens, {row.seconds:.1f} s)"
        return f"windows {first}-{stop - 1} not scored on {row.worker}"

    return "; ".join(map(ran, shards)) or "no task of it ran"
