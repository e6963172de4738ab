"""Validated settings: corpus, calibration and variant specs. One clear line per mistake.

YAML is the single source of truth for a run; these models check it before any model is loaded.
Unknown keys are refused (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import re
from pathlib import Path
from types import UnionType
from typing import Annotated, ClassVar, Literal, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from tasks.config_said import RETIRED_DIVERGENCE, OverrideSaid, Refusal, RetiredSaid, evaluation_of_record, refusals
from tasks.core.errors import InputError, start_of
from tasks.core.places import embedded_corpus_name
from tasks.engine.scoring_options import Windowing
from tasks.engine.settings import BosPolicy, Mode
from tasks.engine.windows import check_plan, chunk_limit
from tasks.methods.method import Method as MethodBackend
from tasks.methods.registry import (  # noqa: F401  (QUANTIZED_*, KERNEL_GROUP_SIZES: imported from here too)
    KERNEL_GROUP_SIZES,
    METHODS,
    QUANTIZED_AT_LOAD,
    QUANTIZED_BY_US,
    RUNTIMES,
    MethodKeys,
    method_of,
    refusal_of,
    runtime_of,
    validate_settings,
)
from tasks.methods.runtimes import Runtime
from tasks.methods.settings import Bits

# each method's own module in tasks.methods says what it is (auto: read from the checkpoint, tasks.models.formats;
# baseline: a float model as it is); the registry names them all
MethodName = Literal[tuple(METHODS)]
# audit and variant names: MLflow run names, file names, YAML keys; not dots alone (".." is a path)
ONE_CORPUS = "corpus"  # the name of the one domain an audit of one corpus (`corpus:`) is
NAME = r"^[A-Za-z0-9_.-]*[A-Za-z0-9_-][A-Za-z0-9_.-]*$"
# a name becomes part of a file name (a record's folder: time, name, id; a cached checkpoint's: name, digest) that a
# file system caps at 255 bytes: bounded here, so that a long one is refused before scoring, not after it
NAME_MAX = 100
QUANTIZED_BITS = get_args(Bits)
DEFAULT_BITS, DEFAULT_GROUP_SIZE = 4, 128  # gptq/awq made here: the common 4-bit scheme with 128-column groups
# stores MLflow can track to; anything else would be spooled and retried forever as if MLflow were down
# the numerics a deployment may run the baseline in, whose difference from its float32 self is the noise floor
FLOOR_DTYPES = ("bfloat16", "float16")
FLOOR_SHORT = {"bfloat16": "bf16", "float16": "fp16"}  # in the floor's row name: floor-bf16
YES_NO = ("on", "off", "true", "false", "yes", "no", "t", "f", "y", "n", "1", "0")  # the words pydantic reads as a bool


def floor_name(dtype: str) -> str:
    """The row name of the noise floor in ``dtype``: ``floor-bf16``."""
    return f"floor-{FLOOR_SHORT[dtype]}"

Rescore = Literal["auto", "always", "never"]  # when a baseline's stored reference is reused (BaselineSpec)
TRACKING_SCHEMES = ("http", "https", "file", "sqlite", "postgresql", "mysql", "mssql", "databricks", "databricks-uc")
DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # through SQLAlchemy: dialect[+driver]://
# SQLAlchemy's default drivers, by module, and the package that brings each
DRIVER_PACKAGES = {"MySQLdb": "mysqlclient", "pymysql": "PyMySQL", "psycopg2": "psycopg2-binary", "pyodbc": "pyodbc"}


def _number_kinds(annotation) -> set[type]:
    """The scalar types a value of ``annotation`` may have at its top (a Literal's by its values; an Annotated's,
    an Optional's and a union's members), without what a container holds."""
    if get_origin(annotation) is Annotated:
        return _number_kinds(get_args(annotation)[0])
    if get_origin(annotation) is Literal:
        return {type(value) for value in get_args(annotation)}
    if get_origin(annotation) in (Union, UnionType):
        return set().union(*(_number_kinds(member) for member in get_args(annotation)))
    return {annotation} if isinstance(annotation, type) else set()


def _containers(annotation, origin: type) -> list[tuple]:
    """The type arguments of each ``origin`` (dict, list) ``annotation`` admits: ``dict[str, int] | None`` gives
    ``[(str, int)]``."""
    if get_origin(annotation) is Annotated:
        return _containers(get_args(annotation)[0], origin)
    if get_origin(annotation) in (Union, UnionType):
        return [found for member in get_args(annotation) for found in _containers(member, origin)]
    return [get_args(annotation)] if get_origin(annotation) is origin else []


def boolean_for_a_number(annotation, value: object) -> tuple[str, bool, bool] | None:
    """Where ``value`` holds a boolean ``annotation`` wants a number for: ``(its place within the value, the
    boolean, whether a whole number is wanted)``, or None. pydantic reads a boolean as 1 or 0 wherever it wants a
    number, and YAML reads true/false, on/off and yes/no as booleans: ``max_tokens: true`` was scored as 1 token."""
    kinds = _number_kinds(annotation)
    if isinstance(value, bool):
        wanted = kinds & {int, float}
        return ("", value, float not in wanted) if wanted and bool not in kinds else None
    if isinstance(value, dict):
        for key_type, item_type in _containers(annotation, dict):
            for key, item in value.items():
                found = boolean_for_a_number(key_type, key) or boolean_for_a_number(item_type, item)
                if found:
                    return f"{key}: {found[0]}", found[1], found[2]
    if isinstance(value, list):
        for (item_type,) in _containers(annotation, list):
            for index, item in enumerate(value):
                found = boolean_for_a_number(item_type, item)
                if found:
                    return f"{index}: {found[0]}", found[1], found[2]
    return None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _a_number_is_not_a_boolean(cls, value: object, info: ValidationInfo) -> object:
        # every setting of every section, in one place (nested sections validate their own fields)
        found = boolean_for_a_number(cls.model_fields[info.field_name].annotation, value)
        if found:
            place, boolean, whole = found
            raise ValueError(f"{place}{str(boolean).lower()} is a yes/no (YAML reads true, on and yes as one), not a "
                             f"number; give a {'whole ' if whole else ''}number")
        return value


class CorpusConfig(Strict):
    """A corpus source and how its documents are read and joined (``tasks.data.corpus`` reads it).

    Attributes:
        source: a text file, a folder of .txt, a .jsonl/.parquet file, ``hf:NAME``, ``embedded`` (Austen) or
            ``embedded:NAME`` (another embedded corpus: python, russian, chinese; ``tasks.data.embedded``).
        column: the text column of JSONL, Parquet and Hugging Face sources.
    """

    source: str
    column: str = "text"
    hf_config: str | None = None
    hf_split: str = "test"
    joiner: str = "\n\n"
    encoding: str = Field("utf-8", description="text encoding of .txt and .jsonl files, a Python codec name")

    @field_validator("source")
    @classmethod
    def _names_something(cls, source: str) -> str:
        # Path("") is "." (the current folder): an empty source would score whatever .txt files lie where the
        # command runs. A folder is named as such ("." or "./"), never by leaving the value out.
        if not source.strip():
            raise ValueError("source is empty; give a text file, a folder of .txt, a .jsonl/.parquet file, "
                             "hf:DATASET or embedded (the current folder: '.')")
        if source.startswith("hf:") and not source[3:].strip():
            raise ValueError("source 'hf:' names no dataset; give hf:NAME, e.g. hf:wikitext with hf_config "
                             "wikitext-2-raw-v1")
        embedded_corpus_name(source)  # an unknown embedded:NAME, refused before anything loads
        return source


class Corpus(CorpusConfig):
    """One domain of an audit with several (``corpora:``): a corpus by its ``name`` (English prose, code, a
    language), scored as its own token stream (its first ``max_tokens``, else ``evaluation.max_tokens``), judged by
    its own gate (``thresholds.per_corpus``); the audit's verdict of a variant is its worst domain's."""

    name: str = Field(min_length=1, max_length=NAME_MAX, pattern=NAME)
    max_tokens: int | None = Field(None, ge=2)

    def alone(self) -> CorpusConfig:
        """The corpus as a one-corpus audit's ``corpus:`` holds it."""
        return CorpusConfig(**self.model_dump(exclude={"name", "max_tokens"}))

    # How lines and refusals name the domain: the one thing that differs between a domain of an audit of several
    # corpora and an audit of one (``OneCorpus``), each domain scored and judged the same
    @property
    def key(self) -> str:
        """The config key holding its text: ``corpora.NAME``."""
        return f"corpora.{self.name}"

    @property
    def within(self) -> str:
        """What a refusal about its text or stream starts with: ``corpora.NAME: ``."""
        return f"{self.key}: "

    @property
    def on(self) -> str:
        """What a line about a model scored on it adds to the model's name: `` on NAME``."""
        return f" on {self.name}"

    @property
    def shown(self) -> str | None:
        """The name lines and JSON give the domain (a compare's history, a diagnosis)."""
        return self.name


