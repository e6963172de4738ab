"""Where a model is and what it is: its path (a folder, a GGUF file, ``embedded``, a Hub id, ``models:/``), its
config and tokenizer, and the device and dtype it runs with."""

from __future__ import annotations

import copy
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tasks.core.errors import InputError, TransientError, is_network_error, one_line
from tasks.core.files import once_per_file_state
from tasks.methods.registry import find_method

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_problem(name: str, gpus: int) -> str | None:
    """Why the device ``name`` cannot be used on a machine with ``gpus`` visible CUDA GPUs, or None. A GPU index
    past them failed only when the model loaded (torch's "invalid device ordinal")."""
    if name in ("auto", "cpu"):
        return None
    known = re.fullmatch(r"cuda(?::(\d+))?", name)
    if known is None:
        return f"unknown device '{name}'; use cpu, cuda, cuda:N or auto"
    if gpus == 0:
        return f"device '{name}' asked for, but no CUDA GPU is visible; use device cpu or auto"
    if known.group(1) is not None and int(known.group(1)) >= gpus:
        visible = "cuda:0" if gpus == 1 else f"cuda:0 to cuda:{gpus - 1}"
        return (f"device '{name}' asked for, but only {gpus} CUDA GPU{'s are' if gpus > 1 else ' is'} visible "
                f"({visible}); use one of them, or auto")
    return None


def visible_gpus() -> int:
    """The CUDA GPUs this process sees (none where CUDA is not available)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    problem = device_problem(name, visible_gpus())
    if problem:
        raise InputError(problem)
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (exact and fast there) and bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise InputError(f"unknown dtype '{name}'; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def device_and_dtype(spec) -> tuple[torch.device, torch.dtype]:
    """Where a model of ``spec`` (a ``VariantSpec``) runs and in what dtype: the one place its ``device`` and
    ``dtype`` settings are resolved (where it loads, on the worker that scores it: ``auto`` is that machine's)."""
    device = resolve_device(spec.device)
    return device, resolve_dtype(spec.dtype, device)


def resolve_model_path(name: str, registry: str | None = None) -> str:
    """A local folder or ``.gguf`` file as a string, or a Hub id left as it is.

    Args:
        registry: the tracking server whose model registry holds ``models:/`` names (default: MLflow's
            ``MLFLOW_TRACKING_URI``, else the local store).
    """
    if name == "embedded":
        from tasks.data.embedded import ensure_embedded_model

        return str(ensure_embedded_model())
    if name.startswith("models:/"):
        from tasks.core.places import tracking_uri
        from tasks.data.registry import download

        return download(name, tracking_uri(registry))
    path = Path(name).expanduser()
    try:
        if path.is_file() and path.suffix == ".gguf":
            return str(path)
        if path.exists():
            if not path.is_dir() or not (path / "config.json").is_file():
                raise InputError(f"model folder {path} has no config.json; give a folder saved with save_pretrained")
            return str(path)
    except PermissionError as error:
        raise InputError(f"cannot read model {path}: {error.strerror}; give this user read access to it") from None
    looks_like_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise InputError(f"model folder not found: {path} (give a folder with config.json, a .gguf file, a Hub id, "
                         "or embedded)")
    return name


# what quantizing a Hub model reads: its config, tokenizer and safetensors weights, not a repo's other formats
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]


def model_files(source: str, fetch: bool = False) -> Path | None:
    """A model's local files: its folder or single-file checkpoint (``.gguf``), or a Hub id's snapshot in the
    Hugging Face cache; None when they are not on this machine (then nothing identifies it well enough to reuse
    a reference). ``fetch``: download a Hub model's files into the cache when they are not there yet (what
    quantizing it on the spot needs), and say in one line why when that cannot be done."""
    if Path(source).is_dir() or (Path(source).is_file() and source.endswith(".gguf")):
        return Path(source)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(source, local_files_only=not fetch, allow_patterns=HUB_FILES if fetch else None))
    except (LocalEntryNotFoundError, HFValidationError, OSError) as error:
        if not fetch:
            return None
        if is_network_error(error):
            raise TransientError(f"cannot reach the model store for {source}: {one_line(error)}") from error
        raise InputError(f"cannot fetch the files of {source}: {one_line(error)}") from None


