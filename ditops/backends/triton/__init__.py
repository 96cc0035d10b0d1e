"""The Triton backend: one portable kernel source per idea (this folder), for NVIDIA and AMD.

Each op of docs/ops.md is a function ``<op>_launch`` with the backend calling convention (the
op's arguments, then the outputs to write) that only computes its ``KernelLaunch``; the op
op's ``Kernel`` (dispatch/contract.py) runs that launch, binds it (a pre-bound launcher for
a call signature) or traces it (the launch handed to torch.compile): kernel_launch.py. Who may call them (devices, dtypes, sizes) is written
in configs/registry.yaml. Math is float32; each output is rounded once when stored.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...dispatch.device import DeviceInfo
from ...dispatch.contract import Kernel
from ..views import Rows, modulation, rows_of, tokens_of
from .gated_add_norm import gated_add_norm_kernel
from .kernel_launch import KernelLaunch, bind, run, trace
from .launch import rotary_launch, row_grid, row_launch, row_tiles, settings_of
from .modulated_norm import modulated_norm_kernel
from .rotary import rotary_kernel
from .row_quantize import row_quantize_kernel
from .selected_modulation_norm import selected_modulation_norm_kernel


def available(device: DeviceInfo) -> Optional[str]:
    """Triton kernels run on NVIDIA and AMD GPUs; on CPU tensors only through the interpreter
    (TRITON_INTERPRET=1) on a simulated device, which is how CI runs them."""
    if device.is_gpu:
        return None
    return "Triton kernels run on NVIDIA and AMD GPUs (on CPU tensors: TRITON_INTERPRET=1 and a simulated device)"


def _invariant(*modulations: tuple) -> bool:
    """Whether modulation views (views.modulation) are the same for every token of a batch item."""
    return all(group_stride == 0 for _, _, group_stride, _, _ in modulations)


def _token_strides(t: torch.Tensor) -> tuple:
    """(batch stride, token stride) of an integer tensor per token, [B, S], or [S] for every batch item."""
    return (0, t.stride(0)) if t.dim() == 1 else tuple(t.stride())


def _modulation_views(modulations: tuple, index: Optional[torch.Tensor], tokens: int) -> list:
    """views.modulation of each tensor; with a modulation_index, a 2-D or 3-D tensor is a table
    (docs/ops.md), addressed as [1, K, D] or [B, K, D] with the index value as the token. The
    view keeps the table itself, which a bound launch finds among the call's tensors."""
    views = []
    for t in modulations:
        if index is not None and t is not None and t.dim() > 1:
            views.append((t, *modulation(t if t.dim() == 3 else t.unsqueeze(0), tokens)[1:]))
        else:
            views.append(modulation(t, tokens))
    return views


def _fp8_max(y_scale, y) -> float:
    """The FP8 output's largest finite value; 0.0 where the output is not FP8 (no y_scale)."""
    return float(torch.finfo(y.dtype).max) if y_scale is not None else 0.0


def _table(kernel: str, y_scale) -> str:
    """The launch table's entry for a row kernel's call: its FP8 form has its own (configs/triton_launch.yaml)."""
    return kernel + "_fp8" if y_scale is not None else kernel


def _modulated_norm(x, residual, gate, scale, shift, weight, bias, norm, eps, modulation_index, y, residual_out,
                    y_scale=None, static_scale=None):
    shape = rows_of(x)
    residual_rows = rows_of(residual) if residual is not None else shape
    table = _table("modulated_norm" if residual is None else "residual_norm", y_scale)
    launch = row_launch(table, shape.batch * shape.tokens, shape.hidden, settings_of(x))
    modulations = _modulation_views((gate, scale, shift), modulation_index, shape.tokens)
    invariant = _invariant(*modulations)
    grid = row_grid(launch, x, shape.batch, shape.tokens, invariant)
    # the index is read only where a table's rows differ (K > 1, not expanded): otherwise every
    # token reads the same row, which a row loop loads once (HOIST) as it does a per-batch vector
    tables = modulation_index is not None and not invariant
    index = modulation_index if tables else None
    index_strides = _token_strides(index) if tables else (0, 0)
    table_rows = next(t.shape[-2] for t in (gate, scale, shift) if t is not None and t.dim() > 1) if tables else 1
    return KernelLaunch(modulated_norm_kernel, grid.grid, (
        x, shape.batch_stride, shape.token_stride,
        residual, residual_rows.batch_stride, residual_rows.token_stride,
        *modulations[0], *modulations[1], *modulations[2],
        index, *index_strides, table_rows,
        weight, bias, y, residual_out, y_scale, static_scale,
        shape.tokens, shape.hidden, eps,
    ), dict(
        QUANT=y_scale is not None, HAS_STATIC_SCALE=static_scale is not None, FP8_MAX=_fp8_max(y_scale, y),
        RMS=norm == "rms", HAS_RESIDUAL=residual is not None, HAS_GATE=gate is not None,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, TABLE=tables,
        BLOCK=launch.block, TAIL=launch.tail, ROWS_PER_PROGRAM=launch.rows_per_program,
        EARLY_LOADS=launch.early_loads, HOIST=grid.hoist, STAGES=grid.stages, FOLD=launch.fold,
        num_warps=launch.num_warps,
    ))


