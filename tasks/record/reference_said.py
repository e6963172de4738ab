"""What an audit says of the baseline's stored reference (``ReferenceSaid``, a rescore's ``Drift`` from it) and of what
a variant's divergence was measured against (``Divergence``): typed values while the audit runs, the record's plain dict
at its boundary. Beside them, the typed reads of the dicts the lines under a table say: the tokens scored
(``Population``, ``StreamDifference``) and what llama.cpp ran a variant with (``LlamaCppRan``)."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.core.plain import read_fields, write_fields


@dataclass(frozen=True)
class ReferenceSaid:
    """The baseline's reference, for the record (``tasks.audit.scoring``): whether the baseline was ``scored`` or
    ``reused`` from it (``baseline``), its ``key`` and ``path`` once in place, the ``drift`` of a rescore from the
    reference stored before (``tasks.audit.reference.drift``), the ``problem`` that left it without one, the damaged
    references found and ``removed``, and ``baseline_key`` (which audits compare with this one,
    ``tasks.audit.reference.baseline_key``). A baseline's shard says only the ``slice`` of it that it wrote (and the
    ``key`` it is joined under), or its ``problem``."""

    baseline: str | None = None
    key: str | None = None
    path: str | None = None
    baseline_key: str | None = None
    removed: tuple[str, ...] = ()
    drift: dict | None = None
    problem: str | None = None
    slice: str | None = None

    @classmethod
    def of_record(cls, said: dict) -> ReferenceSaid:
        """It read back from the record's dict (``as_record``): the fields any schema held."""
        return read_fields(cls, said, {"removed": tuple})

    def as_record(self) -> dict:
        """The record's dict of it, key for key and in the order the record has always held them (a spooled record
        is replayed by ``ppl-audit sync`` long after: its format does not move)."""
        said = {"baseline_key": self.baseline_key} if self.baseline_key is not None else {}
        said |= {"removed": list(self.removed)} if self.removed else {}
        said |= {"baseline": self.baseline, "key": self.key} if self.baseline is not None else {}
        said |= {"drift": self.drift} if self.drift is not None else {}
        said |= {"problem": self.problem} if self.problem is not None else {}
        said |= {"path": self.path} if self.path is not None else {}
        return said | ({"slice": self.slice, "key": self.key} if self.slice is not None else {})


@dataclass(frozen=True)
class Divergence:
    """What a variant's KL was measured against: the baseline reference's ``key`` and the ``memory_bytes`` its LM
    head took; or, where it was not measured though asked for, why (``absent``)."""

    reference: str = ""
    memory_bytes: int = 0
    absent: str | None = None

    @classmethod
    def missing(cls, why: str) -> Divergence:
        return cls(absent=why)


@dataclass(frozen=True)
class Drift:
    """How a rescored baseline's numbers differ from the reference stored before it (``tasks.audit.reference.drift``):
    that reference's key, the largest and the mean change of a token's NLL, the change of PPL, the environment entries
    that differ (``then → now``) and whether it is beyond float noise (``drift``)."""

    reference: str
    max_abs_delta_nll: float
    mean_abs_delta_nll: float
    delta_ppl_pct: float
    changed: dict[str, str]
    drift: bool

    @classmethod
    def of_record(cls, said: dict) -> Drift:
        return read_fields(cls, said)

    def as_record(self) -> dict:
        """The record's dict of it, key for key in the order ``tasks.audit.reference.drift`` has always written: its
        fields'."""
        return write_fields(self)


@dataclass(frozen=True)
class Population:
    """The tokens the baseline and every variant were scored on, named (``tasks.audit.population``): its ``digest``
    and what it digests (the record's dict also holds the scored ``stream``'s digest and ``chunks``, which no line
    says)."""

    digest: str
    tokens: int
    text: str
    tokenizer: str | None
    tokenized_by: str
    mode: str
    window: int
    stride: int
    bos: str
    max_tokens: int | None

    @classmethod
    def of_record(cls, said: dict) -> Population:
        return read_fields(cls, said)


@dataclass(frozen=True)
class StreamDifference:
    """Where llama.cpp's tokenizer of a served file parts from transformers' on the corpus (``tasks.audit.plan``):
    each one's count of tokens, and the first token that differs."""

    llama_cpp_tokens: int
    transformers_tokens: int
    first_difference: int

    @classmethod
    def of_record(cls, said: dict) -> StreamDifference:
        return read_fields(cls, said)


@dataclass(frozen=True)
class LlamaCppRan:
    """What llama.cpp ran a variant with (``tasks.models.llama_cpp.described``): flash attention, the key/value cache
    types, threads and the layers on a GPU; the context's sizes where what ran was kept (None: a record of before,
    which kept the settings as asked), and what was asked where it ran otherwise (None where it ran as asked)."""

    flash_attn: str
    type_k: str
    type_v: str
    threads: int | str
    gpu_layers: int
    n_ctx: int | None = None
    n_batch: int | None = None
    n_ubatch: int | None = None
    flash_attn_asked: str | None = None
    gpu_layers_asked: int | None = None

    @classmethod
    def of_record(cls, said: dict) -> LlamaCppRan:
        return read_fields(cls, said)  # the context's sizes and what was asked: None in a record of before