class OneCorpus(Corpus):
    """The text of an audit of one corpus (``corpus:``) as its one domain, called ``corpus``: the audit speaks of
    it as it did before corpora, naming no domain."""

    @property
    def key(self) -> str:
        return "corpus"

    @property
    def within(self) -> str:
        return ""

    @property
    def on(self) -> str:
        return ""

    @property
    def shown(self) -> str | None:
        return None


class CalibrationConfig(Strict):
    """Calibration text for GPTQ/AWQ: ``samples`` sequences of ``seq_len`` tokens drawn with ``seed``.

    Without ``corpus`` the audit's own corpus is used, from tokens the audit does not evaluate.
    """

    corpus: CorpusConfig | None = None
    samples: int = Field(128, ge=1, le=100_000)
    seq_len: int = Field(512, ge=8)
    seed: int = 0


DEFAULT_CALIBRATION = CalibrationConfig()  # what `quantize` and a variant without calibration settings use
LLAMA_CPP_MOST_THREADS = 512  # ggml's GGML_MAX_N_THREADS: the most threads its compute graph plans for
LLAMA_CPP_MOST_BATCH = 2**20  # tokens per llama_decode: a batch above the context is cut to it; this bounds the buffer
C_INT_MAX = 2**31 - 1  # llama.cpp's int32 settings (gpu_layers): a larger number wraps around as ctypes passes it


class LlamaCppSettings(Strict):
    """What llama.cpp runs a ``runtime: llama.cpp`` variant with, as a deployment sets it (``tasks.models.llama_cpp``):
    ``threads`` (default: llama.cpp's), ``batch`` (llama.cpp's n_batch), the key/value cache types ``type_k`` and
    ``type_v`` (llama.cpp's own: f16, q8_0, q4_0, ...; a quantized V cache needs flash attention), ``flash_attn``
    (``auto``, as llama-perplexity, lets llama.cpp decide), ``gpu_layers`` (a CUDA build: layers offloaded)."""

    # each bounded by what llama.cpp can take: `threads: 100000` was accepted and its worker died with SIGSEGV once
    # scoring started (the machine's own CPUs bound threads further where it runs: tasks.audit.preflight)
    threads: int | None = Field(None, ge=1)
    batch: int = Field(512, ge=1, le=LLAMA_CPP_MOST_BATCH)
    type_k: str = Field("f16", pattern=r"^[a-z0-9_]+$")
    type_v: str = Field("f16", pattern=r"^[a-z0-9_]+$")
    flash_attn: Literal["auto", "on", "off"] = "auto"
    gpu_layers: int = Field(0, ge=0, le=C_INT_MAX)

    @field_validator("threads")
    @classmethod
    def _threads_llama_cpp_can_run(cls, threads: int | None) -> int | None:
        if threads is not None and threads > LLAMA_CPP_MOST_THREADS:
            raise ValueError(f"{threads} is more than llama.cpp can run (ggml's most: {LLAMA_CPP_MOST_THREADS}); use "
                             "at most the machine's cores")
        return threads

    @field_validator("flash_attn", mode="before")
    @classmethod
    def _on_and_off_as_yaml_reads_them(cls, value: object) -> object:
        # YAML 1.1 reads an unquoted on/off (true/false, yes/no) as a boolean
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _a_quantized_v_cache_needs_flash_attention(self) -> LlamaCppSettings:
        if self.type_v not in ("f16", "bf16", "f32") and self.flash_attn == "off":
            raise ValueError(f"type_v {self.type_v} needs flash attention in llama.cpp: set flash_attn on or auto")
        return self