def norm_scale_shift_launch(x, scale, shift, weight, bias, norm, eps, modulation_index, y):
    return _modulated_norm(x, None, None, scale, shift, weight, bias, norm, eps, modulation_index, y, None)


def residual_norm_scale_shift_launch(x, residual, gate, scale, shift, weight, bias, norm, eps, modulation_index, y,
                                     residual_out):
    return _modulated_norm(x, residual, gate, scale, shift, weight, bias, norm, eps, modulation_index, y, residual_out)


def norm_scale_shift_fp8_launch(x, scale, shift, weight, bias, norm, eps, fp8_dtype, static_scale, modulation_index, y,
                                y_scale):
    return _modulated_norm(x, None, None, scale, shift, weight, bias, norm, eps, modulation_index, y, None, y_scale,
                           static_scale)


def residual_norm_scale_shift_fp8_launch(x, residual, gate, scale, shift, weight, bias, norm, eps, fp8_dtype,
                                         static_scale, modulation_index, y, y_scale, residual_out):
    return _modulated_norm(x, residual, gate, scale, shift, weight, bias, norm, eps, modulation_index, y, residual_out,
                           y_scale, static_scale)


def quantize_fp8_launch(x, activation, prefix, fp8_dtype, static_scale, y, y_scale):
    shape = rows_of(x)
    prefix_rows = rows_of(prefix) if prefix is not None else Rows(0, 0, 0, 0, 0)
    width = prefix_rows.hidden + shape.hidden  # a row of y: the prefix's columns, then x's
    launch = row_launch("row_quantize", shape.batch * shape.tokens, width, settings_of(x))
    block, tail = row_tiles(shape.hidden)  # x's columns and the prefix's are tiles of their own
    prefix_block, prefix_tail = row_tiles(prefix_rows.hidden) if prefix is not None else (1, 1)
    return KernelLaunch(row_quantize_kernel, (-(-shape.tokens // launch.rows_per_program), shape.batch), (
        x, shape.batch_stride, shape.token_stride, prefix, prefix_rows.batch_stride, prefix_rows.token_stride,
        prefix_rows.hidden, y, y_scale, static_scale, shape.tokens, shape.hidden,
    ), dict(
        GELU=activation == "gelu_tanh", PREFIX=prefix is not None, HAS_STATIC_SCALE=static_scale is not None,
        FP8_MAX=_fp8_max(y_scale, y), BLOCK=block, TAIL=tail, PREFIX_BLOCK=prefix_block, PREFIX_TAIL=prefix_tail,
        ROWS_PER_PROGRAM=launch.rows_per_program, num_warps=launch.num_warps,
    ))


def _selected_modulation_norm(x, residual, residual_gate, index, modulations, weight, bias, eps, y, residual_out, gate_out,
                              y_scale=None, static_scale=None):
    shape = rows_of(x)
    residual_rows = rows_of(residual) if residual is not None else shape
    gate_rows = rows_of(residual_gate) if residual_gate is not None else shape
    table = _table("selected_modulation_norm", y_scale if residual is None else None)  # launch.ROW_TABLES says why
    launch = row_launch(table, shape.batch * shape.tokens, shape.hidden, settings_of(x))
    per_batch = [argument for t in modulations for argument in (t, t.stride(0) if t.shape[0] > 1 else 0)]
    grid = row_grid(launch, x, shape.batch, shape.tokens, False)  # chosen per token: nothing to hoist
    return KernelLaunch(selected_modulation_norm_kernel, grid.grid, (
        x, shape.batch_stride, shape.token_stride,
        residual, residual_rows.batch_stride, residual_rows.token_stride,
        residual_gate, gate_rows.batch_stride, gate_rows.token_stride,
        index, index.stride(0), index.stride(1),
        *per_batch,
        weight, bias, y, residual_out, gate_out, y_scale, static_scale,
        shape.tokens, shape.hidden, eps,
    ), dict(
        QUANT=y_scale is not None, HAS_STATIC_SCALE=static_scale is not None, FP8_MAX=_fp8_max(y_scale, y),
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK=launch.block, TAIL=launch.tail, ROWS_PER_PROGRAM=launch.rows_per_program,
        EARLY_LOADS=launch.early_loads, FOLD=launch.fold, num_warps=launch.num_warps,
    ))


def norm_scale_shift_select_launch(x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, y, gate_out):
    modulations = (scale0, shift0, gate0, scale1, shift1, gate1)
    return _selected_modulation_norm(x, None, None, index, modulations, weight, bias, eps, y, None, gate_out)


def residual_norm_scale_shift_select_launch(
    x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, y, residual_out, gate_out
):
    modulations = (scale0, shift0, gate0, scale1, shift1, gate1)
    return _selected_modulation_norm(x, residual, residual_gate, index, modulations, weight, bias, eps, y, residual_out, gate_out)


def norm_scale_shift_select_fp8_launch(x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, fp8_dtype,
                                       static_scale, y, y_scale, gate_out):
    modulations = (scale0, shift0, gate0, scale1, shift1, gate1)
    return _selected_modulation_norm(x, None, None, index, modulations, weight, bias, eps, y, None, gate_out, y_scale,
                                     static_scale)


def residual_norm_scale_shift_select_fp8_launch(
    x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, fp8_dtype,
    static_scale, y, y_scale, residual_out, gate_out
):
    modulations = (scale0, shift0, gate0, scale1, shift1, gate1)
    return _selected_modulation_norm(x, residual, residual_gate, index, modulations, weight, bias, eps, y, residual_out,
                                     gate_out, y_scale, static_scale)


def _gated_add_norm(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, out, y, y_scale=None,
                    static_scale=None):
    shape = rows_of(x)
    branch_rows = rows_of(branch)
    launch = row_launch(_table("gated_add_norm", y_scale), shape.batch * shape.tokens, shape.hidden, settings_of(x))
    modulations = [modulation(t, shape.tokens) for t in (gate, scale)]
    grid = row_grid(launch, x, shape.batch, shape.tokens, _invariant(*modulations))
    return KernelLaunch(gated_add_norm_kernel, grid.grid, (
        x, shape.batch_stride, shape.token_stride,
        branch, branch_rows.batch_stride, branch_rows.token_stride,
        *modulations[0], *modulations[1],
        weight, bias, weight2, bias2, out, y, y_scale, static_scale,
        shape.tokens, shape.hidden, eps,
    ), dict(
        QUANT=y_scale is not None, HAS_STATIC_SCALE=static_scale is not None, FP8_MAX=_fp8_max(y_scale, y),
        RMS=norm == "rms", TANH_GATE=gate_act == "tanh", HAS_SCALE=scale is not None,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        HAS_WEIGHT2=weight2 is not None, HAS_BIAS2=bias2 is not None,
        BLOCK=launch.block, TAIL=launch.tail, ROWS_PER_PROGRAM=launch.rows_per_program,
        EARLY_LOADS=launch.early_loads, HOIST=grid.hoist, STAGES=grid.stages, num_warps=launch.num_warps,
    ))


def add_gate_norm_launch(x, branch, gate, weight, bias, norm, eps, gate_act, out):
    return _gated_add_norm(x, branch, gate, None, weight, bias, None, None, norm, eps, gate_act, out, None)


def add_gate_norm_scale_launch(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, out, y):
    return _gated_add_norm(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, out, y)


def add_gate_norm_scale_fp8_launch(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, fp8_dtype,
                                   static_scale, y, y_scale, out):
    return _gated_add_norm(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, out, y, y_scale,
                           static_scale)


def _cache_strides(cache: torch.Tensor) -> tuple:
    """(batch, position, head) strides of a cos/sin cache: [P, R] (0, row, 0), [P, H, R] (0, row,
    head) or [B, P, H, R], whose batch stride is 0 where B is 1 (one table for every item)."""
    if cache.dim() == 2:
        return 0, cache.stride(0), 0
    if cache.dim() == 3:
        return 0, cache.stride(0), cache.stride(1)
    return cache.stride(0) if cache.shape[0] > 1 else 0, cache.stride(1), cache.stride(2)


def _rotary(q, k, q_weight, k_weight, cos_sin_cache, positions, interleaved, eps, position_offset, norm, q_out, k_out,
            token_norm=False, q_bias=None, k_bias=None):
    """norm: None (rope_), "rms" or "layer"."""
    q_out = q if q_out is None else q_out
    k_out = k if k_out is None else k_out
    batch, tokens, q_batch_stride, q_token_stride = tokens_of(q)
    _, _, k_batch_stride, k_token_stride = tokens_of(k) if k is not None else (0, 0, 0, 0)
    _, _, q_out_batch_stride, q_out_token_stride = tokens_of(q_out)
    _, _, k_out_batch_stride, k_out_token_stride = tokens_of(k_out) if k is not None else (0, 0, 0, 0)
    head_size, rotary_dim = q.shape[-1], cos_sin_cache.shape[-1]
    launch = rotary_launch(head_size, rotary_dim, q.shape[-2], k.shape[-2] if k is not None else 0, q.element_size(),
                           batch * tokens, settings_of(q), token_norm, norm == "layer")
    positions_batch_stride, positions_token_stride = _token_strides(positions) if positions is not None else (0, 0)
    return KernelLaunch(rotary_kernel, (batch * tokens, 2 if launch.split else 1), (
        q, q_batch_stride, q_token_stride, q.shape[-2],
        k, k_batch_stride, k_token_stride, k.shape[-2] if k is not None else 0,
        q_out, q_out_batch_stride, q_out_token_stride,
        k_out, k_out_batch_stride, k_out_token_stride,
        q_weight, k_weight, q_bias, k_bias,
        cos_sin_cache, *_cache_strides(cos_sin_cache),
        positions, positions_batch_stride, positions_token_stride, position_offset,
        tokens, head_size, rotary_dim, eps,
    ), dict(
        NORM=norm is not None, TOKEN_NORM=token_norm, HAS_Q_WEIGHT=q_weight is not None, HAS_K_WEIGHT=k_weight is not None,
        LAYER=norm == "layer", HAS_Q_BIAS=q_bias is not None, HAS_K_BIAS=k_bias is not None,
        INTERLEAVED=interleaved, HAS_K=k is not None, HAS_POSITIONS=positions is not None,
        HEAD_CACHE=cos_sin_cache.dim() > 2,
        Q_BLOCK_HEADS=launch.q_block_heads, K_BLOCK_HEADS=launch.k_block_heads,
        HALF_HEAD=launch.half_head, HALF_TAIL=launch.half_tail, BLOCK_REST=launch.block_rest, SPLIT=launch.split,
        STORE_EVICTION=launch.store_eviction,
        num_warps=launch.num_warps,
    ))


# The in-place ops write q and k themselves; given q_out and k_out (a compiled graph's
# functional node, ditops/ops.py), they write those instead and leave q and k as they were.
def qk_norm_rope__launch(q, k, q_weight, k_weight, cos_sin_cache, positions, interleaved, rotary_dim, eps, position_offset,
                         norm_over, norm, q_bias, k_bias, q_out=None, k_out=None):
    return _rotary(q, k, q_weight, k_weight, cos_sin_cache, positions, interleaved, eps, position_offset, norm, q_out, k_out,
                   norm_over == "token", q_bias, k_bias)


def rope__launch(q, k, cos_sin_cache, positions, interleaved, rotary_dim, position_offset, q_out=None, k_out=None):
    return _rotary(q, k, None, None, cos_sin_cache, positions, interleaved, 0.0, position_offset, None, q_out, k_out)


def _kernel(launch_of) -> Kernel:
    """The op as the registry calls it (dispatch/contract.py): its launch run, bound or traced
    (kernel_launch.py)."""
    return Kernel(
        run=lambda *values: run(launch_of(*values)),
        bind=lambda values, device_index: bind(launch_of(*values), values, device_index),
        trace=lambda *values: trace(launch_of(*values)),
    )


norm_scale_shift = _kernel(norm_scale_shift_launch)
residual_norm_scale_shift = _kernel(residual_norm_scale_shift_launch)
norm_scale_shift_select = _kernel(norm_scale_shift_select_launch)
residual_norm_scale_shift_select = _kernel(residual_norm_scale_shift_select_launch)
add_gate_norm = _kernel(add_gate_norm_launch)
add_gate_norm_scale = _kernel(add_gate_norm_scale_launch)
qk_norm_rope_ = _kernel(qk_norm_rope__launch)
rope_ = _kernel(rope__launch)
norm_scale_shift_fp8 = _kernel(norm_scale_shift_fp8_launch)
residual_norm_scale_shift_fp8 = _kernel(residual_norm_scale_shift_fp8_launch)
quantize_fp8 = _kernel(quantize_fp8_launch)
norm_scale_shift_select_fp8 = _kernel(norm_scale_shift_select_fp8_launch)
residual_norm_scale_shift_select_fp8 = _kernel(residual_norm_scale_shift_select_fp8_launch)
add_gate_norm_scale_fp8 = _kernel(add_gate_norm_scale_fp8_launch)
