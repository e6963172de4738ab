"""How a stream is scored, as values: the windows it is cut into (``Windowing``), what each forward pass reads
(``Feed``), and what a run does besides scoring every window in order (``ScoreOptions``).

Plain Python (no torch at import): the validated config names its ``Windowing``, and a command that only reads its
config does not load torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

    from tasks.engine.kv_cache import KVCacheFormat
    from tasks.engine.baseline import Baseline
    from tasks.engine.progress import Progress
    from tasks.engine.stream import TokenStream


@dataclass(frozen=True)
class Windowing:
    """How a stream is cut into windows (``tasks.engine.windows.plan``): a sliding window of at most ``window``
    tokens whose end moves by ``stride``, or the chunks of a published convention (``mode``, ``plan_chunks``)."""

    window: int = 512
    stride: int = 256
    mode: str = "sliding"


@dataclass(frozen=True)
class Feed:
    """What the forward passes read: windows of ``ids``, ``batch_size`` of them a pass.

    Attributes:
        ids: ``[N]`` stream token ids.
        prefix: ids put before every window (BOS under the ``window`` policy).
        first_token: written over each window's first token (llama.cpp's BOS per chunk); None: nothing is.
        batch_size: windows per forward pass; results do not depend on it.
    """

    ids: torch.Tensor
    prefix: tuple[int, ...] = ()
    first_token: int | None = None
    batch_size: int = 1

    @classmethod
    def of(cls, stream: TokenStream, mode: str, batch_size: int = 1) -> Feed:
        """The windows of ``stream`` as ``mode`` reads them: llama.cpp writes BOS over each chunk's first token."""
        first_token = stream.bos_id if mode == "llama.cpp" and stream.bos != "none" else None
        return cls(stream.ids, stream.prefix, first_token, batch_size)


@dataclass(frozen=True)
class ScoreOptions:
    """What a run does besides scoring every window given, in that order, without a word.

    Attributes:
        progress: show a progress bar (``score <model_name>``).
        model_name: how the bar and the result name the model; default its ``name_or_path``.
        reference: the baseline, to measure each token's divergence from.
        keep_hidden: called as ``keep_hidden(slots, hidden)`` with each batch's final hidden states
            ``[T, H]`` (on the host, in the model's dtype) and their places in the token arrays: how a
            baseline reference is written batch by batch, never held whole.
        order: a permutation of the windows given: the order they are scored in (the figures do not depend on it).
        until: asked after each batch with the ``Progress`` so far; when it answers True the run stops there,
            and the result holds the windows scored (``WindowScores.windows``).
        stop_at: score only the first ``stop_at`` windows of the order (a sample of them, as ``until`` leaves).
        kv_cache: the key/value cache format every forward pass stores keys and values in (None: as computed):
            passed with each pass, never set on the model.
    """

    progress: bool = False
    model_name: str = ""
    reference: Baseline | None = None
    keep_hidden: Callable | None = None
    order: np.ndarray | None = None
    until: Callable[[Progress], bool] | None = None
    stop_at: int | None = None
    kv_cache: KVCacheFormat | None = None
