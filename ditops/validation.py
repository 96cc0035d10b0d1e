"""Input validation shared by every backend (docs/ops.md, "General rules").

Every public op validates its arguments here before anything is allocated or written.
A bad argument raises ``ValueError`` naming the op, the argument, what it got and what
it wanted. The functions return the sizes the op needs, so that nobody re-derives them.

This runs on every eager call, so the checks read each tensor attribute once.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""float64 is accepted so that the reference can serve as the float64 oracle; kernels refuse it."""

NORMS = ("layer", "rms")
GATE_ACTIVATIONS = (None, "tanh")
MAX_HEAD_SIZE = 512


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _shape(t) -> str:
    return str(list(t.shape))


def fail(op: str, argument: str, got: str, wanted: str):
    raise ValueError(f"{op}: {argument} {got}; wanted {wanted}")


def tensor(op: str, name: str, t, dtypes=ACTIVATION_DTYPES, device: Optional[torch.device] = None) -> None:
    """``t`` is a tensor of one of ``dtypes`` on ``device``.

    Devices are compared as ``torch.device``: ``get_device()`` is -1 for CPU, meta and every
    other non-CUDA device alike, so comparing indices would let a mix of those through.
    """
    if not isinstance(t, torch.Tensor):
        fail(op, name, f"is a {type(t).__name__}", "a torch.Tensor")
    if t.dtype not in dtypes:
        fail(op, name, f"has dtype {_dtype_name(t.dtype)}", "one of " + ", ".join(map(_dtype_name, dtypes)))
    if device is not None and t.device != device:
        fail(op, name, f"is on {t.device}", f"the device of the first activation argument, {device}")


