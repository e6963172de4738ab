"""Load a causal LM for scoring, and refuse a checkpoint whose files do not make the model it describes."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from tasks.core.errors import InputError, TransientError, is_network_error, one_line
from tasks.models.checkpoint_said import LoadingInfo, WeightIndex
from tasks.models.gguf import check_gguf, gguf_state_dict
from tasks.models.resolve import Located, from_pretrained_args, locate_model

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")

def as_located(model: Located | str) -> Located:
    """``model`` as found once (an audit's ``Checkpoint.model``), or a name a tool or a test gives, found now."""
    return model if isinstance(model, Located) else locate_model(model)


def check_checkpoint(model: Located | str) -> None:
    """Refuse a local model folder without weights or tokenizer (or with shards its index names missing), and a
    folder or GGUF file whose tensors do not fill the model it describes."""
    model = as_located(model)
    path = Path(model.source)
    if path.suffix == ".gguf":
        check_gguf(path, model.config)
        return
    if not path.is_dir():
        return  # a Hub id: the Hub holds the files
    missing = []
    for index in path.glob("*.index.json"):
        try:
            shards = WeightIndex.read(index).shards
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
    check_weights(path, model.config)

# the files from_pretrained reads a folder's weights from, in the order it looks for them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")

def _weight_files(folder: Path) -> list[Path]:
    for name in WEIGHT_FILES:
        file = folder / name
        if file.is_file():
            if name.endswith(".index.json"):
                return sorted({folder / shard for shard in WeightIndex.read(file).shards})
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

def check_weights(folder: Path, config) -> None:
    """Refuse a float checkpoint whose tensors do not fill the model its config.json describes (renamed, from
    another architecture, a base model without its head): transformers would fill the gaps at random and the
    model would be scored as it is. Its files' headers are loaded on the meta device, so transformers' own
    renaming, tying and ignore rules decide, and no weight is read. A quantized checkpoint's packed tensors
    need its quantizer: ``load_model`` checks those as they load (and a folder without the files transformers
    looks for gets transformers' own error there)."""
    from transformers.modeling_utils import load_state_dict
    from transformers.models.auto.auto_factory import _get_model_class
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

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
    said = LoadingInfo.of_info(info)
    found = [f"{len(names)} {kind}: {_few(names)}" for kind, names in (
        ("missing", sorted(said.missing)), ("unexpected", sorted(said.unexpected)),
        ("of another shape", sorted(said.mismatched))) if names]
    if found:
        raise InputError(f"{what}: its weights do not fit {model_class} ({'; '.join(found)}): it would be scored "
                         "with random weights in their place; give the checkpoint as save_pretrained wrote it, with "
                         "the config.json of the model its tensors are for")

def load_model(model: Located | str, dtype: torch.dtype, device: torch.device, **from_pretrained):
    """Load a causal LM for scoring, in eval mode on ``device``.

    Args:
        model: as found (``Located``), or a local folder, a ``.gguf`` file, ``embedded``, or a Hugging Face Hub id
            (needs network).
        dtype: weight dtype for unquantized layers.
        device: where the model runs.
        from_pretrained: extra keyword arguments (a quantization config; a ``device_map`` that splits the model
            instead of placing it on ``device``).
    """
    from transformers import AutoModelForCausalLM

    model = as_located(model)
    name = model.source
    source, extra = from_pretrained_args(model.source)
    loader = AutoModelForCausalLM
    if "gguf_file" in extra:  # checked before the model is built for it
        gguf = Path(source) / extra.pop("gguf_file")
        check_gguf(gguf, model.config)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(model.config)
        # the tensors dequantized here (``gguf_state_dict``), given to the model's own class with its config
        loader, source = type(skeleton), None
        extra = {"config": model.config, "state_dict": gguf_state_dict(gguf, skeleton, dtype)}
    try:
        loaded, info = loader.from_pretrained(source, dtype=dtype, output_loading_info=True,
                                              **({"device_map": str(device)} | extra | from_pretrained))
    except (OSError, ValueError) as error:
        if is_network_error(error):
            raise TransientError(f"cannot reach the model store for {name}: {one_line(error)}") from error
        raise InputError(f"cannot load model {name}: {one_line(error)}") from None
    check_loading_info(f"model {name}", type(loaded).__name__, info)
    return loaded.eval()
