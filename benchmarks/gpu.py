"""Everything a GPU session has to prove, in one command, with the kit built here beforehand (issue #37).

  bash .ci/gpu-kit                                       # here, on CPU: .kit/ (wheels, models, corpus)
  python3 benchmarks/gpu.py run --kit .kit --out $OUT     # there: tests/gpu, every GPU benchmark, one report
  .venv/bin/python benchmarks/gpu.py run --kit .kit --out DIR --dry-run   # here: what runs on CPU runs

``run`` writes ``gpu.json`` and ``gpu.md`` into ``--out``: the machine and library versions, the CUDA tests'
summary, each kit model's perplexity on CUDA and on CPU by method (with the kernel class each ran), and the peer
benchmark at the 1B shape. A part that needs CUDA is skipped on a machine without it, with the reason written
in its place. ``models DIR`` makes the kit's models (the kit script calls it): a briefly trained tiny Llama,
wide enough for the 4-bit kernels' tiles, and its GPTQ, AWQ and compressed-tensors checkpoints.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = "needs a CUDA GPU"
# method -> the kit's checkpoint it loads (None: the float model, quantized at load where the method says so)
METHODS = {"baseline": None, "gptq": "gptq", "awq": "awq", "compressed-tensors": "w4a16", "hqq": None,
           "bnb-int8": None, "bnb-nf4": None}
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, initializer_range=0.02)  # widths the Marlin/AWQ tiles (64, 128) divide


def make_models(folder: Path) -> None:
    """The kit's models and corpus, made here on CPU from a fixed seed (tests/helpers' builders)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import build_llama, build_tokenizer, make_compressed, make_text, train_briefly

    from tasks.data.corpus import tokenize
    from tasks.models.quantize import draw_calibration, quantize

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text(make_text(20000, seed=3))
    tokenizer = build_tokenizer(folder / "tokenizer")
    model = build_llama(folder / "float", tokenizer, **SHAPE)
    train_briefly(model, tokenizer, steps=300)
    model.save_pretrained(folder / "float")
    stream = tokenize(make_text(8000, seed=4), tokenizer)  # calibration: text the corpus does not hold
    calibration = draw_calibration(stream.ids, 32, 128, 0, "make_text(8000, seed=4)", stream.text_digest)
    for method in ("gptq", "awq"):
        quantize(str(folder / "float"), method, 4, 64, True, calibration, folder / method)
    make_compressed(folder / "float", folder / "w4a16", "W4A16")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def environment() -> dict:
    import torch
    import transformers

    found = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
             "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if _cuda() else "CPU only"}
    if _cuda():
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True)
        found["driver"] = smi.stdout.strip() or smi.stderr.strip()
    return found


def _script(arguments: list[str], timeout: float) -> dict:
    """Run one of the sibling benchmarks; its last stdout line is JSON."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if done.returncode:
        return {"failed": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}",
                "seconds": time.monotonic() - started}
    return {"rows": json.loads(done.stdout.strip().splitlines()[-1]), "seconds": time.monotonic() - started}


def cuda_tests() -> dict:
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-o",
                           "addopts="], capture_output=True, text=True, timeout=900, cwd=ROOT)
    return {"summary": done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:],
            "exit": done.returncode}


def quantized(kit: Path, device: str, max_tokens: int) -> dict:
    paths = [f"--path={method}={kit / 'models' / folder}" for method, folder in METHODS.items() if folder]
    return _script(["benchmarks/quantized.py", "--model", str(kit / "models" / "float"), "--corpus",
                    str(kit / "models" / "corpus.txt"), "--methods", *METHODS, *paths, "--device", device,
                    "--window", "256", "--stride", "128", "--max-tokens", str(max_tokens), "--batch-size", "8"],
                   timeout=900)


def peers() -> dict:
    return _script(["benchmarks/peers.py", "--model", "llama-1b", "--window", "2048", "--stride", "1024", "--windows",
                    "48", "--batch-sizes", "8", "16", "--repeats", "2", "--device", "cuda"], timeout=900)


def report(found: dict) -> str:
    lines = [f"# GPU run, {found['date']}", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in found["environment"].items()]
    lines += ["", f"CUDA tests: {found['cuda_tests'].get('summary', found['cuda_tests'].get('skipped'))}", ""]
    for device in ("cuda", "cpu"):
        part = found["quantized"][device]
        lines.append(f"## Kit models on {device}")
        if "rows" not in part:
            lines += [f"{part.get('skipped') or part.get('failed')}", ""]
            continue
        base = part["rows"][0]["ppl"]
        lines += ["", "| method | PPL | vs baseline | tok/s | kernel |", "|---|---|---|---|---|"]
        lines += [f"| {r['method']} | {r['ppl']:.5f} | {100 * (r['ppl'] / base - 1):+.2f}% | "
                  f"{r['tokens_per_second']:.0f} | {r['backend']} |" for r in part["rows"]] + [""]
    lines += ["## Peer benchmark, 1B shape", "", json.dumps(found["peers"].get("rows", found["peers"]))[:4000], ""]
    return "\n".join(lines)


def run(kit: Path, out: Path, dry_run: bool) -> dict:
    """Every part; a CUDA part without CUDA is skipped with its reason. Returns what ``gpu.json`` holds."""
    cuda = _cuda()
    if not cuda and not dry_run:
        raise SystemExit(f"benchmarks/gpu.py: error: {NO_CUDA} (no CUDA device visible); use --dry-run on CPU")
    found = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "environment": environment(),
             "kit": sorted(p.name for p in (kit / "wheels").glob("*.whl"))}
    found["cuda_tests"] = cuda_tests()  # without CUDA each says why it is skipped
    # on CPU the dry run scores a short stream: what is checked is that every method loads and scores
    found["quantized"] = {"cuda": quantized(kit, "cuda", 16384) if cuda else {"skipped": NO_CUDA},
                          "cpu": quantized(kit, "cpu", 16384 if cuda else 1024)}
    found["peers"] = peers() if cuda else {"skipped": NO_CUDA}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps(found, indent=1))
    (out / "gpu.md").write_text(report(found))
    for part in ("cuda_tests", "peers"):
        print(f"{part}: {found[part].get('skipped') or found[part].get('summary') or 'done'}")
    for device, part in found["quantized"].items():
        said = part.get("skipped") or part.get("failed") or f"{len(part['rows'])} methods scored"
        print(f"kit models on {device}: {said}")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", required=True)
    models = actions.add_parser("models", help="make the kit's models and corpus (on CPU, here)")
    models.add_argument("folder", type=Path)
    go = actions.add_parser("run", help="the CUDA tests, the benchmarks and the report")
    go.add_argument("--kit", type=Path, default=ROOT / ".kit")
    go.add_argument("--out", type=Path, required=True)
    go.add_argument("--dry-run", action="store_true", help="on a machine without CUDA: run what runs, skip the rest")
    args = parser.parse_args()
    if args.action == "models":
        make_models(args.folder)
    else:
        run(args.kit, args.out, args.dry_run)


if __name__ == "__main__":
    main()
