"""Load time against file size: GGUF files of the types users ship, GPTQ/AWQ and safetensors checkpoints.

  .venv/bin/python benchmarks/loading.py [--shape llama-1b] [--types Q8_0 Q4_0 Q4_K Q6_K] [--formats gptq awq]

Each file is made here at a Llama shape (``benchmarks/peers.py``'s) with random weights (speed only): GGUF files
written with gguf-py from random blocks with finite scales, GPTQ/AWQ checkpoints synthesized in the kit's formats
(``benchmarks/body.py``'s ``synthesize``; needs ``bash .ci/gpu-kit`` for the kit's small checkpoints), a float
safetensors checkpoint in bf16. Each is loaded in a fresh process by ``tasks.models.loading.load_model`` (float32
on CPU; the file cached by the OS after a first read, as a second audit of it finds it), and a GGUF file also the
way this project loaded it before (gguf-py's reader and its ``dequantize``): the header alone, dequantization,
the whole load. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
HALVES = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [-2]}  # where each block's f16 scales lie


def llama_gguf(path: Path, shape: dict, kind: str, seed: int = 0) -> None:
    """A GGUF file of a Llama of ``shape`` whose decoder and embedding matrices are random blocks of ``kind``."""
    import gguf

    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    h, f, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    vocab = 128_256
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(h)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(f)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_dimension_count(h // heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType[{"Q4_K": "MOSTLY_Q4_K_M", "Q5_K": "MOSTLY_Q5_K_M"}.get(kind, f"MOSTLY_{kind}")])

    def quantized(name: str, rows: int, cols: int) -> None:
        raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
        blocks = raw.reshape(-1, size)
        for at in HALVES[kind]:
            at %= size
            blocks[:, at : at + 2] = (rng.random(len(blocks), np.float32) * 0.01).astype(np.float16).view(
                np.uint8).reshape(-1, 2)
        writer.add_tensor(name, raw, raw_dtype=qtype)

    quantized("token_embd.weight", vocab, h)
    for i in range(layers):
        for name, rows, cols in (("attn_q", h, h), ("attn_k", kv * h // heads, h), ("attn_v", kv * h // heads, h),
                                 ("attn_output", h, h), ("ffn_gate", f, h), ("ffn_up", f, h), ("ffn_down", h, f)):
            quantized(f"blk.{i}.{name}.weight", rows, cols)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(h, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(h, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# the modules any load imports first (transformers' Llama, its GGUF and quantizer code): a process start's cost,
# paid once by an audit whatever it loads, timed apart from the load itself
MEASURE = """
import json, sys, time
import torch
start = time.perf_counter()
import transformers.modeling_gguf_pytorch_utils, transformers.models.llama.modeling_llama
from transformers import AutoModelForCausalLM
from tasks.models.loading import load_model
imported = time.perf_counter()
load_model(sys.argv[1], torch.float32, torch.device("cpu"))
print(json.dumps({"load_seconds": time.perf_counter() - imported, "import_seconds": imported - start}))
"""

BEFORE = """
import json, sys, time
from pathlib import Path
import gguf, numpy as np
path = Path(sys.argv[1])
started = time.perf_counter()
reader = gguf.GGUFReader(path)
parsed = time.perf_counter()
for tensor in reader.tensors:
    np.asarray(gguf.dequantize(tensor.data, tensor.tensor_type), np.float32)
done = time.perf_counter()
print(json.dumps({"header_seconds": parsed - started, "dequantize_seconds": done - parsed}))
"""

AFTER = """
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import torch
from tasks.models.gguf import _dequantized
from tasks.models.gguf_file import read_header
started = time.perf_counter()
header = read_header(Path(sys.argv[1]))
parsed = time.perf_counter()
with ThreadPoolExecutor(torch.get_num_threads()) as pool:
    for tensor in header.tensors:
        _dequantized(header, tensor, pool)
done = time.perf_counter()
print(json.dumps({"header_seconds": parsed - started, "dequantize_seconds": done - parsed}))
"""


def measure(script: str, path: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, cwd=ROOT,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b", choices=["llama-1b", "llama-8b"])
    parser.add_argument("--types", nargs="*", default=["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
    parser.add_argument("--formats", nargs="*", default=["gptq", "awq", "safetensors"])
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch
    from body import build, synthesize
    from peers import LLAMA_SHAPES

    rows = []
    with tempfile.TemporaryDirectory(prefix="loading-") as scratch:
        for kind in args.types:
            path = Path(scratch) / f"{kind}.gguf"
            llama_gguf(path, LLAMA_SHAPES[args.shape], kind)
            measure(MEASURE, path)  # the OS's cache holds the file from here on, for every method alike
            row = {"file": f"GGUF {kind}", "bytes": path.stat().st_size, "after": measure(AFTER, path),
                   "before": measure(BEFORE, path), "load": measure(MEASURE, path)}
            rows.append(row)
            path.unlink()
            print(_line(row), flush=True)
        for form in args.formats:
            folder = Path(scratch) / form
            if form == "safetensors":
                build(args.shape, torch.bfloat16, torch.device("cpu")).save_pretrained(folder)
            else:
                synthesize(ROOT / ".kit" / "models" / form, build(args.shape, torch.bfloat16, torch.device("meta")).config,
                           folder)
            size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            measure(MEASURE, folder)
            rows.append({"file": form, "bytes": size, "load": measure(MEASURE, folder)})
            print(_line(rows[-1]), flush=True)
    print(json.dumps({"shape": args.shape, "threads": torch.get_num_threads(), "rows": rows}))


def _line(row: dict) -> str:
    mb = row["bytes"] / 1e6
    said = f"{row['file']:<12} {mb:8.0f} MB  load_model {row['load']['load_seconds']:6.2f} s " \
           f"({mb / row['load']['load_seconds']:5.0f} MB/s; imports before it {row['load']['import_seconds']:.1f} s)"
    if "after" in row:
        for when in ("before", "after"):
            part = row[when]
            said += f"  {when}: header {part['header_seconds']:.2f} s, dequantize {part['dequantize_seconds']:.2f} s " \
                    f"({mb / part['dequantize_seconds']:.0f} MB/s)"
    return said


if __name__ == "__main__":
    main()
