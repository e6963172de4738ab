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
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = "needs a CUDA GPU"
# variant (NAME=METHOD[:KERNEL][+kv:DTYPE], benchmarks/quantized.py) -> the kit's checkpoint it loads (None: the float
# model, quantized at load where the method says so). The kernels that need no build come first, each named; on an
# H200 gptqmodel's own choice for AWQ built Marlin with nvcc for two minutes, and for GPTQ (Machete) downloaded
# CUTLASS, which fails offline (docs/gpu.md): GPTQ's own choice comes last, to show the line it fails with, and
# AWQ's is left to the CPU. bitsandbytes is carried with its CUDA 13.0 library alone (the wheel holds eleven).
METHODS = {"baseline": None, "gptq-triton=gptq:triton": "gptq", "gptq-torch=gptq:torch": "gptq",
           "awq-torch=awq:torch_awq": "awq", "awq-triton=awq:gemm_triton": "awq",
           "ct-w4a16=compressed-tensors": "w4a16", "ct-w8a8=compressed-tensors": "w8a8",
           "ct-fp8=compressed-tensors": "fp8_dynamic", "fp8": "fp8", "hqq": None, "nf4=bnb-nf4": None,
           "int8=bnb-int8": None, "kv-int8=baseline+kv:int8": None, "kv-int4=baseline+kv:int4": None,
           "kv-fp8=baseline+kv:fp8_e4m3": None, "gptq": "gptq", "awq": "awq"}
CUDA_ONLY = ("fp8", "gptq-triton=gptq:triton", "awq-triton=awq:gemm_triton")  # no CPU kernel
CPU_ONLY = ("awq",)  # on CUDA gptqmodel's choice builds Marlin with nvcc at first use (two minutes)
SYNTHESIZED = {  # the METHODS a part at a larger shape makes and times, by device
    "cuda": ("gptq-triton=gptq:triton", "awq-triton=awq:gemm_triton", "awq-torch=awq:torch_awq",
             "ct-w4a16=compressed-tensors", "ct-w8a8=compressed-tensors", "ct-fp8=compressed-tensors", "fp8"),
    "cpu": ("gptq-torch=gptq:torch", "awq-torch=awq:torch_awq", "ct-w4a16=compressed-tensors",
            "ct-fp8=compressed-tensors", "gptq", "awq")}
TRAINING_STEPS = 300  # the kit's model's: far enough from chance that a broken kernel's perplexity is far off
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, initializer_range=0.02)  # widths the Marlin/AWQ tiles (64, 128) divide


