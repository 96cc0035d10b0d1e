"""Every bad-input rule of the ops (docs/ops.md, "General rules") raises a clear ValueError.

Each case starts from a valid call (the builders below), replaces one or a few arguments
and checks that the message names the argument, what it got and what it wanted. The
message format is ``"<op>: <argument> <got>; wanted <wanted>"`` (ditops/validation.py).
Tensors on another device are faked with the ``meta`` device, so no GPU is needed.
"""

from __future__ import annotations

import re

import pytest
import torch

import ditops

B, S, D = 2, 6, 8  # norm ops: x is [B, S, D]
T, HQ, HK, DH, R, P = 5, 4, 2, 16, 8, 10  # RoPE ops: q [T, HQ, DH], k [T, HK, DH], cache [P, R]
FLOATS = "one of float16, bfloat16, float32, float64"


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def meta(*shape, dtype=torch.float32):
    """A tensor on another device than the CPU activations."""
    return torch.empty(shape, dtype=dtype, device="meta")


# Valid arguments for each op; every test replaces some of them.


def norm_scale_shift_args():
    return dict(x=randn(B, S, D), scale=randn(B, 1, D, seed=1), shift=randn(B, D, seed=2),
                weight=randn(D, seed=3), bias=randn(D, seed=4))


def residual_norm_scale_shift_args():
    return dict(x=randn(B, S, D), residual=randn(B, S, D, seed=1), gate=randn(B, D, seed=2),
                scale=randn(B, D, seed=3), shift=randn(B, D, seed=4), weight=randn(D, seed=5), bias=randn(D, seed=6))


def _select_modulation():
    names = ("scale0", "shift0", "gate0", "scale1", "shift1", "gate1")
    return {name: randn(B, D, seed=10 + i) for i, name in enumerate(names)}


def norm_scale_shift_select_args():
    index = torch.randint(0, 2, (B, S), generator=torch.Generator().manual_seed(1))
    return dict(x=randn(B, S, D), index=index, **_select_modulation(), weight=randn(D, seed=2), bias=randn(D, seed=3))


def residual_norm_scale_shift_select_args():
    return dict(norm_scale_shift_select_args(), residual=randn(B, S, D, seed=4), residual_gate=randn(B, S, D, seed=5))


def add_gate_norm_args():  # norm="rms" by default
    return dict(x=randn(B, S, D), branch=randn(B, S, D, seed=1), gate=randn(B, D, seed=2), weight=randn(D, seed=3))


def add_gate_norm_scale_args():
    return dict(add_gate_norm_args(), scale=randn(B, 1, D, seed=4), weight2=randn(D, seed=5))


def rope_args():
    positions = torch.randint(0, P, (T,), generator=torch.Generator().manual_seed(1))
    return dict(q=randn(T, HQ, DH), k=randn(T, HK, DH, seed=2), cos_sin_cache=randn(P, R, seed=3), positions=positions)


def qk_norm_rope_args():
    return dict(rope_args(), q_weight=randn(DH, seed=4), k_weight=randn(DH, seed=5))


BUILDERS = {
    "norm_scale_shift": norm_scale_shift_args,
    "residual_norm_scale_shift": residual_norm_scale_shift_args,
    "norm_scale_shift_select": norm_scale_shift_select_args,
    "residual_norm_scale_shift_select": residual_norm_scale_shift_select_args,
    "add_gate_norm": add_gate_norm_args,
    "add_gate_norm_scale": add_gate_norm_scale_args,
    "qk_norm_rope_": qk_norm_rope_args,
    "rope_": rope_args,
}
NORM_OPS = ["norm_scale_shift", "residual_norm_scale_shift", "add_gate_norm", "add_gate_norm_scale"]
SELECT_OPS = ["norm_scale_shift_select", "residual_norm_scale_shift_select"]
ROPE_OPS = ["qk_norm_rope_", "rope_"]
PAIRS = {"residual_norm_scale_shift": "residual", "residual_norm_scale_shift_select": "residual",
         "add_gate_norm": "branch", "add_gate_norm_scale": "branch"}  # second activation, same shape and dtype as x
MODULATION = {"norm_scale_shift": ["scale", "shift"], "residual_norm_scale_shift": ["gate", "scale", "shift"],
              "add_gate_norm": ["gate"], "add_gate_norm_scale": ["gate", "scale"]}