def same_shape(op: str, name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if t.shape != other.shape:
        fail(op, name, f"has shape {_shape(t)}", f"the shape of {other_name}, {_shape(other)}")


def same_dtype(op: str, name: str, t: torch.Tensor, other_name: str, other: torch.Tensor) -> None:
    if t.dtype != other.dtype:
        fail(op, name, f"has dtype {_dtype_name(t.dtype)}", f"the dtype of {other_name}, {_dtype_name(other.dtype)}")


def choice(op: str, name: str, value, allowed) -> None:
    if value not in allowed:
        fail(op, name, f"is {value!r}", "one of " + ", ".join(map(repr, allowed)))


def eps(op: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (float, int)) or not value >= 0:
        fail(op, "eps", f"is {value!r}", "a number >= 0")


class RowShape(NamedTuple):
    """x viewed as [B, S, D]; a 2-D x [N, D] is B=1, S=N."""

    batch: int
    tokens: int
    hidden: int


def rows(op: str, name: str, x: torch.Tensor) -> RowShape:
    shape = x.shape
    if len(shape) == 3:
        return RowShape(shape[0], shape[1], shape[2])
    if len(shape) == 2:
        return RowShape(1, shape[0], shape[1])
    fail(op, name, f"has shape {_shape(x)}", "[B, S, D] or [N, D]")


def prefix(op: str, name: str, t, x: torch.Tensor) -> int:
    """Columns that come before x's in each row (quantize_fp8): x's dtype, device and leading
    dims, any width P. Returns P (0 for None)."""
    if t is None:
        return 0
    tensor(op, name, t, ACTIVATION_DTYPES, x.device)
    same_dtype(op, name, t, "x", x)
    if t.shape[:-1] != x.shape[:-1]:
        fail(op, name, f"has shape {_shape(t)}", f"x's leading dims and any width P, [{', '.join(map(str, x.shape[:-1]))}, P]")
    return t.shape[-1]


def modulation(op: str, name: str, t, x_rows: RowShape, device: torch.device, tables: bool = False) -> str:
    """Checks a scale/shift/gate tensor against x and returns its form (docs/ops.md, "Modulation tensors").

    Forms: "scalar", "vector" (one [D] for all rows), "batch" (one per batch item),
    "token" (one per token), "frame" ([B, F, 1, D]: token s uses frame s // (S // F)).
    With ``tables`` (the call has a modulation_index) every 2-D or 3-D tensor is a "table" of
    K >= 1 rows, [K, D] or [B, K, D] ([1, K, D]), token (b, s) reading row index[b, s]: a
    [B, D] or [B, S, D] tensor is then read as a table, and a [B, F, 1, D] one is refused.
    """
    tensor(op, name, t, ACTIVATION_DTYPES, device)
    B, S, D = x_rows
    shape = tuple(t.shape)
    n = len(shape)
    if n == 0 or shape == (1,):
        return "scalar"
    if tables:
        if shape == (D,):
            return "vector"
        if shape[-1] == D and (n == 2 or n == 3 and shape[0] in (1, B)) and shape[-2] > 0:
            return "table"
        fail(op, name, f"has shape {list(shape)} with modulation_index given",
             f"one of [], [1], [D] or a table [K, D], [B, K, D], [1, K, D] with K >= 1 (here B={B}, D={D})")
    if shape[-1] == D:
        if n == 1 or shape[:-1] in ((1,), (1, 1)):
            return "vector"
        if n == 2 and shape[0] == B or n == 3 and shape[:2] == (B, 1):
            return "batch"
        if n == 3 and shape[0] in (1, B) and shape[1] == S:
            return "token"
        if n == 4 and shape[0] in (1, B) and shape[2] == 1 and shape[1] > 0 and S % shape[1] == 0:
            return "frame"
    fail(
        op,
        name,
        f"has shape {list(shape)}",
        f"one of [], [1], [D], [1, D], [1, 1, D], [B, D], [B, 1, D], [B, S, D], [1, S, D], "
        f"[B, F, 1, D] with S % F == 0 (here B={B}, S={S}, D={D})",
    )


INDEX_DTYPES = (torch.int32, torch.int64)


def modulation_index(op: str, index, x_rows: RowShape, device: torch.device) -> None:
    """A modulation_index: int32 or int64 on x's device, [B, S], or [S] for every batch item alike."""
    tensor(op, "modulation_index", index, INDEX_DTYPES, device)
    B, S, _ = x_rows
    if tuple(index.shape) not in ((B, S), (S,)):
        fail(op, "modulation_index", f"has shape {_shape(index)}", f"[B, S] = [{B}, {S}] or [S] = [{S}]")


def modulations(op: str, named: dict, x_rows: RowShape, device: torch.device, index) -> tuple:
    """Checks a call's modulation tensors (name -> tensor) and its modulation_index (None: the
    call has none), and returns their forms in order. The tables of a call share one K: a
    row's index value is clamped into [0, K) once, whichever table it then reads."""
    if index is None:
        return tuple(modulation(op, name, t, x_rows, device) for name, t in named.items())
    modulation_index(op, index, x_rows, device)
    forms, first = [], None
    for name, t in named.items():
        form = modulation(op, name, t, x_rows, device, tables=True)
        if form == "table":
            if first is None:
                first = name
            elif t.shape[-2] != named[first].shape[-2]:
                fail(op, name, f"has K={t.shape[-2]} rows",
                     f"the K of {first}, {named[first].shape[-2]} (the tables of a call have one K)")
        forms.append(form)
    return tuple(forms)


def affine(op: str, name: str, t, hidden: int, device: torch.device) -> None:
    """An optional per-channel weight or bias of shape [hidden]."""
    if t is None:
        return
    tensor(op, name, t, ACTIVATION_DTYPES, device)
    if tuple(t.shape) != (hidden,):
        fail(op, name, f"has shape {_shape(t)}", f"[{hidden}]")


def norm_kind(op: str, norm: str, bias) -> None:
    choice(op, "norm", norm, NORMS)
    if norm == "rms" and bias is not None:
        fail(op, "bias", "is a tensor with norm='rms'", "None (RMSNorm has no bias)")


def activation_pair(op: str, x_name: str, x, other_name: str, other) -> torch.device:
    """Checks two activations of the same shape and dtype; returns the device of x."""
    tensor(op, x_name, x)
    device = x.device
    tensor(op, other_name, other, ACTIVATION_DTYPES, device)
    same_shape(op, other_name, other, x_name, x)
    same_dtype(op, other_name, other, x_name, x)
    return device


def selection_index(op: str, index, x_rows: RowShape, device: torch.device) -> None:
    if not isinstance(index, torch.Tensor) or index.dtype.is_floating_point or index.dtype.is_complex:
        got = f"has dtype {_dtype_name(index.dtype)}" if isinstance(index, torch.Tensor) else f"is a {type(index).__name__}"
        fail(op, "index", got, "an integer or bool tensor of 0/1")
    if index.device != device:
        fail(op, "index", f"is on {index.device}", f"the device of x, {device}")
    if tuple(index.shape) != (x_rows.batch, x_rows.tokens):
        fail(op, "index", f"has shape {_shape(index)}", f"[B, S] = [{x_rows.batch}, {x_rows.tokens}]")


def per_batch(op: str, name: str, t, x_rows: RowShape, device: torch.device) -> None:
    """A modulation tensor of the select ops: exactly [B, D]."""
    tensor(op, name, t, ACTIVATION_DTYPES, device)
    if tuple(t.shape) != (x_rows.batch, x_rows.hidden):
        fail(op, name, f"has shape {_shape(t)}", f"[B, D] = [{x_rows.batch}, {x_rows.hidden}]")


class HeadShape(NamedTuple):
    """q as [..., Hq, Dh] and k as [..., Hk, Dh] with R rotary dims, and the cos/sin cache's
    form: "shared" ([P, R], one row for every head) or "per_head" ([P, H, R], [B, P, H, R])."""

    leading: tuple
    head_size: int
    rotary_dim: int
    rope_cache: str


def _heads(op: str, name: str, t, device: Optional[torch.device]) -> None:
    tensor(op, name, t, ACTIVATION_DTYPES, device)
    if t.dim() not in (3, 4):
        fail(op, name, f"has shape {_shape(t)}", "[T, H, Dh] or [B, S, H, Dh]")
    head_size = t.shape[-1]
    if head_size % 2 or not 2 <= head_size <= MAX_HEAD_SIZE:
        fail(op, name, f"has head size Dh={head_size}", f"an even Dh in [2, {MAX_HEAD_SIZE}]")
    stride = t.stride()
    if stride[-1] != 1 or t.shape[-2] > 1 and stride[-2] != head_size:
        fail(op, name, f"has head and dim strides {list(stride[-2:])}", f"({head_size}, 1)")
    for dim, (size, step) in enumerate(zip(t.shape[:-2], stride[:-2])):
        if size > 1 and step == 0:
            fail(op, name, f"is expanded (stride 0) along dimension {dim}", "a tensor that can be written in place")


def _written_once(op: str, name: str, t: torch.Tensor) -> None:
    """An in-place argument must not hold one memory location twice (an expanded or
    overlapping view). Sufficient test on metadata: with its dimensions ordered by stride,
    each stride passes the last element the smaller ones reach."""
    reach = 0
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1):
        if stride <= reach:
            fail(op, name, f"has strides {list(t.stride())} for shape {_shape(t)}, which alias some of its elements",
                 "a tensor whose elements are distinct memory (not expanded)")
        reach += (size - 1) * stride