class KVCache(Strict):
    """The key/value cache a variant is scored with (``tasks.engine.kv_cache``): ``dtype`` ``int8`` (llama.cpp's
    q8_0), ``int4`` (q4_0), ``fp8_e4m3``/``fp8_e5m2`` (vLLM's fp8 caches) or a float type; ``group_size``: the
    int8/int4 blocks along each head's vector, which it must divide; ``residual``: each query's newest tokens kept as
    computed (0: none, as llama.cpp; transformers' QuantizedCache keeps 128)."""

    dtype: Literal["int8", "int4", "fp8_e4m3", "fp8_e5m2", "float32", "bfloat16", "float16"]
    group_size: int = Field(32, ge=1)
    residual: int = Field(0, ge=0, description="each query's newest tokens kept unquantized (transformers: 128)")

    @model_validator(mode="after")
    def _blocks_are_int_only(self) -> KVCache:
        if self.dtype not in ("int8", "int4") and "group_size" in self.model_fields_set:
            raise ValueError(f"group_size applies to int8 and int4 caches, not {self.dtype} (stored value by value)")
        return self

    def format(self):
        from tasks.engine.kv_cache import KVCacheFormat

        return KVCacheFormat(self.dtype, self.group_size, self.residual)


def check_name(name: str | None) -> None:
    """Refuse a variant name given outside a config (``quantize --name``, ``notify --name``) that no audit could use."""
    if name is not None and not re.match(NAME, name):
        raise InputError(f"name '{name}' may hold only letters, digits, '_', '.' and '-'")
    if name is not None and len(name) > NAME_MAX:
        raise InputError(f"name '{start_of(name)}' is {len(name)} characters; use at most {NAME_MAX} (it becomes a file name)")


def check_group_size(method: str, group_size: int) -> None:
    """Refuse a group size no kernel of ``method`` could run, before hours of quantization."""
    problem = method_of(method).group_size_problem(group_size)
    if problem:
        raise ValueError(problem)


def _overrides_gptqmodel_can_take(dynamic: dict) -> dict:
    """``dynamic`` as gptqmodel reads it, or what is wrong with it: each key's pattern is a regex it matches module
    names with, and each ``+:`` override's bits and group size ones its kernels run (checked here, not after
    minutes of quantizing: gptqmodel compiles the patterns only as it reaches each module)."""
    for key, override in dynamic.items():
        try:
            re.compile(key[2:])
        except re.error as error:
            raise ValueError(f"{key}: not a regular expression ({error}); gptqmodel matches module names with it") from None
        if key.startswith("-:") and override:
            raise ValueError(f"{key}: a -: pattern leaves its modules unquantized and takes no settings; give {{}}")
        said = OverrideSaid.of_entry(override)
        if said.bits is not None and said.bits not in QUANTIZED_BITS:
            raise ValueError(f"{key}: bits {said.bits} is not one gptq takes; use one of "
                             f"{', '.join(map(str, QUANTIZED_BITS))}")
        if said.group_size is not None:
            check_group_size("gptq", said.group_size)
    return dynamic


# gptqmodel's per-module overrides of a gptq checkpoint made here (+:REGEX: other bits or group size, -:REGEX: left
# unquantized), as `ppl-audit tune` writes them: one type for a variant's and `ppl-audit quantize`'s
GptqDynamic = Annotated[dict[Annotated[str, Field(pattern=r"^[+-]:.+")], dict[Literal["bits", "group_size"], int]],
                        AfterValidator(_overrides_gptqmodel_can_take)]


class VariantBase(Strict):
    """What every variant gives, whatever its method (``VariantSpec`` adds the keys only some methods take)."""

    name: str = Field(min_length=1, max_length=NAME_MAX, pattern=NAME)
    method: MethodName = "baseline"
    path: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16", "float64"] = "auto"
    device: str = "auto"
    device_map: Literal["auto"] | dict[str, int | str] | None = None
    max_memory: dict[int | str, int | str] | None = None
    diagnose: bool = Field(False, description="after the verdict, find where it loses (ppl-audit diagnose)")
    kv_cache: KVCache | None = None
    runtime: Literal[tuple(RUNTIMES)] = Field(
        "transformers", description="what scores it: transformers (a GGUF file dequantized: what its weights lost), "
        "or llama.cpp's own kernels and tokenizer (a GGUF file as it is served)")
    llama_cpp: LlamaCppSettings | None = None