def call(op, **changes):
    arguments = BUILDERS[op]()
    arguments.update(changes)
    return getattr(ditops, op)(**arguments)


def case(rule, op, changes, argument, got, wanted):
    """One bad call: ``changes`` to the valid arguments, and the message expected from it."""
    return pytest.param(op, changes, argument, got, wanted, id=f"{op}-{rule}")


@pytest.mark.parametrize("op", BUILDERS)
def test_valid_arguments_pass(op):
    """The builders are valid, so each failure below comes from the replaced argument."""
    arguments = BUILDERS[op]()
    before = {name: t.clone() for name, t in arguments.items() if name in ("q", "k")}
    getattr(ditops, op)(**arguments)
    for name, t in before.items():  # makes the "unchanged after a failure" tests meaningful
        assert not torch.equal(arguments[name], t)


# ---- Rules shared by every op: types, dtypes and devices.

FIRST = {op: "q" if op in ROPE_OPS else "x" for op in BUILDERS}
GENERAL = [
    *(case("x-not-tensor", op, {FIRST[op]: [[1.0, 2.0]]}, FIRST[op], "is a list", "a torch.Tensor") for op in BUILDERS),
    *(case("x-int32", op, {FIRST[op]: randn(B, S, D).to(torch.int32)}, FIRST[op], "has dtype int32", FLOATS)
      for op in BUILDERS),
    case("scale-python-float", "norm_scale_shift", {"scale": 0.5}, "scale", "is a float", "a torch.Tensor"),
    case("gate-int64", "add_gate_norm", {"gate": torch.ones(B, D, dtype=torch.int64)}, "gate", "has dtype int64", FLOATS),
    case("weight-int32", "norm_scale_shift", {"weight": torch.ones(D, dtype=torch.int32)}, "weight", "has dtype int32",
         FLOATS),
    case("index-not-tensor", "norm_scale_shift_select", {"index": [[0, 1]]}, "index", "is a list", "an integer"),
    case("positions-not-tensor", "rope_", {"positions": list(range(T))}, "positions", "is a list", "a torch.Tensor"),
    case("cache-int64", "rope_", {"cos_sin_cache": torch.ones(P, R, dtype=torch.int64)}, "cos_sin_cache",
         "has dtype int64", FLOATS),
    case("q_weight-int32", "qk_norm_rope_", {"q_weight": torch.ones(DH, dtype=torch.int32)}, "q_weight",
         "has dtype int32", FLOATS),
]
DEVICES = [
    case("scale-on-other-device", "norm_scale_shift", {"scale": meta(B, D)}, "scale", "is on meta", "cpu"),
    case("gate-on-other-device", "residual_norm_scale_shift", {"gate": meta(B, D)}, "gate", "is on meta", "cpu"),
    case("residual-on-other-device", "residual_norm_scale_shift", {"residual": meta(B, S, D)}, "residual",
         "is on meta", "cpu"),
    case("weight-on-other-device", "add_gate_norm", {"weight": meta(D)}, "weight", "is on meta", "cpu"),
    case("bias2-on-other-device", "add_gate_norm_scale", {"bias2": meta(D), "norm": "layer"}, "bias2", "is on meta",
         "cpu"),
    case("index-on-other-device", "norm_scale_shift_select", {"index": meta(B, S, dtype=torch.int64)}, "index",
         "is on meta", "cpu"),
    case("gate1-on-other-device", "norm_scale_shift_select", {"gate1": meta(B, D)}, "gate1", "is on meta", "cpu"),
    case("residual_gate-on-other-device", "residual_norm_scale_shift_select", {"residual_gate": meta(B, S, D)},
         "residual_gate", "is on meta", "cpu"),
    case("k-on-other-device", "rope_", {"k": meta(T, HK, DH)}, "k", "is on meta", "cpu"),
    case("cache-on-other-device", "rope_", {"cos_sin_cache": meta(P, R)}, "cos_sin_cache", "is on meta", "cpu"),
    case("positions-on-other-device", "rope_", {"positions": meta(T, dtype=torch.int64)}, "positions", "is on meta",
         "cpu"),
    case("k_weight-on-other-device", "qk_norm_rope_", {"k_weight": meta(DH)}, "k_weight", "is on meta", "cpu"),
]

# ---- Norm ops: shapes of x, modulation, affine parameters; norm, gate_act, eps.

