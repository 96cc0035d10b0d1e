"""The reference backend against an independent float64 formulation of docs/ops.md, plus properties.

The helpers at the top restate each op in a different way from the reference: the norms
come from torch.nn.functional, modulation tensors are expanded token by token from the
docs/ops.md table (no torch broadcasting), and RoPE is a complex multiplication. The reference
is called with float64 inputs and must agree to ~1e-12. Then: properties of RoPE and the
norms (hypothesis), ditops.rope_cos_sin_cache, and the reference in bf16/fp16/fp32 against
itself in float64 (one rounding per output, within the docs/ops.md tolerances).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ditops
import ditops.backends.reference as reference

F64 = torch.float64
TIGHT = dict(rtol=1e-12, atol=1e-12)
FEW = settings(max_examples=25, deadline=None)


# ----------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape, dtype=F64, scale: float = 1.0) -> torch.Tensor:
    """Random normal values (never all zeros), drawn in float64 then cast to dtype."""
    return (scale * torch.randn(tuple(shape), generator=gen, dtype=F64)).to(dtype)


# ----------------------------------------------------------------------------------------
# Independent float64 formulation
# ----------------------------------------------------------------------------------------

# Modulation shapes of docs/ops.md: name -> (form, shape as a function of B, S, D, F).
MODULATION_SHAPES = {
    "[]": ("scalar", lambda B, S, D, F: ()),
    "[1]": ("scalar", lambda B, S, D, F: (1,)),
    "[D]": ("vector", lambda B, S, D, F: (D,)),
    "[1,D]": ("vector", lambda B, S, D, F: (1, D)),
    "[1,1,D]": ("vector", lambda B, S, D, F: (1, 1, D)),
    "[B,D]": ("batch", lambda B, S, D, F: (B, D)),
    "[B,1,D]": ("batch", lambda B, S, D, F: (B, 1, D)),
    "[B,S,D]": ("token", lambda B, S, D, F: (B, S, D)),
    "[1,S,D]": ("token", lambda B, S, D, F: (1, S, D)),
    "[B,F,1,D]": ("frame", lambda B, S, D, F: (B, F, 1, D)),
    "[1,F,1,D]": ("frame", lambda B, S, D, F: (1, F, 1, D)),
}
SHAPE_NAMES = list(MODULATION_SHAPES)


def modulation(gen, name: str, B: int, S: int, D: int, F: int, dtype=F64, scale: float = 0.5) -> torch.Tensor:
    """A random modulation tensor of the named docs/ops.md shape."""
    return randn(gen, *MODULATION_SHAPES[name][1](B, S, D, F), dtype=dtype, scale=scale)


def expand_modulation(t: torch.Tensor, name: str, B: int, S: int, D: int) -> torch.Tensor:
    """The [B, S, D] float64 tensor that a modulation tensor stands for, built token by token.

    Follows the docs/ops.md table literally: [B, D] is one vector per batch item (not torch
    broadcasting), and [B, F, 1, D] gives token s the vector of frame s // (S // F).
    """
    form = MODULATION_SHAPES[name][0]
    t = t.to(F64)
    out = torch.empty(B, S, D, dtype=F64)
    for b in range(B):
        for s in range(S):
            if form == "scalar":
                row = t.reshape(-1)[0].repeat(D)
            elif form == "vector":
                row = t.reshape(D)
            elif form == "batch":
                row = t.reshape(B, D)[b]
            elif form == "token":
                row = t[b if t.shape[0] > 1 else 0, s]
            else:  # frame
                frames = t.shape[1]
                row = t[b if t.shape[0] > 1 else 0, s // (S // frames), 0]
            out[b, s] = row
    return out


def as_bsd(x: torch.Tensor) -> torch.Tensor:
    """x as [B, S, D]: a 2-D [N, D] is B=1, S=N."""
    return x if x.dim() == 3 else x.unsqueeze(0)


def norm64(v, weight=None, bias=None, norm="layer", eps=1e-6) -> torch.Tensor:
    """LayerNorm or RMSNorm over the last dim in float64, from torch.nn.functional."""
    v = v.to(F64)
    weight = None if weight is None else weight.to(F64)
    bias = None if bias is None else bias.to(F64)
    if norm == "layer":
        return F.layer_norm(v, (v.shape[-1],), weight, bias, eps)
    assert bias is None
    return F.rms_norm(v, (v.shape[-1],), weight, eps)


def norm_scale_shift64(x, scale, scale_name, shift, shift_name, weight=None, bias=None, norm="layer", eps=1e-6):
    """y = norm(x) * (1 + scale) + shift, modulation expanded per token."""
    x3 = as_bsd(x.to(F64))
    B, S, D = x3.shape
    y = norm64(x3, weight, bias, norm, eps) * (1 + expand_modulation(scale, scale_name, B, S, D))
    y = y + expand_modulation(shift, shift_name, B, S, D)
    return y.reshape(x.shape)


def gated_residual64(x, residual, gate, gate_name):
    """residual + gate * x in float64 (gate None = 1)."""
    x3, r3 = as_bsd(x.to(F64)), as_bsd(residual.to(F64))
    B, S, D = x3.shape
    g = torch.ones(B, S, D, dtype=F64) if gate is None else expand_modulation(gate, gate_name, B, S, D)
    return (r3 + g * x3).reshape(x.shape)


def select64(index, set0, set1, B, S) -> torch.Tensor:
    """[B, S, D]: token (b, s) takes set1[b] where index[b, s] != 0, else set0[b]."""
    rows = [[(set1 if int(index[b, s]) != 0 else set0)[b].to(F64) for s in range(S)] for b in range(B)]
    return torch.stack([torch.stack(r) for r in rows])


def norm_select64(x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight=None, bias=None, eps=1e-6):
    """(layernorm(x) * (1 + scale_sel) + shift_sel, gate_sel) per token."""
    x3 = as_bsd(x.to(F64))
    B, S, _ = x3.shape
    n = norm64(x3, weight, bias, "layer", eps)
    y = n * (1 + select64(index, scale0, scale1, B, S)) + select64(index, shift0, shift1, B, S)
    return y.reshape(x.shape), select64(index, gate0, gate1, B, S).reshape(x.shape)


def add_gate_norm64(x, branch, gate, gate_name, weight=None, bias=None, norm="rms", eps=1e-5, gate_act=None):
    """x + act(gate) * norm(branch), act = identity or tanh."""
    x3 = as_bsd(x.to(F64))
    B, S, D = x3.shape
    g = expand_modulation(gate, gate_name, B, S, D)
    if gate_act == "tanh":
        g = torch.tanh(g)
    return (x3 + g * norm64(as_bsd(branch), weight, bias, norm, eps)).reshape(x.shape)


def token_positions(q: torch.Tensor, positions, position_offset: int) -> torch.Tensor:
    """The cache row of every token of q ([T, H, Dh] or [B, S, H, Dh]), shaped like q's leading dims."""
    leading = q.shape[:-2]
    if positions is not None:
        return positions.long()
    out = torch.empty(leading, dtype=torch.long)
    if len(leading) == 1:
        for t in range(leading[0]):
            out[t] = position_offset + t
    else:
        for b in range(leading[0]):
            for s in range(leading[1]):
                out[b, s] = position_offset + s
    return out


