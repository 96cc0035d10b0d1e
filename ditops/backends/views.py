"""How kernels of every backend address their tensors: activations as rows of [B, S, D],
q/k as tokens of heads, and modulation tensors in any form of docs/ops.md as one addressing rule.
Launch code turns tensors into these views; kernels read strides, never shapes."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Rows(NamedTuple):
    """x as [B, S, D] rows: a 2-D x [N, D] is B=1, S=N."""

    batch: int
    tokens: int
    hidden: int
    batch_stride: int
    token_stride: int


def rows_of(t: torch.Tensor) -> Rows:
    if t.dim() == 2:
        return Rows(1, t.shape[0], t.shape[1], 0, t.stride(0))
    return Rows(t.shape[0], t.shape[1], t.shape[2], t.stride(0), t.stride(1))


class Tokens(NamedTuple):
    """q or k as tokens of heads: [T, H, Dh] is B=1, S=T; [B, S, H, Dh] as is."""

    batch: int
    tokens: int
    batch_stride: int
    token_stride: int


def tokens_of(t: torch.Tensor) -> Tokens:
    if t.dim() == 3:
        return Tokens(1, t.shape[0], 0, t.stride(0))
    return Tokens(t.shape[0], t.shape[1], t.stride(0), t.stride(1))


def modulation(t: Optional[torch.Tensor], tokens: int) -> tuple:
    """A modulation tensor in any form of docs/ops.md as (tensor, batch_stride, group_stride,
    group_size, dim_stride): token s of batch item b reads t at
    b * batch_stride + (s // group_size) * group_stride + column * dim_stride.
    A size-1 dimension gets stride 0, so [], [1], [D], [1, D], [B, D], [B, 1, D], [1, S, D],
    [B, S, D] and [B, F, 1, D] all fit. None (absent) is (None, 0, 0, 1, 0)."""
    if t is None:
        return (None, 0, 0, 1, 0)
    shape, strides = t.shape, t.stride()
    stride = lambda dim: strides[dim] if shape[dim] > 1 else 0  # noqa: E731
    if t.dim() <= 1:
        return (t, 0, 0, 1, stride(0) if t.dim() == 1 else 0)
    if t.dim() == 2:
        return (t, stride(0), 0, 1, stride(1))
    if t.dim() == 3:
        return (t, stride(0), stride(1), 1, stride(2))
    return (t, stride(0), stride(1), tokens // shape[1], stride(3))