class VariantSpec(MethodKeys, VariantBase):
    """One model of an audit: the baseline or a quantized variant of it.

    ``path`` is a checkpoint to load: a folder, a Hub id, a ``.gguf`` file (or a folder and ``gguf_file``);
    its method is read from it unless given (``auto``, the default with a path). Without a path, bnb,
    torchao and hqq variants quantize the baseline as it loads (hqq with ``bits`` and ``group_size``),
    and gptq/awq variants are quantized from the baseline with ``bits``, ``group_size``, ``sym`` and
    ``calibration``.

    The keys only some methods take (bits, kernel, type, ...) are their methods' (``MethodKeys``, from
    ``tasks.methods``), each method's settings validated by its own model (``_method_settings_problem``); a new
    method is its module and a registry line. Not a pydantic discriminated union: ``tasks.methods.settings`` says why.
    """

    role: ClassVar[str] = "variant"  # what its refusals call it (BaselineSpec: the baseline)
    # the method keys whose types are this layer's: tasks.methods, below it, declares them loosely
    calibration: CalibrationConfig | None = None
    dynamic: GptqDynamic | None = Field(
        None, description="gptq made here: gptqmodel's per-module overrides (+:REGEX: other bits or group_size, "
        "-:REGEX: left unquantized), a mixed-precision recipe as `ppl-audit tune` writes it; loaded by gptqmodel "
        "(with {}: the uniform checkpoint, loaded as a recipe is)")

    @field_validator("path", "gguf_file")
    @classmethod
    def _not_blank(cls, value: str | None, info) -> str | None:
        # as an empty corpus source: Path("") is the current folder, whose model would be audited unasked
        if value is not None and not value.strip():
            raise ValueError(f"{info.field_name} is empty; name a model folder, a .gguf file, a Hub id or embedded "
                             "(the current folder: '.')")
        return value

    @model_validator(mode="before")
    @classmethod
    def _method_of_a_checkpoint_is_read_from_it(cls, data: object) -> object:
        if isinstance(data, dict) and "method" not in data and data.get("path") is not None and cls is VariantSpec:
            return {**data, "method": "auto"}
        return data

    @model_validator(mode="after")
    def _settings_fit_the_method(self) -> VariantSpec:
        # its method's own settings first (tasks.methods: the keys it takes and its rules), then what every
        # variant's must fit
        problem = self._method_settings_problem()
        if problem:
            raise ValueError(problem)
        backend, runtime = self.backend, self.runtime_backend
        if runtime.llama_cpp and not backend.is_gguf(self.location):
            raise ValueError(f"runtime llama.cpp runs a GGUF file, and this {self.role} is {backend.what(self.path)}: "
                             f"use method gguf with a .gguf path{' or a type' if self.role == 'variant' else ''}")
        if self.llama_cpp is not None and not runtime.llama_cpp:
            raise ValueError("llama_cpp sets how llama.cpp runs a variant: give it with runtime llama.cpp")
        if self.diagnose and not runtime.in_transformers:
            raise ValueError("diagnose swaps a variant's layers in transformers, and llama.cpp runs this one whole: "
                             "diagnose the same file without runtime llama.cpp")
        if self.kv_cache is not None and not runtime.in_transformers:
            raise ValueError("kv_cache emulates a cache in transformers; in llama.cpp set llama_cpp.type_k and type_v")
        if self.max_memory is not None and self.device_map is None:
            raise ValueError("max_memory bounds what device_map places on each device: give device_map too")
        if self.device_map is not None and self.device != "auto":
            raise ValueError("give device (one device) or device_map (a model split over several), not both")
        if self.device_map is not None and backend.one_device:
            raise ValueError("hqq quantizes through its own API, on one device: device_map is not for it")
        if isinstance(self.device_map, dict):
            for module, device in self.device_map.items():
                if not (isinstance(device, int) or device in ("cpu", "disk", "cuda") or re.fullmatch(r"cuda:\d+", device)):
                    raise ValueError(f"device_map puts '{module}' on '{device}': use a GPU index (0), cuda:N, cpu or disk")
        return self

    def _method_settings_problem(self) -> str | None:
        """Why the keys only some methods take that it gives do not fit its method (None: they do): validated by the
        method's own settings model, those the method does not take refused in their owners' words, never pydantic's."""
        try:
            validate_settings(self)
        except ValidationError as error:
            refused = refusals(error)
            keys = [str(each.loc[0]) for each in refused if each.type == "extra_forbidden"]
            return refusal_of(keys, self.method) if keys else refused[0].msg.removeprefix("Value error, ")
        return None

    @property
    def llama_cpp_settings(self) -> LlamaCppSettings:
        """How llama.cpp runs it: its own settings, or the defaults (llama-perplexity's)."""
        return self.llama_cpp or LlamaCppSettings()

    @property
    def backend(self) -> MethodBackend:
        """What its method is (``tasks.methods``): the settings it takes, whether it is made here, its package."""
        return method_of(self.method)

    @property
    def runtime_backend(self) -> Runtime:
        """What scores it: transformers, or llama.cpp's own kernels."""
        return runtime_of(self.runtime)

    @property
    def label(self) -> str:
        """What scored it, where that is not transformers: ``@llama.cpp``, appended to its method in the table."""
        return self.runtime_backend.label

    @property
    def quantize_here(self) -> bool:
        """Made here from the baseline with gptqmodel (a gptq or awq variant without a path)."""
        return self.backend.quantized_here and self.path is None

    @property
    def location(self) -> str | None:
        """What ``path`` and ``gguf_file`` name together: a folder, a Hub id or a file."""
        if self.gguf_file is not None:
            return str(Path(self.path) / self.gguf_file)
        return self.path

    @property
    def quantization(self) -> tuple[int, int, bool]:
        """``(bits, group_size, sym)`` a gptq/awq variant is quantized with, defaults filled in."""
        return (self.bits or DEFAULT_BITS, self.group_size or DEFAULT_GROUP_SIZE, True if self.sym is None else self.sym)


class BaselineSpec(VariantSpec):
    """The model an audit compares with, and when its stored reference (``tasks.audit.reference``) is reused.

    ``rescore``: ``auto`` reuses the reference made from the same model, tokens, settings, library
    versions and device kind; ``always`` scores the baseline again; ``never`` reuses one made in
    another environment too. A baseline scored while a reference exists is compared with it (drift).
    """

    role: ClassVar[str] = "baseline"
    rescore: Rescore = "auto"

    @model_validator(mode="after")
    def _the_baseline_keeps_its_cache(self) -> BaselineSpec:
        if self.type is not None:
            raise ValueError("type makes a GGUF file from the baseline's: a baseline is a file, give it as path")
        if self.kv_cache is not None:
            raise ValueError("kv_cache is a variant's: to measure the cache alone, add a variant of the baseline's own "
                             "weights with it (a variant without path or method)")
        return self