def rope64(v, cache, positions, position_offset=0, interleaved=True) -> torch.Tensor:
    """RoPE as complex multiplication by cos + i sin on the first R = cache.shape[1] dims of each head.

    Interleaved: the complex numbers are the pairs (v[2j], v[2j+1]) (torch.view_as_complex).
    NeoX: the complex number of pair j is v[j] + i v[j + R/2].
    """
    v = v.to(F64)
    R = cache.shape[1]
    half = R // 2
    rows = cache.to(F64)[token_positions(v, positions, position_offset)]  # [..., R]
    rotation = torch.complex(rows[..., :half], rows[..., half:]).unsqueeze(-2)  # [..., 1, R/2]
    rest = v[..., R:]
    if interleaved:
        z = torch.view_as_complex(v[..., :R].contiguous().reshape(*v.shape[:-1], half, 2)) * rotation
        rotated = torch.view_as_real(z).reshape(*v.shape[:-1], R)
    else:
        z = torch.complex(v[..., :half], v[..., half:R]) * rotation
        rotated = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rotated, rest), dim=-1)


def qk_norm_rope64(v, weight, cache, positions, position_offset=0, interleaved=True, eps=1e-6) -> torch.Tensor:
    """RMSNorm over each head (F.rms_norm), then rope64."""
    return rope64(norm64(v, weight, None, "rms", eps), cache, positions, position_offset, interleaved)


