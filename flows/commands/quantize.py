"""``ppl-audit quantize``: make a GPTQ or AWQ checkpoint and announce it."""

from __future__ import annotations

import argparse
from pathlib import Path

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
    quantize.add_argument("--dynamic", metavar="FILE|MAPPING",
                          help="gptq: gptqmodel's per-module overrides, as YAML/JSON ('{\"-:.*lm_head\": {}}') or a "
                          "file: a variant's dynamic, or the recipe/gptqmodel-dynamic.json `ppl-audit tune` logs")


def run(args: argparse.Namespace) -> int:
    from flows.quantize import quantize_flow
    from tasks.config import CalibrationConfig, CorpusConfig, parse
    from tasks.models.quantize_request import QuantizeRequest, open_quantize
    from tasks.models.quantize_said import ManifestSaid

    corpus = parse(CorpusConfig, {"source": args.calibration, "column": args.text_column}, "--calibration")
    calibration = parse(CalibrationConfig, {"corpus": corpus, "samples": args.samples, "seq_len": args.seq_len,
                                            "seed": args.seed}, "arguments")
    if args.holdout_tokens < 0:
        raise InputError(f"--holdout-tokens {args.holdout_tokens}: give a number of tokens, 0 or more")
    # opened here, so that bad input ends before Prefect starts, and only here: the flow takes it as it is
    fields = {"model": args.model, "method": args.method, "bits": args.bits, "group_size": args.group_size,
              "sym": not args.asym, "calibration": calibration, "holdout_tokens": args.holdout_tokens, "out": args.out,
              "name": args.name, "dynamic": _dynamic(args)}
    request = open_quantize(parse(QuantizeRequest, fields, "arguments"))
    manifest = ManifestSaid.of_json(quantize_flow(request))
    overrides = f" with {len(request.dynamic)} per-module override{'s' * (len(request.dynamic) != 1)}" \
        if request.dynamic else ""
    print(f"{args.method} {args.bits}-bit g{args.group_size} checkpoint{overrides} in {request.out} "
          f"({manifest.calibration_samples} calibration samples, {manifest.seconds} s); "
          "emitted quantization.completed", file=console.out())
    return 0


def _dynamic(args: argparse.Namespace) -> object:
    """``--dynamic`` as written (checked as ``QuantizeRequest.dynamic``): a mapping given inline or in a file; of
    the file ``ppl-audit tune`` logs (bits and group size beside the overrides), its overrides, once its scheme is
    the command's."""
    import yaml

    from tasks.config import yaml_problem
    from tasks.models.quantize_said import DynamicRecipe

    if args.dynamic is None:
        return None
    try:
        a_file = Path(args.dynamic).is_file()
    except OSError:  # a name too long to be a file's: the mapping itself
        a_file = False
    try:
        text = Path(args.dynamic).read_text(encoding="utf-8") if a_file else args.dynamic
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"--dynamic {args.dynamic}: cannot be read ({error}); give a YAML or JSON file") from None
    try:
        given = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise InputError(f"--dynamic: not YAML or JSON ({yaml_problem(error)}); give a mapping such as "
                         "'{\"-:.*lm_head\": {}}' or a file") from None
    if isinstance(given, dict) and "dynamic" in given:  # tune's gptqmodel-dynamic.json
        recipe = DynamicRecipe.of_json(given)
        for key, flag, value in (("bits", "--bits", recipe.bits), ("group_size", "--group-size", recipe.group_size)):
            if value is not None and value != getattr(args, key):
                raise InputError(f"--dynamic: the recipe is for {key} {value} and the command's {flag} is "
                                 f"{getattr(args, key)}; give {flag} {value}")
        given = recipe.dynamic
    if isinstance(given, str):  # neither a file nor a mapping: most likely a file's name mistyped
        raise InputError(f"--dynamic {given}: no such file, nor a mapping; give tune's gptqmodel-dynamic.json or "
                         "'{\"-:.*lm_head\": {}}'")
    return given