def validation_line(refused: tuple[Refusal, ...], where: str) -> str:
    """The first of what pydantic ``refused`` as one line naming the key; the count of any others after it."""
    first = refused[0]
    key = ".".join(str(part) for part in first.loc)
    message = first.msg.removeprefix("Value error, ")
    if first.type == "extra_forbidden":
        message = "unknown key; check its spelling against the documented keys"
    if first.type == "string_pattern_mismatch" and first.pattern == NAME:
        message = (f"'{start_of(first.input)}' is not a name: use letters, digits, '_', '-' and '.', not dots alone "
                   "(a name becomes a folder and an MLflow run)")
    if first.type == "string_too_long":
        message = (f"'{start_of(first.input)}' is {len(first.input)} characters; use at most "
                   f"{first.max_length} (it becomes a file name)")
    more = len(refused) - 1
    return f"{where}: {key + ': ' if key else ''}{message}" + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def parse(model: type[Strict], data: object, where: str, overrides: list[str] | tuple[str, ...] = ()):
    """Validate ``data`` into ``model``, or raise ``InputError`` with one line naming the key, and what gave it:
    ``where``, or the ``--set`` of ``overrides`` (``apply_overrides``) that set it."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        refused = refusals(error)
        raise InputError(validation_line(refused, _given_by(refused[0], overrides) or where)) from None


def _given_by(first: Refusal, overrides: list[str] | tuple[str, ...]) -> str | None:
    """``--set KEY=VALUE`` where the ``first`` mistake lies within what it set, or is a key it made (``--set a.b.c=1``
    makes ``a``, which the file never had), else None: the file's."""
    at = [str(part) for part in first.loc]
    for override in overrides:
        key = override.partition("=")[0].split(".")
        if at and (at[:len(key)] == key or (key[:len(at)] == at and first.type == "extra_forbidden")):
            return f"--set {start_of(override)}"
    return None


def yaml_problem(error: Exception) -> str:
    """What is wrong with YAML text and where, in one line: PyYAML's first line names only what it was doing
    (``while scanning for the next token``); its problem has the line and column, and a tab is named as such."""
    mark, problem = getattr(error, "problem_mark", None), getattr(error, "problem", None)
    if mark is None or problem is None:
        return str(error).strip().splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}"
    if "'\\t'" in problem or "tab character" in problem:
        return f"{where}: a tab; YAML indents with spaces only: replace it with spaces"
    return f"{where}: {problem}"


DEFAULT_WINDOW = 512  # tokens a window holds, unless evaluation.window says otherwise


