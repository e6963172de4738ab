"""What a tune found, typed (``TuneFound``): the units chosen with their measured gains and costs, the assignment as
measured, the curve, the file as built, and the audit's verdicts. The recipe formats, the choice table, the JSON and
the MLflow run (``tasks.record.tuning``) read its attributes.

A tune is made as plain data (``tasks.audit.recipe.proof.tune_report``, then ``tasks.steps.measure_tune`` and
``flows.tune`` add what was built, audited and logged) and written as such (``tune.json``, ``--json``); this module
alone reads it and writes it back (``TuneFound.of_record``, ``TuneFound.as_record``), key for key and in the order the
producers give them. A recipe written by hand, with only what the recipe formats read, is read as a ``TuneRecipe``.

The reader and the writer are driven by the fields: each value's fields are its record's keys, in order; a tuple is a
list; a field whose default is None is absent while it is None; an inline field's keys are its holder's (a gptq tune's
own), present when its first key is.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cache
from typing import Any, Union, get_args, get_origin, get_type_hints

_INLINE = {"inline": True}


@dataclass(frozen=True)
class GptqScheme:
    """A gptq tune's chosen unit's scheme: its bits (None: left unquantized) and group size."""

    bits: int | None
    group_size: int


@dataclass(frozen=True)
class GptqOwn:
    """A gptq tune's variant: its bits, group size, and the prefix its decoder layers' modules are named under."""

    bits: int
    group_size: int
    prefix: str


@dataclass(frozen=True)
class ChosenUnit:
    """A unit the recipe gives more precision: its label, layer, part and modules; the option's type, what it won
    back alone (KL ``gain``, ``share`` of the variant's KL with its interval) and its ``cost`` in bytes; what its
    option's uniform model holds its matrices as (``held``); a gptq tune's scheme for it."""

    unit: str
    layer: int
    part: str
    modules: tuple[str, ...]
    type: str
    gain: float
    share: tuple[float, float, float]
    cost: int
    held: tuple[str, ...]
    scheme: GptqScheme | None = field(default=None, metadata=_INLINE)


@dataclass(frozen=True)
class UnitGain:
    """A unit at an option, measured alone: what it won back and what it costs."""

    unit: str
    type: str
    gain: float
    share: tuple[float, float, float]
    cost: int


@dataclass(frozen=True)
class MeasuredPoint:
    """An assignment scored on the sample: its KL and ΔNLL, the KL its units' gains alone predict, the share of the
    variant's KL won back, its cost, its bits per weight and its units."""

    kl: float
    delta_nll: float
    predicted: float
    share: tuple[float, float, float]
    cost: int
    bpw: float
    units: tuple[str, ...]


@dataclass(frozen=True)
class BuiltRecipe:
    """The recipe's file or checkpoint as made and checked (``tasks.audit.recipe.proof.built``); ``recipe``: what it
    changes in the variant's spec, as the spec takes it."""

    file: str
    path: str
    bpw: float
    bytes: int
    file_mib: float
    within: bool
    checked: int
    tensors: int
    wrong: tuple[str, ...]
    recipe: dict


@dataclass(frozen=True)
class Proven:
    """Whether the recipe is proven better than the uniform variant, and than the larger one (None: no claim)."""

    uniform: bool | None = None
    larger: bool | None = None


@dataclass(frozen=True)
class AuditedAt:
    """A model of the audit of the recipe: its bits per weight and its mean KL on the audit's tokens."""

    bpw: float
    kl: float


@dataclass(frozen=True)
class TuneFound:
    """What a tune found, from its measuring to where it was logged; the stages not reached are None."""

    variant: str
    method: str
    file_type: str
    budget: str
    per: str
    types: tuple[str, ...]
    budget_bpw: float
    extra_bytes: int
    variant_bpw: float
    baseline_bpw: float
    variant_kl: float
    variant_delta_nll: float
    windows: int
    tokens: int
    chosen: tuple[ChosenUnit, ...]
    every: tuple[UnitGain, ...]
    first: MeasuredPoint
    final: MeasuredPoint
    curve: tuple[MeasuredPoint, ...]
    tried: int
    seconds: float
    tensor_types: tuple[str, ...]
    own: GptqOwn | None = field(default=None, metadata=_INLINE)
    built: BuiltRecipe | None = None
    folder: str | None = None
    verdicts: tuple[str, ...] | None = None
    proven: Proven | None = None
    audited: tuple[tuple[str, AuditedAt], ...] | None = field(default=None, metadata={"keyed": AuditedAt})
    audit_table: str | None = None
    audit_verdict: str | None = None
    mlflow_run_id: str | None = None
    record: str | None = None

    def as_record(self) -> dict:
        """The tune as plain data, key for key and in order as its producers made it."""
        return _write(self)

    @classmethod
    def of_record(cls, flat: dict) -> TuneFound:
        """A tune as its producers made it; a key it does not know is refused, never dropped from what is written."""
        return _read(cls, flat, strict=True)


@dataclass(frozen=True)
class RecipeUnit:
    """What a recipe gives one unit: the option's type for its layer's modules, a gptq tune's scheme."""

    layer: int
    modules: tuple[str, ...]
    type: str
    scheme: GptqScheme | None = field(default=None, metadata=_INLINE)


@dataclass(frozen=True)
class TuneRecipe:
    """What the recipe formats are written from, read from a tune's record or one written by hand with only these
    keys: the variant's type, the units chosen, the tensor-type entries, and a gptq tune's method and own scheme."""

    file_type: str
    chosen: tuple[RecipeUnit, ...]
    tensor_types: tuple[str, ...]
    method: str | None = None
    own: GptqOwn | None = field(default=None, metadata=_INLINE)

    @classmethod
    def of_record(cls, flat: dict) -> TuneRecipe:
        """The recipe a tune's record (whole or as written by hand) holds; other keys are left."""
        return _read(cls, flat, strict=False)


def _write(value: Any) -> dict:
    record = {}
    for each in fields(value):
        item = getattr(value, each.name)
        if item is None and each.default is None:
            continue
        if each.metadata.get("inline"):
            record |= _write(item)
        elif each.metadata.get("keyed"):
            record[each.name] = {name: _plain(entry) for name, entry in item}
        else:
            record[each.name] = _plain(item)
    return record


def _plain(item: Any) -> Any:
    if is_dataclass(item):
        return _write(item)
    if isinstance(item, tuple):
        return [_plain(entry) for entry in item]
    return item


def _read(cls: type, flat: dict, strict: bool) -> Any:
    known, values = set(), {}
    for each in fields(cls):
        kind = _hints(cls)[each.name]
        if each.metadata.get("inline"):
            inline = fields(kind)
            known |= {f.name for f in inline}
            if inline[0].name in flat:  # its holder's other keys are its holder's to check
                values[each.name] = _read(kind, flat, strict=False)
        elif each.name in flat:
            known.add(each.name)
            values[each.name] = _typed(kind, flat[each.name], each.metadata.get("keyed"), strict)
    unknown = [key for key in flat if key not in known]
    if strict and unknown:
        raise ValueError(f"{cls.__name__} has no field for {', '.join(map(str, unknown))}: a key the tune's record "
                         "gains is a field of its typed value, or it is lost when the record is written")
    return cls(**values)


def _typed(kind: Any, item: Any, keyed: type | None, strict: bool) -> Any:
    if keyed is not None:
        return tuple((name, _read(keyed, entry, strict)) for name, entry in item.items())
    if is_dataclass(kind):
        return _read(kind, item, strict)
    if get_origin(kind) is tuple:
        element = get_args(kind)[0]
        return tuple(_read(element, entry, strict) if is_dataclass(element) else entry for entry in item)
    return item


@cache
def _hints(cls: type) -> dict[str, Any]:
    """Each field's type, None taken out of an optional one."""
    return {name: _required(hint) for name, hint in get_type_hints(cls).items()}


def _required(hint: Any) -> Any:
    if get_origin(hint) in (Union, types.UnionType):
        [hint] = [arg for arg in get_args(hint) if arg is not type(None)]
    return hint
