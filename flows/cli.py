"""The ``ppl-audit`` command line. Bad input ends with one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import traceback
from contextlib import suppress
from pathlib import Path
from typing import Literal, NoReturn, get_args, get_origin

from flows import lifetime
from tasks.core import console
from tasks.core.errors import InputError, NumericalError, one_line


def process_defaults() -> None:
    """The process's set-up, done once by the command line (and by the tests, which call flows directly):
    environment defaults the libraries read, and the loggers that are noise. A user's own setting wins."""
    import logging

    # Telemetry calls hang or fail without internet; users can still turn them back on.
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Prefect's local mode starts a temporary server; on 2 busy cores it can take longer than the 20 s default
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # A dead tracking server must not hang an audit for minutes (MLflow's default retries take ~4 min).
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    # bitsandbytes warns on every int8 forward that it casts inputs; once is news, every call is noise
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def _batch_size(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{value}' is not a whole number or auto") from None


def _field(model, name: str):
    """A config field's default and, for a ``Literal`` (or an optional one), its choices: the CLI's
    defaults and choice lists are the config's, written once."""
    info = model.model_fields[name]
    kinds = [info.annotation] if get_origin(info.annotation) is Literal else \
        [a for a in get_args(info.annotation) if a is not type(None)]
    if kinds and all(get_origin(kind) is Literal for kind in kinds):
        return info.default, [choice for kind in kinds for choice in get_args(kind)]
    return info.default, None


def _add_ppl(commands) -> None:
    from tasks.config import CorpusConfig, EvaluationConfig, VariantSpec

    def option(flag: str, model, name: str, **kwargs) -> None:
        default, choices = _field(model, name)
        ppl.add_argument(flag, default=default, choices=choices, **kwargs)

    ppl = commands.add_parser("ppl", help="perplexity of one model on one corpus")
    ppl.add_argument("--model", required=True, help="model folder, Hugging Face Hub id, or 'embedded'")
    ppl.add_argument("--corpus", required=True,
                     help="text file, folder of .txt, .jsonl/.parquet file, hf:DATASET, or 'embedded'")
    option("--text-column", CorpusConfig, "column", help="text column of JSONL/Parquet/HF sources")
    option("--hf-config", CorpusConfig, "hf_config", help="Hugging Face dataset config (e.g. wikitext-2-raw-v1)")
    option("--hf-split", CorpusConfig, "hf_split", help="Hugging Face dataset split")
    option("--joiner", CorpusConfig, "joiner", help="separator put between documents")
    option("--encoding", CorpusConfig, "encoding", help="text encoding of .txt/.jsonl corpora (e.g. latin-1)")
    option("--window", EvaluationConfig, "window", type=int, help="tokens per window (L)")
    option("--stride", EvaluationConfig, "stride", type=int, help="tokens each window moves (S); default L/2")
    option("--batch-size", EvaluationConfig, "batch_size", type=_batch_size,
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
    ppl.add_argument("--method", choices=_field(VariantSpec, "method")[1],
                     help="measure --model quantized this way (bnb/torchao/hqq at load, gptq/awq on the spot); "
                          "default auto: read from the checkpoint (a .gguf file, a quantization_config, or float)")
    ppl.add_argument("--variant", help="a variant spec: a YAML file or inline YAML, e.g. '{name: q, method: gptq, path: DIR}'")
    ppl.add_argument("--json", action="store_true", help="end stdout with one JSON line of the result")


def _add_quantize(commands) -> None:
    from tasks.config import (
        DEFAULT_BITS,
        DEFAULT_CALIBRATION,
        DEFAULT_GROUP_SIZE,
        QUANTIZED_BY_US,
        CorpusConfig,
        VariantSpec,
    )

    quantize = commands.add_parser("quantize", help="make a GPTQ or AWQ checkpoint from a model (gptqmodel)")
    quantize.add_argument("--model", required=True, help="model folder, Hub id, or 'embedded'")
    quantize.add_argument("--method", required=True, choices=QUANTIZED_BY_US)
    quantize.add_argument("--bits", type=int, default=DEFAULT_BITS, choices=_field(VariantSpec, "bits")[1])
    quantize.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE,
                          help="columns per quantization group (-1: per channel)")
    quantize.add_argument("--asym", action="store_true", help="asymmetric quantization (default symmetric)")
    quantize.add_argument("--calibration", required=True, help="calibration corpus (same forms as --corpus)")
    quantize.add_argument("--text-column", default=_field(CorpusConfig, "column")[0])
    quantize.add_argument("--samples", type=int, default=DEFAULT_CALIBRATION.samples, help="calibration sequences")
    quantize.add_argument("--seq-len", type=int, default=DEFAULT_CALIBRATION.seq_len, help="tokens per calibration sequence")
    quantize.add_argument("--seed", type=int, default=DEFAULT_CALIBRATION.seed)
    quantize.add_argument("--holdout-tokens", type=int, default=0,
                          help="never calibrate on the first N tokens (what an audit with max_tokens N scores)")
    quantize.add_argument("--out", required=True, help="folder for the quantized checkpoint")
    quantize.add_argument("--name", help="the variant's name in audits of this checkpoint (it picks the gate)")


def _add_notify(commands) -> None:
    from tasks.config import VariantSpec

    notify = commands.add_parser("notify", help="announce a checkpoint (quantization.completed) to the Prefect "
                                                "server at PREFECT_API_URL: `serve` audits it")
    notify.add_argument("--model", required=True, help="the checkpoint's folder, as the serving machine reads it")
    notify.add_argument("--method", choices=[m for m in _field(VariantSpec, "method")[1] if m != "baseline"],
                        help="how it was quantized (default: the checkpoint's manifest, else gptq)")
    notify.add_argument("--bits", type=int, help="informative")
    notify.add_argument("--name", help="the variant's name in the audit (it picks the gate)")
    notify.add_argument("--baseline", help="the model it was made from (default: the audit config's baseline)")


def _variant(args: argparse.Namespace):
    """The one model `ppl` measures: --variant, else --model with --method, as a validated spec."""
    import yaml

    from tasks.config import QUANTIZED_AT_LOAD, QUANTIZED_BY_US, VariantSpec, parse

    if args.variant:
        path = Path(args.variant)
        try:
            data = yaml.safe_load(path.read_text() if path.is_file() else args.variant)
        except yaml.YAMLError as error:
            raise InputError(f"--variant is not valid YAML: {str(error).splitlines()[0]}") from None
        return parse(VariantSpec, data, "--variant")
    method = args.method or "auto"
    name = (Path(args.model).name or args.model) if method in ("auto", "baseline") else method
    spec = {"name": name.replace("/", "_"), "method": method, "dtype": args.dtype, "device": args.device}
    if method not in QUANTIZED_BY_US + QUANTIZED_AT_LOAD:  # a checkpoint measured as it is, not made from --model
        spec["path"] = args.model
    return parse(VariantSpec, spec, "arguments")


def _ppl_settings(args: argparse.Namespace):
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


def run_ppl(args: argparse.Namespace) -> int:
    from tasks.audit.checkpoints import prepare
    from tasks.audit.scoring import score_variant
    from tasks.config import BaselineSpec
    from tasks.data.corpus import corpus_text
    from tasks.data.evaluation import evaluation
    from tasks.engine.model_facts import max_positions
    from tasks.engine.windows import check_window
    from tasks.models.loading import check_checkpoint
    from tasks.models.resolve import load_config, resolve_device, resolve_dtype

    spec = _variant(args)
    corpus, settings = _ppl_settings(args)
    resolve_dtype(spec.dtype, resolve_device(spec.device))
    text = corpus_text(corpus)
    check_window(settings.window, max_positions(load_config(spec.path or args.model)))
    lineup = prepare(BaselineSpec(name="baseline", path=args.model), [spec])
    [checkpoint] = lineup.variants
    if checkpoint.problem:
        raise InputError(checkpoint.problem)
    check_checkpoint(checkpoint.source or lineup.baseline.source)  # the files it loads: made from --model, or its own
    scored = evaluation(text, lineup.tokenizer, settings, progress=True)
    outcome = score_variant(checkpoint, lineup, scored, progress=True)
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


def run_quantize(args: argparse.Namespace) -> int:
    from flows.quantize import check_request, quantize_flow
    from tasks.config import CorpusConfig
    from tasks.data.corpus import corpus_text

    # checked here too, so that bad input ends before Prefect starts
    out = check_request(args.method, args.out, args.name, args.group_size)
    corpus_text(CorpusConfig(source=args.calibration, column=args.text_column))
    manifest = quantize_flow(model=args.model, method=args.method, out=str(out), calibration=args.calibration,
                             bits=args.bits, group_size=args.group_size, sym=not args.asym, column=args.text_column,
                             samples=args.samples, seq_len=args.seq_len, seed=args.seed,
                             holdout_tokens=args.holdout_tokens, name=args.name)
    print(f"{args.method} {args.bits}-bit g{args.group_size} checkpoint in {out} "
          f"({manifest['calibration']['samples']} calibration samples, {manifest['seconds']} s); "
          "emitted quantization.completed", file=console.out())
    return 0


def _checked_config(path: str, overrides: list[str]):
    """Load, validate and preflight an audit config: bad input ends here, before any model loads."""
    from tasks.audit.preflight import check_calibration_room, check_stream, preflight
    from tasks.config import load_audit_config
    from tasks.data.corpus import corpus_text

    config = load_audit_config(path, overrides)
    preflight(config)
    # read once more in the flow; a bad corpus is refused here, not there
    text = corpus_text(config.corpus)
    check_calibration_room(config, text, progress=True)
    check_stream(config, text)
    return config


def run_audit(args: argparse.Namespace) -> int:
    from flows.audit import audit, summary_json, summary_of

    _checked_config(args.config, args.set)
    state = audit(config=args.config, overrides=args.set, return_state=True)
    summary = summary_of(state)
    if summary is None:
        print(f"ppl-audit: audit failed: {state.message}", file=console.err())
        return 1
    verdict, say = summary["verdict"], console.out()
    print(summary["table"], file=say)
    if args.stats == "full":
        from tasks.record.verdict import format_stats

        print(f"\n{format_stats(summary['rows'])}\n", file=say)
    print(f"verdict: {verdict.status.upper()} — {verdict.reason}", file=say)
    print(f"record: {summary['record']}", file=say)
    if args.json:
        print(summary_json(summary), file=say)
    return 0 if verdict.status == "pass" else 1


def _duration(value: str) -> float:
    units = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
    if len(value) < 2 or value[-1] not in units or not value[:-1].replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"'{value}' is not an age; use a number and m, h, d or w, e.g. 30d")
    return float(value[:-1]) * units[value[-1]]