class EvaluationConfig(Strict):
    """How every model of the audit is scored (see ``tasks.engine.perplexity``); ``stride`` is filled in
    (``window // 2``) once validated, so nothing downstream sees None."""

    window: int = DEFAULT_WINDOW
    stride: int | None = Field(None, description="default window // 2")
    batch_size: int | Literal["auto"] = Field(1, ge=1)
    bos: BosPolicy | None = Field(None, description="default: the mode's own")
    max_tokens: int | None = Field(None, ge=2)
    chunks: int | None = Field(None, description="chunk modes: the first N chunks (llama-perplexity --chunks)")
    mode: Mode = "sliding"
    divergence: bool = Field(True, description="KL, top-1 and Δp from the baseline reference (YAML on/off)")
    sequential: bool = Field(False, description="stop each variant once its verdict is settled (YAML on/off)")
    order_seed: int = Field(0, ge=0, description="the seed of a sequential run's window order")
    floor: bool | list[Literal["bfloat16", "float16"]] = Field(
        False, description="the noise floor: the baseline itself in bfloat16 and float16 (on) or in the dtypes listed, "
        "scored against its float32 self on the same windows; every variant is judged above it or within it")
    body: Literal["eager", "compile", "liger", "liger+compile"] = Field(
        "eager", description="the decoder layers as transformers runs them, compiled, with liger-kernel's fused "
        "ops (CUDA), or both: the same numbers to bf16 noise, faster on a GPU (tasks.engine.body, docs/gpu.md)")

    @field_validator("floor", mode="before")
    @classmethod
    def _dtypes_a_floor_can_take(cls, floor: object) -> object:
        # said in one line: pydantic's union error named the branch it tried first (floor.bool)
        if isinstance(floor, str) and floor in FLOOR_DTYPES:
            raise ValueError(f"{floor} is one dtype; give on, off or a list: [{floor}]")
        named = [floor] if isinstance(floor, str) and floor.lower() not in YES_NO else floor
        for dtype in named if isinstance(named, list) else ():
            if dtype not in FLOOR_DTYPES:
                raise ValueError(f"{start_of(dtype)} is not a dtype the noise floor can take; give "
                                 f"{', '.join(FLOOR_DTYPES)} or both (or on, or off)")
        return floor

    @model_validator(mode="before")
    @classmethod
    def _retired_settings(cls, data):
        if not isinstance(data, dict):  # pydantic's own error says what is wrong
            return data
        said = RetiredSaid.of_section(data)
        if said.divergence in RETIRED_DIVERGENCE:
            raise ValueError(f"divergence {said.divergence} is retired: KL is now always exact, from the "
                             "baseline's stored reference at one model's cost; use on (or off)")
        if said.top_k:
            raise ValueError("top_k is retired with the top-k cache: KL is now exact, from the baseline's "
                             "stored reference; remove it")
        return data

    @model_validator(mode="before")
    @classmethod
    def _stride_is_half_the_window_unless_given(cls, data):
        if isinstance(data, dict) and data.get("stride") is None:
            window = data.get("window", DEFAULT_WINDOW)
            if isinstance(window, int):  # else the window's own error says what is wrong
                data = {**data, "stride": window // 2}
        return data

    @classmethod
    def of_record(cls, data: dict) -> EvaluationConfig:
        """The settings an audit record was scored with (a record from before the reference keeps the
        retired settings, whose KL was on)."""
        return cls.model_validate(evaluation_of_record(data))

    @model_validator(mode="after")
    def _a_plan_the_engine_can_make(self) -> EvaluationConfig:
        try:  # the engine's own checks, so that a config and `ppl` get the same line
            check_plan(self.window, self.stride, self.mode, 1 if self.bos == "window" else 0)
            chunk_limit(self.chunks, self.window, self.mode, self.max_tokens)
        except InputError as error:
            raise ValueError(str(error)) from None
        return self

    @property
    def floors(self) -> tuple[str, ...]:
        """The dtypes of the noise floor (``floor``): none when it is off."""
        if self.floor is True:
            return FLOOR_DTYPES
        return tuple(dict.fromkeys(self.floor)) if self.floor else ()

    @property
    def windowing(self) -> Windowing:
        """How the engine cuts the stream into windows, as these settings say."""
        return Windowing(self.window, self.stride, self.mode)


class Gate(Strict):
    """Limits a variant must stay within to pass, judged on the pessimistic end of each 95% interval."""

    max_ppl_increase_pct: float | None = Field(None, gt=0, le=1000)
    max_kld_mean: float | None = Field(None, gt=0)
    min_top1_agreement: float | None = Field(None, gt=0, le=1)


class CorpusGate(Gate):
    """A domain's limits (``thresholds.per_corpus.NAME``), with per-variant overrides within that domain."""

    per_variant: dict[str, Gate] = {}


class Thresholds(Gate):
    """The gate for every variant, with per-variant overrides by name and, in an audit of several corpora, per-domain
    overrides (``per_corpus``). On a domain, its own limits replace the audit's (per-variant ones too), and its own
    per-variant limits replace those: a variant's gate there is, each limit taken from the first that sets it,
    ``per_corpus.D.per_variant.V``, ``per_corpus.D``, ``per_variant.V``, the audit's."""

    per_variant: dict[str, Gate] = {}
    per_corpus: dict[str, CorpusGate] = {}

    def for_variant(self, name: str) -> Gate:
        override = self.per_variant.get(name)
        merged = self.model_dump(exclude={"per_variant", "per_corpus"})
        if override:
            merged.update(override.model_dump(exclude_none=True))
        return Gate(**merged)

    def for_corpus(self, corpus: str) -> Thresholds:
        """The thresholds of a one-corpus audit of the domain ``corpus``: what this audit judges that domain by."""
        domain = self.per_corpus.get(corpus)
        if domain is None:
            return self.model_copy(update={"per_corpus": {}})
        limits = domain.model_dump(exclude={"per_variant"}, exclude_none=True)
        names = set(self.per_variant) | set(domain.per_variant)
        per_variant = {name: Gate(**self.per_variant.get(name, Gate()).model_dump(exclude_none=True) | limits
                                  | domain.per_variant.get(name, Gate()).model_dump(exclude_none=True))
                       for name in names}
        return Thresholds(**self.model_dump(exclude={"per_variant", "per_corpus"}) | limits, per_variant=per_variant)


class Schedule(Strict):
    """When ``serve`` runs the audit: ``cron`` read in ``timezone`` (an IANA name: 03:00 stays 03:00 across DST),
    and on each ``quantization.completed`` event; ``event_baseline``: whether an event may name the baseline
    (within the allowed folders, ``tasks.audit.served``) instead of the config's."""

    cron: str | None = None
    timezone: str = "UTC"
    event_baseline: bool = False

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, zone: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"'{zone}' is not an IANA time zone; use a name such as UTC or Europe/Berlin") from None
        return zone

    @model_validator(mode="after")
    def _valid_cron(self) -> Schedule:
        if self.cron is not None:
            from datetime import datetime

            from cronsim import CronSim, CronSimError

            try:
                CronSim(self.cron, datetime(2026, 1, 1))
            except CronSimError as error:
                raise ValueError(f"cron '{self.cron}' is not a cron expression ({error})") from None
        return self


class Runner(Strict):
    """Where variants run: one after another here, or concurrently through Dask or Ray workers.

    ``address``: an existing cluster's scheduler (Dask ``tcp://host:8786``; Ray ``ray://host:10001`` or
    ``auto``); without it ``workers`` local workers are started for the audit. ``shards``: each variant's
    windows are split into this many contiguous slices, one task each, merged exactly.
    """

    kind: Literal["sequential", "dask", "ray"] = "sequential"
    workers: int = Field(2, ge=1)
    gpus_per_variant: float = Field(0, ge=0)
    address: str | None = None
    shards: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _fits_the_kind(self) -> Runner:
        if self.shards > 1 and self.kind == "sequential":
            raise ValueError("shards split a model's windows across workers: set kind dask or ray")
        schemes = {"dask": ("tcp://", "tls://"), "ray": ("ray://",)}.get(self.kind)
        if self.address is None:
            return self
        if schemes is None:
            raise ValueError("address is a Dask or Ray scheduler's: set kind dask or ray")
        if not (self.address.startswith(schemes) or (self.kind == "ray" and self.address == "auto")):
            raise ValueError(f"'{self.address}' is not a {self.kind} scheduler address; use "
                             + ("tcp://HOST:8786" if self.kind == "dask" else "ray://HOST:10001 or auto"))
        return self


