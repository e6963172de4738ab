"""Sliding-window perplexity over one token stream: plain PyTorch, no Prefect.

The corpus is one stream of N tokens. Window k ends at ``min(L + k*S, N)`` and holds at most L tokens;
the first window scores its tokens 1..L-1, every later window scores only the tokens the previous one
did not reach, and the rest of it is context. So every token but the first is scored exactly once, each
with as much context as the window allows. Per-token NLL is summed in float64 and divided once, so the
result does not depend on batch size, window order or padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from tasks.core import console
from tasks.core.errors import NumericalError
from tasks.engine import abandon, divergence
from tasks.engine.kv_cache import KVCacheFormat, check_cacheable, forward_arguments
from tasks.engine.memory import PeakMemory
from tasks.engine.paired import token_slots  # torch-free: the record reads it
from tasks.engine.model_facts import check_logits, input_device, max_positions
from tasks.engine.baseline import BaselineBatch
from tasks.engine.progress import Progress
from tasks.engine.scoring_options import Feed, ScoreOptions, Windowing
from tasks.engine.stream import TokenStream
from tasks.engine.token_figures import TokenFigures
from tasks.engine.windows import Window, check_settings, plan, plan_chunks

# Bounds one chunk of float32 logits, by device. CPU: 341 rows at vocab 49k, 128 at 128k. CUDA: 512 rows
# at 128k; fewer rows re-read the head's weights too often (64 MiB chunks ran the 128k head at a quarter
# of an H100's matmul rate), and the fused NLL below never writes the float32 chunk anyway.
DEFAULT_HEAD_CHUNK_BYTES = 64 << 20  # a CPU's, and any device's without its own
HEAD_CHUNK_BYTES = {"cpu": DEFAULT_HEAD_CHUNK_BYTES, "cuda": 256 << 20}


def _upcast(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _nll(logits: torch.Tensor, target: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``logsumexp(logits) - logits[target]`` per row, in float32 (float64 for a float64 model).

    NLL alone needs no ``[rows, V]`` log-softmax: on CPU writing one costs a quarter of the head's matmul,
    and logsumexp is the more accurate of the two.
    """
    logits = _upcast(logits, softcap)
    return torch.logsumexp(logits, -1) - logits.gather(-1, target).squeeze(-1)


@functools.cache
def _compiled_nll():
    return torch.compile(_nll)


