"""Load a causal LM and its tokenizer from a local folder, a GGUF file, ``embedded``, or a Hugging Face Hub id."""

from __future__ import annotations

import json
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
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if path.exists():
        if not path.is_dir() or not (path / "config.json").is_file():
            raise InputError(f"model folder {path} has no config.json; give a folder saved with save_pretrained")
        return str(path)
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
    """Refuse a local model folder without weights or tokenizer (or with shards its index names missing)."""
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
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **({"device_map": str(device)} | extra
                                                                             | from_pretrained))
    except (OSError, ValueError) as error:
        if is_network_error(error):
            raise TransientError(f"cannot reach the model store for {name}: {one_line(error)}") from error
        raise InputError(f"cannot load model {name}: {one_line(error)}") from None
    return model.eval()


def load_config(name: str, registry: str | None = None):
    """The model's config alone: enough to check settings before any weights are loaded."""
    from transformers import AutoConfig

    source, extra = from_pretrained_args(resolve_model_path(name, registry))
    try:
        return AutoConfig.from_pretrained(source, **extra)
    except (OSError, ValueError) as error:
        raise InputError(f"cannot load the config of {name}: {one_line(error)}") from None


def max_positions(config) -> int | None:
    """The longest sequence the model's position scheme was built for, when its config says."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