def block_fp8(source: Path, target: Path, block: int = 128) -> None:
    """A transformers fine-grained FP8 checkpoint of a float model (DeepSeek-V3's layout, which transformers
    loads): each decoder Linear's weight in float8_e4m3fn by ``block`` x ``block`` tiles, with the tile's
    ``weight_scale_inv`` (amax / 448) that multiplies it back; made by hand, since transformers quantizes to FP8
    only on a GPU."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(source / "model.safetensors")
    out = {}
    for name, w in weights.items():
        if name.endswith("_proj.weight"):
            rows, cols = w.shape[0] // block, w.shape[1] // block
            tiles = w.float().reshape(rows, block, cols, block)
            scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
            out[name] = (tiles / scale[:, None, :, None]).reshape(w.shape).to(torch.float8_e4m3fn)
            out[name.removesuffix("weight") + "weight_scale_inv"] = scale
        else:
            out[name] = w
    target.mkdir(parents=True, exist_ok=True)
    save_file(out, target / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [block, block]}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / extra, target / extra)


def make_models(folder: Path, steps: int = TRAINING_STEPS) -> None:
    """The kit's models and corpus, made here on CPU from a fixed seed (tests/helpers' builders), the float model
    trained ``steps`` steps."""
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers import build_llama, build_tokenizer, make_compressed, make_text, train_briefly

    from tasks.data.corpus import tokenize
    from tasks.models.quantize import Scheme, draw_calibration, quantize
    from tasks.models.resolve import load_tokenizer, locate_model

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text(make_text(20000, seed=3))
    tokenizer = build_tokenizer(folder / "tokenizer")
    model = build_llama(folder / "float", tokenizer, **SHAPE)
    train_briefly(model, tokenizer, steps=steps)
    model.save_pretrained(folder / "float")
    stream = tokenize(make_text(8000, seed=4), tokenizer)  # calibration: text the corpus does not hold
    calibration = draw_calibration(stream.ids, 32, 128, 0, "make_text(8000, seed=4)", stream.text_digest)
    for method in ("gptq", "awq"):
        quantize(locate_model(str(folder / "float")), Scheme(method, 4, 64, True), calibration, folder / method,
                 load_tokenizer(str(folder / "float")))
    for scheme in ("W4A16", "W8A8", "FP8_DYNAMIC"):
        make_compressed(folder / "float", folder / scheme.lower(), scheme)
    block_fp8(folder / "float", folder / "fp8")


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


class Schedule:
    """Every part in turn against one deadline: a device session is short, so a part gets what is left (at most
    its own limit), and ``gpu.json``/``gpu.md`` are written after each, so a run stopped halfway keeps what it
    measured."""

    def __init__(self, out: Path, found: dict, budget: float, only: list[str] | None = None):
        self.out, self.found, self.deadline, self.only = out, found, time.monotonic() + budget, only
        out.mkdir(parents=True, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def part(self, key: str, arguments: list[str] | None, limit: float, reason: str = "") -> None:
        """Run a sibling script (its last stdout line is JSON), or record ``reason`` where ``arguments`` is None."""
        if self.only and key not in self.only:
            return
        if arguments is None:
            self.found[key] = {"skipped": reason}
        elif self.left() < 20:
            self.found[key] = {"skipped": "out of time"}
        else:
            self.found[key] = _script(key, arguments, min(limit, self.left() - 5), self.out)
        part = self.found[key]
        print(f"{key}: {part.get('skipped') or part.get('failed') or 'done'} ({part.get('seconds', 0):.0f} s)",
              flush=True)
        (self.out / "gpu.json").write_text(json.dumps(self.found, indent=1))
        (self.out / "gpu.md").write_text(report(self.found))


def _script(key: str, arguments: list[str], timeout: float, out: Path) -> dict:
    """Run ``arguments`` with this Python, its output kept in ``out/KEY.log``; the last stdout line is JSON."""
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, *arguments], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as stopped:
        _log(out, key, _text(stopped.stdout) + _text(stopped.stderr))
        return {"failed": f"stopped after {timeout:.0f} s", "seconds": time.monotonic() - started,
                "printed": _text(stopped.stdout)[-3000:]}
    _log(out, key, done.stdout + done.stderr)
    seconds = time.monotonic() - started
    if done.returncode:
        return {"failed": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-3:]}", "seconds": seconds}
    last = done.stdout.strip().splitlines()[-1]
    try:
        return {"rows": json.loads(last), "seconds": seconds}
    except json.JSONDecodeError:  # pytest: its summary line
        return {"summary": last, "seconds": seconds}


def _log(out: Path, key: str, text: str) -> None:
    """Every part's output in one file: a device run brings back only a few files."""
    with (out / "logs.txt").open("a") as log:
        log.write(f"\n===== {key} =====\n{text}")


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def quantized_arguments(kit: Path, device: str, max_tokens: int) -> list[str]:
    methods = [m for m in METHODS if m not in (CPU_ONLY if device == "cuda" else CUDA_ONLY)]
    paths = [f"--path={m.partition('=')[0]}={kit / 'models' / METHODS[m]}" for m in methods if METHODS[m]]
    return ["benchmarks/quantized.py", "--model", str(kit / "models" / "float"), "--corpus",
            str(kit / "models" / "corpus.txt"), "--methods", *methods, *paths, "--device", device,
            "--window", "256", "--stride", "128", "--max-tokens", str(max_tokens), "--batch-size", "8"]


