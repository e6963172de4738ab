"""The ``ppl-audit`` command line. Bad input ends with one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tasks.errors import InputError, NumericalError


def _offline_defaults() -> None:
    # Telemetry calls hang or fail without internet; users can still turn them back on.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _add_ppl(commands) -> None:
    ppl = commands.add_parser("ppl", help="perplexity of one model on one corpus")
    ppl.add_argument("--model", required=True, help="model folder, Hugging Face Hub id, or 'embedded'")
    ppl.add_argument("--corpus", required=True,
                     help="text file, folder of .txt, .jsonl/.parquet file, hf:DATASET, or 'embedded'")
    ppl.add_argument("--text-column", default="text", help="text column of JSONL/Parquet/HF sources")
    ppl.add_argument("--hf-config", help="Hugging Face dataset config (e.g. wikitext-2-raw-v1)")
    ppl.add_argument("--hf-split", default="test", help="Hugging Face dataset split")
    ppl.add_argument("--joiner", default="\n\n", help="separator put between documents")
    ppl.add_argument("--window", type=int, default=512, help="tokens per window (L)")
    ppl.add_argument("--stride", type=int, help="tokens each window moves (S); default L/2")
    ppl.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
    ppl.add_argument("--bos", choices=["none", "stream", "window"],
                     help="BOS policy; default 'stream' when the tokenizer has a BOS token")
    ppl.add_argument("--max-tokens", type=int, help="truncate the token stream to this many tokens")
    ppl.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    ppl.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 or float64")
    ppl.add_argument("--json", action="store_true", help="end stdout with one JSON line of the result")


def run_ppl(args: argparse.Namespace) -> int:
    from tasks.corpus import CorpusSpec, corpus_text, tokenize
    from tasks.models import load_config, load_model, load_tokenizer, max_positions, resolve_device, resolve_dtype
    from tasks.perplexity import check_settings, perplexity

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    stride = args.stride if args.stride is not None else args.window // 2
    positions = max_positions(load_config(args.model))
    tokenizer = load_tokenizer(args.model)
    spec = CorpusSpec(args.corpus, args.text_column, args.hf_config, args.hf_split, args.joiner)
    stream = tokenize(corpus_text(spec), tokenizer, args.bos, args.max_tokens, progress=True)
    check_settings(args.window, stride, args.batch_size, stream, positions)
    model = load_model(args.model, dtype, device)
    result = perplexity(model, stream, args.window, stride, args.batch_size, progress=True, model_name=args.model)
    print(f"{args.model}: PPL {result.ppl:.4f} ± {result.ppl_stderr:.4f} over {result.n_tokens} tokens "
          f"(mean NLL {result.mean_nll:.5f}, {result.bits_per_byte:.4f} bits/byte, "
          f"{result.tokens_per_second:.0f} tok/s)")
    if args.json:
        print(json.dumps(result.summary()))
    return 0


def run_setup(args: argparse.Namespace) -> int:
    from tasks.embedded import ensure_embedded_corpus, ensure_embedded_model

    print(f"embedded model:  {ensure_embedded_model()}")
    print(f"embedded corpus: {ensure_embedded_corpus()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    _offline_defaults()
    parser = argparse.ArgumentParser(prog="ppl-audit", description="Audit quantized LLMs by perplexity.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_ppl(commands)
    commands.add_parser("setup", help="build the embedded model and corpus (once; cached)")
    args = parser.parse_args(argv)
    handlers = {"ppl": run_ppl, "setup": run_setup}
    try:
        return handlers[args.command](args)
    except InputError as error:
        print(f"ppl-audit: error: {error}", file=sys.stderr)
        return 2
    except NumericalError as error:
        print(f"ppl-audit: failed: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
