"""``ppl-audit ppl``: the perplexity of one model on one corpus, as an audit scores it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flows.commands.arguments import batch_size_argument, config_field
from tasks.core import console
from tasks.core.errors import InputError

NAME, LOGGED = "ppl", True


def add(commands) -> None:
    from tasks.config import CorpusConfig, EvaluationConfig, VariantSpec

    def option(flag: str, model, name: str, **kwargs) -> None:
        default, choices = config_field(model, name)
        ppl.add_argument(flag, default=default, choices=choices, **kwargs)

    ppl = commands.add_parser(NAME, help="perplexity of one model on one corpus")
    ppl.add_argument("--model", required=True, help="model folder, Hugging Face Hub id, or 'embedded'")
    ppl.add_argument("--corpus", required=True,
                     help="text file, folder of .txt, .jsonl/.parquet file, hf:DATASET, 'embedded' (Austen) or "
                          "embedded:NAME (python, russian, chinese)")
    option("--text-column", CorpusConfig, "column", help="text column of JSONL/Parquet/HF sources")
    option("--hf-config", CorpusConfig, "hf_config", help="Hugging Face dataset config (e.g. wikitext-2-raw-v1)")
    option("--hf-split", CorpusConfig, "hf_split", help="Hugging Face dataset split")
    option("--joiner", CorpusConfig, "joiner", help="separator put between documents")
    option("--encoding", CorpusConfig, "encoding", help="text encoding of .txt/.jsonl corpora (e.g. latin-1)")
    option("--window", EvaluationConfig, "window", type=int, help="tokens per window (L)")
    option("--stride", EvaluationConfig, "stride", type=int, help="tokens each window moves (S); default L/2")
    option("--batch-size", EvaluationConfig, "batch_size", type=batch_size_argument,
           help="windows per forward pass, or auto (searched once per model, window and device)")
    option("--bos", EvaluationConfig, "bos",
           help="BOS policy; default: each mode's own (sliding: 'stream' when the tokenizer has a BOS token; "
                "gptq: 'none'; llama.cpp: 'stream' when the tokenizer adds BOS, else 'none')")
    option("--max-tokens", EvaluationConfig, "max_tokens", type=int, help="truncate the token stream to this many tokens")
    option("--chunks", EvaluationConfig, "chunks", type=int,
           help="gptq/llama.cpp modes: score the first N chunks (llama-perplexity --chunks)")
    option("--mode", EvaluationConfig, "mode",
           help="sliding window (default), or a published convention: gptq (GPTQ/AWQ papers), llama.cpp")
    option("--device", VariantSpec, "device", help="cpu, cuda, cuda:N or auto")
    option("--dtype", VariantSpec, "dtype", help="weights' dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    option("--runtime", VariantSpec, "runtime", help="what scores a .gguf file: transformers (dequantized) or "
           "llama.cpp (its own kernels and tokenizer, as served)")
    ppl.add_argument("--method", choices=config_field(VariantSpec, "method")[1],
                     help="measure --model quantized this way (bnb/torchao/hqq at load, gptq/awq on the spot); "
                          "default auto: read from the checkpoint (a .gguf file, a quantization_config, or float)")
    ppl.add_argument("--variant", help="a variant spec: a YAML file or inline YAML, e.g. '{name: q, method: gptq, path: DIR}'")
    ppl.add_argument("--json", action="store_true", help="end stdout with one JSON line of the result")


def _variant(args: argparse.Namespace):
    """The one model `ppl` measures: --variant, else --model with --method, as a validated spec."""
    import yaml

    from tasks.config import VariantSpec, parse, read_yaml, yaml_problem
    from tasks.methods.registry import method_of

    if args.variant:
        path = Path(args.variant)
        try:
            data = read_yaml(path.read_text() if path.is_file() else args.variant, "--variant")
        except yaml.YAMLError as error:
            raise InputError(f"--variant is not valid YAML: {yaml_problem(error)}") from None
        return parse(VariantSpec, data, "--variant")
    method = args.method or "auto"  # one of the registry's: --method's choices are the config's methods
    backend = method_of(method)
    name = (Path(args.model).name or args.model) if backend.detected or backend.float_model else method
    # a checkpoint measured as it is has --model as its path; one made from --model has none
    path = None if backend.quantized_here or backend.quantized_at_load else args.model
    return parse(VariantSpec, {"name": name.replace("/", "_"), "method": method, "path": path, "dtype": args.dtype,
                               "device": args.device, "runtime": args.runtime}, "arguments")


def _settings(args: argparse.Namespace):
    """The corpus and evaluation settings of `ppl`, validated as an audit's are (one line per mistake)."""
    from tasks.config import CorpusConfig, EvaluationConfig, parse

    corpus = parse(CorpusConfig, {"source": args.corpus, "column": args.text_column, "hf_config": args.hf_config,
                                  "hf_split": args.hf_split, "joiner": args.joiner, "encoding": args.encoding},
                   "arguments")
    # `ppl` measures one model: nothing is kept for a KL it does not take
    settings = parse(EvaluationConfig, {"window": args.window, "stride": args.stride, "batch_size": args.batch_size,
                                        "bos": args.bos, "max_tokens": args.max_tokens, "chunks": args.chunks,
                                        "mode": args.mode, "divergence": False}, "arguments")
    return corpus, settings