def heads(op: str, q, k, cos_sin_cache, positions, rotary_dim, position_offset, interleaved) -> HeadShape:
    """Checks the arguments shared by the RoPE ops (docs/ops.md, "RoPE details").

    Reads no tensor values (see ``position_values``), so its verdict depends on metadata alone.
    """
    _heads(op, "q", q, None)
    _written_once(op, "q", q)
    device = q.device
    leading = tuple(q.shape[:-2])
    head_size = q.shape[-1]
    if k is not None:
        _heads(op, "k", k, device)
        _written_once(op, "k", k)
        same_dtype(op, "k", k, "q", q)
        if tuple(k.shape[:-2]) != leading or k.shape[-1] != head_size:
            fail(op, "k", f"has shape {_shape(k)}", f"[{', '.join(map(str, leading))}, Hk, {head_size}] (q's leading dims and Dh)")
    tensor(op, "cos_sin_cache", cos_sin_cache, ACTIVATION_DTYPES, device)
    rank = cos_sin_cache.dim()
    cache_dims = cos_sin_cache.shape[-1] if rank else 0
    if rank not in (2, 3, 4) or cache_dims % 2 or not 2 <= cache_dims <= head_size:
        fail(op, "cos_sin_cache", f"has shape {_shape(cos_sin_cache)}",
             f"[P, R], [P, H, R] or [B, P, H, R] with R even and 2 <= R <= Dh = {head_size}")
    if rank > 2:
        _per_head_cache(op, cos_sin_cache, q, k)
    cache_positions = _cache_rows(cos_sin_cache)
    if rotary_dim is not None and rotary_dim != cache_dims:
        fail(op, "rotary_dim", f"is {rotary_dim!r}", f"None or cos_sin_cache.shape[-1] = {cache_dims} (the cache holds R/2 cos then R/2 sin columns)")
    if cos_sin_cache.stride(-1) != 1 and cache_dims > 1:
        fail(op, "cos_sin_cache", f"has strides {list(cos_sin_cache.stride())}", "a last dimension of stride 1")
    if not isinstance(interleaved, bool):
        fail(op, "interleaved", f"is {interleaved!r}", "True or False")
    # a SymInt when torch.compile traces with dynamic shapes (e.g. FLUX's text length)
    if isinstance(position_offset, bool) or not isinstance(position_offset, (int, torch.SymInt)) or position_offset < 0:
        fail(op, "position_offset", f"is {position_offset!r}", "an int >= 0")
    if positions is None:
        tokens = leading[-1]
        if position_offset + tokens > cache_positions:
            fail(
                op,
                "cos_sin_cache",
                f"has {cache_positions} rows",
                f"at least position_offset + S = {position_offset} + {tokens} rows",
            )
    else:
        _positions(op, positions, leading, position_offset, device)
    return HeadShape(leading, head_size, cache_dims, "per_head" if rank > 2 else "shared")