def from_pretrained_args(source: str) -> tuple[str, dict]:
    """``(folder or Hub id, keyword arguments)`` that transformers' ``from_pretrained`` takes for ``source``:
    a ``.gguf`` file is its folder and ``gguf_file`` (transformers dequantizes it as it loads)."""
    if source.endswith(".gguf"):
        path = Path(source)
        return str(path.parent), {"gguf_file": path.name}
    return source, {}


@dataclass(frozen=True)
class Located:
    """A model found once: where it loads from and what it is, so that nothing after resolves its name again.

    Attributes:
        source: a local folder, a ``.gguf`` file or a Hub id (``resolve_model_path``).
        config: its transformers config (for a GGUF file, made from the file's header).
        name: what the user called it (``embedded``, a Hub id, a path as written): what messages and manifests say.
    """

    source: str
    config: object
    name: str

    @classmethod
    def at(cls, source: str, name: str | None = None) -> Located:
        """``source`` (already resolved) with its config read; ``name`` is what the user called it. Where its files
        lie is not kept: each machine that reads them looks (``model_files``), as a worker may hold a Hub snapshot
        the machine that found the model does not."""
        return cls(source, read_config(source, name or source), name or source)


def locate_model(name: str, registry: str | None = None) -> Located:
    """``name`` resolved and read once (``resolve_model_path``, its config)."""
    return Located.at(resolve_model_path(name, registry), name)


def load_tokenizer(name: str):
    """The tokenizer of the model ``name`` (resolved first: for a tool or a test; an audit reads its models' once,
    in ``tasks.audit.checkpoints``, with ``read_tokenizer``)."""
    return read_tokenizer(resolve_model_path(name), name)


def read_tokenizer(source: str, name: str | None = None):
    """The tokenizer at ``source``, a folder, ``.gguf`` file or Hub id as ``resolve_model_path`` gives it."""
    from transformers import AutoTokenizer

    name = name or source
    source, extra = from_pretrained_args(source)
    try:
        return _parsed_once(AutoTokenizer, source, **extra)
    except Exception as error:  # noqa: BLE001 -- the tokenizers library raises bare Exception for a bad vocabulary
        if is_network_error(error):
            raise TransientError(f"cannot reach the model store for {name}: {one_line(error)}") from error
        raise InputError(f"cannot load the tokenizer of {name}: {_tokenizer_problem(source, error)}") from None


def _tokenizer_problem(source: str, error: Exception) -> str:
    """What is wrong with a model's tokenizer files, and what to do: the libraries say only a missing key
    (``'added_tokens'``) or their parser's position."""
    found = one_line(error)
    files = [name for name in ("tokenizer.json", "tokenizer_config.json") if (Path(source) / name).is_file()]
    if not files:
        return found
    for name in files:
        try:
            json.loads((Path(source) / name).read_text(encoding="utf-8"))
        except (ValueError, OSError) as bad:
            found = f"{name} is not readable JSON ({one_line(bad)})"
            break
    else:
        if isinstance(error, KeyError):
            found = f"{' or '.join(files)} is malformed: it lacks the key {found}"
    return f"{found}; copy the tokenizer's files again from where the model came from (or its original repository)"


def load_config(name: str, registry: str | None = None):
    """The config of the model ``name`` (resolved first: for a tool or a test; an audit's models carry theirs, read
    once: ``Located``)."""
    return read_config(resolve_model_path(name, registry), name)


def read_config(source: str, name: str | None = None):
    """The config at ``source`` alone: enough to check settings before any weights are loaded."""
    from transformers import AutoConfig

    name = name or source
    if source.endswith(".gguf"):  # before its header is parsed: a file that is not GGUF is said so in one line
        from tasks.models.gguf_file import check_magic

        check_magic(Path(source))
    source, extra = from_pretrained_args(source)
    _check_quantization_config(Path(source) / "config.json", name)
    try:
        return _parsed_once(AutoConfig, source, **extra)
    except (OSError, ValueError) as error:
        raise InputError(f"cannot load the config of {name}: {one_line(error)}") from None
    except (struct.error, MemoryError, OverflowError) as error:  # a GGUF header cut short or with absurd lengths
        raise InputError(f"cannot read {name}: {one_line(error)}; give a whole llama.cpp .gguf file") from None