def _size(value: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number, unit = (value[:-1], value[-1].upper()) if value[-1:].upper() in units else (value, "")
    if not number.replace(".", "", 1).isdigit():
        raise argparse.ArgumentTypeError(f"'{value}' is not a size; use a number and K, M, G or T, e.g. 20G")
    return int(float(number) * units.get(unit, 1))


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB" if size >= 2**20 else f"{size / 2**10:,.0f} KiB"


def run_reference(args: argparse.Namespace) -> int:
    from tasks.audit import reference
    from tasks.core.places import references_dir
    from tasks.record.verdict import drift_text

    say = console.out()
    if args.action == "build":
        from flows.reference import build_reference
        from tasks.audit.preflight import check_stream, preflight
        from tasks.config import load_audit_config
        from tasks.data.corpus import corpus_text

        config = load_audit_config(args.config, args.set)
        preflight(config, variants=False)  # before Prefect starts: the baseline only
        check_stream(config, corpus_text(config.corpus))
        outcome = build_reference(config=args.config, overrides=args.set)
        if not outcome.ok:
            print(f"ppl-audit: failed: {outcome.name}: {outcome.reason}", file=console.err())
            return 1
        said, result = outcome.reference, outcome.result
        where = f"reference {said['key']} in {said['path']}" if said.get("path") else f"no reference: {said['problem']}"
        print(f"baseline {said['baseline']}: PPL {result.ppl:.4f} ± {result.ppl_stderr:.4f} over {result.n_tokens} "
              f"tokens; {where}", file=say)
        if said.get("drift"):
            print(drift_text(said["drift"]), file=say)
        return 0 if said.get("path") else 1
    if args.action == "ls":
        found = reference.stored()
        print(f"{'key':<17}{'created':<17}{'last used':<17}{'size':>10}  {'tokens':>8}  {'dtype':<9}{'device':<12}"
              "torch / transformers  model", file=say)
        for r in found:
            m = r.manifest
            print(f"{r.key:<17}{_when(m['created']):<17}{_when(r.last_used):<17}{_mib(r.size_bytes):>10}  "
                  f"{m['result']['n_tokens']:>8}  {m['identity']['dtype']:<9}{m['environment']['device'][:11]:<12}"
                  f"{m['environment'].get('torch')} / {m['environment'].get('transformers')}  {m['source']}", file=say)
        print(f"{len(found)} reference(s), {_mib(sum(r.size_bytes for r in found))} in {references_dir()}",
              file=say)
        return 0
    if args.action == "verify":
        return _verify_references(args.keys, args.all)
    if not (args.keys or args.all or args.older_than is not None or args.over is not None):
        raise InputError("reference rm: name the keys to remove (see `ppl-audit reference ls`), or give --all, "
                         "--older-than AGE or --over SIZE")
    found = {r.key: r for r in reference.stored()}
    unknown = [key for key in args.keys if key not in found]
    if unknown:
        raise InputError(f"reference rm: no reference {', '.join(unknown)}; `ppl-audit reference ls` lists them")
    removed = [found[key] for key in args.keys] if not args.all else list(found.values())
    for r in removed:
        reference.remove(r)
    if args.older_than is not None or args.over is not None:
        removed += reference.prune(args.older_than, args.over)
    print(f"removed {len(removed)} reference(s), {_mib(sum(r.manifest['size_bytes'] for r in removed))}"
          + "".join(f"\n  {r.key}" for r in removed), file=say)
    return 0


def _verify_references(keys: list[str], every: bool) -> int:
    """One line per reference: intact, or what is damaged; 1 when any is damaged."""
    from tasks.audit import reference

    if bool(keys) == every:
        raise InputError("reference verify: name the keys to check (see `ppl-audit reference ls`), or give --all")
    folders = reference.folders()
    unknown = [key for key in keys if key not in folders]
    if unknown:
        raise InputError(f"reference verify: no reference {', '.join(unknown)}; `ppl-audit reference ls` lists them")
    damaged = 0
    for key in keys or sorted(folders):
        try:
            problem = reference.verify(folders[key])
            said = f"DAMAGED: {problem}" if problem else "intact: files, result and NLL check out"
        except (InputError, OSError, ValueError) as error:  # the baseline's files, whose head it needs, are gone
            problem, said = None, f"files and result intact; NLL not checked: {one_line(error)}"
        damaged += problem is not None
        print(f"{key}  {said}", file=console.out())
    if damaged:
        print(f"{damaged} damaged: an audit never uses one; it removes it and scores the baseline again "
              "(or: ppl-audit reference rm KEY)", file=console.out())
    return 1 if damaged else 0


def _when(epoch: float) -> str:
    from datetime import datetime

    return f"{datetime.fromtimestamp(epoch):%Y-%m-%d %H:%M}"


def _add_reference(commands) -> None:
    reference = commands.add_parser("reference", help="stored baseline references: build, list, verify, remove")
    actions = reference.add_subparsers(dest="action", required=True)
    build = actions.add_parser("build", help="score an audit's baseline once and store its reference "
                                             "(audits then reuse it and load only their variants)")
    build.add_argument("config", help="audit YAML: its baseline, corpus and evaluation settings")
    build.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set baseline.rescore=always (repeatable)")
    build.add_argument("--verbose", action="store_true", help=VERBOSE)
    actions.add_parser("ls", help="list the stored references")
    verify = actions.add_parser("verify", help="check stored references: every file's digest, the result against "
                                               "the scores, the LM head on the hidden states against the NLL")
    verify.add_argument("keys", nargs="*", help="keys from `ppl-audit reference ls`")
    verify.add_argument("--all", action="store_true", help="check every reference")
    rm = actions.add_parser("rm", help="remove references by key, by age or to a size")
    rm.add_argument("keys", nargs="*", help="keys from `ppl-audit reference ls`")
    rm.add_argument("--all", action="store_true", help="remove every reference")
    rm.add_argument("--older-than", type=_duration, metavar="AGE", help="remove those unused for AGE (30d, 12h, ...)")
    rm.add_argument("--over", type=_size, metavar="SIZE",
                    help="remove the least recently used until the rest fit in SIZE (20G, 500M, ...)")


def run_serve(args: argparse.Namespace) -> int:
    from datetime import datetime

    from flows.serve import serve_config
    from tasks.audit.served import Policy

    config = _checked_config(args.config, [])
    missing = [folder for folder in args.allow if not Path(folder).is_dir()]
    if missing:
        raise InputError(f"--allow {missing[0]}: no such folder; give a folder served audits may read checkpoints from")
    # the serve's flow runs run in processes of its own, which inherit it; the Prefect API cannot set it
    os.environ.update(Policy.of(args.config, config, args.allow).environment())
    serve_config(args.config, lambda line: print(f"{datetime.now():%H:%M:%S} {line}", file=console.out(), flush=True))
    return 0


def run_ui(args: argparse.Namespace) -> int:
    import subprocess

    from mlflow import MlflowClient

    from tasks.core.places import default_uri, home
    from tasks.record.tracking import ui_link

    home().mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:  # before the address is printed: mlflow would fail with a page of traceback
        try:
            probe.bind(("127.0.0.1", args.port))
        except OSError as error:
            raise InputError(f"port {args.port} on 127.0.0.1 is taken ({error.strerror}); use --port with a free "
                             "one") from None
    url = f"http://127.0.0.1:{args.port}"
    experiments = []  # a store not made yet has none (and reading it would make it, with a page of logs)
    if (home() / "mlflow.db").exists():
        experiments = [e for e in MlflowClient(default_uri()).search_experiments() if e.name != "Default"]
    print(f"MLflow UI on {url} (store {default_uri()}); Ctrl-C stops it", flush=True)
    for experiment in experiments:
        print(f"  {experiment.name}: {ui_link(url, experiment.experiment_id)}", flush=True)
    mlflow = Path(sys.executable).parent / "mlflow"
    command = [str(mlflow), "server", "--host", "127.0.0.1", "--port", str(args.port), "--backend-store-uri",
               default_uri(), "--default-artifact-root", (home() / "mlartifacts").as_uri()]
    return subprocess.call(command)  # Ctrl-C: main says so, and the supervisor stops what the server started


def run_sync(args: argparse.Namespace) -> int:
    from tasks.record.spool import claim, damage, mark_synced, pending, quarantine, sweep_partials
    from tasks.record.tracking import replay

    sweep_partials()
    waiting = pending()
    synced = elsewhere = failed = damaged = 0
    for folder in waiting:
        with claim(folder) as state:
            if state != "mine":  # another sync, or an audit tracking its own record: not a failure
                elsewhere += 1
                print(f"{folder.name}: skipped, {'being synced' if state == 'busy' else 'synced'} by another process",
                      file=console.out())
                continue
            problem = damage(folder)
            if problem:  # it would fail every later sync too: set aside, as any damaged cache is
                damaged += 1
                print(f"ppl-audit: warning: {folder.name} is damaged ({problem}); moved to {quarantine(folder)}: "
                      "inspect its record.json, then move it back to the spool or delete it", file=console.err())
                continue
            try:
                run_id = replay(folder, args.tracking_uri)
            except Exception as error:  # keep going: each record is independent
                failed += 1
                print(f"{folder.name}: not synced ({type(error).__name__}: {one_line(error)[:200]})",
                      file=console.err())
                continue
            mark_synced(folder)
        synced += 1
        print(f"{folder.name}: synced as MLflow run {run_id}", file=console.out())
    others = (f", {elsewhere} by another process" if elsewhere else "") + (f", {damaged} damaged" if damaged else "")
    print(f"{synced} of {len(waiting)} spooled audit(s) synced{others}", file=console.out())
    return 1 if failed else 0


def run_notify(args: argparse.Namespace) -> int:
    from flows.notify import notify

    sent = notify(args.model, method=args.method, bits=args.bits, name=args.name, baseline=args.baseline)
    print(f"quantization.completed for {Path(args.model).resolve()} sent: event {sent}", file=console.out())
    return 0


def run_setup(args: argparse.Namespace) -> int:
    from tasks.data.embedded import ensure_embedded_corpus, ensure_embedded_model

    print(f"embedded model:  {ensure_embedded_model()}", file=console.out())
    print(f"embedded corpus: {ensure_embedded_corpus()}", file=console.out())
    return 0


# the commands (and `reference build`) whose library output goes to a log file: `serve`'s console is then what
# an operator reads (what is served, a line as each run starts and ends); `ui` is a service whose output is its log
LOGGED = ("ppl", "quantize", "run", "sync", "setup", "notify", "serve")
VERBOSE = "show library output (warnings, gptqmodel, Prefect) live on stderr; it is always in the log file"
LOG_BYTES = 256 * 2**20  # the oldest logs go beyond this


def _log_file(args: argparse.Namespace) -> Path:
    """``<home>/logs/<time>-<command>[-<config>]-<pid>.log``: one per command run, the oldest pruned."""
    from datetime import datetime

    from tasks.core.files import prune
    from tasks.core.places import log_dir

    folder = log_dir()
    if folder.is_dir():
        prune(folder, LOG_BYTES)
    about = f"-{Path(args.config).stem}" if getattr(args, "config", None) else ""
    return folder / f"{datetime.now():%Y%m%dT%H%M%S}-{args.command}{about}-{os.getpid()}.log"


class _Parser(argparse.ArgumentParser):
    """A wrong argument is one line, as any other bad input (argparse prints its usage block before it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _port(value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1 to 65535)")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ppl-audit", description="Audit quantized LLMs by perplexity.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_ppl(commands)
    _add_quantize(commands)
    run = commands.add_parser("run", help="run an audit flow from a YAML config")
    run.add_argument("config", help="audit YAML, e.g. configs/demo.yaml")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config value, e.g. --set evaluation.max_tokens=4096 (repeatable)")
    run.add_argument("--json", action="store_true", help="end stdout with one JSON line of the audit's result")
    run.add_argument("--stats", choices=("summary", "full"), default="summary",
                     help="full: after the table, llama-perplexity's statistics block for each variant (KL both "
                          "ways, its percentiles, Δp, same top token)")
    serve = commands.add_parser("serve", help="serve the audit deployment: cron schedule + quantization.completed trigger")
    serve.add_argument("config", help="audit YAML")
    serve.add_argument("--allow", action="append", default=[], metavar="DIR",
                       help="a folder whose checkpoints events may name (again for more); the config's own paths "
                            "and the cache's quantized checkpoints always are")
    ui = commands.add_parser("ui", help="start the MLflow UI on the local store (127.0.0.1)")
    ui.add_argument("--port", type=_port, default=5000)
    sync = commands.add_parser("sync", help="send spooled audits (tracking was down) to MLflow")
    sync.add_argument("--tracking-uri", help="default: each audit's configured URI, MLFLOW_TRACKING_URI, or the local store")
    commands.add_parser("setup", help="build the embedded model and corpus (once; cached)")
    _add_notify(commands)
    _add_reference(commands)
    for name in LOGGED:
        commands.choices[name].add_argument("--verbose", action="store_true", help=VERBOSE)
    return parser


HANDLERS = {"ppl": run_ppl, "quantize": run_quantize, "run": run_audit, "serve": run_serve, "ui": run_ui,
            "sync": run_sync, "setup": run_setup, "notify": run_notify, "reference": run_reference}


def main(argv: list[str] | None = None, capture: bool = False) -> int:
    """Run one command; returns its exit code.

    Args:
        capture: send library output to a log file under ``<home>/logs`` (named on stderr at the end),
            keeping the terminal for answers and progress bars. The console script does; tests calling
            ``main`` in-process do not, as it changes the process's stdout and stderr for good.
    """
    process_defaults()
    args = _parser().parse_args(argv)
    logged = args.command in LOGGED or getattr(args, "action", None) == "build"
    log = _log_file(args) if capture and logged else None
    if log is not None:
        try:
            console.capture(log, live=args.verbose)
        except OSError as error:
            print(f"ppl-audit: error: cannot write the log {log} ({error.strerror}); set PPL_AUDIT_HOME to a "
                  "folder you can write", file=sys.stderr)
            return 2
    code, started = 1, time.time()
    try:
        code = HANDLERS[args.command](args)
    except KeyboardInterrupt:  # the one signal Python turns into an exception
        code = 128 + signal.SIGINT
        print(interrupted(signal.SIGINT, started), file=console.err(), flush=True)
        lifetime.said()
    except SystemExit as stop:  # flows.lifetime stops a command so on SIGTERM and SIGHUP
        if isinstance(stop.code, int) and stop.code - 128 in (signal.SIGTERM, signal.SIGHUP):
            code = stop.code
            print(interrupted(signal.Signals(stop.code - 128), started), file=console.err(), flush=True)
            lifetime.said()
        raise
    except InputError as error:
        print(f"ppl-audit: error: {error}", file=console.err())
        code = 2
    except NumericalError as error:
        print(f"ppl-audit: failed: {error}", file=console.err())
    except Exception as error:
        if log is None:
            raise
        traceback.print_exc()  # into the log
        print(f"ppl-audit: crashed: {type(error).__name__}: {one_line(error)}", file=console.err())
    finally:
        console.settle()
        if log is not None and code == 2:  # bad input: the one line says it all, and no log is left behind
            log.unlink(missing_ok=True)
        elif log is not None:
            print(f"log: {log}", file=console.err())
    return code


def interrupted(signum: signal.Signals, started: float, how: str = "") -> str:
    """The one line an interrupted command ends with: which signal, and what it kept that later commands use
    (what was half-written is never picked up: references and records are renamed into place whole)."""
    from tasks.core.places import references_dir, spool_dir, synced_dir  # the standard library's only: said at once

    def since(root: Path, file: str) -> list[str]:  # folders put in place whole (not hidden), their file made since
        return sorted(found.parent.name for found in root.glob(f"[!.]*/{file}") if found.stat().st_mtime >= started)

    kept = [f"baseline reference {key}" for key in since(references_dir(), "manifest.json")]
    kept += [f"record {name} (in MLflow)" for name in since(synced_dir(), "record.json")]
    kept += [f"record {name} (spooled: ppl-audit sync sends it)" for name in since(spool_dir(), "record.json")]
    return f"ppl-audit: interrupted by {signum.name}{how}; kept: {', '.join(kept) if kept else 'nothing'}"


def entry() -> NoReturn:
    """The ``ppl-audit`` console script: ``main`` in a child that takes every process it started down with it,
    even when the process the user started is killed (flows/lifetime.py). Tests call ``main`` in-process."""
    from tasks.core.places import home

    # Prefect's local mode keeps its temporary server's database (every flow run, its parameters and logs) in
    # ~/.prefect; ours goes beside the audits' records, which PPL_AUDIT_HOME moves
    if "PREFECT_SERVER_DATABASE_CONNECTION_URL" not in os.environ:
        with suppress(OSError):  # an unwritable home is main's one line to say
            (home() / "prefect").mkdir(parents=True, exist_ok=True)
            os.environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{home() / 'prefect' / 'prefect.db'}"
    started = time.time()
    lifetime.run(lambda: main(capture=True), lambda signum: interrupted(
        signum, started, f" (killed: it had not stopped {lifetime.STOP_S:g} s later)"))


if __name__ == "__main__":
    entry()
