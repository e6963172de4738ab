"""Load a causal LM and its tokenizer from a local folder, a GGUF file, ``embedded``, or a Hugging Face Hub id."""

from __future__ import annotations

import json
import struct
from contextlib import contextmanager
from pathlib import Path

import torch

from tasks.errors import InputError, TransientError, is_network_error, one_line

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device '{name}' asked for, but no CUDA GPU is visible; use device cpu or auto")
    if name != "cpu" and not name.startswith("cuda"):
        raise InputError(f"unknown device '{name}'; use cpu, cuda, cuda:N or auto")
    return torch.device(name)


def input_device(model) -> torch.device:
    """The device a model takes its input ids on: where its input embeddings run. That is not ``model.device``
    (its first parameter's) when accelerate's hooks run offloaded modules (``device_map`` with ``cpu``/``disk``
    beside a GPU, ``cpu_offload``): their weights wait on ``meta`` and are brought to the hook's device per call.
    """
    embeddings = model.get_input_embeddings()
    hook = getattr(embeddings, "_hf_hook", None)
    for each in getattr(hook, "hooks", [hook]):  # a SequentialHook holds several
        if getattr(each, "execution_device", None) is not None:
            device = each.execution_device
            return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return embeddings.weight.device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (exact and fast there) and bfloat16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise InputError(f"unknown dtype '{name}'; use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_model_path(name: str, registry: str | None = None) -> str:
    """A local folder or ``.gguf`` file as a string, or a Hub id left as it is.

    Args:
        registry: the tracking server whose model registry holds ``models:/`` names (default: MLflow's
            ``MLFLOW_TRACKING_URI``, else the local store).
    """
    if name == "embedded":
        from tasks.embedded import ensure_embedded_model

        return str(ensure_embedded_model())
    if name.startswith("models:/"):
        from tasks.registry import download
        from tasks.tracking import tracking_uri

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


def from_pretrained_args(source: str) -> tuple[str, dict]:
    """``(folder or Hub id, keyword arguments)`` that transformers' ``from_pretrained`` takes for ``source``:
    a ``.gguf`` file is its folder and ``gguf_file`` (transformers dequantizes it as it loads)."""
    if source.endswith(".gguf"):
        path = Path(source)
        return str(path.parent), {"gguf_file": path.name}
    return source, {}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_checkpoint(name: str, registry: str | None = None) -> None:
    """Refuse a local model folder without weights or tokenizer (or with shards its index names missing), and a
    folder or GGUF file whose tensors do not fill the model it describes."""
    path = Path(resolve_model_path(name, registry))
    if path.suffix == ".gguf":
        from tasks.formats import check_gguf

        check_gguf(path)
        return
    if not path.is_dir():
        return  # a Hub id: the Hub holds the files
    from tasks.variants import WEIGHT_SUFFIXES

    missing = []
    for index in path.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            raise InputError(f"model folder {path}: {index.name} is not a weight index; copy the checkpoint again") from None
        missing += sorted(shard for shard in shards if not (path / shard).is_file())
    if missing:
        raise InputError(f"model folder {path} lacks weight shard(s) its index names: {', '.join(missing[:3])}"
                         f"{' …' if len(missing) > 3 else ''}; copy the whole checkpoint")
    if not any(file.suffix in WEIGHT_SUFFIXES for file in path.iterdir()):
        raise InputError(f"model folder {path} has no weights (*.safetensors or *.bin); copy the whole checkpoint")
    if not any((path / file).is_file() for file in TOKENIZER_FILES):
        raise InputError(f"model folder {path} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                         "save the tokenizer beside the weights (tokenizer.save_pretrained)")
    check_weights(path)


# the files from_pretrained reads a folder's weights from, in the order it looks for them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _weight_files(folder: Path) -> list[Path]:
    for name in WEIGHT_FILES:
        file = folder / name
        if file.is_file():
            if name.endswith(".index.json"):
                return sorted({folder / shard for shard in json.loads(file.read_text())["weight_map"].values()})
            return [file]
    return []


@contextmanager
def _quiet():
    """Without transformers' load report and progress bar: a check's one line says what they would."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def check_weights(folder: Path) -> None:
    """Refuse a float checkpoint whose tensors do not fill the model its config.json describes (renamed, from
    another architecture, a base model without its head): transformers would fill the gaps at random and the
    model would be scored as it is. Its files' headers are loaded on the meta device, so transformers' own
    renaming, tying and ignore rules decide, and no weight is read. A quantized checkpoint's packed tensors
    need its quantizer: ``load_model`` checks those as they load (and a folder without the files transformers
    looks for gets transformers' own error there)."""
    from transformers.modeling_utils import load_state_dict
    from transformers.models.auto.auto_factory import _get_model_class
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = load_config(str(folder))
    files = _weight_files(folder)
    quantized = getattr(config, "quantization_config", None) is not None
    if quantized or not files or type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return
    tensors = {}
    for file in files:
        try:
            tensors.update(load_state_dict(str(file), map_location="meta"))
        except Exception as error:  # noqa: BLE001 -- safetensors and pickle raise bare Exception subclasses
            raise InputError(f"model folder {folder}: cannot read {file.name} ({one_line(error)}); "
                             "copy the checkpoint again") from None
    model_class = _get_model_class(config, MODEL_FOR_CAUSAL_LM_MAPPING)  # the class AutoModelForCausalLM loads
    with _quiet():
        _, info = model_class.from_pretrained(None, config=config, state_dict=tensors, device_map="meta",
                                              ignore_mismatched_sizes=True, output_loading_info=True)
    check_loading_info(f"model folder {folder}", model_class.__name__, info)


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", …" if len(names) > 3 else "")


def check_loading_info(what: str, model_class: str, info: dict) -> None:
    """Refuse a load whose loading info (``output_loading_info``) names a weight the model needs that its
    files lack, a tensor there that it does not use, or one of another shape: one line naming a few of each."""
    found = [f"{len(names)} {kind}: {_few(names)}" for kind, names in (
        ("missing", sorted(info["missing_keys"])), ("unexpected", sorted(info["unexpected_keys"])),
        ("of another shape", sorted(key for key, *_ in info["mismatched_keys"]))) if names]
    if found:
        raise InputError(f"{what}: its weights do not fit {model_class} ({'; '.join(found)}): it would be scored "
                         "with random weights in their place; give the checkpoint as save_pretrained wrote it, with "
                         "the config.json of the model its tensors are for")


def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    source, extra = from_pretrained_args(resolve_model_path(name))
    try:
        return AutoTokenizer.from_pretrained(source, **extra)
    except Exception as error:  # noqa: BLE001 -- the tokenizers library raises bare Exception for a bad vocabulary
        if is_network_error(error):
            raise TransientError(f"cannot reach the model store for {name}: {one_line(error)}") from error
        raise InputError(f"cannot load the tokenizer of {name}: {one_line(error)}") from None


def load_model(name: str, dtype: torch.dtype, device: torch.device, **from_pretrained):
    """Load a causal LM for scoring, in eval mode on ``device``.

    Args:
        name: a local folder, a ``.gguf`` file, ``embedded``, or a Hugging Face Hub id (needs network).
        dtype: weight dtype for unquantized layers.
        device: where the model runs.
        from_pretrained: extra keyword arguments (a quantization config; a ``device_map`` that splits the model
            instead of placing it on ``device``).
    """
    from transformers import AutoModelForCausalLM

    source, extra = from_pretrained_args(resolve_model_path(name))
    if "gguf_file" in extra:  # checked before transformers builds the whole model for it
        from tasks.formats import check_gguf

        check_gguf(Path(source) / extra["gguf_file"])
    try:
        model, info = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, output_loading_info=True,
                                                           **({"device_map": str(device)} | extra | from_pretrained))
    except (OSError, ValueError) as error:
        if is_network_error(error):
            raise TransientError(f"cannot reach the model store for {name}: {one_line(error)}") from error
        raise InputError(f"cannot load model {name}: {one_line(error)}") from None
    check_loading_info(f"model {name}", type(model).__name__, info)
    return model.eval()


def load_config(name: str, registry: str | None = None):
    """The model's config alone: enough to check settings before any weights are loaded."""
    from transformers import AutoConfig

    source, extra = from_pretrained_args(resolve_model_path(name, registry))
    _check_quantization_config(Path(source) / "config.json", name)
    try:
        return AutoConfig.from_pretrained(source, **extra)
    except (OSError, ValueError) as error:
        raise InputError(f"cannot load the config of {name}: {one_line(error)}") from None
    except (struct.error, MemoryError, OverflowError) as error:  # a GGUF header cut short or with absurd lengths
        raise InputError(f"cannot read {name}: {one_line(error)}; give a whole llama.cpp .gguf file") from None


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
    method = (quantization or {}).get("quant_method")
    if method in ("gptq", "awq") and not isinstance(quantization.get("bits"), int):
        raise InputError(f"the config.json of {name} says quant_method {method} but gives no bits; it is not a "
                         f"whole {method} checkpoint (save it again with its quantizer)")


def max_positions(config) -> int | None:
    """The longest sequence the model's position scheme was built for, when its config says."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