def _cache_rows(cos_sin_cache) -> int:
    """P, the positions a cos/sin cache holds: its rows, [P, R], [P, H, R] or [B, P, H, R]."""
    return cos_sin_cache.shape[-3] if cos_sin_cache.dim() > 2 else cos_sin_cache.shape[0]


def _per_head_cache(op: str, cache: torch.Tensor, q: torch.Tensor, k) -> None:
    """A cache with a row per head, [P, H, R], or a table per batch item too, [B, P, H, R]: its H
    is q's heads and k's (under GQA a k head serves several q heads, whose rows differ), its B
    q's batch size or 1 (one table for every item)."""
    heads = cache.shape[-2]
    if heads != q.shape[-2]:
        fail(op, "cos_sin_cache", f"has shape {_shape(cache)}, rows for H={heads} heads",
             f"a row per head of q, H = {q.shape[-2]}")
    if k is not None and k.shape[-2] != heads:
        fail(op, "cos_sin_cache", f"has a row per head, for q's {heads} heads and k's {k.shape[-2]}",
             "a [P, R] cache where q and k have different head counts (per head: rope_ on q and on k, "
             "each with its own cache)")
    if cache.dim() == 4:
        if q.dim() != 4:
            fail(op, "cos_sin_cache", f"has shape {_shape(cache)}, a table per batch item, for q of shape {_shape(q)}",
                 "q as [B, S, H, Dh] beside a [B, P, H, R] cache")
        if cache.shape[0] not in (1, q.shape[0]):
            fail(op, "cos_sin_cache", f"has shape {_shape(cache)}, tables for B={cache.shape[0]} batch items",
                 f"one per batch item of q, B = {q.shape[0]}, or one for every item, B = 1")


def _positions(op, positions, leading, position_offset, device) -> None:
    tensor(op, "positions", positions, (torch.int32, torch.int64), device)
    if tuple(positions.shape) != leading:
        fail(op, "positions", f"has shape {_shape(positions)}", f"q's leading shape {list(leading)}")
    if position_offset:
        fail(op, "position_offset", f"is {position_offset} with positions given", "0 (the offset applies only when positions is None)")


def position_values(op: str, positions, cos_sin_cache) -> None:
    """Positions must index rows of the cache. Reading them on a GPU synchronizes, so there
    this runs only with DITOPS_DEBUG=1; meta tensors have no values to read. Unlike the
    other checks it runs on every call, since its verdict depends on values."""
    if positions is None or not positions.numel():
        return
    kind = positions.device.type
    if kind == "cpu" or kind != "meta" and debug_checks():
        low, high = int(positions.min()), int(positions.max())
        rows = _cache_rows(cos_sin_cache)
        if low < 0 or high >= rows:
            fail(op, "positions", f"has values in [{low}, {high}]", f"values in [0, {rows}) (rows of cos_sin_cache)")