def _parsed_once(auto, source: str, gguf_file: str | None = None):
    """``auto.from_pretrained(source)``; from a GGUF file, parsed once per process and copied after.

    transformers reads a config or a tokenizer out of a GGUF file by parsing all of its metadata, every vocabulary
    string and merge (~4 s for SmolLM2's 49k on this project's 2-core machine), and an audit asks for each of a
    file several times (lineup, preflight, loading, the reference's head). The file's size and modification time
    are in the key: a file rewritten in place is parsed again."""
    if gguf_file is None:
        return auto.from_pretrained(source)
    return copy.deepcopy(_from_gguf(Path(source) / gguf_file, auto))


@once_per_file_state(maxsize=16)
def _from_gguf(file: Path, auto):
    from transformers import AutoConfig, AutoTokenizer

    if auto is AutoConfig:  # from the header alone where it can be (tasks.models.gguf_file): no vocabulary parsed
        from transformers import CONFIG_MAPPING

        from tasks.models.gguf_file import header_config, read_header

        found = header_config(read_header(file))
        if found is not None:
            config = CONFIG_MAPPING[found.model_type].from_dict(found.values)
            config._name_or_path = str(file.parent)  # as from_pretrained names it
            return config
    if auto is AutoTokenizer and (chosen := _gguf_tokenizer_class(file)) is not None:
        return chosen.from_pretrained(str(file.parent), gguf_file=file.name)
    return auto.from_pretrained(str(file.parent), gguf_file=file.name)


def _gguf_tokenizer_class(file: Path):
    """The class ``AutoTokenizer`` picks for a GGUF file, where it is plain to see, else None (then it decides).

    To pick it, ``AutoTokenizer`` builds the file's config, for most architectures by parsing every vocabulary
    string and merge with gguf-py (2.7 s of the 2.95 s it takes for SmolLM2's file on this project's machine; the
    tokenizer itself reads the file's metadata in 0.2 s). For a file with no ``tokenizer_config.json`` beside it
    and a config made from its header (``_from_gguf``) that names no tokenizer class, its choice is the tokenizer
    registered for the config's class, else ``TokenizersBackend`` (transformers 5.23's ``AutoTokenizer``;
    tests/test_gguf_file.py holds the two equal)."""
    import fnmatch

    from transformers import AutoConfig, TokenizersBackend
    from transformers.models.auto.tokenization_auto import MODEL_IDS_TO_TOKENIZERS_BACKEND, TOKENIZER_MAPPING

    if (file.parent / "tokenizer_config.json").exists():
        return None
    config = _from_gguf(file, AutoConfig)
    if getattr(config, "tokenizer_class", None) is not None or any(
            fnmatch.fnmatch(str(file.parent).lower(), model) for model in MODEL_IDS_TO_TOKENIZERS_BACKEND):
        return None
    chosen = TOKENIZER_MAPPING.get(type(config), TokenizersBackend)
    return None if chosen is None or chosen.__name__ == "MistralCommonBackend" else chosen


def _check_quantization_config(file: Path, name: str) -> None:
    """A local config.json's ``quantization_config`` is a mapping: transformers crashes on anything else."""
    try:
        raw = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, ValueError) as error:
        raise InputError(f"cannot load the config of {name}: {one_line(error)}") from None
    quantization = raw.get("quantization_config") if isinstance(raw, dict) else None
    if quantization is not None and not isinstance(quantization, dict):
        raise InputError(f"the config.json of {name} holds quantization_config {json.dumps(quantization)[:60]}, not a "
                         "mapping of its settings; fix the checkpoint's config.json")
    declared = (quantization or {}).get("quant_method")
    # gptqmodel's checkpoints name their method as ppl-audit does (gptq, awq), and load by their bits
    made = find_method(declared) if isinstance(declared, str) else None
    if made is not None and made.gptqmodel_kernels and not isinstance(quantization.get("bits"), int):
        raise InputError(f"the config.json of {name} says quant_method {declared} but gives no bits; it is not a "
                         f"whole {declared} checkpoint (save it again with its quantizer)")