def run(args: argparse.Namespace) -> int:
    from tasks.audit.checkpoints import prepare
    from tasks.audit.scoring import variant_outcome
    from tasks.config import BaselineSpec
    from tasks.data.corpus import corpus_text
    from tasks.data.evaluation import evaluation
    from tasks.models.resolve import device_and_dtype

    spec = _variant(args)
    corpus, settings = _settings(args)
    device_and_dtype(spec)  # a device or dtype this machine lacks is said before anything loads
    text = corpus_text(corpus)
    lineup = prepare(BaselineSpec(name="baseline", path=args.model), [spec])  # each model found once
    [checkpoint] = lineup.variants
    _check(args, spec, lineup, settings.window)
    scored = evaluation(text, _stream_tokenizer(lineup, checkpoint, settings.mode), settings, progress=True)
    outcome = variant_outcome(checkpoint, lineup, scored, progress=True)
    if not outcome.ok:
        print(f"ppl-audit: failed: {spec.name}: {outcome.reason}", file=console.err())
        return 1
    result = outcome.result
    per_byte = f"{result.bits_per_byte:.4f} bits/byte, " if result.bits_per_byte is not None else ""
    say = console.out()
    print(f"{spec.name}: PPL {result.ppl:.4f} ± {result.ppl_stderr:.4f} over {result.n_tokens} tokens "
          f"(mean NLL {result.mean_nll:.5f}, {per_byte}{result.tokens_per_second:.0f} tok/s, {outcome.facts.backend})",
          file=say)
    for figure, why in result.absent.items():
        print(f"{spec.name}: no {figure}: {why}", file=say)
    if args.json:
        print(json.dumps({**result.summary(), "name": spec.name, "model": spec.path or args.model,
                          "method": spec.method, "variant": outcome.facts.summary()}), file=say)
    return 0


def _check(args: argparse.Namespace, spec, lineup, window: int) -> None:
    """What would stop the variant scoring, said before it loads: a window past its positions, a group size no
    kernel could score when it is quantized here, a problem finding it, files it cannot load."""
    from tasks.audit.preflight import check_kv_cache
    from tasks.engine.model_facts import check_logits, max_positions
    from tasks.engine.windows import check_window
    from tasks.models.loading import check_checkpoint
    from tasks.models.quantize import check_group_fits

    [checkpoint] = lineup.variants
    if checkpoint.model is not None or not checkpoint.problem:
        config = (checkpoint.model or lineup.baseline.model).config
        check_logits(config, args.model)
        check_window(window, max_positions(config))
        if spec.kv_cache is not None:
            check_kv_cache(spec, config)
    if spec.quantize_here:  # made from --model here: a group size no kernel could score is refused now
        try:
            check_group_fits(lineup.baseline.model, spec.method, spec.quantization[1])
        except InputError as error:
            raise InputError(f"--method {spec.method} quantizes {args.model} here: {error} in --variant "
                             f"'{{name: {spec.method}, method: {spec.method}, group_size: N}}'; to measure a "
                             f"{spec.method} checkpoint as it is, leave --method out") from None
    if checkpoint.problem:
        raise InputError(checkpoint.problem)
    check_checkpoint(checkpoint.model or lineup.baseline.model)  # the files it loads: made from --model, or its own


def _stream_tokenizer(lineup, checkpoint, mode: str):
    """What tokenizes the corpus: llama.cpp's tokenizer of a GGUF file that llama.cpp runs or that ``--mode llama.cpp``
    scores (llama-perplexity's stream, on any text), else the model's transformers tokenizer. Without the llama.cpp
    runtime installed, ``--mode llama.cpp`` keeps transformers' and says so."""
    from tasks.audit.checkpoints import served_tokenizer

    source = checkpoint.model.source if checkpoint.model is not None else ""
    if lineup.transformers_tokenizer is not None or mode != "llama.cpp" or not source.endswith(".gguf"):
        return lineup.tokenizer
    return served_tokenizer(Path(source), checkpoint.tokenizer) or lineup.tokenizer
