"""A faster body for scoring: the decoder layers compiled, or liger-kernel's fused RMSNorm, RoPE and SwiGLU, or
both, giving the eager body's numbers to within bf16 noise (tests/gpu/test_cuda.py holds them to it).

Compiling suits scoring: every full window has the audit's length, so a batch has one of two shapes (a full
batch, the last one) and each compiles once; ``dynamic=False`` keeps it from generalizing to symbolic shapes.
Each decoder layer is compiled rather than the whole model, so that the engine's own head (chunked NLL) and
every hook on a layer (diagnose, the key/value cache) stay as they are; same-class layers share one graph.
"""

from __future__ import annotations

from tasks.engine.layers import decoder_layers

BODIES = ("eager", "compile", "liger", "liger+compile")


def speed_up(model, body: str) -> None:
    """Make ``model``'s decoder layers run as ``body`` (one of ``BODIES``) says, in place."""
    if body not in BODIES:
        raise ValueError(f"body '{body}' is not one of {', '.join(BODIES)}")
    if "liger" in body:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        # the engine computes the head's NLL itself, so liger's cross-entropy kernels are not wanted
        _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
    if "compile" in body:
        for layer in decoder_layers(model):
            layer.compile(dynamic=False)
