"""A gptq/awq variant whose gptqmodel kernel cannot start here fails alone, with one line naming the kernel and the
``kernel:`` to give instead (issue #57).

gptqmodel picks a kernel as the checkpoint loads and builds or fetches some of them at first use: on a Hopper GPU
its choice for GPTQ is Machete, which downloads CUTLASS (``urlopen error`` on an offline machine), and for AWQ
AWQ-Marlin, built with nvcc (two minutes; a failure without a CUDA toolkit). Its Triton and Torch kernels need
neither, so the line names one of them.
"""

from __future__ import annotations

import traceback
from contextlib import contextmanager

import torch

from tasks.core.errors import InputError, one_line
from tasks.engine.model_facts import input_device

# the kernels that need no build nor download: Triton's on CUDA, plain Torch on CPU (gptqmodel's names)
NO_BUILD = {("gptq", "cuda"): "triton", ("gptq", "cpu"): "torch", ("awq", "cuda"): "gemm_triton",
            ("awq", "cpu"): "torch_awq"}
# gptqmodel's kernels by the word their errors name them with (CUTLASS is Machete's)
NAMED = {"machete": "Machete", "cutlass": "Machete", "marlin": "Marlin", "exllama": "ExLlama", "bitblas": "BitBLAS",
         "swordfish": "Swordfish", "triton": "Triton", "qqq": "QQQ"}


def raised_in_gptqmodel(error: BaseException) -> BaseException | None:
    """The error out of gptqmodel's own code that ``error`` is or was raised from (loading wraps it in a line of
    its own), or None."""
    seen = error
    while seen is not None:
        if any("/gptqmodel/" in frame.filename for frame in traceback.extract_tb(seen.__traceback__)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def kernel_error(name: str, method: str, kernel: str | None, device_type: str, error: BaseException) -> InputError:
    """The line for ``error``, raised as variant ``name``'s kernel started: the kernel (the one given, else the one
    its error names) and the ``kernel:`` that needs no build or download on this device."""
    said = one_line(error)
    named = kernel or next((label for word, label in NAMED.items() if word in said.lower()), "gptqmodel's choice")
    instead = NO_BUILD[method, "cuda" if device_type == "cuda" else "cpu"]
    return InputError(f"variant '{name}' ({method}): kernel {named} could not start here ({said[:240]}); "
                      f"give `kernel: {instead}` on this variant, a kernel that needs no build or download")


@contextmanager
def said_as_the_kernel(name: str, method: str, kernel: str | None, device_type: str):
    """Turn an error that comes out of gptqmodel while the block runs (loading, a first forward) into ``kernel_error``'s
    line; any other error, and running out of memory, pass as they are."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        cause = raised_in_gptqmodel(error)
        if cause is None:
            raise
        raise kernel_error(name, method, kernel, device_type, cause) from error


def first_forward(model, name: str, method: str, kernel: str | None) -> None:
    """One forward pass of two tokens through a freshly loaded gptq/awq ``model``: the kernels that build or fetch
    at first use do it now, where a failure is the kernel's and said so, not halfway through scoring."""
    device = input_device(model)
    with said_as_the_kernel(name, method, kernel, device.type), torch.inference_mode():
        model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device), use_cache=False)
