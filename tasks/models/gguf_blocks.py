"""llama.cpp's most shipped block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) dequantized with torch, on every core.

Each is a transcription of gguf-py's numpy ``dequantize_blocks`` (gguf/quants.py), the operations in the same
order, so that the result is the same float32 to the bit (tests/test_gguf_file.py checks each against gguf-py on
random blocks), on slices of a million values (``tasks.models.gguf``) where gguf-py goes through a tensor 16 rows
at a time: 2.5-3× faster on this project's 2 cores (docs/benchmarks.md#loading-a-gguf-file).
"""

from __future__ import annotations

import torch

QK_K = 256  # the K-quants' super-block


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at bytes ``start:start + 2`` of each block, as float32 ``[n, 1]``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[..., k]`` bytes to ``[..., 2, k]``: their low nibbles, then their high ones."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-2)


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).reshape(len(blocks), -1).view(torch.int8) - 8
    return _half(blocks, 0) * q.float()


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:]).reshape(len(blocks), -1).float()
    return _half(blocks, 0) * q + _half(blocks, 2)


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = len(blocks)
    scales = blocks[:, 4:16].reshape(n, 3, 4)
    d, m, m_d = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    d = (_half(blocks, 0) * sc.float()).reshape(n, -1, 1)
    dm = (_half(blocks, 2) * mins.float()).reshape(n, -1, 1)
    q = _nibbles(blocks[:, 16:].reshape(n, -1, 32)).reshape(n, -1, 32).float()
    return (d * q - dm).reshape(n, QK_K)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = len(blocks)
    ql, qh = blocks[:, : QK_K // 2], blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
    scales = blocks[:, QK_K // 2 + QK_K // 4 : -2].contiguous().view(torch.int8).float()
    d = (_half(blocks, blocks.shape[1] - 2) * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(ql.reshape(n, -1, 64)).reshape(n, -1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> shifts) & 0x03).reshape(n, -1, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, QK_K // 16, -1).float()
    return (d * q).reshape(n, QK_K)


DEQUANTIZE = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q4_K": q4_k, "Q6_K": q6_k}
