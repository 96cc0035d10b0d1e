"""The one builder of op arguments: the conformance cases, the benchmark cases, ``ditops
info`` / ``ditops explain`` and the tests all describe a call as a spec and build it here.

A ``RowSpec`` describes a norm-op call (x's [B, S, D], the form of each modulation tensor,
layout, norm, parameter dtypes), a ``HeadSpec`` a RoPE-op call (q/k heads, head size,
rotary dims, positions, layout). ``build(op, spec, dtype, device, generator)`` gives the
keyword arguments of ``ditops.<op>``. Inputs are random (never zeros), drawn on the
generator's device (a CPU generator for reproducible tests, a GPU one where the largest
benchmark shapes would take seconds on the CPU) and then moved and cast. On the "meta"
device the tensors have shapes, strides and dtypes but no memory: enough to validate and
dispatch a call of any size (``ditops explain``).

``example_arguments(op, shape)`` is the typical call of a DiT block for a shape: x's
[B, S, D] or [S, D] for the norm ops, q's [T, H, Dh] or [B, S, H, Dh] for the RoPE ops.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch

from .ops import PUBLIC

DEFAULT_SHAPES = {
    "norm_scale_shift": (1, 4096, 3072),
    "residual_norm_scale_shift": (1, 4096, 3072),
    "norm_scale_shift_select": (1, 8192, 3072),
    "residual_norm_scale_shift_select": (1, 8192, 3072),
    "add_gate_norm": (1, 4096, 3840),
    "add_gate_norm_scale": (1, 4096, 3840),
    "qk_norm_rope_": (4608, 24, 128),
    "rope_": (4096, 32, 128),
}

HEAD_OPS = ("qk_norm_rope_", "rope_")


def _is_meta(device) -> bool:
    return torch.device(device).type == "meta"


def random(generator, device, dtype, *shape) -> torch.Tensor:
    """Standard normal values, drawn on the generator's device, then moved and cast."""
    if _is_meta(device):  # no values: drawing them first would allocate the full size
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.randn(shape, generator=generator, device=generator.device).to(device=device, dtype=dtype)


