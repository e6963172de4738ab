"""``ppl-audit quantize``: make a GPTQ or AWQ checkpoint and announce it."""

from __future__ import annotations

import argparse

from flows.commands.arguments import config_field
from tasks.core import console
from tasks.core.errors import InputError

NAME, LOGGED = "quantize", True


def add(commands) -> None:
    from tasks.config import (
        DEFAULT_BITS,
        DEFAULT_CALIBRATION,
        DEFAULT_GROUP_SIZE,
        QUANTIZED_BY_US,
        CorpusConfig,
        VariantSpec,
    )

    quantize = commands.add_parser(NAME, help="make a GPTQ or AWQ checkpoint from a model (gptqmodel)")
    quantize.add_argument("--model", required=True, help="model folder, Hub id, or 'embedded'")
    quantize.add_argument("--method", required=True, choices=QUANTIZED_BY_US)
    quantize.add_argument("--bits", type=int, default=DEFAULT_BITS, choices=config_field(VariantSpec, "bits")[1])
    quantize.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE,
                          help="columns per quantization group (-1: per channel)")
    quantize.add_argument("--asym", action="store_true", help="asymmetric quantization (default symmetric)")
    quantize.add_argument("--calibration", required=True, help="calibration corpus (same forms as --corpus)")
    quantize.add_argument("--text-column", default=config_field(CorpusConfig, "column")[0])
    quantize.add_argument("--samples", type=int, default=DEFAULT_CALIBRATION.samples, help="calibration sequences")
    quantize.add_argument("--seq-len", type=int, default=DEFAULT_CALIBRATION.seq_len, help="tokens per calibration sequence")
    quantize.add_argument("--seed", type=int, default=DEFAULT_CALIBRATION.seed)
    quantize.add_argument("--holdout-tokens", type=int, default=0,
                          help="never calibrate on the first N tokens (what an audit with max_tokens N scores)")
    quantize.add_argument("--out", required=True, help="folder for the quantized checkpoint")
    quantize.add_argument("--name", help="the variant's name in audits of this checkpoint (it picks the gate)")


def run(args: argparse.Namespace) -> int:
    from flows.quantize import quantize_flow
    from tasks.config import CalibrationConfig, CorpusConfig, parse
    from tasks.models.quantize_request import QuantizeRequest, open_quantize

    corpus = parse(CorpusConfig, {"source": args.calibration, "column": args.text_column}, "--calibration")
    calibration = parse(CalibrationConfig, {"corpus": corpus, "samples": args.samples, "seq_len": args.seq_len,
                                            "seed": args.seed}, "arguments")
    if args.holdout_tokens < 0:
        raise InputError(f"--holdout-tokens {args.holdout_tokens}: give a number of tokens, 0 or more")
    # opened here, so that bad input ends before Prefect starts, and only here: the flow takes it as it is
    request = open_quantize(QuantizeRequest(model=args.model, method=args.method, bits=args.bits,
                                            group_size=args.group_size, sym=not args.asym, calibration=calibration,
                                            holdout_tokens=args.holdout_tokens, out=args.out, name=args.name))
    manifest = quantize_flow(request)
    print(f"{args.method} {args.bits}-bit g{args.group_size} checkpoint in {request.out} "
          f"({manifest['calibration']['samples']} calibration samples, {manifest['seconds']} s); "
          "emitted quantization.completed", file=console.out())
    return 0