def _byte_span(t: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last (0 when empty)."""
    if not t.numel():
        return 0
    return (sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1) * t.element_size()


def _rows(t: torch.Tensor) -> tuple:
    """(size, stride) of the dims above the heads that have more than one index."""
    return tuple((size, stride) for size, stride in zip(t.shape[:-2], t.stride()[:-2]) if size != 1)


class InPlaceAliasing:
    """What an in-place op writes (q, k) must not share memory with the other one or with
    anything it reads: the kernels read each head once and write it back, so a shared
    location would be read after it was written (``rope_(q, q, ...)`` would rotate twice).
    The spans come from shapes and strides, fixed for a launch plan; ``check`` reads only
    data pointers on each call, before anything is written.

    q and k may share one buffer as the head blocks of a fused projection (FLUX's
    [T, 3, H, Dh] qkv): the same strides over their rows (batch and token dims, leaving out
    dims of one index, whose stride means nothing), every row start a multiple of the
    innermost row stride, and k's heads after or before q's within each such row."""

    def __init__(self, op: str, q: torch.Tensor, k: Optional[torch.Tensor], read: dict):
        self.op = op
        self.q_span = _byte_span(q)
        self.k_span = _byte_span(k) if k is not None else 0
        # (index in ``check``'s pointers, name, span) of every tensor read that has bytes
        present = [(name, t) for name, t in read.items() if t is not None]
        first = 1 if k is None else 2
        self.read_spans = [(first + i, name, span) for i, (name, t) in enumerate(present) if (span := _byte_span(t))]
        self.row_window = None  # (one q row's bytes, one k row's bytes, row stride in bytes) when rows may interleave
        rows = _rows(q) if self.q_span and self.k_span and q.dim() >= 3 else ()
        if rows and rows == _rows(k):
            row_stride = rows[-1][1]
            if row_stride > 0 and all(stride % row_stride == 0 for _, stride in rows):
                first_row = (0,) * (q.dim() - 2)
                self.row_window = (_byte_span(q[first_row]), _byte_span(k[first_row]), row_stride * q.element_size())

    def __call__(self, arguments: tuple, pointers: tuple) -> None:
        """The check as a plan's per-call check (ops.Plan.check_values)."""
        self.check(pointers)

    def check(self, pointers: tuple) -> None:
        """``pointers``: the data pointers of q, of k (unless None), then of the tensors read
        that are not None, in the order of the ``read`` given at construction (anything after
        them is ignored)."""
        if not self.q_span:
            return
        q_start = k_start = pointers[0]
        low, high = q_start, q_start + self.q_span  # every byte written lies in [low, high)
        if self.k_span:
            k_start = pointers[1]
            offset = k_start - q_start
            if -self.k_span < offset < self.q_span and not self._rows_disjoint(offset):
                fail(self.op, "k", "shares memory with q", "a tensor disjoint from q (q and k are both written)")
            low, high = min(low, k_start), max(high, k_start + self.k_span)
        for index, name, span in self.read_spans:
            start = pointers[index]
            if start < high and low < start + span:  # near what is written: compare with q and k each
                for written_name, written_start, written_span in (("q", q_start, self.q_span), ("k", k_start, self.k_span)):
                    if written_span and start < written_start + written_span and written_start < start + span:
                        fail(self.op, name, f"shares memory with {written_name}",
                             f"a tensor disjoint from {written_name}, which this op writes")

    def _rows_disjoint(self, offset: int) -> bool:
        if self.row_window is None:
            return False
        q_bytes, k_bytes, row_stride = self.row_window
        if offset >= 0:
            return offset >= q_bytes and offset + k_bytes <= row_stride
        return -offset >= k_bytes and -offset + q_bytes <= row_stride


def debug_checks() -> bool:
    """DITOPS_DEBUG=1 turns on the checks that read GPU tensor values (they synchronize)."""
    return os.environ.get("DITOPS_DEBUG", "0") not in ("", "0")