class Diagnosis(Strict):
    """How a variant is diagnosed (``ppl-audit diagnose``, ``diagnose: on`` or ``diagnose: failed``): on a sample
    of ``windows`` of the audit's windows drawn by ``seed`` (null: every window), the greedy restore curve up to
    ``restore`` layers."""

    # enough windows for intervals over windows (Student's t with 7 degrees of freedom), few enough that the 36
    # restored variants of a 30-layer model score in ~5 minutes on 2 CPU cores (docs/diagnose.md)
    windows: int | None = Field(8, ge=2)
    restore: int = Field(4, ge=0)  # how many layers a user would consider keeping in higher precision
    seed: int = Field(0, ge=0)


def tracking_problem(uri: str) -> str | None:
    """Why MLflow could never track to ``uri`` (a scheme it does not know, an http URI without a host, a database
    whose driver is not installed, a SQLite file in a folder that does not exist), or None. Otherwise the audit
    would run, spool its record and leave it for a ``sync`` that can never succeed."""
    from urllib.parse import urlparse

    if not uri.strip():  # read as unset, it would send the audits to another store than the one meant
        return "the tracking URI is empty; leave it out for MLFLOW_TRACKING_URI or the local store, or name one"
    parsed = urlparse(uri)
    dialect, plus, _ = parsed.scheme.partition("+")
    if dialect not in TRACKING_SCHEMES or (plus and dialect not in DATABASES):
        return (f"'{uri}' is not an MLflow tracking URI; use http(s)://HOST:PORT, sqlite:///FILE.db, file:///FOLDER "
                "or another store MLflow knows")
    if dialect in ("http", "https") and not parsed.hostname:
        return f"'{uri}' names no host; use {dialect}://HOST:PORT"
    if dialect not in DATABASES:
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        url = make_url(uri)
        url.get_dialect().import_dbapi()
    except (ArgumentError, NoSuchModuleError) as error:
        return f"'{uri}' is not a database URL SQLAlchemy can use ({error}); e.g. {dialect}://USER@HOST/DATABASE"
    except ImportError as error:
        package = DRIVER_PACKAGES.get(error.name, error.name)
        return f"'{uri}' needs the database driver {error.name}, which is not installed: pip install {package}"
    if dialect == "sqlite" and url.database not in (None, "", ":memory:") and not Path(url.database).parent.is_dir():
        return f"'{uri}': the folder {Path(url.database).parent} does not exist; create it or name another file"
    return None


def check_tracking(given: str | None, where: str) -> str:
    """The tracking URI a command uses (``given``, else ``MLFLOW_TRACKING_URI``, else the local store), refused in
    one line naming where it came from when MLflow could never track to it."""
    from tasks.core.places import default_uri, tracking_uri

    uri = given if given is not None else tracking_uri()  # an empty one is refused, not read as unset
    problem = None if uri == default_uri() else tracking_problem(uri)  # the local store's folder is made on first use
    if problem:
        source = where if given is not None else "MLFLOW_TRACKING_URI"
        raise InputError(f"{source}: {problem}")
    return uri


class Tracking(Strict):
    """MLflow: ``uri`` (else ``MLFLOW_TRACKING_URI``, else the local SQLite store) and experiment."""

    uri: str | None = None
    # MLflow keeps an experiment's name in a 256-character column, and its record's spool folder cannot sync one longer
    experiment: str = Field("ppl-audit", min_length=1, max_length=NAME_MAX)

    @field_validator("uri")
    @classmethod
    def _tracking_uri(cls, uri: str | None) -> str | None:
        problem = uri is not None and tracking_problem(uri)
        if problem:
            raise ValueError(problem)
        return uri

    @field_validator("experiment")
    @classmethod
    def _experiment_stays_inside(cls, name: str) -> str:
        # a local store keeps each experiment's artifacts in a folder named after it
        if name.strip() != name or name.startswith("/") or "\\" in name or ".." in name.split("/"):
            raise ValueError(f"experiment '{name}' cannot name a folder inside the store (no leading '/', "
                             "'..', '\\' or surrounding spaces)")
        return name