def body_arguments(model: str, window: int, windows: int, batch: int, bodies: list[str], peers: bool) -> list[str]:
    return ["benchmarks/body.py", "--model", model, "--window", str(window), "--stride", str(window // 2),
            "--windows", str(windows), "--batch-size", str(batch), "--bodies", *bodies] + (["--peers"] if peers else [])


def profile_arguments(model: str, window: int, windows: int, batch: int, chunks: list[int], modes: list[str]):
    return ["benchmarks/profile_body.py", "--model", model, "--window", str(window), "--windows", str(windows),
            "--batch-size", str(batch), "--chunks-mib", *map(str, chunks), "--modes", *modes]


def formats(kit: Path, device: str) -> list[str]:
    """``NAME=CHECKPOINT[:KERNEL]`` of the kit's checkpoints, for a synthesized model of a larger shape (making and
    loading each takes seconds at 1B): gptqmodel's own kernel choices and, on CUDA, Triton's, on CPU its Torch ones."""
    return [f"{m.partition('=')[0]}={kit / 'models' / METHODS[m]}" + (f":{m.partition(':')[2]}" if ":" in m else "")
            for m in SYNTHESIZED[device]]


def prebuild_marlin(out: Path) -> subprocess.Popen:
    """gptqmodel builds its Marlin kernels with nvcc at first use (two minutes each for bf16 and fp16 on an H200):
    start that now, on half the cores, so that it overlaps the parts before the quantized models."""
    script = ("import torch; from gptqmodel.utils.marlin import prewarm_marlin_extension as p; "
              "print(p(torch.bfloat16), p(torch.float16))")  # AWQ's Marlin runs in fp16
    log = (out / "marlin-build.txt").open("w")
    return subprocess.Popen([sys.executable, "-c", script], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=os.environ | {"MAX_JOBS": "8"})


def report(found: dict) -> str:
    lines = [f"# GPU run, {found['date']}", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in found["environment"].items()]
    for key, part in found.items():
        if key in ("date", "environment", "kit") or not isinstance(part, dict):
            continue
        lines += ["", f"## {key}", ""]
        if "rows" not in part:
            lines.append(str(part.get("summary") or part.get("skipped") or part.get("failed")))
        elif key.startswith("quantized") and isinstance(part["rows"], list):
            rows = part["rows"]
            base = rows[0].get("ppl", float("nan"))
            lines += ["| variant | PPL | vs baseline | tok/s | kernel |", "|---|---|---|---|---|"]
            lines += [f"| {r['method']} | failed: {r['error']} | | | |" if "error" in r else
                      f"| {r['method']} | {r['ppl']:.5f} | {100 * (r['ppl'] / base - 1):+.2f}% | "
                      f"{r['tokens_per_second']:.0f} | {r['backend']} |" for r in rows]
        elif "bodies" not in part["rows"]:  # peers, profile: their figures as they came
            lines += ["```json", json.dumps(part["rows"], indent=1), "```"]
        else:
            figures = part["rows"]
            lines += [f"{figures['model']}, L={figures['window']} S={figures['stride']}, batch {figures['batch_size']}, "
                      f"{figures['scored_tokens']} scored tokens", "",
                      "| body | tok/s | MFU | peak MiB | first batch s | mean NLL vs first |", "|---|---|---|---|---|---|"]
            for body, r in figures["bodies"].items():
                if "error" in r:
                    lines.append(f"| {body} | failed: {r['error']} | | | | |")
                    continue
                mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
                lines.append(f"| {body} | {r['tokens_per_second']:.0f} | {mfu} | {r['peak_bytes'] / 2**20:.0f} | "
                             f"{r['first_batch_seconds']:.1f} | {r['mean_nll_rel_diff']:.1e} |")
            for peer in ("hf_loop", "bare_forwards"):
                if peer in figures:
                    lines.append(f"| {peer} | {figures[peer]['tokens_per_second']:.0f} | | "
                                 f"{figures[peer]['peak_bytes'] / 2**20:.0f} | | |")
            if figures.get("formats"):
                lines += ["", "| synthesized checkpoint | tok/s | MFU | peak MiB | weights MiB | kernel |",
                          "|---|---|---|---|---|---|"]
                for name, r in figures["formats"].items():
                    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
                    lines.append(f"| {name} | failed: {r['error']} | | | | |" if "error" in r else
                                 f"| {name} | {r['tokens_per_second']:.0f} | {mfu} | {r['peak_bytes'] / 2**20:.0f} | "
                                 f"{r['weight_bytes'] / 2**20:.0f} | {r['kernel']} |")
    return "\n".join(lines) + "\n"


def run(kit: Path, out: Path, dry_run: bool, budget: float, marlin: bool, only: list[str] | None = None) -> dict:
    """Every part, most wanted first, within ``budget`` seconds; a CUDA part without CUDA is skipped with its
    reason (the dry run on CPU runs the rest small). Returns what ``gpu.json`` holds."""
    cuda = _cuda()
    if not cuda and not dry_run:
        raise SystemExit(f"benchmarks/gpu.py: error: {NO_CUDA} (no CUDA device visible); use --dry-run on CPU")
    found = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "environment": environment(),
             "kit": sorted(p.name for p in (kit / "wheels").glob("*.whl"))}
    plan = Schedule(out, found, budget, only)
    builder = prebuild_marlin(out) if cuda and marlin else None
    # what no GPU run has measured yet comes first (issue #57); what the H200 run of 2026-11-26 measured, last
    plan.part("quantized_cuda", quantized_arguments(kit, "cuda", 16384) if cuda else None, 150, NO_CUDA)
    plan.part("quantized_cpu", None if cuda else quantized_arguments(kit, "cpu", 1024), 300,
              "measured on the CPU machine: benchmarks/gpu.py run --dry-run")
    plan.part(*(("profile_1b", profile_arguments("llama-1b", 2048, 32, 8, [64, 256, 1024, 4096],
                                                 ["default", "max-autotune-no-cudagraphs", "reduce-overhead"]))
                if cuda else ("profile_tiny", profile_arguments("tiny", 256, 8, 4, [1, 64], []) + ["--device", "cpu"])),
              180)
    plan.part("peers_8b", ["benchmarks/peers.py", "--model", "llama-8b", "--window", "2048", "--stride", "1024",
                           "--windows", "16", "--batch-sizes", "4", "--repeats", "2", "--tokenizer", str(kit / "models" / "float"),
                           "--corpus", str(kit / "models" / "corpus.txt")] if cuda else None, 150, NO_CUDA)
    plan.part("cuda_tests", ["-m", "pytest", "tests/gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts="], 150)
    plan.part("quantized_1b", body_arguments("llama-1b", 2048, 48, 8, [], False) + ["--formats", *formats(kit, "cuda")]
              if cuda else None, 120, NO_CUDA)
    if cuda:
        plan.part("body_1b", body_arguments("llama-1b", 2048, 48, 8, ["eager", "compile"], True), 150)
    else:  # what runs on CPU: eager against compiled, and the synthesized formats, small
        plan.part("body_tiny", body_arguments("tiny", 256, 8, 4, ["eager", "compile"], True) + [
            "--device", "cpu", "--formats", *formats(kit, "cpu")], 180)
    plan.part("body_8b", body_arguments("llama-8b", 2048, 16, 4, ["eager", "compile"], True) if cuda else None,
              150, NO_CUDA)
    if builder is not None and builder.poll() is None:
        builder.kill()
    print(report(found))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", required=True)
    models = actions.add_parser("models", help="make the kit's models and corpus (on CPU, here)")
    models.add_argument("folder", type=Path)
    models.add_argument("--steps", type=int, default=TRAINING_STEPS,
                        help=f"training steps of the float model (default {TRAINING_STEPS}, the kit's)")
    go = actions.add_parser("run", help="the CUDA tests, the benchmarks and the report")
    go.add_argument("--kit", type=Path, default=ROOT / ".kit")
    go.add_argument("--out", type=Path, required=True)
    go.add_argument("--dry-run", action="store_true", help="on a machine without CUDA: run what runs, skip the rest")
    go.add_argument("--budget", type=float, default=450, help="seconds for every part together (default 450)")
    go.add_argument("--parts", nargs="*", metavar="PART", help="only these parts (a second call's rerun)")
    go.add_argument("--marlin", action="store_true",
                    help="build gptqmodel's Marlin kernels with nvcc in the background (two minutes each)")
    args = parser.parse_args()
    if args.action == "models":
        make_models(args.folder, args.steps)
    else:
        run(args.kit, args.out, args.dry_run, args.budget, args.marlin, args.parts)


if __name__ == "__main__":
    main()
