"""A variant's per-token figures against its baseline, one typed value from the engine (``perplexity.token_stats``)
to the record: torch tensors while it is scored (``WindowScores.extra``), numpy arrays in its result
(``PerplexityResult.extra``). Torch-free: the record reads it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

A = TypeVar("A")  # an array: torch.Tensor in the engine, np.ndarray in a result
B = TypeVar("B")


@dataclass(frozen=True, eq=False)  # arrays: compared figure by figure, never as a whole
class TokenFigures(Mapping[str, A]):
    """Per-token arrays aligned with the token NLL; None: not measured (no baseline to measure against, or a
    figure of one mode). ``kl``: KL(base‖variant), as llama.cpp reports it, and ``kl_reverse``: KL(variant‖base)
    (float64); ``top1``: both put the same token first; ``base_top`` and ``top``: the token each puts first (int32);
    ``base_top_p``: the baseline's probability of its own first (float32); ``base_right``: the baseline's first is the
    target; ``kl_llama``: KL as llama-perplexity estimates it (float64; mode llama.cpp, ``BaselineBatch.llama_kld``).

    It is also a read-only mapping of the figures measured, by these names, in this order: the names a kept floor's
    ``scores.npz`` and a record's token tables keep them under."""

    kl: A | None = None
    kl_reverse: A | None = None
    top1: A | None = None
    base_top: A | None = None
    top: A | None = None
    base_top_p: A | None = None
    base_right: A | None = None
    kl_llama: A | None = None

    @classmethod
    def of_named(cls, named: Mapping[str, A]) -> TokenFigures[A]:
        """Read from arrays by name (a file's columns, ``divergence.exact``'s figures); a name it does not know
        raises TypeError."""
        return cls(**named)

    def _measured(self) -> dict[str, A]:
        return {name: value for name, value in vars(self).items() if value is not None}

    def __getitem__(self, name: str) -> A:
        return self._measured()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._measured())

    def __len__(self) -> int:
        return len(self._measured())

    def mapped(self, change: Callable[[A], B]) -> TokenFigures[B]:
        """Each figure measured through ``change`` (a slice of its tokens, a copy to the host, as numpy)."""
        return type(self).of_named({name: change(value) for name, value in self.items()})

    @classmethod
    def joined(cls, parts: list[TokenFigures[A]], join: Callable[[list[A]], A]) -> TokenFigures[A]:
        """The figures of ``parts`` (of disjoint tokens, each measuring the same figures), figure by figure through
        ``join`` (which puts the parts' tokens in order)."""
        return cls.of_named({name: join([part[name] for part in parts]) for name in parts[0]})