BAD_MODULATION_SHAPES = [
    ("wrong-D", (D + 1,), "[9]"),
    ("BD-wrong-B", (B + 1, D), "[3, 8]"),
    ("BSD-wrong-S", (B, S + 1, D), "[2, 7, 8]"),
    ("frame-S-not-divisible-by-F", (B, 4, 1, D), "[2, 4, 1, 8]"),
]
MODULATION_WANTED = "[B, F, 1, D] with S % F == 0 (here B=2, S=6, D=8)"


def _ranked(op, shape):
    """x (and the activations that must match it) with another rank."""
    names = ["x", PAIRS.get(op), "residual_gate" if op == "residual_norm_scale_shift_select" else None]
    return {name: randn(*shape, seed=i) for i, name in enumerate(names) if name}


NORMS = [
    *(case(f"x-{len(shape)}d", op, _ranked(op, shape), "x", f"has shape {list(shape)}", "[B, S, D] or [N, D]")
      for op in NORM_OPS + SELECT_OPS for shape in ((D,), (B, S, 1, D))),
    *(case(f"{name}-{rule}", op, {name: randn(*shape)}, name, f"has shape {got}", MODULATION_WANTED)
      for op, names in MODULATION.items() for name in names for rule, shape, got in BAD_MODULATION_SHAPES),
    *(case("weight-shape", op, {"weight": randn(D + 1)}, "weight", "has shape [9]", "[8]") for op in NORM_OPS + SELECT_OPS),
    *(case("bias-shape", op, {"bias": randn(1, D), "norm": "layer"}, "bias", "has shape [1, 8]", "[8]")
      for op in NORM_OPS),
    case("bias-shape", "norm_scale_shift_select", {"bias": randn(D - 1)}, "bias", "has shape [7]", "[8]"),
    case("weight2-shape", "add_gate_norm_scale", {"weight2": randn(2 * D)}, "weight2", "has shape [16]", "[8]"),
    case("bias2-shape", "add_gate_norm_scale", {"bias2": randn(D, 1), "norm": "layer"}, "bias2", "has shape [8, 1]",
         "[8]"),
    *(case("bias-with-rms", op, {"bias": randn(D), "norm": "rms"}, "bias", "is a tensor with norm='rms'", "None")
      for op in NORM_OPS),
    case("bias2-with-rms", "add_gate_norm_scale", {"bias2": randn(D)}, "bias2", "is a tensor with norm='rms'", "None"),
    *(case("unknown-norm", op, {"norm": "group"}, "norm", "is 'group'", "one of 'layer', 'rms'") for op in NORM_OPS),
    *(case("bad-gate_act", op, {"gate_act": "relu"}, "gate_act", "is 'relu'", "one of None, 'tanh'")
      for op in ("add_gate_norm", "add_gate_norm_scale")),
    *(case("negative-eps", op, {"eps": -1e-6}, "eps", "is -1e-06", "a number >= 0")
      for op in NORM_OPS + SELECT_OPS + ["qk_norm_rope_"]),
    case("nan-eps", "norm_scale_shift", {"eps": float("nan")}, "eps", "is nan", "a number >= 0"),
    case("string-eps", "add_gate_norm", {"eps": "1e-5"}, "eps", "is '1e-5'", "a number >= 0"),
]
PAIRS_RULES = [
    *(case(f"{name}-shape", op, {name: randn(B, S + 1, D)}, name, "has shape [2, 7, 8]", "the shape of x, [2, 6, 8]")
      for op, name in PAIRS.items()),
    *(case(f"{name}-dtype", op, {name: randn(B, S, D, dtype=torch.float16)}, name, "has dtype float16",
           "the dtype of x, float32") for op, name in PAIRS.items()),
]

# ---- Select ops: index, [B, D] modulation, residual_gate.

SELECT = [
    *(case("index-float", op, {"index": torch.ones(B, S)}, "index", "has dtype float32",
           "an integer or bool tensor of 0/1") for op in SELECT_OPS),
    *(case("index-shape", op, {"index": torch.ones(B, S + 1, dtype=torch.int64)}, "index", "has shape [2, 7]",
           "[B, S] = [2, 6]") for op in SELECT_OPS),
    case("index-flat", "norm_scale_shift_select", {"index": torch.ones(B * S, dtype=torch.int32)}, "index",
         "has shape [12]", "[B, S] = [2, 6]"),
    *(case(f"{name}-not-BD", op, {name: randn(*shape)}, name, f"has shape {list(shape)}", "[B, D] = [2, 8]")
      for op in SELECT_OPS for name, shape in (("scale0", (D,)), ("gate1", (B, 1, D)), ("shift1", (1, D)))),
    case("residual_gate-shape", "residual_norm_scale_shift_select", {"residual_gate": randn(B, D)}, "residual_gate",
         "has shape [2, 8]", "the shape of x, [2, 6, 8]"),
]