def _count(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def activation(generator, device, dtype, shape, layout="contiguous", special_values=False) -> torch.Tensor:
    """x-like tensor: contiguous, a row-strided view of a wider buffer, or a view at storage offset 1;
    with ``special_values``, its first row holds a NaN and its last row an Inf."""
    if layout == "strided":
        t = random(generator, device, dtype, *shape[:-1], shape[-1] + 24)[..., : shape[-1]]
    elif layout == "misaligned":
        t = random(generator, device, dtype, _count(shape) + 1)[1:].view(shape)
    else:
        t = random(generator, device, dtype, *shape)
    if special_values:
        leading = t.dim() - 1
        t[(0,) * leading + (1,)] = float("nan")
        t[(-1,) * leading + (2,)] = float("inf")
    return t


def modulation(generator, device, dtype, form, batch, tokens, hidden, frames=3) -> torch.Tensor:
    """One modulation tensor in a form of docs/ops.md; values around 0.5 so that 1 + scale is not ~1."""
    rand = lambda *shape: random(generator, device, dtype, *shape) * 0.5  # noqa: E731
    if form == "scalar":
        return rand()
    if form == "scalar1":
        return rand(1)
    if form == "vector":
        return rand(hidden)
    if form == "vector3":
        return rand(1, 1, hidden)
    if form == "batch":
        return rand(batch, hidden)
    if form == "batch_view":  # mod[:, 2] of a [B, 6, D] tensor, as DiTs chunk their modulation
        return rand(batch, 6, hidden)[:, 2]
    if form == "batch3_view":  # mod[:, 2:3] of a [B, 6, D] tensor: [B, 1, D], as Wan chunks it
        return rand(batch, 6, hidden)[:, 2:3]
    if form == "batch3":
        return rand(batch, 1, hidden)
    if form == "token":
        return rand(batch, tokens, hidden)
    if form == "token1":
        return rand(1, tokens, hidden)
    if form == "token_expanded":  # a [B, D] vector expanded over tokens: stride 0
        return rand(batch, 1, hidden).expand(batch, tokens, hidden)
    if form == "frame":
        return rand(batch, frames, 1, hidden)
    raise ValueError(f"modulation form must be one of scalar, scalar1, vector, vector3, batch, batch_view, "
                     f"batch3_view, batch3, token, token1, token_expanded, frame; got {form!r}")


@dataclass(frozen=True)
class RowSpec:
    """Shape and layout of a norm-op call."""

    batch: int
    tokens: int
    hidden: int
    scale: str = "batch_view"
    shift: str = "batch_view"
    gate: Optional[str] = "batch_view"
    layout: str = "contiguous"
    norm: str = "layer"
    param_dtype: Optional[torch.dtype] = None  # modulation and weights; None: the activations' dtype (float32 in Wan)
    weight_dtype: Optional[torch.dtype] = None  # weight and bias when they differ from param_dtype
    affine: bool = True
    two_d: bool = False
    special_values: bool = False  # plant NaN and Inf in x: they must propagate as in the reference
    index: str = "random"  # select ops: "random" 0/1 per token, or "halves" (Qwen-Image-Edit: set 1 for the second half)
    select_form: str = "batch"  # select ops: the form of their six [B, D] modulation tensors ("batch" or "batch_view")
    gate_in_param_dtype: bool = False  # residual_norm_scale_shift_select: residual_gate in param_dtype, not x's dtype and layout
    set1_dtype: Optional[torch.dtype] = None  # select ops: set 1's modulation dtype where it differs from set 0's


@dataclass(frozen=True)
class HeadSpec:
    """Shape and layout of a RoPE-op call."""

    leading: tuple  # (T,) or (B, S)
    q_heads: int
    k_heads: int
    head_size: int
    rotary_dim: Optional[int] = None  # None: Dh
    interleaved: bool = True
    positions: Optional[torch.dtype] = None  # None: no positions, rows position_offset + s
    position_offset: int = 0
    layout: str = "contiguous"  # or "qkv" (views of one fused buffer), "misaligned"
    cache_dtype: torch.dtype = torch.float32
    k_none: bool = False
    weight_dtypes: tuple = (torch.float32, None)  # qk_norm_rope_'s q_weight and k_weight; None: the activations' dtype
    spare_cache_rows: int = 5  # cache rows past the last position a call reads (a cache sized for longer sequences)


def _selection_index(spec: RowSpec, device, generator) -> torch.Tensor:
    if _is_meta(device):
        return torch.empty((spec.batch, spec.tokens), dtype=torch.int64, device="meta")
    if spec.index == "halves":
        index = torch.zeros(spec.batch, spec.tokens, dtype=torch.int64, device=device)
        index[:, spec.tokens // 2 :] = 1
        return index
    return (torch.rand((spec.batch, spec.tokens), generator=generator, device=generator.device) > 0.5).to(device=device, dtype=torch.int64)


def row_arguments(op: str, spec: RowSpec, dtype, device, generator) -> dict:
    shape = (spec.tokens, spec.hidden) if spec.two_d else (spec.batch, spec.tokens, spec.hidden)
    param_dtype = spec.param_dtype or dtype
    weight_dtype = spec.weight_dtype or param_dtype
    x_like = lambda: activation(generator, device, dtype, shape, spec.layout, spec.special_values)  # noqa: E731
    mod = lambda form: modulation(generator, device, param_dtype, form, spec.batch, spec.tokens, spec.hidden)  # noqa: E731
    affine = lambda: random(generator, device, weight_dtype, spec.hidden) if spec.affine else None  # noqa: E731
    bias = lambda: affine() if spec.norm == "layer" else None  # noqa: E731
    if op == "norm_scale_shift":
        return dict(x=x_like(), scale=mod(spec.scale), shift=mod(spec.shift), weight=affine(), bias=bias(), norm=spec.norm)
    if op == "residual_norm_scale_shift":
        return dict(
            x=x_like(),
            residual=x_like(),
            gate=mod(spec.gate) if spec.gate else None,
            scale=mod(spec.scale),
            shift=mod(spec.shift),
            weight=affine(),
            bias=bias(),
            norm=spec.norm,
        )
    if op in ("norm_scale_shift_select", "residual_norm_scale_shift_select"):
        index = _selection_index(spec, device, generator)  # drawn before x: the conformance cases' values depend on the order
        arguments = dict(x=x_like(), index=index)
        arguments.update({name: mod(spec.select_form) for name in ("scale0", "shift0", "gate0", "scale1", "shift1", "gate1")})
        if spec.set1_dtype is not None:
            arguments.update({name: arguments[name].to(spec.set1_dtype) for name in ("scale1", "shift1", "gate1")})
        arguments.update(weight=affine(), bias=bias())
        if op == "residual_norm_scale_shift_select":
            residual = x_like()
            residual_gate = random(generator, device, param_dtype, *shape) if spec.gate_in_param_dtype else x_like()
            arguments.update(residual=residual, residual_gate=residual_gate)
        return arguments
    if op in ("add_gate_norm", "add_gate_norm_scale"):
        gate_act = "tanh" if spec.norm == "rms" else None  # Z-Image's RMS sandwich uses a tanh gate
        arguments = dict(
            x=x_like(), branch=x_like(), gate=mod(spec.gate), weight=affine(), bias=bias(), norm=spec.norm, eps=1e-5, gate_act=gate_act
        )
        if op == "add_gate_norm_scale":
            arguments.update(scale=mod(spec.scale), weight2=affine(), bias2=bias())
        return arguments
    raise ValueError(f"op must be a norm op ({', '.join(op for op in DEFAULT_SHAPES if op not in HEAD_OPS)}), got {op!r}")


def head_arguments(op: str, spec: HeadSpec, dtype, device, generator) -> dict:
    if op not in HEAD_OPS:
        raise ValueError(f"op must be one of {', '.join(HEAD_OPS)}, got {op!r}")
    head_size = spec.head_size
    q_shape = (*spec.leading, spec.q_heads, head_size)
    k_shape = (*spec.leading, spec.k_heads, head_size)
    if spec.layout == "qkv":
        width = (spec.q_heads + 2 * spec.k_heads) * head_size
        qkv = random(generator, device, dtype, *spec.leading, width)
        q = qkv[..., : spec.q_heads * head_size].unflatten(-1, (spec.q_heads, head_size))
        k = qkv[..., spec.q_heads * head_size : (spec.q_heads + spec.k_heads) * head_size].unflatten(-1, (spec.k_heads, head_size))
    else:
        q = activation(generator, device, dtype, q_shape, spec.layout)
        k = activation(generator, device, dtype, k_shape, spec.layout)
    rotary_dim = spec.rotary_dim or head_size
    tokens = spec.leading[-1]
    rows = spec.position_offset + tokens + spec.spare_cache_rows
    if _is_meta(device):
        cache = torch.empty((rows, rotary_dim), dtype=spec.cache_dtype, device="meta")
        positions = None if spec.positions is None else torch.empty(spec.leading, dtype=spec.positions, device="meta")
    else:
        angle = torch.rand((rows, rotary_dim // 2), generator=generator, device=generator.device, dtype=torch.float64) * 6.3
        cache = torch.cat([torch.cos(angle), torch.sin(angle)], dim=1).to(device=device, dtype=spec.cache_dtype)
        positions = None
        if spec.positions is not None:
            positions = torch.randint(0, rows, spec.leading, generator=generator, device=generator.device).to(device=device, dtype=spec.positions)
    arguments = dict(
        q=q,
        k=None if spec.k_none else k,
        cos_sin_cache=cache,
        positions=positions,
        interleaved=spec.interleaved,
        rotary_dim=spec.rotary_dim,
        position_offset=spec.position_offset,
    )
    if op == "qk_norm_rope_":
        q_weight_dtype, k_weight_dtype = (weight_dtype or dtype for weight_dtype in spec.weight_dtypes)
        arguments.update(
            q_weight=random(generator, device, q_weight_dtype, head_size), k_weight=random(generator, device, k_weight_dtype, head_size)
        )
    return arguments


def build(op: str, spec: Union[RowSpec, HeadSpec], dtype, device, generator) -> dict:
    """Keyword arguments of ``ditops.<op>`` for a spec."""
    if isinstance(spec, HeadSpec):
        return head_arguments(op, spec, dtype, device, generator)
    return row_arguments(op, spec, dtype, device, generator)


def check_shape(op: str, shape: Sequence[int]) -> tuple:
    """``shape`` as a tuple if it fits op (see the module docstring), else a ValueError saying what fits."""
    if op not in DEFAULT_SHAPES:
        raise ValueError(f"op must be one of {', '.join(DEFAULT_SHAPES)}, got {op!r}")
    shape = tuple(shape)
    heads = op in HEAD_OPS
    wanted = "q's T,H,Dh or B,S,H,Dh" if heads else "x's B,S,D or S,D"
    ranks = (3, 4) if heads else (2, 3)
    if len(shape) not in ranks or any(not isinstance(size, int) or size < 0 for size in shape):
        raise ValueError(f"shape for {op} must be {wanted} (sizes >= 0), got {','.join(map(str, shape))}")
    return shape


def typical_spec(op: str, shape: Sequence[int], param_dtype: Optional[torch.dtype] = None) -> Union[RowSpec, HeadSpec]:
    """The spec of a DiT block's call at ``shape``: per-batch [B, D] modulation views of [B, 6, D]
    tensors, float32 weights and cos/sin cache, no positions. With param_dtype, every tensor but
    the activations has that dtype (as in Wan: float32)."""
    shape = check_shape(op, shape)
    weight_dtype = param_dtype or torch.float32
    if op in HEAD_OPS:
        return HeadSpec(
            shape[:-2], shape[-2], shape[-2], shape[-1], cache_dtype=weight_dtype, weight_dtypes=(weight_dtype, weight_dtype), spare_cache_rows=0
        )
    batch, tokens, hidden = shape if len(shape) == 3 else (1, *shape)
    norm = "rms" if op.startswith("add_gate") else "layer"  # each op's default norm
    return RowSpec(
        batch, tokens, hidden, two_d=len(shape) == 2, norm=norm, param_dtype=param_dtype, weight_dtype=weight_dtype,
        index="halves", select_form="batch_view", gate_in_param_dtype=True,
    )


def example_arguments(
    op: str,
    shape: Optional[Sequence[int]] = None,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
    param_dtype: Optional[torch.dtype] = None,
) -> dict:
    """Keyword arguments for ``ditops.<op>`` as a DiT block passes them (``typical_spec``); those
    equal to the op's defaults are left out, so that a caller may pass them (``interleaved=False``)."""
    spec = typical_spec(op, shape or DEFAULT_SHAPES[op], param_dtype)
    arguments = build(op, spec, dtype, device, torch.Generator().manual_seed(seed))
    defaults = {name: p.default for name, p in inspect.signature(PUBLIC[op]).parameters.items() if p.default is not p.empty}
    return {name: value for name, value in arguments.items() if not (name in defaults and _is_default(value, defaults[name]))}


def _is_default(value, default) -> bool:
    if value is None or default is None:
        return value is default
    return not isinstance(value, torch.Tensor) and type(value) is type(default) and value == default
