"""Plain helpers the tests share: deterministic text, a tokenizer trained on the spot, small Llamas built
from a config and a seed, an audit YAML, and process-level waiting. A module of its own, imported as
``from helpers import ...``; the fixtures built on them stay in ``conftest.py``."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import torch

WORDS = ("the a of and to in was her it his she he that with had for not be as at by on but "
         "miss mr mrs lady sir elizabeth darcy emma anne letter house morning evening walk "
         "said thought felt could would must very much little great good dear").split()


def make_text(n_words: int, seed: int = 0, vocabulary: tuple[str, ...] | list[str] = WORDS) -> str:
    """Deterministic English-like text: sentences of common words (``vocabulary``'s), paragraphs between."""
    rng = random.Random(seed)
    sentences = []
    for _ in range(n_words // 8):
        words = [rng.choice(vocabulary) for _ in range(rng.randint(4, 12))]
        sentences.append(" ".join(words).capitalize() + rng.choice([".", ".", ",", "!", "?"]))
    paragraphs = [" ".join(sentences[i : i + 5]) for i in range(0, len(sentences), 5)]
    return "\n\n".join(paragraphs)


def build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([make_text(4000, seed=1)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return fast


def build_llama(folder: Path, tokenizer, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """A 2-layer Llama with random weights, saved with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    initializer_range=0.3, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).to(dtype).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def train_briefly(model, tokenizer, steps: int = 150, seed: int = 2, text: str | None = None) -> None:
    """A few hundred steps of next-token training on ``text`` (English-like words by default), so that the model
    predicts better than chance."""
    text = make_text(20000, seed=seed) if text is None else text
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 65, (8,), generator=generator)
        batch = torch.stack([ids[s : s + 65] for s in starts])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def command_here(capsys, *argv: str) -> tuple[int, str, str]:
    """``ppl-audit ARGV`` run in this process (``main``, what the console script calls): its exit code, stdout and
    stderr, as the ``cli`` fixture answers (a refusal of argparse's, which ends the process, read as its code). A
    command of its own spends seconds importing what this process has imported; each kind of command is still run
    as users run it somewhere (``cli``)."""
    from flows.cli import main

    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys, *argv: str) -> str:
    """What ``ppl-audit ARGV`` run in-process says on stderr, checked to be one line with exit code 2 (bad input)."""
    code, _, err = command_here(capsys, *argv)
    err = err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def json_line(out: str, err: str = "", **loads) -> dict:
    """The last line of a ``--json`` command's stdout, parsed (``loads``: ``json.loads`` options); a clear
    failure, not an IndexError, where stdout is empty."""
    import json

    lines = out.strip().splitlines()
    assert lines, f"no JSON line on stdout; stderr ends: {err[-2000:]!r}"
    return json.loads(lines[-1], **loads)


def wait_for(check, timeout: float, what: str, every: float = 1.0, tolerate: tuple[type[BaseException], ...] = ()):
    """``check()``'s first truthy answer, asked every ``every`` seconds; an error in ``tolerate`` (or an HTTP
    error: a server still starting) counts as no answer."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
        except (httpx.HTTPError, *tolerate):
            found = None
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def dead_pid() -> int:
    """The pid of a process that has ended (as a killed writer's is)."""
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def place_prefect_database(database: Path, folder: Path) -> None:
    """A copy of ``database`` (conftest's ``prefect_database``) as ``folder``/prefect.db, where Prefect looks for it
    with PREFECT_HOME (or ppl-audit with its home) at ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(database, folder / "prefect.db")


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_config(path: Path, baseline: Path, corpus: Path, variants: list[dict], **sections) -> Path:
    """An audit YAML for a tiny model: small windows, a short stream."""
    import yaml

    config = {"name": sections.pop("name", "tiny"), "baseline": {"path": str(baseline)},
              "corpus": {"source": str(corpus)},
              "evaluation": {"window": 64, "stride": 32, "batch_size": 4, "max_tokens": 1500},
              "variants": variants, **sections}
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def stored_reference(model, stream, window: int, stride: int, source: Path, key: str, batch_size: int = 3):
    """Score ``model`` as an audit scores its baseline, writing its reference under ``key``; returns
    ``(Reference, PerplexityResult)``. The manifest holds what reading it back needs: a whole identity, but for a
    model named by ``key`` rather than by its files' digest."""
    from tasks.audit.reference import REFERENCE_FORMAT, Identity, Writer, building, environment, stream_digest
    from tasks.engine.perplexity import perplexity, scored_targets
    from tasks.engine.scoring_options import ScoreOptions, Windowing

    with building() as scratch:
        writer = Writer(scratch / key, scored_targets(stream, window, stride))
        writer.staging.mkdir()
        result = perplexity(model, stream, Windowing(window, stride), batch_size, ScoreOptions(keep_hidden=writer))
        identity = Identity(REFERENCE_FORMAT, key, key, stream_digest(stream), "sliding", window, stride, stream.bos,
                            str(model.dtype).removeprefix("torch."))
        manifest = {"identity": identity.as_dict(),
                    "environment": environment(model.device), "facts": {},
                    "source": str(source), "softcap": None}
        return writer.publish(key, manifest, result, model.get_output_embeddings(), replace=False), result


def rewrite_scores(folder: Path, change) -> None:
    """Give a stored reference the per-token NLL ``change(token_nll)`` as one written by another computation
    would hold it: its window sums, result and digests made to agree (all that ``Reference.damage`` checks)."""
    import json
    import math

    from tasks.audit import reference
    from tasks.core.files import file_digest

    with np.load(folder / reference.SCORES) as scores:
        arrays = {name: scores[name] for name in scores.files}
    arrays["token_nll"] = change(arrays["token_nll"])
    counts = arrays["window_tokens"]
    arrays["window_nll"] = np.add.reduceat(arrays["token_nll"].astype(np.float64), np.cumsum(counts) - counts)
    np.savez(folder / reference.SCORES, **arrays)
    manifest = json.loads((folder / reference.MANIFEST).read_text())
    nll_sum = float(arrays["window_nll"].sum())
    manifest["result"] |= {"nll_sum": nll_sum, "mean_nll": nll_sum / counts.sum(), "ppl": math.exp(nll_sum / counts.sum())}
    manifest["files"][reference.SCORES] = {"bytes": (folder / reference.SCORES).stat().st_size,
                                           "sha256": file_digest(folder / reference.SCORES)}
    manifest["digest"] = reference.manifest_digest(manifest)
    (folder / reference.MANIFEST).write_text(json.dumps(manifest))


def perturbed(model_dir: Path, dtype: torch.dtype = torch.float64, scale: float = 0.05, seed: int = 3):
    """The model in ``model_dir`` with Gaussian noise of ``scale`` on every weight: a variant that really differs."""
    from tasks.models.loading import load_model

    model = load_model(str(model_dir), dtype, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator, dtype=torch.float64).to(dtype) * scale)
    return model


def rewrite_gguf(source: Path, target: Path, quant_type: str | None = None, tokens: dict[int, str] | None = None,
                 leave_out: tuple[str, ...] = (), architecture: str | None = None) -> Path:
    """A copy of a GGUF file with every quantized tensor re-quantized to ``quant_type`` (gguf-py's own
    quantizer, from the dequantized values) and tokens ``{id: new text}`` renamed; float tensors as they are.
    ``tokens`` values that are ids take that token's text (a swap keeps every merge valid). Tensors whose names
    start with one of ``leave_out`` are not copied (``""``: none is, a metadata-only file). ``architecture``: the
    copy says it is one of these, its keys renamed to match."""
    import gguf

    reader = gguf.GGUFReader(source)
    was = reader.get_field("general.architecture").contents()
    writer = gguf.GGUFWriter(target, arch=architecture or was)
    qtype = gguf.GGMLQuantizationType[quant_type] if quant_type else None
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        value = field.contents()
        if field.name == "general.file_type" and qtype is not None:
            value = gguf.LlamaFileType[f"MOSTLY_{quant_type}"].value
        if field.name == "tokenizer.ggml.tokens" and tokens:
            value = [value[tokens[i]] if isinstance(tokens.get(i), int) else tokens.get(i, text)
                     for i, text in enumerate(value)]
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        name = f"{architecture}.{field.name.removeprefix(was + '.')}" if architecture and field.name.startswith(was + ".") \
            else field.name
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith(leave_out):
            continue
        if qtype is None or tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


# compressed-tensors' preset schemes as llm-compressor names them; W4A16 with 32-column groups (the preset's 128
# does not divide the test models' 128-wide layers into more than one group)
COMPRESSED_SCHEMES = {"W4A16": {"group_size": 32}, "W8A8": {}, "FP8_DYNAMIC": {}}


def _weight_range(weight: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max of a weight over each quantization group (channel, group of columns, or whole tensor)."""
    from compressed_tensors.quantization import QuantizationStrategy

    w = weight.detach().float()
    if args.strategy == QuantizationStrategy.CHANNEL:
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if args.strategy == QuantizationStrategy.GROUP:
        w = w.unflatten(1, (w.shape[1] // args.group_size, args.group_size))
        return w.amin(dim=-1), w.amax(dim=-1)
    return w.amin().reshape(1), w.amax().reshape(1)


def make_compressed(source: Path, target: Path, scheme: str) -> Path:
    """A compressed-tensors checkpoint of a float model, made with compressed-tensors' own API (llm-compressor
    0.14 pins transformers<=5.17 and cannot install beside ours): the preset scheme applied to every Linear but
    lm_head, weight scales from each group's min/max (weights need no calibration data; activations are dynamic),
    compressed in the scheme's format and saved with its quantization_config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams, is_module_quantized
    from transformers import AutoModelForCausalLM, AutoTokenizer

    chosen = preset_name_to_scheme(scheme, targets=["Linear"])
    chosen.weights = chosen.weights.model_copy(update=COMPRESSED_SCHEMES[scheme])
    config = QuantizationConfig(config_groups={"group_0": chosen}, ignore=["lm_head"],
                                quantization_status=QuantizationStatus.INITIALIZED)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    apply_quantization_config(model, config, show_progress=False)
    with torch.no_grad():
        for module in model.modules():
            if not is_module_quantized(module) or module.quantization_scheme.weights is None:
                continue
            args = module.quantization_scheme.weights
            scale, zero_point = calculate_qparams(*_weight_range(module.weight, args), args)
            update_offload_parameter(module, "weight_scale", scale.to(module.weight_scale.dtype))
            if hasattr(module, "weight_zero_point"):
                update_offload_parameter(module, "weight_zero_point", zero_point.to(module.weight_zero_point.dtype))
            module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def scored_log_probs(base, variant, stream, windows):
    """Each window alone through both models, in float64 over the whole vocabulary: yields, for every scored token
    in window order, its place in the stream and the baseline's and the variant's log-probabilities there."""
    for w in sorted(windows, key=lambda w: w.index):
        row = stream.ids[w.start : w.end][None]
        with torch.no_grad():
            lb = torch.log_softmax(base(row).logits[0].double(), -1)
            lv = torch.log_softmax(variant(row).logits[0].double(), -1)
        for q in range(w.first_scored, w.end):
            yield q, lb[q - w.start - 1], lv[q - w.start - 1]


class MlflowServer:
    """``mlflow server`` on 127.0.0.1 over a SQLite file that outlives restarts."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port, self.process = folder, free_port(), None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import os
        import subprocess
        import sys
        import time

        import httpx

        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{self.folder / 'server.db'}",
             "--artifacts-destination", str(self.folder / "artifacts")],
            env=env, stdout=open(self.folder / "server.log", "a"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.uri}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(1)
        raise AssertionError("mlflow server did not start")

    def stop(self) -> None:
        import os
        import signal

        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # gunicorn workers die with their group
            self.process.wait()


def audit_two_domains(folder: Path, baseline: Path, corpus: Path, name: str, **sections) -> tuple[dict, Path]:
    """Run, through the audit flow, an audit of ``baseline`` on two domains (``prose``: ``corpus``; ``other``: a text
    of its own) tracked to a SQLite store in ``folder`` with spooled records under ``folder/home``; ``sections``: its
    ``evaluation``, ``variants``, ``thresholds``, each domain's ``max_tokens`` (``prose_tokens``, ``other_tokens``).
    Returns (its summary, its record's folder)."""
    import pytest
    import yaml

    from flows.audit import audit, result_of

    other = folder / "other.txt"
    other.write_text(make_text(1500, seed=1))
    config = {"name": name, "baseline": {"path": str(baseline)},
              "corpora": [{"name": "prose", "source": str(corpus), "max_tokens": sections.pop("prose_tokens")},
                          {"name": "other", "source": str(other), "max_tokens": sections.pop("other_tokens")}],
              **sections, "tracking": {"uri": f"sqlite:///{folder / 'mlflow.db'}", "experiment": "tests"}}
    (folder / f"{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PPL_AUDIT_HOME", str(folder / "home"))
        summary = result_of(audit(config=str(folder / f"{name}.yaml"), return_state=True))
    [record_folder] = (folder / "home" / "synced").iterdir()
    return summary, record_folder


def only(result):
    """The one domain's result (``DomainResult``) of an audit of one corpus (``AuditResult``)."""
    [domain] = result.domains.values()
    return domain


def assert_reads_back(result, record: dict) -> None:
    """The audit's ``record`` read back (``from_record``) prints what its live ``result`` printed: every form of the
    console's answer and its JSON line, to the last digit."""
    from dataclasses import replace

    from tasks.record.answer import answer_json, answer_text
    from tasks.record.serial import from_record

    back = replace(from_record(record), record=result.record, mlflow_run_id=result.mlflow_run_id)
    for by_domain in (False, True):
        for stats in ("summary", "full"):
            assert answer_text(back, by_domain, stats) == answer_text(result, by_domain, stats), (by_domain, stats)
    assert answer_json(back) == answer_json(result)


def typed(flat: dict):
    """A comparison row as a record holds it (flat), read as the audit's typed row (``ModelRow``)."""
    from tasks.record.row import ModelRow

    return ModelRow.of_record(flat)


def flat(rows) -> list[dict]:
    """Typed comparison rows as a record holds them (flat): what a test reads by key. Each is read back into its
    typed value and written again to the same keys in the same order: what a record keeps of a row is all of it."""
    written = [row.as_record() for row in rows]
    for row in written:
        assert list(typed(row).as_record().items()) == list(row.items()), f"{row['variant']} does not read back"
    return written