# ---- Modulation tables: modulation_index and the tables it reads (norm_scale_shift, residual_norm_scale_shift
# and their FP8 forms).

K = 4
FP8 = dict(fp8_dtype=torch.float8_e4m3fn)  # the CPU has no FP8 format of its own
TABLE_OPS = {
    "norm_scale_shift": dict(scale=randn(K, D, seed=7), shift=randn(B, K, D, seed=8)),
    "residual_norm_scale_shift": dict(gate=randn(1, K, D, seed=7), scale=randn(K, D, seed=8), shift=randn(D, seed=9)),
    "norm_scale_shift_fp8": dict(scale=randn(K, D, seed=7), shift=randn(B, K, D, seed=8), **FP8),
    "residual_norm_scale_shift_fp8": dict(gate=randn(1, K, D, seed=7), scale=randn(K, D, seed=8), shift=randn(D, seed=9),
                                          **FP8),
}
INDEX_WANTED = "[B, S] = [2, 6] or [S] = [6]"
TABLES_WANTED = "one of [], [1], [D] or a table [K, D], [B, K, D], [1, K, D] with K >= 1 (here B=2, D=8)"


def _tables(op, **changes):
    """Valid arguments of op with tables and an index [B, S], then ``changes``."""
    index = torch.randint(0, K, (B, S), generator=torch.Generator().manual_seed(3))
    return {**BUILDERS[op.removesuffix("_fp8")](), **TABLE_OPS[op], "modulation_index": index, **changes}


TABLES = [
    *(rule for op in TABLE_OPS for rule in (
        case("index-not-tensor", op, _tables(op, modulation_index=[[0, 1]]), "modulation_index", "is a list",
             "a torch.Tensor"),
        case("index-float", op, _tables(op, modulation_index=torch.zeros(B, S)), "modulation_index",
             "has dtype float32", "one of int32, int64"),
        case("index-bool", op, _tables(op, modulation_index=torch.zeros(B, S, dtype=torch.bool)), "modulation_index",
             "has dtype bool", "one of int32, int64"),
        case("index-on-other-device", op, _tables(op, modulation_index=meta(B, S, dtype=torch.int64)),
             "modulation_index", "is on meta", "cpu"),
        case("index-shape", op, _tables(op, modulation_index=torch.zeros(B, S + 1, dtype=torch.int64)),
             "modulation_index", "has shape [2, 7]", INDEX_WANTED),
        case("index-flat", op, _tables(op, modulation_index=torch.zeros(B * S, dtype=torch.int32)), "modulation_index",
             "has shape [12]", INDEX_WANTED),
        case("index-one-batch-item", op, _tables(op, modulation_index=torch.zeros(1, S, dtype=torch.int64)),
             "modulation_index", "has shape [1, 6]", INDEX_WANTED),
        case("frame-with-index", op, _tables(op, scale=randn(B, 3, 1, D)), "scale",
             "has shape [2, 3, 1, 8] with modulation_index given", TABLES_WANTED),
        case("table-wrong-D", op, _tables(op, shift=randn(K, D + 1)), "shift",
             "has shape [4, 9] with modulation_index given", TABLES_WANTED),
        case("table-wrong-B", op, _tables(op, scale=randn(B + 1, K, D)), "scale",
             "has shape [3, 4, 8] with modulation_index given", TABLES_WANTED),
        case("table-no-rows", op, _tables(op, scale=randn(0, D)), "scale", "has shape [0, 8] with modulation_index given",
             TABLES_WANTED),
        case("tables-of-two-K", op, _tables(op, shift=randn(K + 2, D)), "shift", "has K=6 rows",
             "the K of " + ("gate, 4" if op.startswith("residual") else "scale, 4")),
    )),
]


@pytest.mark.parametrize("op, arguments, argument, got, wanted", TABLES)
def test_bad_table_argument_raises(op, arguments, argument, got, wanted):
    pattern = f"^{re.escape(op)}: {re.escape(argument)} .*{re.escape(got)}.*; wanted .*{re.escape(wanted)}"
    with pytest.raises(ValueError, match=pattern):
        getattr(ditops, op)(**arguments)