class AuditConfig(Strict):
    """One audit: a baseline, its variants, the corpus, how to score, and the gate."""

    name: str = Field(min_length=1, max_length=NAME_MAX, pattern=NAME)
    baseline: BaselineSpec
    corpus: CorpusConfig | None = None
    corpora: list[Corpus] | None = None
    evaluation: EvaluationConfig = EvaluationConfig()
    variants: list[VariantSpec] = []
    thresholds: Thresholds = Thresholds()
    schedule: Schedule = Schedule()
    runner: Runner = Runner()
    tracking: Tracking = Tracking()
    diagnose: Literal["failed"] | bool = False  # failed: every variant that fails its gate; on: every variant
    diagnosis: Diagnosis = Diagnosis()

    @field_validator("baseline", mode="before")
    @classmethod
    def _baseline_is_named_baseline(cls, baseline: object) -> object:
        # a name given keeps it; "baseline" is not BaselineSpec's default, so that its model_dump (a tune's audit
        # config) writes the name as it always has
        return {"name": "baseline", **baseline} if isinstance(baseline, dict) else baseline

    @model_validator(mode="after")
    def _consistent(self) -> AuditConfig:
        if not self.baseline.backend.float_model or self.baseline.path is None:
            raise ValueError("baseline needs a path (model folder, Hub id or embedded) and method baseline")
        if not self.variants:
            raise ValueError("variants is empty: an audit compares variants with the baseline; add one "
                             "(to measure one model, use ppl-audit ppl)")
        names = [self.baseline.name] + [v.name for v in self.variants]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"variant names must be unique: {', '.join(duplicates)} repeats")
        unknown = sorted(set(self.thresholds.per_variant) - set(names))
        if unknown:
            raise ValueError(f"thresholds.per_variant names no variant: {', '.join(unknown)}")
        self._one_source_of_text()
        self._a_floor_it_can_measure(names)
        for domain, gate in self.thresholds.per_corpus.items():
            unknown = sorted(set(gate.per_variant) - set(names))
            if unknown:
                raise ValueError(f"thresholds.per_corpus.{domain}.per_variant names no variant: {', '.join(unknown)}")
        return self

    def _a_floor_it_can_measure(self, names: list[str]) -> None:
        """``evaluation.floor`` loads the baseline in 16 bits in transformers and compares it with its float32 self."""
        floors = self.evaluation.floors
        if not floors:
            return
        base = self.baseline
        if not base.runtime_backend.in_transformers:
            raise ValueError("evaluation.floor loads the baseline in bfloat16/float16 in transformers, and this baseline "
                             "runs in llama.cpp, whose numerics are its own: set floor off")
        if base.dtype in FLOOR_DTYPES:
            raise ValueError(f"evaluation.floor measures 16-bit numerics against the float32 baseline, and "
                             f"baseline.dtype is {base.dtype}: set baseline.dtype float32 (or auto), or floor off")
        taken = sorted({floor_name(dtype) for dtype in floors} & set(names))
        if taken:
            raise ValueError(f"{', '.join(taken)} names the noise floor's row (evaluation.floor): rename that variant")

    def _one_source_of_text(self) -> None:
        """``corpus`` (one) or ``corpora`` (several, each named once); ``per_corpus`` names only those."""
        # one line for each mistake, saying which it is: "one of them" left a user who gave both guessing
        names = [c.name for c in self.corpora or []]
        if (self.corpus is None) == (self.corpora is None):
            raise ValueError("no text to score: give corpus (one text) or corpora (several domains, each with a name)"
                             if self.corpus is None else "corpus and corpora are both given: keep corpus (one text) "
                             "or corpora (several domains, each with a name), not both")
        if self.corpus is None and not names:
            raise ValueError("corpora is empty: list the domains to audit (name and source each), or give corpus")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"corpora names must be unique: {', '.join(repeated)} repeats")
        unknown = sorted(set(self.thresholds.per_corpus) - set(names))
        if unknown:
            known = f"the corpora are {', '.join(names)}" if names else "the audit has one corpus: use corpora to name several"
            raise ValueError(f"thresholds.per_corpus names no corpus: {', '.join(unknown)} ({known})")

    @property
    def domains(self) -> list[Corpus]:
        """The corpora the audit scores, each named: a one-corpus audit's is ``corpus`` (``OneCorpus``). The one
        place that asks which of the two the config gives; past it, one corpus is one domain."""
        return list(self.corpora or [OneCorpus(name=ONE_CORPUS, **self.corpus.model_dump())])

    def for_domain(self, domain: Corpus) -> AuditConfig:
        """The one-corpus audit of ``domain``: its text, its ``max_tokens``, its gates. Each domain of an audit of
        several is scored and judged as this config's audit would be, figure for figure; an audit of one corpus is
        its own (an equal config)."""
        evaluation = self.evaluation if domain.max_tokens is None else EvaluationConfig.model_validate(
            self.evaluation.model_dump() | {"max_tokens": domain.max_tokens})
        return self.model_copy(update={"corpus": domain.alone(), "corpora": None, "evaluation": evaluation,
                                       "thresholds": self.thresholds.for_corpus(domain.name)})


def _index(override: str, part: str, items: list) -> int:
    if not part.isdigit() or int(part) >= len(items):
        raise InputError(f"--set {override}: {part} is not an index of that list (it has {len(items)} items: "
                         f"0 to {len(items) - 1})")
    return int(part)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``key.sub=value`` overrides (values parsed as YAML; list items by index) to raw config data."""
    import yaml

    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key:
            raise InputError(f"--set {override}: use key=value, e.g. --set evaluation.max_tokens=4096")
        node, parts = data, key.split(".")
        for part in parts[:-1]:
            if isinstance(node, list):
                node = node[_index(override, part, node)]
            else:
                node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise InputError(f"--set {override}: {part} is not a section")
        last = parts[-1]
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as error:
            raise InputError(f"--set {override}: the value is not YAML ({yaml_problem(error)}); quote it "
                             "in the shell as a whole, e.g. --set 'evaluation.window=[1, 2]'") from None
        if isinstance(node, list):
            node[_index(override, last, node)] = value
        else:
            node[last] = value
    return data


def read_yaml(text: str, where: str):
    """``text`` parsed as YAML, with every mapping's keys unique: YAML parsers keep a repeated key's last value, and
    a second ``thresholds:`` block would silently replace the first gate. Raises ``yaml.YAMLError`` for bad YAML and
    ``InputError`` naming a repeated key and both its lines."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            lines = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # "<<": merged keys are meant to be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = lines.get(key)
                except TypeError:  # an unhashable key: SafeLoader's own error says so
                    break
                if first is not None:
                    raise InputError(f"{where}: key '{start_of(key)}' is given twice (lines {first} and {line}); "
                                     "keep one of them")
                lines[key] = line
            return super().construct_mapping(node, deep)

    return yaml.load(text, Loader=UniqueKeys)


def load_audit_config(path: str, overrides: list[str] = ()) -> AuditConfig:
    """Read, override and validate an audit YAML file; every mistake is one line naming the key."""
    from pathlib import Path

    import yaml

    file = Path(path)
    if not file.is_file():
        raise InputError(f"config not found: {file} (give a YAML file, e.g. configs/demo.yaml)")
    try:
        data = read_yaml(file.read_text(encoding="utf-8"), str(file)) or {}
    except yaml.YAMLError as error:
        raise InputError(f"{file} is not valid YAML: {yaml_problem(error)}") from None
    except UnicodeDecodeError as error:
        raise InputError(f"{file} is not UTF-8 text (byte {error.start}); save the config as UTF-8") from None
    except OSError as error:
        raise InputError(f"cannot read config {file}: {error.strerror}") from None
    if not isinstance(data, dict):
        raise InputError(f"{file} must hold a mapping of settings at the top level")
    return parse(AuditConfig, apply_overrides(data, list(overrides)), str(file), list(overrides))