def _fused_nll(logits: torch.Tensor, target: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``_nll`` compiled for CUDA into passes that read the 16-bit logits and write one number per row.

    Eager, the float32 upcast, max, subtraction, exp and sum each write or re-read a float32 copy of the
    chunk: on an H100 at a 128k vocabulary that took twice as long as the head's matmul itself. Rows
    vary from chunk to chunk, the vocabulary does not: one compiled kernel serves every chunk.
    """
    torch._dynamo.maybe_mark_dynamic(logits, 0)
    torch._dynamo.maybe_mark_dynamic(target, 0)
    return _compiled_nll()(logits, target, softcap)


def _log_probs(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = _upcast(logits, softcap)
    return logits - torch.logsumexp(logits, -1, keepdim=True)


def _divergence(logits: torch.Tensor, base_logits: torch.Tensor, target: torch.Tensor, softcap: float | None,
                base_softcap: float | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``divergence.exact`` of one chunk of rows of a variant's and the baseline's logits (by name: the compiled
    kernel gives plain tensors), and the baseline's NLL of the targets, which checks its stored reference at no extra
    pass."""
    base = _log_probs(base_logits, base_softcap)
    return divergence.exact(base, _log_probs(logits, softcap)), -base.gather(-1, target).squeeze(-1)


# The divergence is compiled on CPU for a stream of at least this many logits (tokens x vocabulary): compiling costs
# ~4 CPU-s in every new process even from Inductor's cache on disk (TorchDynamo traces it again, Inductor runs g++),
# and saves 18 ns a logit on one core from a vocabulary of 2k up (6 against 24; 7 at 384), 2026-11-26. The demo's 8k
# tokens at a 49k vocabulary (4e8) are compiled; a test model's streams, and a few windows of SmolLM2, are measured
# eagerly. Decided by the stream, not by the windows a process scores: the same bits sequential, in shards, stopped.
COMPILE_FROM_LOGITS = 200_000_000


def divergence_kernel(device_type: str, logits: int):
    """What measures the divergence of a chunk of a stream of ``logits`` (tokens x vocabulary): ``_divergence``,
    compiled where that pays (on CUDA always)."""
    if device_type == "cpu" and logits < COMPILE_FROM_LOGITS:
        return _divergence
    return _compiled_divergence(device_type)


@functools.cache
def _compiled_divergence(device_type: str):
    """``_divergence`` compiled into a few fused passes over the chunk, where it compiles.

    Eager, the two log-softmaxes, the difference, both exps and both weighted sums each read or write a
    ``[rows, V]`` array: on 2 CPU cores that took 1.5 times the baseline head's matmul, five times the
    compiled kernel. Inductor needs a C++ compiler on CPU (Triton on CUDA); without one, eager gives the
    same numbers, more slowly. The NLL is not taken here but by the plain path's own function, so that
    a variant's PPL is the same number whether or not its KL is taken.
    """
    compiled = torch.compile(_divergence, dynamic=True)
    try:
        probe = torch.zeros(2, 3, device=device_type)
        compiled(probe, probe, torch.zeros(2, 1, dtype=torch.long, device=device_type), None, None)
    except Exception:  # inductor could not build here (no compiler); torch raises many kinds
        return _divergence
    return compiled


def _vocabulary(head: torch.nn.Module) -> int:
    return getattr(head, "out_features", None) or head.weight.shape[0]


def _chunk_rows(head: torch.nn.Module, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (4 * _vocabulary(head)))


def head_chunk_bytes(device: torch.device) -> int:
    return HEAD_CHUNK_BYTES.get(device.type, DEFAULT_HEAD_CHUNK_BYTES)


@dataclass(frozen=True, eq=False)
class TokenStats(TokenFigures[torch.Tensor]):
    """``token_stats``'s per-token figures, each ``[T]``: ``nll`` (float32, or float64 for a float64 model) and,
    measured against a baseline, its divergence (``TokenFigures``; None: not measured). As a mapping, every figure
    measured by name, ``nll`` last."""

    nll: torch.Tensor = field(kw_only=True)

    def divergence(self) -> TokenFigures[torch.Tensor]:
        """Its figures but the NLL."""
        return TokenFigures.of_named({name: value for name, value in self.items() if name != "nll"})

    def on_host(self) -> TokenStats:
        """Its figures being copied to the host (asynchronously: ``_to_host``)."""
        return self.mapped(lambda value: value.to("cpu", non_blocking=True))


def token_stats(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None = None,
                chunk_bytes: int | None = None, reference: BaselineBatch | None = None,
                stream_tokens: int | None = None) -> TokenStats:
    """Per-token NLL (and divergence from the baseline), running the LM head in chunks of rows.

    Args:
        head: the output projection, ``[..., H] -> [..., V]``.
        hidden: ``[T, H]`` final hidden states at the positions that predict ``targets``.
        targets: ``[T]`` token ids.
        softcap: final logit soft-capping of the model, if it has one (Gemma 2).
        chunk_bytes: bound on one chunk's float32 logits (default by device, ``HEAD_CHUNK_BYTES``); the
            full ``[T, V]`` is never built, for the variant nor for the baseline.
        reference: the baseline's head and its hidden states at the same ``T`` positions.
        stream_tokens: the length of the stream these tokens are of, which decides how the divergence is measured
            (``divergence_kernel``); default ``T``.

    Returns:
        ``nll``; with ``reference`` also its divergence from the baseline (``TokenStats``).
    """
    rows = _chunk_rows(head, chunk_bytes or head_chunk_bytes(hidden.device))
    nll = _fused_nll if hidden.is_cuda else _nll
    if reference is not None:
        measure = divergence_kernel(hidden.device.type, (stream_tokens or hidden.shape[0]) * _vocabulary(head))
    chunks: list[TokenStats] = []
    for start in range(0, hidden.shape[0], rows):
        stop = start + rows
        logits = head(hidden[start:stop])
        target = targets[start:stop, None].to(logits.device)  # a split model's head may sit on another device
        chunk = TokenStats(nll=nll(logits, target, softcap))
        if reference is not None:
            base_logits = reference.head(reference.hidden[start:stop]).to(logits.device)
            figures, base_nll = measure(logits, base_logits, target, softcap, reference.softcap)
            chunk = dataclasses.replace(chunk, **figures)  # divergence.exact names its figures as TokenFigures does
            chunk = dataclasses.replace(chunk, base_right=chunk.base_top == target.squeeze(-1))
            if reference.llama_kld:
                chunk = dataclasses.replace(chunk, kl_llama=divergence.as_llama_perplexity(
                    _upcast(base_logits, reference.softcap), _upcast(logits, softcap)))
            reference.check(base_nll, start)
        chunks.append(chunk)
    return TokenStats.joined(chunks, torch.cat)


@dataclass
class WindowScores:
    """Per-token and per-window results of scoring a stream.

    Attributes:
        token_nll: ``[n_scored]`` NLL of each scored token (float32; float64 for a float64 model),
            window by window in index order (stream order for the sliding window).
        window_nll: ``[n_windows]`` float64 NLL sum of each window's scored tokens.
        window_tokens: ``[n_windows]`` int64 number of tokens each window scored.
        extra: further per-token figures aligned with ``token_nll``: the divergence from the baseline
            (``TokenFigures``: none measured without a baseline).
    """

    token_nll: torch.Tensor
    window_nll: torch.Tensor
    window_tokens: torch.Tensor
    extra: TokenFigures[torch.Tensor] = field(default_factory=TokenFigures)
    windows: torch.Tensor | None = None  # a run stopped early: the plan's indices of the windows it scored
    planned_tokens: int | None = None  # and how many tokens every window of the plan holds

    def stats(self) -> TokenStats:
        """Its per-token figures by name, the NLL with them, as ``token_stats`` measured them (what
        ``Progress.add`` sums of a piece scored elsewhere)."""
        return TokenStats(nll=self.token_nll, **self.extra)

    def kept(self, windows: torch.Tensor) -> WindowScores:
        """Only the windows ``windows`` (indices, ascending), their tokens in window order."""
        slots = torch.from_numpy(token_slots(self.window_tokens.numpy(), windows.numpy()))
        return WindowScores(self.token_nll[slots], self.window_nll[windows], self.window_tokens[windows],
                            self.extra.mapped(lambda value: value[slots]), windows,
                            int(self.window_tokens.sum()))


def batch_inputs(ids: torch.Tensor, batch: list[Window], prefix: torch.Tensor, first_token: int | None = None):
    """Right-padded input ids, attention mask (None when nothing is padded), and scored positions.

    ``first_token`` is written over the first token of every window (llama.cpp's BOS per chunk).
    """
    rows = [torch.cat([prefix, ids[w.start : w.end]]) for w in batch]
    if first_token is not None:
        for row in rows:
            row[len(prefix)] = first_token
    lengths = torch.tensor([len(row) for row in rows])
    input_ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = row
    mask = None
    if bool((lengths != lengths.max()).any()):
        mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
    row_index = torch.cat([torch.full((w.n_scored,), i) for i, w in enumerate(batch)])
    # the hidden state at column c predicts the token at column c + 1
    columns = torch.cat([torch.arange(w.first_scored, w.end) - w.start + len(prefix) - 1 for w in batch])
    targets = torch.cat([ids[w.first_scored : w.end] for w in batch])
    return input_ids, mask, row_index, columns, targets


def scored_targets(stream: TokenStream, window: int, stride: int, mode: str = "sliding") -> torch.Tensor:
    """The ids of every token the plan scores, in the order of the token arrays (window by window)."""
    return torch.cat([stream.ids[w.first_scored : w.end] for w in plan(stream, window, stride, mode)])


def scored_positions(stream: TokenStream, window: int, stride: int, mode: str = "sliding") -> np.ndarray:
    """The position in its window of every token the plan scores, in the order of the token arrays: how many
    tokens of context precede it in the model's input (the BOS prefix of every window included)."""
    prefix = len(stream.prefix)
    return np.concatenate([np.arange(w.first_scored - w.start, w.end - w.start) + prefix
                           for w in plan(stream, window, stride, mode)])


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host to device without making the host wait: from pinned memory on CUDA.

    A plain copy from pageable memory waits for every kernel queued before it, which would leave the
    GPU idle while the host prepares the next batch.
    """
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _to_host(stats: TokenStats, hidden: torch.Tensor | None, device: torch.device):
    """Start copying a batch's per-token results (and its ``hidden`` states, where they are kept) to the host;
    returns them and an event to wait on.

    On CUDA the copies go to pinned memory asynchronously, so the next batch is queued before these
    results are read (``store`` then waits for this batch alone).
    """
    host = stats.on_host()
    kept = None if hidden is None else hidden.to("cpu", non_blocking=True)
    copied = None
    if device.type == "cuda":
        copied = torch.cuda.Event()
        copied.record()
    return host, kept, copied


def hidden_states(model, input_ids: torch.Tensor, mask: torch.Tensor | None, row_index, columns,
                  kv_cache: KVCacheFormat | None = None) -> torch.Tensor:
    """The final hidden states ``[T, H]`` at the scored positions, keys and values kept in ``kv_cache``'s format
    (None: as computed). A model another runtime runs (``tasks.models.llama_cpp``) gives its logits at the scored
    positions itself (``scored_logits``), and its head is the identity."""
    runtime = getattr(model, "scored_logits", None)
    if runtime is not None:
        return runtime(input_ids, mask, row_index, columns)
    device = input_device(model)
    padding = None if mask is None else _to_device(mask, device)
    hidden = model.base_model(input_ids=_to_device(input_ids, device), use_cache=False,
                              **forward_arguments(model, kv_cache, input_ids, padding, device)).last_hidden_state
    # a model split over devices ends on its last module's device
    return hidden[_to_device(row_index, hidden.device), _to_device(columns, hidden.device)]


@torch.inference_mode()
def score_windows(model, feed: Feed, windows: list[Window], options: ScoreOptions = ScoreOptions(),
                  label: str | None = None) -> WindowScores:
    """Score the windows of one stream, ``feed.batch_size`` windows per forward pass, in the order given.

    Args:
        model: a Hugging Face causal LM (``base_model`` gives hidden states, the output embeddings
            give logits).
        feed: the stream's ids, the prefix and first token of every window, and the batch size.
        windows: from ``plan_windows`` or ``plan_chunks``, in any order.
        options: the baseline to measure against (``reference``), where the hidden states go (``keep_hidden``),
            the order to score ``windows`` in and when to stop (``order``, ``until``, ``stop_at``); its
            ``progress`` and ``model_name`` are ``score_part``'s, which names the bar.
        label: the progress bar's name (``score <model>``); no bar when None.
    """
    reference, keep_hidden, until = options.reference, options.keep_hidden, options.until
    if options.order is not None:
        windows = [windows[i] for i in options.order]
    head = model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    counts = torch.zeros(len(windows) and max(w.index for w in windows) + 1, dtype=torch.long)
    for w in windows:
        counts[w.index] = w.n_scored
    offsets = torch.cumsum(counts, 0) - counts  # where each window's tokens go, by window index
    total = int(counts.sum())
    arrays: dict[str, torch.Tensor] = {}
    window_nll = torch.zeros(len(counts), dtype=torch.float64)
    prefix_ids = torch.tensor(feed.prefix, dtype=torch.long)
    progress = Progress([], {}, counts, feed.batch_size)

    def store(batch: list[Window], slots: torch.Tensor, host: TokenStats, kept: torch.Tensor | None, copied) -> None:
        if copied is not None:
            copied.synchronize()
        if kept is not None:
            keep_hidden(slots, kept)
        for w, part in zip(batch, host.nll.split([w.n_scored for w in batch])):
            window_nll[w.index] = part.double().sum()
        if until is not None:
            progress.add([w.index for w in batch], host)
        for key, value in host.items():
            if key not in arrays:
                # at least float32 (a bf16 model's figures are float32); a float64 model's stay float64
                dtype = torch.promote_types(value.dtype, torch.float32) if value.is_floating_point() else value.dtype
                arrays[key] = torch.zeros((total, *value.shape[1:]), dtype=dtype)
            arrays[key][slots] = value.to(arrays[key].dtype)
        bar.update(len(slots))

    pending = None  # the previous batch, whose results are read once this batch is queued
    limit = len(windows) if options.stop_at is None else options.stop_at
    scored = limit
    with console.bar(sum(w.n_scored for w in windows[:limit]), label or "score", "tok",
                     enabled=label is not None) as bar:
        for b in range(0, limit, feed.batch_size):
            batch = windows[b : min(b + feed.batch_size, limit)]
            inputs = batch_inputs(feed.ids, batch, prefix_ids, feed.first_token)
            input_ids, mask, row_index, columns, targets = inputs
            slots = torch.cat([torch.arange(int(offsets[w.index]), int(offsets[w.index]) + w.n_scored) for w in batch])
            hidden = hidden_states(model, input_ids, mask, row_index, columns, options.kv_cache)
            against = None
            if reference is not None:
                against = BaselineBatch(reference.head, _to_device(reference.states(slots, inputs), hidden.device),
                                        reference.softcap, None if reference.nll is None else reference.nll(slots),
                                        reference.tolerance, reference.source, reference.llama_kld)
            stats = token_stats(head, hidden, _to_device(targets, hidden.device), softcap, reference=against,
                                stream_tokens=len(feed.ids))
            if pending is not None:
                store(*pending)
            pending = (batch, slots, *_to_host(stats, hidden if keep_hidden is not None else None, hidden.device))
            abandon.check()
            if until is not None:  # judged on this batch before the next is queued: none is scored for nothing
                store(*pending)
                pending = None
                if until(progress):
                    scored = b + len(batch)
                    break
        if pending is not None:
            store(*pending)
    measured = TokenStats.of_named(arrays)
    scores = WindowScores(measured.nll, window_nll, counts, measured.divergence())
    if scored < len(windows):
        return scores.kept(torch.tensor(sorted(w.index for w in windows[:scored])))
    return scores


@dataclass
class PerplexityResult:
    """One model's perplexity on one token stream, with what it took to get it."""

    model: str
    n_tokens: int
    nll_sum: float
    mean_nll: float
    ppl: float
    stderr: float  # standard error of the mean token NLL; PPL error is ppl * stderr, as llama.cpp prints
    ppl_stderr: float
    n_bytes: int  # of the text whose tokens were scored; 0 where it was not counted for this mode
    n_words: int
    bits_per_byte: float | None  # None where the scored text was not counted
    byte_ppl: float | None
    word_ppl: float | None
    window: int
    stride: int
    batch_size: int
    bos: str
    mode: str
    n_windows: int
    device: str
    dtype: str
    corpus_digest: str
    wall_seconds: float
    tokens_per_second: float
    peak_memory_bytes: int
    token_nll: np.ndarray = field(repr=False)
    window_nll: np.ndarray = field(repr=False)
    window_tokens: np.ndarray = field(repr=False)
    extra: TokenFigures[np.ndarray] = field(default_factory=TokenFigures, repr=False)  # per token, as ``token_nll``
    absent: dict[str, str] = field(default_factory=dict)  # figure -> why it is None
    scored_fraction: float = 1.0  # the share of the stream's scored tokens this result holds
    scored_windows: np.ndarray | None = field(default=None, repr=False)  # which windows, where not all

    def summary(self) -> dict:
        """Every scalar field and ``absent``, for JSON and tracking (the arrays are left out)."""
        return {k: v for k, v in asdict(self).items()
                if k not in ("extra", "scored_windows") and not isinstance(v, np.ndarray)}


def _per_unit_ppl(nll_sum: float, units: int, unit: str, absent: dict[str, str]) -> float | None:
    """``exp(nll_sum / units)``, or None with the reason put in ``absent``: nothing was counted, or it is
    past a float (text with few whitespace-separated words, as Chinese or Japanese has, gives e^thousands)."""
    if not units:
        absent[f"{unit}_ppl"] = f"no {unit}s were counted in the scored text"
        return None
    if nll_sum / units > math.log(sys.float_info.max):
        absent[f"{unit}_ppl"] = f"e^{nll_sum / units:.0f} is past a float: the scored text has too few {unit}s ({units})"
        return None
    return math.exp(nll_sum / units)


def summarize(scores: WindowScores, stream: TokenStream, *, mode: str, **facts) -> PerplexityResult:
    """Turn sums into the corpus figures: every mean is one sum divided once by one count; ``mode`` says which
    text the stream's bytes and words were counted for, and ``facts`` the rest of what it took."""
    nll = scores.token_nll.double()
    n = int(scores.window_tokens.sum())
    nll_sum = float(scores.window_nll.sum())
    if not math.isfinite(nll_sum):
        bad = int((~torch.isfinite(nll)).sum())
        raise NumericalError(f"the model produced non-finite log-probabilities for {bad} of {n} scored tokens")
    mean = nll_sum / n
    variance = float(((nll - mean) ** 2).sum()) / (n - 1) if n > 1 else float("nan")
    stderr = math.sqrt(variance / n)
    ppl = math.exp(mean)
    n_bytes, n_words = (stream.n_bytes, stream.n_words) if stream.counted_for == mode else (0, 0)
    absent: dict[str, str] = {}
    sampled = scores.windows is not None
    if sampled:  # the stream's bytes and words are not those of the windows scored
        n_bytes = n_words = 0
        absent |= {f"{unit}_ppl": "the run stopped early: it scored a sample of the stream's windows"
                   for unit in ("byte", "word")}
    return PerplexityResult(
        n_tokens=n, nll_sum=nll_sum, mean_nll=mean, ppl=ppl, stderr=stderr, ppl_stderr=ppl * stderr,
        n_bytes=n_bytes, n_words=n_words,
        bits_per_byte=nll_sum / (n_bytes * math.log(2)) if n_bytes else None,
        byte_ppl=None if sampled else _per_unit_ppl(nll_sum, n_bytes, "byte", absent),
        word_ppl=None if sampled else _per_unit_ppl(nll_sum, n_words, "word", absent), absent=absent,
        scored_fraction=n / scores.planned_tokens if sampled else 1.0,
        scored_windows=scores.windows.numpy() if sampled else None,
        bos=stream.bos, n_windows=len(scores.window_tokens), corpus_digest=stream.text_digest,
        token_nll=scores.token_nll.numpy(), window_nll=scores.window_nll.numpy(),
        window_tokens=scores.window_tokens.numpy(), extra=scores.extra.mapped(lambda value: value.numpy()),
        mode=mode,
        **facts,
    )


def count_scored_text(stream: TokenStream, tokenizer, window: int, mode: str) -> TokenStream:
    """The stream with ``n_bytes``/``n_words`` of the text a chunk mode actually scores, decoded from
    the scored tokens of each chunk (the dropped tail and each chunk's unscored part are left out)."""
    texts = [tokenizer.decode(stream.ids[w.first_scored : w.end]) for w in plan_chunks(len(stream.ids), window, mode)]
    return dataclasses.replace(stream, n_bytes=sum(len(text.encode("utf-8")) for text in texts),
                               n_words=sum(len(text.split()) for text in texts), counted_for=mode)


@dataclass
class Part:
    """What scoring one contiguous slice of a stream's windows gave: a shard, or the whole stream.

    Attributes:
        windows: ``(first, stop)``: the slice's window indices in the stream's plan.
        scores: the slice's results, its windows numbered from 0.
        wall_seconds, peak_memory_bytes, batch_size, device, dtype: what scoring it took, and where.
    """

    windows: tuple[int, int]
    scores: WindowScores
    wall_seconds: float
    peak_memory_bytes: int
    batch_size: int
    device: str
    dtype: str


def shard_bounds(n_windows: int, shards: int, batch_size: int) -> list[tuple[int, int]]:
    """At most ``shards`` contiguous, non-empty slices ``(first, stop)`` of ``n_windows`` windows, as even as
    whole batches allow: each boundary is a multiple of ``batch_size``, so that every forward pass holds the
    same windows as when one worker scores them all, and gives the same bits."""
    batches = math.ceil(n_windows / batch_size)
    shards = max(1, min(shards, batches))
    bounds = [min(n_windows, (batches * i // shards) * batch_size) for i in range(shards + 1)]
    return list(zip(bounds, bounds[1:]))


def _shifted(options: ScoreOptions, offset: int) -> ScoreOptions:
    """``options`` for a slice whose first scored token is token ``offset`` of the stream: its ``reference`` and
    ``keep_hidden`` both address the stream's token arrays (a stored reference is read, or written, at the stream's
    places)."""
    if not offset:
        return options
    whole, keep_hidden = options.reference, options.keep_hidden

    def states(slots: torch.Tensor, inputs: tuple) -> torch.Tensor:
        return whole.states(slots + offset, inputs)

    def nll(slots: torch.Tensor) -> torch.Tensor:
        return whole.nll(slots + offset)

    def keep(slots: torch.Tensor, hidden: torch.Tensor) -> None:
        keep_hidden(slots + offset, hidden)

    reference = whole
    if whole is not None:
        reference = dataclasses.replace(whole, states=states, nll=nll if whole.nll is not None else None)
    return dataclasses.replace(options, reference=reference, keep_hidden=None if keep_hidden is None else keep)


def score_part(model, stream: TokenStream, windowing: Windowing = Windowing(), batch_size: int = 1,
               windows: tuple[int, int] | None = None, options: ScoreOptions = ScoreOptions()) -> Part:
    """Score the windows ``windows = (first, stop)`` of the stream's plan (all of them when None).

    A slice is scored exactly as within the whole run: the same windows, the same context; ``combine``
    joins the parts. ``options`` are as in ``score_windows``, ``reference`` and ``keep_hidden`` at the stream's
    places; ``order`` (a permutation of the slice's windows, numbered from 0) is the order they are scored in, and
    ``until`` may stop the run after any batch, ``stop_at`` after that many windows of the order (a sample of
    them: ``score_windows``); the figures do not depend on the order; ``kv_cache`` is the key/value cache format the
    model is scored with.
    """
    window, stride, mode = windowing.window, windowing.stride, windowing.mode
    check_settings(window, stride, batch_size, stream, max_positions(model.config), mode)
    check_logits(model.config, options.model_name or "the model")
    if options.kv_cache is not None:  # once a part, not at every forward pass
        check_cacheable(model.config)
    planned = plan(stream, window, stride, mode)
    first, stop = windows or (0, len(planned))
    if not 0 <= first < stop <= len(planned):
        raise ValueError(f"windows {first}..{stop} are not a slice of the plan's {len(planned)}")
    offset = sum(w.n_scored for w in planned[:first])
    mine = [dataclasses.replace(w, index=w.index - first) for w in planned[first:stop]]
    device = input_device(model)
    with PeakMemory(device) as memory:
        started = time.perf_counter()
        label = None
        if options.progress:
            label = f"score {options.model_name or model.name_or_path}"
            label += f" [windows {first}-{stop - 1}]" if windows else ""
        scores = score_windows(model, Feed.of(stream, mode, batch_size), mine, _shifted(options, offset), label)
        wall = time.perf_counter() - started
    return Part((first, stop), scores, wall, memory.peak_bytes, batch_size, str(device),
                str(model.dtype).removeprefix("torch."))


def combine(parts: list[Part], stream: TokenStream, model_name: str, window: int, stride: int,
            mode: str = "sliding") -> PerplexityResult:
    """One result from the parts that cover a stream's windows, in window order: per-token and per-window
    arrays concatenated, then one float64 sum and one division (``summarize``), as if one run scored them."""
    parts = sorted(parts, key=lambda part: part.windows)
    joined = [b.windows[0] for b in parts[1:]] == [a.windows[1] for a in parts[:-1]]
    sampled = any(p.scores.windows is not None for p in parts)
    if not parts or parts[0].windows[0] != 0 or not (joined or sampled):
        raise ValueError(f"parts {[p.windows for p in parts]} do not cover the windows from the first, in turn")

    def cat(arrays: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(arrays) if len(arrays) > 1 else arrays[0]

    if len(parts) == 1:
        scores = parts[0].scores
    elif sampled:
        scores = joined_samples([p.scores for p in parts])
    else:
        scores = WindowScores(cat([p.scores.token_nll for p in parts]), cat([p.scores.window_nll for p in parts]),
                              cat([p.scores.window_tokens for p in parts]),
                              TokenFigures.joined([p.scores.extra for p in parts], cat))
    wall = sum(p.wall_seconds for p in parts)  # compute time, on however many workers
    return summarize(
        scores, stream, model=model_name, window=window, stride=stride if mode == "sliding" else window,
        batch_size=min(p.batch_size for p in parts), mode=mode, device=parts[0].device, dtype=parts[0].dtype,
        wall_seconds=wall, tokens_per_second=int(scores.window_tokens.sum()) / wall,
        peak_memory_bytes=max(p.peak_memory_bytes for p in parts),
    )


def joined_samples(samples: list[WindowScores]) -> WindowScores:
    """One sample of a stream's windows from samples of disjoint windows (``WindowScores.windows``), its windows
    in index order; the whole stream's scores, with no ``windows``, when they hold every token."""
    windows = torch.cat([sample.windows for sample in samples])
    order = torch.argsort(windows)
    if len(set(windows.tolist())) != len(windows):
        raise ValueError("samples that share a window cannot be joined: it would count twice")

    def by_window(arrays: list[torch.Tensor], per_token: bool) -> torch.Tensor:
        if not per_token:
            return torch.cat(arrays)[order]
        pieces = [piece for array, sample in zip(arrays, samples)
                  for piece in array.split(sample.window_tokens.tolist())]
        return torch.cat([pieces[i] for i in order.tolist()])

    joined = WindowScores(by_window([s.token_nll for s in samples], True),
                          by_window([s.window_nll for s in samples], False),
                          by_window([s.window_tokens for s in samples], False),
                          TokenFigures.joined([s.extra for s in samples], lambda arrays: by_window(arrays, True)),
                          windows[order], samples[0].planned_tokens)
    if int(joined.window_tokens.sum()) == joined.planned_tokens:
        return dataclasses.replace(joined, windows=None, planned_tokens=None)
    return joined


def perplexity(model, stream: TokenStream, windowing: Windowing = Windowing(), batch_size: int = 1,
               options: ScoreOptions = ScoreOptions()) -> PerplexityResult:
    """Perplexity of ``model`` on ``stream`` with a sliding window of ``windowing.window`` tokens moving by
    ``windowing.stride``.

    With the ``window`` BOS policy the BOS counts towards the window, so ``window - 1`` stream tokens fit.
    ``windowing.mode`` selects a published convention instead (see ``plan_chunks``); ``options`` (divergence from
    a baseline, writing a baseline reference, another order, a stop) are passed to ``score_windows``.
    """
    name = options.model_name or str(model.name_or_path)
    part = score_part(model, stream, windowing, batch_size, None, dataclasses.replace(options, model_name=name))
    return combine([part], stream, name, windowing.window, windowing.stride, windowing.mode)