@pytest.mark.parametrize("op", TABLE_OPS)
def test_valid_table_forms_pass(op):
    """Tables of K = 1 ([1, D] and [1, 1, D] are tables beside an index), [1, K, D], an index
    shared by the batch items ([S]) and int32, out-of-range values (clamped), and scalars and
    vectors beside tables; and, with no table at all, an index that nothing reads."""
    shared = torch.tensor([0, 5, -1, 3, 2, 1], dtype=torch.int32)
    residual = op.startswith("residual")
    names = ("gate", "scale", "shift") if residual else ("scale", "shift")
    two_d = {name: randn(S, D, seed=i) for i, name in enumerate(("x", "residual") if residual else ("x",))}
    for arguments in (
        _tables(op, **{name: randn(1, D, seed=i) if i % 2 else randn(1, 1, D, seed=i) for i, name in enumerate(names)}),
        _tables(op, **{names[0]: randn(D), names[-1]: randn()}),
        _tables(op, **{names[-1]: randn(1, K, D)}, modulation_index=shared),
        _tables(op, **{name: randn(D, seed=i) for i, name in enumerate(names)}),
        _tables(op, **two_d, **{names[-1]: randn(1, K, D)}, modulation_index=shared[None]),
    ):
        getattr(ditops, op)(**arguments)


# ---- RoPE ops: q, k, cos_sin_cache, positions, offsets, flags.