def rope_angles64(positions: torch.Tensor, dims, thetas) -> torch.Tensor:
    """[N, R/2] angles with Python math: axis a, pair j turns by p[n, a] * theta_a ** (-2j / d_a)."""
    rows = []
    for n in range(positions.shape[0]):
        row = []
        for axis, (d, theta) in enumerate(zip(dims, thetas)):
            p = float(positions[n, axis])
            row += [p * theta ** (-2 * j / d) for j in range(d // 2)]
        rows.append(row)
    return torch.tensor(rows, dtype=F64)


def cos_sin64(angles: torch.Tensor) -> torch.Tensor:
    """[N, R] cache from [N, R/2] angles: cos columns then sin columns (math.cos / math.sin)."""
    cos = [[math.cos(a) for a in row] for row in angles.tolist()]
    sin = [[math.sin(a) for a in row] for row in angles.tolist()]
    return torch.cat((torch.tensor(cos, dtype=F64), torch.tensor(sin, dtype=F64)), dim=1)


# ----------------------------------------------------------------------------------------
# 1. The reference in float64 against the independent formulation
# ----------------------------------------------------------------------------------------

# (x shape, B, S, D, F): B != S; B == S (where torch broadcasting of [B, D] would silently
# run and be wrong); a 2-D x [N, D] (B = 1).
X_CASES = {
    "B2S6": ((2, 6, 8), 2, 6, 8, 3),
    "B3S3": ((3, 3, 16), 3, 3, 16, 3),
    "N6": ((6, 8), 1, 6, 8, 2),
}
AFFINES = [("layer", False, False), ("layer", True, False), ("layer", True, True), ("layer", False, True),
           ("rms", False, False), ("rms", True, False)]  # fmt: skip


def affine(gen, D, with_weight, with_bias):
    weight = randn(gen, D, scale=0.5) + 1 if with_weight else None
    bias = randn(gen, D, scale=0.5) if with_bias else None
    return weight, bias


@pytest.mark.parametrize("case", list(X_CASES))
@pytest.mark.parametrize("norm,with_weight,with_bias", AFFINES)
@pytest.mark.parametrize("scale_index", range(len(SHAPE_NAMES)))
def test_norm_scale_shift(case, norm, with_weight, with_bias, scale_index):
    x_shape, B, S, D, Fr = X_CASES[case]
    # scale takes every form; shift takes the next form in the list, so pairs differ.
    scale_name, shift_name = SHAPE_NAMES[scale_index], SHAPE_NAMES[(scale_index + 1) % len(SHAPE_NAMES)]
    gen = generator(1000 + scale_index)
    x = randn(gen, *x_shape, scale=2.0) + 0.5
    scale, shift = modulation(gen, scale_name, B, S, D, Fr), modulation(gen, shift_name, B, S, D, Fr)
    weight, bias = affine(gen, D, with_weight, with_bias)
    y = reference.norm_scale_shift(x, scale, shift, weight, bias, norm, 1e-6)
    assert y.dtype == F64 and y.shape == x.shape
    want = norm_scale_shift64(x, scale, scale_name, shift, shift_name, weight, bias, norm, 1e-6)
    torch.testing.assert_close(y, want, **TIGHT)


@pytest.mark.parametrize("case", list(X_CASES))
@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("gate_name", [None, "[B,D]", "[B,S,D]", "[B,F,1,D]", "[]"])
def test_residual_norm_scale_shift(case, norm, gate_name):
    x_shape, B, S, D, Fr = X_CASES[case]
    gen = generator(2000)
    x, residual = randn(gen, *x_shape), randn(gen, *x_shape, scale=3.0)
    gate = None if gate_name is None else modulation(gen, gate_name, B, S, D, Fr)
    scale, shift = modulation(gen, "[B,1,D]", B, S, D, Fr), modulation(gen, "[1,F,1,D]", B, S, D, Fr)
    weight, bias = affine(gen, D, True, norm == "layer")
    residual_before = residual.clone()
    y, residual_out = reference.residual_norm_scale_shift(x, residual, gate, scale, shift, weight, bias, norm, 1e-6)
    want_residual = gated_residual64(x, residual, gate, gate_name)
    torch.testing.assert_close(residual_out, want_residual, **TIGHT)
    want_y = norm_scale_shift64(want_residual, scale, "[B,1,D]", shift, "[1,F,1,D]", weight, bias, norm, 1e-6)
    torch.testing.assert_close(y, want_y, **TIGHT)
    assert torch.equal(residual, residual_before)  # not in place


def select_index(gen, B, S) -> torch.Tensor:
    """0/1 of shape [B, S] with both values present (Qwen-Image-Edit: 0 first, then 1; here mixed)."""
    index = torch.randint(0, 2, (B, S), generator=gen)
    index[0, 0], index[-1, -1] = 0, 1
    return index


@pytest.mark.parametrize("case", list(X_CASES))
@pytest.mark.parametrize("with_weight,with_bias", [(False, False), (True, True)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32, torch.bool])
def test_norm_scale_shift_select(case, with_weight, with_bias, index_dtype):
    x_shape, B, S, D, _ = X_CASES[case]
    gen = generator(3000)
    x = randn(gen, *x_shape)
    index = select_index(gen, B, S).to(index_dtype)
    sets = [randn(gen, B, D, scale=0.5) for _ in range(6)]  # scale0, shift0, gate0, scale1, shift1, gate1
    weight, bias = affine(gen, D, with_weight, with_bias)
    y, gate_out = reference.norm_scale_shift_select(x, index, *sets, weight, bias, 1e-6)
    want_y, want_gate = norm_select64(x, index, *sets, weight, bias, 1e-6)
    torch.testing.assert_close(y, want_y, **TIGHT)
    torch.testing.assert_close(gate_out, want_gate, **TIGHT)
    assert gate_out.shape == x.shape


@pytest.mark.parametrize("case", list(X_CASES))
@pytest.mark.parametrize("with_weight,with_bias", [(False, False), (True, True)])
def test_residual_norm_scale_shift_select(case, with_weight, with_bias):
    x_shape, B, S, D, _ = X_CASES[case]
    gen = generator(4000)
    x, residual, residual_gate = randn(gen, *x_shape), randn(gen, *x_shape), randn(gen, *x_shape)
    index = select_index(gen, B, S)
    sets = [randn(gen, B, D, scale=0.5) for _ in range(6)]
    weight, bias = affine(gen, D, with_weight, with_bias)
    y, residual_out, gate_out = reference.residual_norm_scale_shift_select(
        x, residual, residual_gate, index, *sets, weight, bias, 1e-6
    )
    want_residual = residual + residual_gate * x  # elementwise: residual_gate is a full tensor
    torch.testing.assert_close(residual_out, want_residual, **TIGHT)
    want_y, want_gate = norm_select64(want_residual, index, *sets, weight, bias, 1e-6)
    torch.testing.assert_close(y, want_y, **TIGHT)
    torch.testing.assert_close(gate_out, want_gate, **TIGHT)


GATE_NORM_CASES = [("rms", False, False), ("rms", True, False), ("layer", True, True), ("layer", False, False)]


@pytest.mark.parametrize("case", list(X_CASES))
@pytest.mark.parametrize("norm,with_weight,with_bias", GATE_NORM_CASES)
@pytest.mark.parametrize("gate_act", [None, "tanh"])
@pytest.mark.parametrize("gate_name", ["[B,1,D]", "[B,D]", "[1]", "[B,S,D]", "[B,F,1,D]"])
def test_add_gate_norm(case, norm, with_weight, with_bias, gate_act, gate_name):
    x_shape, B, S, D, Fr = X_CASES[case]
    gen = generator(5000)
    x, branch = randn(gen, *x_shape), randn(gen, *x_shape, scale=4.0)
    gate = modulation(gen, gate_name, B, S, D, Fr, scale=1.5)
    weight, bias = affine(gen, D, with_weight, with_bias)
    out = reference.add_gate_norm(x, branch, gate, weight, bias, norm, 1e-5, gate_act)
    want = add_gate_norm64(x, branch, gate, gate_name, weight, bias, norm, 1e-5, gate_act)
    torch.testing.assert_close(out, want, **TIGHT)


@pytest.mark.parametrize("case", list(X_CASES))
@pytest.mark.parametrize("norm,with_weight,with_bias", GATE_NORM_CASES)
@pytest.mark.parametrize("gate_act", [None, "tanh"])
@pytest.mark.parametrize("gate_name,scale_name", [("[B,1,D]", "[B,1,D]"), ("[B,D]", "[1,S,D]"), ("[B,F,1,D]", "[]")])
def test_add_gate_norm_scale(case, norm, with_weight, with_bias, gate_act, gate_name, scale_name):
    x_shape, B, S, D, Fr = X_CASES[case]
    gen = generator(6000)
    x, branch = randn(gen, *x_shape), randn(gen, *x_shape, scale=4.0)
    gate = modulation(gen, gate_name, B, S, D, Fr, scale=1.5)
    scale = modulation(gen, scale_name, B, S, D, Fr)
    weight, bias = affine(gen, D, with_weight, with_bias)
    weight2, bias2 = affine(gen, D, with_weight, with_bias)
    out, y = reference.add_gate_norm_scale(x, branch, gate, scale, weight, bias, weight2, bias2, norm, 1e-5, gate_act)
    want_out = add_gate_norm64(x, branch, gate, gate_name, weight, bias, norm, 1e-5, gate_act)
    torch.testing.assert_close(out, want_out, **TIGHT)
    n = norm64(as_bsd(want_out), weight2, bias2, norm, 1e-5)
    want_y = (n * (1 + expand_modulation(scale, scale_name, B, S, D))).reshape(x.shape)
    torch.testing.assert_close(y, want_y, **TIGHT)


# RoPE cases: (leading dims, Hq, Hk, Dh, R). GQA, MQA, partial rotary, R = Dh, 3-D and 4-D.
ROPE_CASES = {
    "T5_gqa4-2_full": ((5,), 4, 2, 8, 8),
    "T6_mqa3-1_partial": ((6,), 3, 1, 12, 4),
    "B2S3_2-2_partial": ((2, 3), 2, 2, 10, 6),
    "B2S4_3-1_R2": ((2, 4), 3, 1, 8, 2),
}


def rope_inputs(seed, case, with_positions, position_offset, P=16):
    leading, Hq, Hk, Dh, R = ROPE_CASES[case]
    gen = generator(seed)
    q, k = randn(gen, *leading, Hq, Dh), randn(gen, *leading, Hk, Dh)
    # A cache with arbitrary (not rope-shaped) angles: any [P, R] cos/sin table is valid input.
    angles = randn(gen, P, R // 2, scale=3.0)
    cache = torch.cat((angles.cos(), angles.sin()), dim=1)
    positions = torch.randint(0, P, leading, generator=gen) if with_positions else None
    return q, k, cache, positions, (0 if with_positions else position_offset)


@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("with_positions,position_offset", [(True, 0), (False, 0), (False, 5)])
def test_qk_norm_rope_(case, interleaved, with_positions, position_offset):
    q, k, cache, positions, offset = rope_inputs(7000, case, with_positions, position_offset)
    gen = generator(7001)
    Dh = q.shape[-1]
    q_weight, k_weight = randn(gen, Dh, scale=0.5) + 1, randn(gen, Dh, scale=0.5) + 1
    want_q = qk_norm_rope64(q, q_weight, cache, positions, offset, interleaved, 1e-6)
    want_k = qk_norm_rope64(k, k_weight, cache, positions, offset, interleaved, 1e-6)
    got_q, got_k = reference.qk_norm_rope_(
        q, k, q_weight, k_weight, cache, positions, interleaved, cache.shape[1], 1e-6, offset
    )
    assert got_q is q and got_k is k  # in place
    torch.testing.assert_close(q, want_q, **TIGHT)
    torch.testing.assert_close(k, want_k, **TIGHT)


@pytest.mark.parametrize("case", list(ROPE_CASES))
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("with_positions,position_offset", [(True, 0), (False, 0), (False, 5)])
@pytest.mark.parametrize("with_k", [True, False])
def test_rope_(case, interleaved, with_positions, position_offset, with_k):
    q, k, cache, positions, offset = rope_inputs(8000, case, with_positions, position_offset)
    k = k if with_k else None
    want_q = rope64(q, cache, positions, offset, interleaved)
    want_k = rope64(k, cache, positions, offset, interleaved) if with_k else None
    got_q, got_k = reference.rope_(q, k, cache, positions, interleaved, None, offset)
    assert got_q is q and got_k is k
    torch.testing.assert_close(q, want_q, **TIGHT)
    if with_k:
        torch.testing.assert_close(k, want_k, **TIGHT)


def test_rope_on_views_of_a_fused_qkv_buffer():
    """q and k as slices of one [T, Hq + 2 Hk, Dh] buffer: only their heads change; v is untouched."""
    gen = generator(8500)
    T, Hq, Hk, Dh, R = 5, 4, 2, 8, 6
    qkv = randn(gen, T, Hq + 2 * Hk, Dh)
    q, k, v = qkv[:, :Hq], qkv[:, Hq : Hq + Hk], qkv[:, Hq + Hk :]
    cache = ditops.rope_cos_sin_cache(16, R, dtype=F64)
    positions = torch.randint(0, 16, (T,), generator=gen)
    want_q, want_k = rope64(q, cache, positions, 0, False), rope64(k, cache, positions, 0, False)
    v_before = v.clone()
    reference.rope_(q, k, cache, positions, False, None, 0)
    torch.testing.assert_close(qkv[:, :Hq], want_q, **TIGHT)
    torch.testing.assert_close(qkv[:, Hq : Hq + Hk], want_k, **TIGHT)
    assert torch.equal(qkv[:, Hq + Hk :], v_before)


def test_flux_like_multi_axis_rope_with_position_offset():
    """Image tokens after text: a per-token multi-axis cache (axes 4, 6, 6) read at position_offset + s."""
    gen = generator(8600)
    text, height, width, H, Dh = 3, 2, 3, 2, 20
    ids = [(0, 0, 0)] * text + [(0, h, w) for h in range(height) for w in range(width)]
    cache = ditops.rope_cos_sin_cache(torch.tensor(ids), [4, 6, 6], dtype=F64)  # [text + image, 16]
    q = randn(gen, 1, height * width, H, Dh)  # image tokens only
    weight = randn(gen, Dh, scale=0.5) + 1
    want = qk_norm_rope64(q, weight, cache, None, text, True, 1e-6)
    reference.qk_norm_rope_(q, q.clone(), weight, weight, cache, None, True, None, 1e-6, text)
    torch.testing.assert_close(q, want, **TIGHT)


@pytest.mark.parametrize("op", ["rope_", "qk_norm_rope_"])
@pytest.mark.parametrize("form", ["head", "batch_head", "one_table"])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("with_positions", [True, False])
def test_a_cache_row_per_head(op, form, interleaved, with_positions):
    """A cache with a row per head, [P, H, R], [B, P, H, R] or [1, P, H, R]: head h of item b
    is normalised and rotated as that head alone with the [P, R] cache of its own rows."""
    gen = generator(8800)
    B, S, H, Dh, R, P = 2, 5, 3, 12, 8, 9
    q, k = randn(gen, B, S, H, Dh), randn(gen, B, S, H, Dh)
    angles = randn(gen, B, P, H, R // 2, scale=3.0)
    tables = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [B, P, H, R]
    cache = {"head": tables[0], "batch_head": tables, "one_table": tables[:1]}[form]
    positions = torch.randint(0, P, (B, S), generator=gen) if with_positions else None
    offset = 0 if with_positions else 2
    q_weight, k_weight = randn(gen, Dh, scale=0.5) + 1, randn(gen, Dh, scale=0.5) + 1
    want_q, want_k = q.clone(), k.clone()
    for b in range(B):
        item = slice(b, b + 1)
        item_positions = positions[item] if with_positions else None
        for h in range(H):
            table = tables[b if form == "batch_head" else 0, :, h]
            for want, v, weight in ((want_q, q, q_weight), (want_k, k, k_weight)):
                head = v[item, :, h : h + 1]
                want[item, :, h : h + 1] = (rope64(head, table, item_positions, offset, interleaved) if op == "rope_"
                                            else qk_norm_rope64(head, weight, table, item_positions, offset, interleaved))
    if op == "rope_":
        reference.rope_(q, k, cache, positions, interleaved, None, offset)
    else:
        reference.qk_norm_rope_(q, k, q_weight, k_weight, cache, positions, interleaved, None, 1e-6, offset)
    torch.testing.assert_close(q, want_q, **TIGHT)
    torch.testing.assert_close(k, want_k, **TIGHT)


def test_outputs_written_into_given_tensors():
    """Given output tensors are filled (every element) and returned."""
    gen = generator(8700)
    x, residual = randn(gen, 2, 6, 8), randn(gen, 2, 6, 8)
    scale, shift, gate = randn(gen, 2, 8), randn(gen, 8), randn(gen, 2, 1, 8)
    y, residual_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    got = reference.residual_norm_scale_shift(x, residual, gate, scale, shift, y=y, residual_out=residual_out)
    assert got[0] is y and got[1] is residual_out
    want = reference.residual_norm_scale_shift(x, residual, gate, scale, shift)
    torch.testing.assert_close(got, want, **TIGHT)


# ----------------------------------------------------------------------------------------
# 2. Properties
# ----------------------------------------------------------------------------------------


@st.composite
def rope_problem(draw, P=12):
    """Random small q, k ([T, H, Dh] or [B, S, H, Dh]), a [P, R] cache from rope_cos_sin_cache, positions."""
    seed = draw(st.integers(0, 2**31 - 1))
    gen = generator(seed)
    if draw(st.booleans()):  # [B, S, H, Dh]
        leading = (draw(st.integers(1, 3)), draw(st.integers(1, 4)))
    else:  # [T, H, Dh]
        leading = (draw(st.integers(1, 6)),)
    Hq, Hk = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    Dh = 2 * draw(st.integers(1, 8))
    R = 2 * draw(st.integers(1, Dh // 2))
    theta = draw(st.sampled_from([10000.0, 500.0, 1e6]))
    cache = ditops.rope_cos_sin_cache(P, R, theta=theta, dtype=F64)
    q, k = randn(gen, *leading, Hq, Dh), randn(gen, *leading, Hk, Dh)
    positions = torch.randint(0, P, leading, generator=gen)
    return q, k, cache, positions, draw(st.booleans())


def pair_norms(v: torch.Tensor, R: int, interleaved: bool) -> torch.Tensor:
    first, second = (v[..., 0:R:2], v[..., 1:R:2]) if interleaved else (v[..., : R // 2], v[..., R // 2 : R])
    return torch.hypot(first, second)


@FEW
@given(rope_problem())
def test_rope_keeps_pair_norms(problem):
    q, k, cache, positions, interleaved = problem
    R = cache.shape[1]
    before = [(pair_norms(t, R, interleaved), t[..., R:].clone()) for t in (q, k)]
    reference.rope_(q, k, cache, positions, interleaved, None, 0)
    for t, (norms, rest) in zip((q, k), before):
        torch.testing.assert_close(pair_norms(t, R, interleaved), norms, **TIGHT)
        assert torch.equal(t[..., R:], rest)  # dims [R, Dh) untouched


@FEW
@given(rope_problem())
def test_rope_position_zero_is_identity(problem):
    q, k, cache, positions, interleaved = problem
    R = cache.shape[1]
    assert torch.equal(cache[0, : R // 2], torch.ones(R // 2, dtype=F64))
    assert torch.equal(cache[0, R // 2 :], torch.zeros(R // 2, dtype=F64))
    q0, k0 = q.clone(), k.clone()
    reference.rope_(q, k, cache, torch.zeros_like(positions), interleaved, None, 0)
    assert torch.equal(q, q0) and torch.equal(k, k0)


@FEW
@given(rope_problem(), st.integers(1, 5000))
def test_rope_by_p_then_minus_p_is_identity(problem, p):
    q, k, cache, positions, interleaved = problem
    R = cache.shape[1]
    cache = ditops.rope_cos_sin_cache(torch.tensor([p, -p]), R, dtype=F64)
    q0, k0 = q.clone(), k.clone()
    reference.rope_(q, k, cache, torch.zeros_like(positions), interleaved, None, 0)
    reference.rope_(q, k, cache, torch.ones_like(positions), interleaved, None, 0)
    torch.testing.assert_close(q, q0, **TIGHT)
    torch.testing.assert_close(k, k0, **TIGHT)


@FEW
@given(rope_problem(), st.floats(0.25, 4.0), st.booleans())
def test_qk_norm_rope_at_position_zero_is_rms_norm(problem, w, negative):
    """A cache whose rows are all position 0 makes qk_norm_rope_ a pure RMSNorm; weight = w gives RMS |w|."""
    q, k, cache, positions, interleaved = problem
    P, R = cache.shape
    w = -w if negative else w
    zero_cache = ditops.rope_cos_sin_cache(torch.zeros(P), R, dtype=F64)
    weight = torch.full((q.shape[-1],), w, dtype=F64)
    want_q, want_k = F.rms_norm(q, (q.shape[-1],), weight, 1e-12), F.rms_norm(k, (k.shape[-1],), weight, 1e-12)
    reference.qk_norm_rope_(q, k, weight, weight, zero_cache, positions, interleaved, None, 1e-12, 0)
    torch.testing.assert_close(q, want_q, **TIGHT)
    torch.testing.assert_close(k, want_k, **TIGHT)
    for t in (q, k):
        rms = t.square().mean(-1).sqrt()
        torch.testing.assert_close(rms, torch.full_like(rms, abs(w)), rtol=1e-6, atol=1e-6)


NONZERO = dict(allow_nan=False, allow_infinity=False)


@FEW
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 3),
    st.integers(1, 5),
    st.integers(2, 24),
    st.floats(-0.9, 2.0, **NONZERO).filter(lambda v: v != 0),
    st.floats(-3.0, 3.0, **NONZERO).filter(lambda v: v != 0),
)
def test_norm_rows_standardised(seed, B, S, D, c, d):
    """y = norm(x) * (1 + c) + d: LayerNorm rows have mean d and std |1 + c|; RMSNorm rows of y - d have RMS |1 + c|.

    Exactly, the std is |1 + c| * sqrt(var / (var + eps)) (and likewise with mean(x^2) for RMS);
    with eps = 1e-12 the factor matters only for nearly constant rows, so it is included.
    """
    gen = generator(seed)
    eps = 1e-12
    x = randn(gen, B, S, D, scale=3.0) + randn(gen, B, S, 1)
    scale, shift = torch.tensor(c, dtype=F64), torch.tensor([d], dtype=F64)
    y = reference.norm_scale_shift(x, scale, shift, None, None, "layer", eps)
    var = x.var(-1, unbiased=False)
    mean, std = y.mean(-1), y.var(-1, unbiased=False).sqrt()
    torch.testing.assert_close(mean, torch.full_like(mean, d), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(std, abs(1 + c) * (var / (var + eps)).sqrt(), rtol=1e-9, atol=1e-9)
    y = reference.norm_scale_shift(x, scale, shift, None, None, "rms", eps)
    mean_square = x.square().mean(-1)
    rms = (y - d).square().mean(-1).sqrt()
    torch.testing.assert_close(rms, abs(1 + c) * (mean_square / (mean_square + eps)).sqrt(), rtol=1e-9, atol=1e-9)


@FEW
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 3),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 12),
    st.sampled_from(SHAPE_NAMES),
    st.sampled_from(SHAPE_NAMES),
    st.sampled_from(["layer", "rms"]),
)
def test_norm_scale_shift_random_shapes(seed, B, frames, per_frame, D, scale_name, shift_name, norm):
    """Random B, S = F * (S // F), D and modulation forms against the independent formulation."""
    gen = generator(seed)
    S = frames * per_frame
    x = randn(gen, B, S, D)
    scale, shift = modulation(gen, scale_name, B, S, D, frames), modulation(gen, shift_name, B, S, D, frames)
    y = reference.norm_scale_shift(x, scale, shift, None, None, norm, 1e-6)
    torch.testing.assert_close(y, norm_scale_shift64(x, scale, scale_name, shift, shift_name, None, None, norm), **TIGHT)


# ----------------------------------------------------------------------------------------
# 3. ditops.rope_cos_sin_cache
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("P,R,theta", [(16, 8, 10000.0), (7, 2, 10000.0), (33, 12, 1e6), (5, 6, 500.0)])
def test_rope_cache_one_axis(P, R, theta):
    cache = ditops.rope_cos_sin_cache(P, R, theta=theta, dtype=F64)
    assert cache.shape == (P, R) and cache.dtype == F64
    want = cos_sin64(rope_angles64(torch.arange(P)[:, None], [R], [theta]))
    torch.testing.assert_close(cache, want, **TIGHT)
    # The same rows from a 1-D tensor of positions, in any order; float32 is the float64 cache rounded once.
    positions = torch.randperm(P, generator=generator(P))
    torch.testing.assert_close(ditops.rope_cos_sin_cache(positions, R, theta=theta, dtype=F64), want[positions], **TIGHT)
    assert torch.equal(ditops.rope_cos_sin_cache(P, R, theta=theta), want.to(torch.float32))


def test_rope_cache_fractional_and_negative_positions():
    positions = torch.tensor([0.5, -3.0, 2.25], dtype=F64)
    cache = ditops.rope_cos_sin_cache(positions, 6, dtype=F64)
    torch.testing.assert_close(cache, cos_sin64(rope_angles64(positions[:, None], [6], [10000.0])), **TIGHT)


def test_rope_cache_is_made_on_the_device_asked_for():
    """device= was once ignored for a tensor of positions: the cache came back on their device."""
    assert ditops.rope_cos_sin_cache(torch.arange(4), 8, device="meta").device.type == "meta"
    assert ditops.rope_cos_sin_cache(4, 8, device="meta").device.type == "meta"


@pytest.mark.parametrize("thetas", [10000.0, [10000.0, 500.0, 2000.0]])
def test_rope_cache_multi_axis_flux_like(thetas):
    """FLUX-like ids [N, 3] (text tokens at 0, image tokens at (0, h, w)), axes (4, 6, 6) -> R = 16."""
    ids = torch.tensor([(0, 0, 0)] * 2 + [(0, h, w) for h in range(3) for w in range(4)] + [(5, 1, 2)])
    cache = ditops.rope_cos_sin_cache(ids, [4, 6, 6], theta=thetas, dtype=F64)
    assert cache.shape == (ids.shape[0], 16)
    per_axis = thetas if isinstance(thetas, list) else [thetas] * 3
    torch.testing.assert_close(cache, cos_sin64(rope_angles64(ids, [4, 6, 6], per_axis)), **TIGHT)
    # Each axis's block of cos and sin columns is that axis's own one-axis cache.
    start = 0
    for axis, d in enumerate([4, 6, 6]):
        one = ditops.rope_cos_sin_cache(ids[:, axis], d, theta=per_axis[axis], dtype=F64)
        torch.testing.assert_close(cache[:, start : start + d // 2], one[:, : d // 2], **TIGHT)
        torch.testing.assert_close(cache[:, 8 + start : 8 + start + d // 2], one[:, d // 2 :], **TIGHT)
        start += d // 2


@pytest.mark.parametrize(
    "positions,rotary_dim,theta",
    [
        (8, 5, 10000.0),  # odd R
        (8, 0, 10000.0),  # R = 0
        (8, -4, 10000.0),  # negative R
        (-3, 4, 10000.0),  # negative count
        (torch.zeros(4, 2), 4, 10000.0),  # two axes, one rotary_dim
        (torch.zeros(4, 3), [4, 6], 10000.0),  # three axes, two dims
        (8, [4, 6], 10000.0),  # a count with two axes
        (torch.zeros(4, 2), [4, 6], [10000.0]),  # one theta for two axes
        (torch.zeros(2, 3, 2), [4, 6], 10000.0),  # 3-D positions
        (torch.zeros(()), 4, 10000.0),  # 0-D positions
        (torch.zeros(4, 2), [4, 3], 10000.0),  # one odd axis
        (torch.zeros(4, 0), [], 10000.0),  # no axes
        (8, 4, 0.0),  # theta 0
        (8, 4, -10000.0),  # negative theta
    ],
)
def test_rope_cache_bad_arguments(positions, rotary_dim, theta):
    with pytest.raises(ValueError, match="rope_cos_sin_cache"):
        ditops.rope_cos_sin_cache(positions, rotary_dim, theta=theta)


# ----------------------------------------------------------------------------------------
# 4. Lower precision: the reference rounds once
# ----------------------------------------------------------------------------------------

TOLERANCES = {
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}
LOW = list(TOLERANCES)


def assert_rounded_once(got: torch.Tensor, want64: torch.Tensor, dtype: torch.dtype) -> None:
    """docs/ops.md conformance: dtype, elementwise tolerances, and ||got - want|| / ||want|| <= 4 eps(dtype)."""
    assert got.dtype == dtype and got.shape == want64.shape
    torch.testing.assert_close(got.to(F64), want64, **TOLERANCES[dtype])
    relative = (got.to(F64) - want64).norm() / want64.norm()
    assert relative <= 4 * torch.finfo(dtype).eps, f"relative error {float(relative):.3g}"


def up(*tensors):
    """The same values in float64 (None stays None)."""
    return [None if t is None else t.to(F64) for t in tensors]


def low_inputs(seed, dtype, *shapes, scale=1.0):
    gen = generator(seed)
    return [randn(gen, *shape, dtype=dtype, scale=scale) for shape in shapes]


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_low_precision_norm_scale_shift(dtype, norm):
    (x,) = low_inputs(9000, dtype, (2, 64, 96), scale=2.0)
    scale, shift, weight = low_inputs(9001, torch.float32, (2, 96), (1, 64, 96), (96,), scale=0.5)
    bias = low_inputs(9002, torch.bfloat16, (96,))[0] if norm == "layer" else None
    y = reference.norm_scale_shift(x, scale, shift, weight + 1, bias, norm, 1e-6)
    want = reference.norm_scale_shift(*up(x, scale, shift, weight + 1, bias), norm, 1e-6)
    assert_rounded_once(y, want, dtype)


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_residual_norm_scale_shift(dtype):
    """residual_out is rounded once; y is rounded once from the float64 norm of residual_out as stored."""
    x, residual = low_inputs(9100, dtype, (2, 64, 96), (2, 64, 96))
    gate, scale, shift = low_inputs(9101, torch.float32, (2, 4, 1, 96), (2, 1, 96), (96,), scale=0.5)
    y, residual_out = reference.residual_norm_scale_shift(x, residual, gate, scale, shift, None, None, "layer", 1e-6)
    want_residual = reference.residual_norm_scale_shift(*up(x, residual, gate, scale, shift), None, None, "layer", 1e-6)[1]
    assert_rounded_once(residual_out, want_residual, dtype)
    want_y = reference.norm_scale_shift(*up(residual_out, scale, shift), None, None, "layer", 1e-6)
    assert_rounded_once(y, want_y, dtype)


@pytest.mark.parametrize("dtype", LOW)
def test_low_precision_select(dtype):
    x, residual, residual_gate = low_inputs(9200, dtype, (2, 64, 96), (2, 64, 96), (2, 64, 96))
    sets = low_inputs(9201, torch.float32, *[(2, 96)] * 6, scale=0.5)
    index = select_index(generator(9202), 2, 64)
    y, gate_out = reference.norm_scale_shift_select(x, index, *sets)
    want_y, want_gate = reference.norm_scale_shift_select(up(x)[0], index, *up(*sets))
    assert_rounded_once(y, want_y, dtype)
    assert_rounded_once(gate_out, want_gate, dtype)
    y, residual_out, gate_out = reference.residual_norm_scale_shift_select(x, residual, residual_gate, index, *sets)
    want = reference.residual_norm_scale_shift_select(*up(x, residual, residual_gate), index, *up(*sets))
    assert_rounded_once(residual_out, want[1], dtype)
    assert_rounded_once(gate_out, want[2], dtype)
    want_y = reference.norm_scale_shift_select(up(residual_out)[0], index, *up(*sets))[0]
    assert_rounded_once(y, want_y, dtype)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("gate_act", [None, "tanh"])
def test_low_precision_add_gate_norm(dtype, gate_act):
    x, branch = low_inputs(9300, dtype, (2, 64, 96), (2, 64, 96))
    gate, scale, weight, weight2 = low_inputs(9301, torch.float32, (2, 1, 96), (2, 96), (96,), (96,), scale=0.5)
    out = reference.add_gate_norm(x, branch, gate, weight + 1, None, "rms", 1e-5, gate_act)
    want = reference.add_gate_norm(*up(x, branch, gate, weight + 1), None, "rms", 1e-5, gate_act)
    assert_rounded_once(out, want, dtype)
    out, y = reference.add_gate_norm_scale(x, branch, gate, scale, weight + 1, None, weight2 + 1, None, "rms", 1e-5, gate_act)
    assert_rounded_once(out, want, dtype)
    # y reads out as stored: the float64 norm of the rounded out, times (1 + scale).
    want_y = norm64(up(out)[0], weight2 + 1, None, "rms", 1e-5) * (1 + scale.to(F64)[:, None, :])
    assert_rounded_once(y, want_y, dtype)


@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_low_precision_rope(dtype, interleaved, cache_dtype):
    q, k = low_inputs(9400, dtype, (2, 32, 4, 64), (2, 32, 2, 64), scale=2.0)
    weight_q, weight_k = low_inputs(9401, torch.float32, (64,), (64,), scale=0.5)
    cache = ditops.rope_cos_sin_cache(64, 48, dtype=cache_dtype)  # partial rotary: R = 48 < Dh = 64
    positions = torch.randint(0, 64, (2, 32), generator=generator(9402))
    want_q, want_k = up(q, k)
    reference.rope_(want_q, want_k, up(cache)[0], positions, interleaved, None, 0)
    got_q, got_k = q.clone(), k.clone()
    reference.rope_(got_q, got_k, cache, positions, interleaved, None, 0)
    assert_rounded_once(got_q, want_q, dtype)
    assert_rounded_once(got_k, want_k, dtype)
    want_q, want_k = up(q, k)
    reference.qk_norm_rope_(want_q, want_k, *up(weight_q + 1, weight_k + 1, cache), None, interleaved, None, 1e-6, 16)
    reference.qk_norm_rope_(q, k, weight_q + 1, weight_k + 1, cache, None, interleaved, None, 1e-6, 16)
    assert_rounded_once(q, want_q, dtype)
    assert_rounded_once(k, want_k, dtype)
