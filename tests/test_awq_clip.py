"""AWQ's clip search as matmuls (``tasks.models.patches.best_clip_by_matmul``) against gptqmodel's own."""

from __future__ import annotations

import functools
import types

import pytest
import torch


def processor(sym: bool, group_size: int):
    """What the clip search reads of gptqmodel's AWQProcessor: its settings and its pseudo-quantizer."""
    from gptqmodel.looper.awq_processor import AWQProcessor

    stub = types.SimpleNamespace(qcfg=types.SimpleNamespace(group_size=group_size, bits=4, sym=sym))
    stub._pseudo_quantize_tensor_into = functools.partial(AWQProcessor._pseudo_quantize_tensor_into, stub)
    return stub


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("group_size", [64, -1])
def test_the_clip_search_as_matmuls_chooses_what_gptqmodel_s_chooses(sym, group_size):
    """In float32 both sum exactly enough to pick the same clipping for every group; in bfloat16 gptqmodel sums in
    bfloat16 and we in float32, so near-ties may go either way, rarely. 1100 tokens: both take every second one."""
    from gptqmodel.looper.awq_processor import AWQProcessor

    from tasks.models.patches import best_clip_by_matmul

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(192, 256, generator=generator) * 0.05
    weight[:, 7] *= 8  # an outlier column: clipping pays off somewhere
    features = torch.randn(4, 275, 256, generator=generator)
    settings = processor(sym, group_size)
    theirs = AWQProcessor._compute_best_clip(settings, weight, features)
    ours = best_clip_by_matmul(settings, weight, features)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    assert torch.equal(ours, theirs)
    assert (ours < weight.abs().reshape(192, -1, 256 if group_size < 0 else group_size).amax(-1, keepdim=True)).any()
    half = weight.bfloat16(), features.bfloat16()
    theirs, ours = AWQProcessor._compute_best_clip(settings, *half), best_clip_by_matmul(settings, *half)
    assert ours.dtype == torch.bfloat16 and (ours == theirs).float().mean() > 0.95


def test_quantizing_runs_the_matmul_clip_search_and_puts_gptqmodel_s_back():
    from gptqmodel.looper.awq_processor import AWQProcessor

    from tasks.models.patches import best_clip_by_matmul, clip_search_by_matmul

    stock = AWQProcessor._compute_best_clip
    with pytest.raises(RuntimeError), clip_search_by_matmul():
        assert AWQProcessor._compute_best_clip is best_clip_by_matmul
        raise RuntimeError("a quantization that fails")
    assert AWQProcessor._compute_best_clip is stock