HEADS_WANTED = "[T, H, Dh] or [B, S, H, Dh]"
CACHE_WANTED = "[P, R], [P, H, R] or [B, P, H, R] with R even and 2 <= R <= Dh = 16"
ROPE = [
    *(rule for op in ROPE_OPS for rule in (
        case("q-2d", op, {"q": randn(T, DH)}, "q", "has shape [5, 16]", HEADS_WANTED),
        case("q-5d", op, {"q": randn(1, 1, T, HQ, DH)}, "q", "has shape [1, 1, 5, 4, 16]", HEADS_WANTED),
        case("odd-Dh", op, {"q": randn(T, HQ, 15)}, "q", "has head size Dh=15", "an even Dh in [2, 512]"),
        case("Dh-over-512", op, {"q": randn(1, 1, 514)}, "q", "has head size Dh=514", "an even Dh in [2, 512]"),
        case("k-leading-dims", op, {"k": randn(T + 1, HK, DH)}, "k", "has shape [6, 2, 16]", "[5, Hk, 16]"),
        case("k-Dh", op, {"k": randn(T, HK, DH // 2)}, "k", "has shape [5, 2, 8]", "[5, Hk, 16]"),
        case("k-rank", op, {"k": randn(1, T, HK, DH)}, "k", "has shape [1, 5, 2, 16]", "[5, Hk, 16]"),
        case("k-dtype", op, {"k": randn(T, HK, DH, dtype=torch.bfloat16)}, "k", "has dtype bfloat16",
             "the dtype of q, float32"),
        # q made by transposing heads and tokens of a [H, T, Dh] buffer: head stride T * Dh.
        case("q-heads-tokens-transposed", op, {"q": randn(HQ, T, DH).transpose(0, 1)}, "q",
             "has head and dim strides [80, 1]", "(16, 1)"),
        case("k-dim-stride-2", op, {"k": randn(T, HK, DH, 2)[..., 0]}, "k", "has head and dim strides [32, 2]",
             "(16, 1)"),
        case("q-expanded", op, {"q": randn(1, HQ, DH).expand(T, HQ, DH)}, "q",
             "is expanded (stride 0) along dimension 0", "a tensor that can be written in place"),
        case("cache-5d", op, {"cos_sin_cache": randn(1, P, HQ, 1, R)}, "cos_sin_cache", "has shape [1, 10, 4, 1, 8]",
             CACHE_WANTED),
        case("cache-1d", op, {"cos_sin_cache": randn(R)}, "cos_sin_cache", "has shape [8]", CACHE_WANTED),
        # a row per head: q's heads, and k's (under GQA k's rows would be undefined)
        case("head-cache-heads", op, {"cos_sin_cache": randn(P, HQ + 1, R)}, "cos_sin_cache",
             "has shape [10, 5, 8], rows for H=5 heads", "a row per head of q, H = 4"),
        case("head-cache-gqa", op, {"cos_sin_cache": randn(P, HQ, R)}, "cos_sin_cache",
             "has a row per head, for q's 4 heads and k's 2", "a [P, R] cache where q and k have different head counts"),
        case("head-cache-batch-for-3d-q", op, {"cos_sin_cache": randn(1, P, HQ, R), "k": randn(T, HQ, DH)},
             "cos_sin_cache",
             "has shape [1, 10, 4, 8], a table per batch item, for q of shape [5, 4, 16]",
             "q as [B, S, H, Dh] beside a [B, P, H, R] cache"),
        case("cache-odd-R", op, {"cos_sin_cache": randn(P, R - 1)}, "cos_sin_cache", "has shape [10, 7]", CACHE_WANTED),
        case("cache-R-over-Dh", op, {"cos_sin_cache": randn(P, DH + 2)}, "cos_sin_cache", "has shape [10, 18]",
             CACHE_WANTED),
        case("cache-column-stride", op, {"cos_sin_cache": randn(R, P).t()}, "cos_sin_cache", "has strides [1, 10]",
             "a last dimension of stride 1"),
        case("rotary_dim-not-R", op, {"rotary_dim": R // 2}, "rotary_dim", "is 4",
             "None or cos_sin_cache.shape[-1] = 8"),
        case("positions-float", op, {"positions": torch.ones(T)}, "positions", "has dtype float32",
             "one of int32, int64"),
        case("positions-shape", op, {"positions": torch.ones(T + 1, dtype=torch.int32)}, "positions",
             "has shape [6]", "q's leading shape [5]"),
        case("positions-negative", op, {"positions": torch.tensor([0, 1, -1, 2, 3])}, "positions",
             "has values in [-1, 3]", "values in [0, 10)"),
        case("positions-past-cache", op, {"positions": torch.tensor([0, 1, 9, 10, 3], dtype=torch.int32)}, "positions",
             "has values in [0, 10]", "values in [0, 10)"),
        case("offset-with-positions", op, {"position_offset": 2}, "position_offset", "is 2 with positions given", "0"),
        case("offset-plus-S-past-cache", op, {"positions": None, "position_offset": P - T + 1}, "cos_sin_cache",
             "has 10 rows", "at least position_offset + S = 6 + 5 rows"),
        case("negative-offset", op, {"positions": None, "position_offset": -1}, "position_offset", "is -1",
             "an int >= 0"),
        case("interleaved-int", op, {"interleaved": 1}, "interleaved", "is 1", "True or False"),
        case("interleaved-string", op, {"interleaved": "neox"}, "interleaved", "is 'neox'", "True or False"),
    )),
    # For [B, S, H, Dh], positions is [B, S] and the offset check counts S tokens, not B * S.
    case("4d-positions-shape", "rope_", {"q": randn(B, T, HQ, DH), "k": None, "positions": torch.ones(B * T,
         dtype=torch.int64)}, "positions", "has shape [10]", "q's leading shape [2, 5]"),
    case("4d-offset-plus-S-past-cache", "rope_", {"q": randn(B, T, HQ, DH), "k": None, "positions": None,
         "position_offset": P - T + 1}, "cos_sin_cache", "has 10 rows", "at least position_offset + S = 6 + 5 rows"),
    # a table per batch item: B of q, or one for every item; its rows count positions as a [P, R] cache's
    case("head-cache-batch", "rope_", {"q": randn(B, T, HQ, DH), "k": None, "positions": None,
         "cos_sin_cache": randn(B + 1, P, HQ, R)}, "cos_sin_cache", "has shape [3, 10, 4, 8], tables for B=3 batch items",
         "one per batch item of q, B = 2, or one for every item, B = 1"),
    case("head-cache-offset-plus-S-past-rows", "rope_", {"q": randn(B, T, HQ, DH), "k": None, "positions": None,
         "cos_sin_cache": randn(B, P, HQ, R), "position_offset": P - T + 1}, "cos_sin_cache", "has 10 rows",
         "at least position_offset + S = 6 + 5 rows"),
    case("head-cache-positions-past-rows", "rope_", {"k": None, "cos_sin_cache": randn(P, HQ, R),
         "positions": torch.tensor([0, 1, 9, 10, 3])}, "positions", "has values in [0, 10]", "values in [0, 10)"),
    case("k-None", "qk_norm_rope_", {"k": None}, "k", "is None", "a tensor (only rope_ takes k=None)"),
    case("q_weight-shape", "qk_norm_rope_", {"q_weight": randn(HQ, DH)}, "q_weight", "has shape [4, 16]", "[16]"),
    case("k_weight-shape", "qk_norm_rope_", {"k_weight": randn(DH + 2)}, "k_weight", "has shape [18]", "[16]"),
    case("norm-bad", "qk_norm_rope_", {"norm": "group"}, "norm", "is 'group'", "one of 'layer', 'rms'"),
    case("q_bias-with-rms", "qk_norm_rope_", {"q_bias": randn(DH)}, "q_bias", "is a tensor with norm='rms'",
         "None (RMSNorm has no bias)"),
    case("k_bias-shape", "qk_norm_rope_", {"norm": "layer", "k_bias": randn(DH + 2)}, "k_bias", "has shape [18]", "[16]"),
]


@pytest.mark.parametrize("op, changes, argument, got, wanted", GENERAL + DEVICES + NORMS + PAIRS_RULES + SELECT + ROPE)
def test_bad_argument_raises(op, changes, argument, got, wanted):
    # "<op>: <argument> ...<got>...; wanted ...<wanted>..."
    pattern = f"^{re.escape(op)}: {re.escape(argument)} .*{re.escape(got)}.*; wanted .*{re.escape(wanted)}"
    with pytest.raises(ValueError, match=pattern):
        call(op, **changes)


def test_valid_edge_forms_pass():
    """The boundaries of the rules above are accepted: frames that divide S, offset + S == P, Dh = 512,
    a cache whose rows are strided."""
    call("norm_scale_shift", scale=randn(B, 3, 1, D), shift=randn(1, 2, 1, D))
    call("rope_", positions=None, position_offset=P - T)
    call("rope_", q=randn(B, T, HQ, DH), k=None, positions=None, position_offset=P - T)
    call("rope_", q=randn(1, 1, 512), k=None, cos_sin_cache=randn(P, 512), positions=None)
    call("rope_", positions=torch.tensor([0, P - 1, 0, P - 1, 3], dtype=torch.int32))
    call("rope_", cos_sin_cache=randn(P, 2 * R)[:, :R])  # rows strided, columns contiguous: the kernels take a row stride
    # a row per head: [P, H, R], its head axis expanded, a table per item or one for all, read through strides
    call("rope_", k=None, cos_sin_cache=randn(P, HQ, R))
    call("qk_norm_rope_", k=randn(T, HQ, DH), cos_sin_cache=randn(P, 1, R).expand(P, HQ, R))
    call("rope_", q=randn(B, T, HQ, DH), k=randn(B, T, HQ, DH), positions=None, cos_sin_cache=randn(1, P, HQ, R))
    call("rope_", q=randn(B, T, HQ, DH), k=None, positions=None, cos_sin_cache=randn(B, HQ, P, R).transpose(1, 2))


# ---- Nothing is written before validation passes.

# A bad cos_sin_cache: too few rows, a wrong width, dtype, layout or device.
BAD_CACHES = {
    "cache-rows": {"positions": None, "position_offset": P - T + 1},
    "cache-odd-width": {"cos_sin_cache": randn(P, R - 1)},
    "cache-width-over-Dh": {"cos_sin_cache": randn(P, DH + 2)},
    "cache-int64": {"cos_sin_cache": torch.ones(P, R, dtype=torch.int64)},
    "cache-column-stride": {"cos_sin_cache": randn(R, P).t()},
    "cache-on-meta": {"cos_sin_cache": meta(P, R)},
    "head-cache-gqa": {"cos_sin_cache": randn(P, HQ, R)},
}
IN_PLACE_FAILURES = [
    *(pytest.param(op, {"positions": torch.tensor([0, 1, 2, 3, P])}, "positions", id=f"{op}-positions-past-cache")
      for op in ROPE_OPS),
    *(pytest.param(op, {"interleaved": "yes"}, "interleaved", id=f"{op}-interleaved") for op in ROPE_OPS),
    *(pytest.param(op, changes, "cos_sin_cache", id=f"{op}-{rule}") for op in ROPE_OPS
      for rule, changes in BAD_CACHES.items()),
    pytest.param("qk_norm_rope_", {"k_weight": randn(DH + 2)}, "k_weight", id="qk_norm_rope_-k_weight"),
    pytest.param("qk_norm_rope_", {"eps": -1.0}, "eps", id="qk_norm_rope_-eps"),
]


@pytest.mark.parametrize("op, changes, argument", IN_PLACE_FAILURES)
def test_in_place_ops_leave_q_and_k_unchanged(op, changes, argument):
    arguments = dict(BUILDERS[op](), **changes)
    q, k = arguments["q"].clone(), arguments["k"].clone()
    with pytest.raises(ValueError, match=f"^{re.escape(op)}: {argument} "):
        getattr(ditops, op)(**arguments)
    assert torch.equal(arguments["q"], q) and torch.equal(arguments["k"], k)


@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({"shift": randn(B, 4, 1, D)}, id="shift-frames"),
        pytest.param({"bias": randn(D), "norm": "rms"}, id="bias-with-rms"),
        pytest.param({"eps": -1.0}, id="eps"),
        pytest.param({"scale": randn(K, D), "modulation_index": torch.zeros(B, S + 1, dtype=torch.int64)},
                     id="modulation_index-shape"),
        pytest.param({"scale": randn(K, D), "shift": randn(K + 1, D), "modulation_index": torch.zeros(B, S, dtype=torch.int64)},
                     id="tables-of-two-K"),
    ],
)
def test_residual_norm_scale_shift_leaves_inputs_unchanged(changes):
    arguments = dict(residual_norm_scale_shift_args(), **changes)
    before = {name: t.clone() for name, t in arguments.items() if isinstance(t, torch.Tensor)}
    with pytest.raises(ValueError):
        ditops.residual_norm_scale_shift(**arguments)
    for name, t in before.items():
        assert torch.equal(arguments[name], t), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: position values on a GPU are read only with DITOPS_DEBUG=1")
def test_gpu_position_range_is_checked_in_debug_mode(monkeypatch):
    def arguments():
        q, k = randn(4, 2, 8).cuda(), randn(4, 2, 8).cuda()
        return dict(q=q, k=k, cos_sin_cache=ditops.rope_cos_sin_cache(4, 8, device="cuda"),
                    positions=torch.tensor([0, 1, 2, 9], device="cuda"))

    monkeypatch.setenv("DITOPS_DEBUG", "1")
    with pytest.raises(ValueError, match=r"positions has values in \[0, 9\]; wanted values in \[0, 4\)"):
        ditops.rope_(**arguments())


@pytest.mark.parametrize("call, named", [
    (lambda: ditops.rope_cos_sin_cache(2.5, 32), "positions is a float"),
    (lambda: ditops.rope_cos_sin_cache(True, 32), "positions is a bool"),
    (lambda: ditops.rope_cos_sin_cache([0, 1], 32), "positions is a list"),
    (lambda: ditops.rope_cos_sin_cache(-1, 32), "positions is -1"),
    (lambda: ditops.rope_cos_sin_cache(torch.tensor([True, False]), 32), "positions has dtype torch.bool"),
    (lambda: ditops.rope_cos_sin_cache(torch.zeros(4, 2), 32), "positions has shape [4, 2] with 1 axis dims"),
    (lambda: ditops.rope_cos_sin_cache(torch.zeros(4, 3), [8, 8]), "positions has shape [4, 3] with 2 axis dims"),
    (lambda: ditops.rope_cos_sin_cache(torch.zeros(4, 2), [8, 8], theta=[1e4]), "and 1 thetas"),
    (lambda: ditops.rope_cos_sin_cache(torch.zeros(4, 0), []), "rotary_dim is an empty list"),
    (lambda: ditops.rope_cos_sin_cache(8, 32, theta=0.0), "has an entry 0.0; wanted values > 0"),
    (lambda: ditops.rope_cos_sin_cache(8, 31), "rotary_dim 31 has an entry 31; wanted even sizes > 0"),
    (lambda: ditops.rope_cos_sin_cache(8, 0), "has an entry 0; wanted even sizes > 0"),
    (lambda: ditops.rope_cos_sin_cache(8, True), "has an entry True"),
    (lambda: ditops.rope_cos_sin_cache(8, 32, dtype=torch.int32), "dtype is torch.int32; wanted a floating"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_rope_cos_sin_cache_refuses_bad_arguments(call, named):
    with pytest.raises(ValueError, match=re.escape(f"rope_cos_sin_cache: ") + ".*" + re.escape(named)):
        call()
