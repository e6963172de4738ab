"""The family matrix of #69: every architecture family users quantize, measured as a user would measure it.

Each family is a tiny model built from its transformers config with a fixed seed (tests/families.py), trained briefly
on English-like text made here (so quantizing has something to lose), saved with the tests' byte-level tokenizer, and
measured by ``ppl-audit ppl`` as a user runs it, a process per cell: float, then each method that quantizes it here. A cell is the figure
(PPL, its change against the family's own float, bits per weight: a method that leaves the experts' fused 3-D tensors
in float shows it there) or the one line the command ended with (a refusal, or a library's failure, named).

    .venv/bin/python benchmarks/families.py --out docs/families.md [--families llama qwen3_moe] [--methods hqq]

Run alone on the 2-core machine (each cell is a command's work: quantizing with gptqmodel takes seconds a family).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("torchao-int8", "bnb-int8", "bnb-nf4", "hqq", "gptq", "awq")
WINDOW, MAX_TOKENS = "128", "4096"
# gptq and awq quantize here with groups the tiny models' widths (32 and up) take, on a calibration their 512 positions
# hold; the others take no settings
SETTINGS = {method: f"{{name: {method}, method: {method}, group_size: 32, calibration: {{samples: 16, seq_len: 128}}}}"
            for method in ("gptq", "awq")}


def _made(folder: Path, only: list[str] | None, steps: int) -> tuple[Path, list[str]]:
    """The corpus and the trained models of the families (``only`` these) under ``folder``: made once, reused by a
    later run."""
    sys.path.insert(0, str(ROOT / "tests"))
    from families import FAMILIES, build_family
    from helpers import build_tokenizer, make_text, train_briefly

    folder.mkdir(parents=True, exist_ok=True)
    corpus = folder / "corpus.txt"
    if not corpus.exists():
        corpus.write_text(make_text(6000, seed=5))  # not the training text (seed 2)
    tokenizer = build_tokenizer(folder / "tokenizer")
    families = only or list(FAMILIES)
    for family in families:
        if not (folder / family / "config.json").exists():
            model = build_family(family)
            train_briefly(model, tokenizer, steps=steps)
            model.save_pretrained(folder / family)
            tokenizer.save_pretrained(folder / family)
    return corpus, families


def _cell(model: Path, corpus: Path, method: str | None) -> dict:
    """``ppl-audit ppl`` on ``model`` (quantized by ``method``; float when None), in a process of its own as a user
    runs it: its JSON result, or the line it ended with. Not in this process: gptqmodel's Defuser, once it has
    quantized or loaded an MoE checkpoint, changes how transformers builds every later MoE model of the process (a
    Mixtral loaded after a Qwen3-MoE quantized in the same process was refused, and loaded alone)."""
    argv = [sys.executable, "-m", "flows.cli", "ppl", "--model", str(model), "--corpus", str(corpus), "--window",
            WINDOW, "--max-tokens", MAX_TOKENS, "--json",
            *(["--variant", SETTINGS[method]] if method in SETTINGS else ["--method", method] if method else [])]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if done.returncode == 0:
        return {**json.loads(done.stdout.strip().splitlines()[-1]), "seconds": seconds}
    lines = [line for line in done.stderr.splitlines() if line.startswith("ppl-audit: ")]
    return {"said": (lines or done.stderr.strip().splitlines() or ["no output"])[-1], "code": done.returncode,
            "seconds": seconds}


def _text(cell: dict, float_ppl: float | None, notes: list[str]) -> str:
    """A cell: its PPL and change against the family's float, or a note's number (the line it ended with, below)."""
    if "said" in cell:
        said = cell["said"].removeprefix("ppl-audit: ").replace("|", "/")
        if said not in notes:
            notes.append(said)
        return f"{'refused' if cell['code'] == 2 else 'failed'} [{notes.index(said) + 1}]"
    change = "" if float_ppl is None else f" ({100 * (cell['ppl'] / float_ppl - 1):+.2f}%)"
    return f"{cell['ppl']:.3f}{change}"


def table(cells: dict[str, dict[str, dict]], methods: list[str]) -> str:
    """The matrix as markdown: a row per family, the float's PPL and each method's cell; what a cell ended with,
    numbered below it."""
    import importlib.metadata as meta

    versions = ", ".join(f"{name} {meta.version(name)}" for name in
                         ("torch", "transformers", "gptqmodel", "bitsandbytes", "hqq", "torchao"))
    notes: list[str] = []
    lines = [f"Measured {date.today()} on {platform.processor() or platform.machine()} ({versions}); window "
             f"{WINDOW}, {MAX_TOKENS} tokens; `benchmarks/families.py`.", "",
             "| family | float PPL | " + " | ".join(methods) + " |", "|---|---|" + "---|" * len(methods)]
    for family, row in cells.items():
        base = row["float"].get("ppl")
        lines.append(f"| {family} | {_text(row['float'], None, notes)} | " +
                     " | ".join(_text(row[method], base, notes) for method in methods) + " |")
    lines += ["", *(f"{number}. {said}" for number, said in enumerate(notes, 1))]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the matrix (markdown) here; else print it")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ppl-audit-families"), help="models and corpus")
    parser.add_argument("--families", nargs="*", help="these families only")
    parser.add_argument("--methods", nargs="*", default=list(METHODS), help="these methods only")
    parser.add_argument("--steps", type=int, default=150, help="training steps of each family's model")
    parser.add_argument("--again", action="store_true", help="write the matrix of the last run's cells (--work)")
    args = parser.parse_args()
    if args.again:
        _write(json.loads((args.work / "cells.json").read_text()), args)
        return
    corpus, families = _made(args.work, args.families, args.steps)
    cells: dict[str, dict[str, dict]] = {}
    for family in families:
        model = args.work / family
        cells[family] = {"float": _cell(model, corpus, None)}
        for method in args.methods:
            cells[family][method] = _cell(model, corpus, method)
            print(family, method, _text(cells[family][method], cells[family]["float"].get("ppl"), []),
                  f"{cells[family][method]['seconds']:.1f}s", file=sys.stderr, flush=True)
    (args.work / "cells.json").write_text(json.dumps(cells, indent=1, default=str))
    _write(cells, args)


def _write(cells: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    matrix = table(cells, args.methods)
    if args.out:
        args.out.write_text(matrix)
    print(matrix)


if __name__ == "__main__":
    main()
