"""Sliding-window perplexity over one token stream: plain PyTorch, no Prefect.

The corpus is one stream of N tokens. Window k ends at ``min(L + k*S, N)`` and holds at most L tokens;
the first window scores its tokens 1..L-1, every later window scores only the tokens the previous one
did not reach, and the rest of it is context. So every token but the first is scored exactly once, each
with as much context as the window allows. Per-token NLL is summed in float64 and divided once, so the
result does not depend on batch size, window order or padding.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from tasks.corpus import TokenStream
from tasks.errors import InputError, NumericalError
from tasks.memory import PeakMemory
from tasks.models import max_positions

HEAD_CHUNK_BYTES = 64 << 20  # bounds one chunk of float32 logits: 341 rows at vocab 49k, 128 at 128k


@dataclass(frozen=True)
class Window:
    """Stream tokens ``[start, end)`` go through the model; tokens ``[first_scored, end)`` are scored."""

    index: int
    start: int
    end: int
    first_scored: int

    @property
    def n_scored(self) -> int:
        return self.end - self.first_scored


def plan_windows(n_tokens: int, window: int, stride: int, first_scored: int = 1) -> list[Window]:
    """Cover a stream of ``n_tokens`` with sliding windows.

    Args:
        n_tokens: stream length N.
        window: the most tokens one window holds (L).
        stride: how far each window's end moves (S, ``1 <= S < L``).
        first_scored: the first stream position to score: 1, or 0 when a prefix (BOS) precedes every
            window and so gives the first token a context.
    """
    if not 1 <= stride < window:
        raise InputError(f"stride {stride} must be at least 1 and below the window length {window}; lower --stride")
    windows: list[Window] = []
    scored_until = first_scored
    while scored_until < n_tokens:
        end = min(window + len(windows) * stride, n_tokens)
        windows.append(Window(len(windows), max(0, end - window), end, scored_until))
        scored_until = end
    return windows


def token_nll(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, softcap: float | None = None,
              chunk_bytes: int = HEAD_CHUNK_BYTES) -> torch.Tensor:
    """Negative log-likelihood of each target, running the LM head in chunks of rows.

    Args:
        head: the output projection, ``[..., H] -> [..., V]``.
        hidden: ``[T, H]`` final hidden states at the positions that predict ``targets``.
        targets: ``[T]`` token ids.
        softcap: final logit soft-capping of the model, if it has one (Gemma 2).
        chunk_bytes: bound on one chunk's float32 logits; the full ``[T, V]`` is never built.

    Returns:
        ``[T]`` NLL in float32, or float64 for a float64 model.
    """
    rows = max(1, chunk_bytes // (4 * head.out_features if hasattr(head, "out_features") else 4 * 65536))
    pieces = []
    for start in range(0, hidden.shape[0], rows):
        logits = head(hidden[start : start + rows])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        target = targets[start : start + rows, None]
        pieces.append(torch.logsumexp(logits, dim=-1) - logits.gather(-1, target).squeeze(-1))
    return torch.cat(pieces)


@dataclass
class WindowScores:
    """Per-token and per-window results of scoring a stream.

    Attributes:
        token_nll: ``[n_scored]`` float32 NLL of each scored token, in stream order.
        window_nll: ``[n_windows]`` float64 NLL sum of each window's scored tokens.
        window_tokens: ``[n_windows]`` int64 number of tokens each window scored.
    """

    token_nll: torch.Tensor
    window_nll: torch.Tensor
    window_tokens: torch.Tensor


def _batch_inputs(ids: torch.Tensor, batch: list[Window], prefix: torch.Tensor):
    """Right-padded input ids, attention mask (None when nothing is padded), and scored positions."""
    rows = [torch.cat([prefix, ids[w.start : w.end]]) for w in batch]
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


@torch.inference_mode()
def score_windows(model, ids: torch.Tensor, windows: list[Window], prefix: tuple[int, ...] = (),
                  batch_size: int = 1, progress: bool = False) -> WindowScores:
    """Score the windows of one stream, ``batch_size`` windows per forward pass, in the order given.

    Args:
        model: a Hugging Face causal LM (``base_model`` gives hidden states, the output embeddings
            give logits).
        ids: ``[N]`` stream token ids.
        windows: from ``plan_windows``, in any order; together they must score one contiguous range.
        prefix: ids put before every window (BOS under the ``window`` policy).
        batch_size: windows per forward pass; results do not depend on it.
    """
    device = model.device
    body, head = model.base_model, model.get_output_embeddings()
    softcap = getattr(model.config, "final_logit_softcapping", None)
    offset = min(w.first_scored for w in windows)
    nll_by_position = torch.full((max(w.end for w in windows) - offset,), float("nan"), dtype=torch.float32)
    window_nll = torch.zeros(len(windows), dtype=torch.float64)
    window_tokens = torch.zeros(len(windows), dtype=torch.long)
    prefix_ids = torch.tensor(prefix, dtype=torch.long)
    total = sum(w.n_scored for w in windows)
    with tqdm(total=total, unit="tok", unit_scale=True, desc="scoring", disable=not progress) as bar:
        for b in range(0, len(windows), batch_size):
            batch = windows[b : b + batch_size]
            input_ids, mask, row_index, columns, targets = _batch_inputs(ids, batch, prefix_ids)
            hidden = body(
                input_ids=input_ids.to(device),
                attention_mask=None if mask is None else mask.to(device),
                use_cache=False,
            ).last_hidden_state
            scored = hidden[row_index.to(device), columns.to(device)]
            nll = token_nll(head, scored, targets.to(device), softcap).cpu()
            counts = [w.n_scored for w in batch]
            for w, part in zip(batch, nll.split(counts)):
                nll_by_position[w.first_scored - offset : w.end - offset] = part.float()
                window_nll[w.index] = part.double().sum()
                window_tokens[w.index] = w.n_scored
            bar.update(sum(counts))
    return WindowScores(nll_by_position, window_nll, window_tokens)


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
    n_bytes: int
    n_words: int
    bits_per_byte: float
    byte_ppl: float
    word_ppl: float
    window: int
    stride: int
    batch_size: int
    bos: str
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

    def summary(self) -> dict:
        """Every scalar field, for JSON and tracking (the arrays are left out)."""
        return {k: v for k, v in asdict(self).items() if not isinstance(v, np.ndarray)}


def summarize(scores: WindowScores, stream: TokenStream, **facts) -> PerplexityResult:
    """Turn sums into the corpus figures: every mean is one sum divided once by one count."""
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
    return PerplexityResult(
        n_tokens=n, nll_sum=nll_sum, mean_nll=mean, ppl=ppl, stderr=stderr, ppl_stderr=ppl * stderr,
        n_bytes=stream.n_bytes, n_words=stream.n_words,
        bits_per_byte=nll_sum / (stream.n_bytes * math.log(2)) if stream.n_bytes else float("nan"),
        byte_ppl=math.exp(nll_sum / stream.n_bytes) if stream.n_bytes else float("nan"),
        word_ppl=math.exp(nll_sum / stream.n_words) if stream.n_words else float("nan"),
        bos=stream.bos, n_windows=len(scores.window_tokens), corpus_digest=stream.text_digest,
        token_nll=scores.token_nll.numpy(), window_nll=scores.window_nll.numpy(),
        window_tokens=scores.window_tokens.numpy(), **facts,
    )


def check_settings(window: int, stride: int, batch_size: int, stream: TokenStream, positions: int | None) -> None:
    """Refuse settings the engine cannot honour, before any model work starts.

    Args:
        positions: the model's maximum positions (``max_positions(config)``), if known.
    """
    if positions is not None and window > positions:
        raise InputError(f"window {window} is longer than the model's {positions} positions; use --window {positions} or less")
    if batch_size < 1:
        raise InputError(f"batch size {batch_size} must be at least 1")
    capacity = window - len(stream.prefix)
    if not 1 <= stride < capacity:
        held = f"{capacity} (the window of {window} less the BOS it starts with)" if stream.prefix else str(window)
        raise InputError(f"stride {stride} must be at least 1 and below {held}; lower --stride")


def perplexity(model, stream: TokenStream, window: int = 512, stride: int = 256, batch_size: int = 1,
               progress: bool = False, model_name: str = "") -> PerplexityResult:
    """Perplexity of ``model`` on ``stream`` with a sliding window of ``window`` tokens moving by ``stride``.

    With the ``window`` BOS policy the BOS counts towards the window, so ``window - 1`` stream tokens fit.
    """
    check_settings(window, stride, batch_size, stream, max_positions(model.config))
    windows = plan_windows(len(stream.ids), window - len(stream.prefix), stride, stream.first_scored)
    device = model.device
    with PeakMemory(device) as memory:
        started = time.perf_counter()
        scores = score_windows(model, stream.ids, windows, stream.prefix, batch_size, progress)
        wall = time.perf_counter() - started
    n_scored = int(scores.window_tokens.sum())
    return summarize(
        scores, stream, model=model_name or str(model.name_or_path), window=window, stride=stride,
        batch_size=batch_size, device=str(device), dtype=str(model.dtype).removeprefix("torch."),
        wall_seconds=wall, tokens_per_second=n_scored / wall, peak_memory_bytes=memory.peak_bytes,
    )
