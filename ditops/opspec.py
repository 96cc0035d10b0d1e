"""Every op, defined once: its signature and documentation, argument checks, outputs,
reference and the inputs that exercise it.

An ``OpSpec`` holds one op. ditops/ops.py derives from it the public function (the
signature below, plus ``backend=``), the torch.library schema and registration, the fake
(meta) implementation, ``explain``; the registry (ditops/dispatch/registry.py) learns the op
and its reference from it; ditops/examples.py, ditops/conformance.py and ditops/bench/cases.py
build their calls with its ``build`` from its ``conformance`` and ``bench`` inputs.

Adding an op is one entry here and its reference function (docs/extending.md); the kernels of
other backends and their registry rows come after, each checked against the reference.
"""

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from . import validation
from .backends import reference
from .dispatch import Features, describe, device_of, fp8_dtypes
from .inputs import HeadSpec, RowSpec, activation, is_meta, modulation, modulation_index, random, selection_index

InputSpec = Union[RowSpec, HeadSpec]


class BenchShape(NamedTuple):
    """A benchmark case of an op: the model it stands for, its shape as text, its inputs."""

    model: str
    shape: str
    inputs: InputSpec
    quick: bool = False  # part of `ditops bench --quick`


@dataclass(frozen=True)
class OpSpec:
    """One op. ``signature``: a function whose signature and docstring are the public
    function's (its body never runs; annotations give the schema's types). ``check(*arguments,
    describe_call=True)``: raises ValueError on bad input, else returns the call's Features (None
    for an empty input). ``outputs``: the names of the new tensors it returns, each shaped and
    typed like its first argument; an in-place op names the arguments it writes in ``mutates``
    instead. ``reference(*arguments, *outputs)``: the definition (backends/reference). ``build(
    inputs, dtype, device, generator)``: the keyword arguments of a call described by a RowSpec
    or HeadSpec (ditops/inputs.py)."""

    signature: Callable
    check: Callable
    reference: Callable
    build: Callable
    inputs: type = RowSpec  # what ``build`` takes: RowSpec (x's rows) or HeadSpec (q/k heads)
    outputs: tuple = ()
    mutates: tuple = ()
    check_values: Optional[Callable] = None  # (*arguments) -> a plan's per-call check (arguments, pointers), ops.Plan
    # (named arguments, reference outputs, dtype, stored) -> the float64 expectation, laid out as the
    # outputs; of the outputs given it reads the intermediate alone. None: the reference's outputs
    oracle: Optional[Callable] = None
    intermediate: Optional[str] = None  # the result that ``oracle`` normalises as stored (``stored``: a backend's)
    conformance: Mapping = dataclasses.field(default_factory=dict)  # case name -> inputs
    # case name -> inputs of calls long enough that each row group of a GPU's persistent grid
    # loops over several rows (the cuda stream kernel's ring wraps): run on GPUs, apart from
    # ``conformance``, whose every case Triton's interpreter also runs
    long_conformance: Mapping = dataclasses.field(default_factory=dict)
    bench: tuple = ()  # BenchShape
    default_shape: tuple = ()  # ``ditops explain`` / ``example_arguments`` without a shape
    typical: Optional[Callable] = None  # (shape, param_dtype) -> the inputs of a DiT block's call at that shape
    quantized: bool = False  # outputs[0]: FP8 rows in the fp8_dtype argument's format, outputs[1]: their float32 scales [..., 1]

    @property
    def name(self) -> str:
        return self.signature.__name__

    @property
    def result_names(self) -> tuple:
        """What a call gives back: the new outputs, or the tensors written in place."""
        return self.mutates or self.outputs

    def schema(self) -> str:
        """The torch.library schema: the signature's arguments in order (``(a!)`` marking what is
        written in place), then ``str? backend``, the override."""
        letters = iter("abcdefgh")
        arguments = []
        for parameter in inspect.signature(self.signature).parameters.values():
            text = _SCHEMA_TYPES[parameter.annotation]
            if parameter.name in self.mutates:
                text = text.replace("Tensor", f"Tensor({next(letters)}!)")
            arguments.append(f"{text} {parameter.name}")
        returns = "()" if self.mutates else "Tensor" if len(self.outputs) == 1 else f"({', '.join(['Tensor'] * len(self.outputs))})"
        return f"({', '.join(arguments)}, str? backend) -> {returns}"

    def expected(self, named: dict, dtype: torch.dtype, stored: Optional[Tensor] = None) -> tuple:
        """The expected results of a call in float64 (``named``: every argument, widened);
        ``stored``: the ``intermediate`` as a backend stored it, which the results computed
        from it then normalise (None: the float64 one rounded once to dtype)."""
        results = self.reference(*named.values())
        results = results if isinstance(results, tuple) else (results,)
        if self.oracle is not None:
            return self.oracle(named, results, dtype, stored)
        return tuple(t for t in results if t is not None)


_SCHEMA_TYPES = {
    Tensor: "Tensor", Optional[Tensor]: "Tensor?", str: "str", Optional[str]: "str?", float: "float",
    bool: "bool", int: "SymInt", Optional[int]: "SymInt?", torch.dtype: "ScalarType",
    Optional[torch.dtype]: "ScalarType?",
}


def _stored(t: Tensor, dtype: torch.dtype, stored: Optional[Tensor] = None) -> Tensor:
    """A float64 intermediate as the op stores it: rounded once to the activations' dtype, or
    as a backend stored it (``stored``, widened)."""
    return (t.to(dtype) if stored is None else stored).to(torch.float64)


# Checks: validation (raises ValueError), then the features the dispatcher reads.


def _norm_arguments(op, shape, device, weight, bias, norm, eps):
    validation.affine(op, "weight", weight, shape.hidden, device)
    validation.affine(op, "bias", bias, shape.hidden, device)
    validation.norm_kind(op, norm, bias)
    validation.eps(op, eps)


def fp8_format(x: Tensor, fp8_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The FP8 format of a call's output: ``fp8_dtype``, or where None the first format of x's
    device (registry.yaml's fp8_formats; None where it has none)."""
    if fp8_dtype is not None:
        return fp8_dtype
    return next(iter(fp8_dtypes(device_of(x.get_device()))), None)


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


def _fp8_arguments(op, x, fp8_dtype, static_scale) -> dict:
    """Checks the FP8 output's arguments (an FP8 dtype, or None where the device has a format;
    an optional one-element float32 static scale) and returns what describe() takes of them:
    static_scale among the tensors, the format and whether the device's hardware has it."""
    device = device_of(x.get_device())
    formats = fp8_dtypes(device)
    if fp8_dtype is None and not formats:
        validation.fail(op, "fp8_dtype", f"is None on {device}, which has no FP8 format",
                        "an FP8 dtype to compute on the reference (FP8 hardware: NVIDIA sm_89+, AMD gfx942, gfx950)")
    if fp8_dtype is not None:
        validation.choice(op, "fp8_dtype", fp8_dtype, FP8_DTYPES)
    if static_scale is not None:
        validation.tensor(op, "static_scale", static_scale, (torch.float32, torch.float64), x.device)
        if static_scale.numel() != 1:
            validation.fail(op, "static_scale", f"has shape {list(static_scale.shape)}", "one element (a scalar tensor)")
    out_dtype = fp8_dtype or formats[0]
    return dict(params=(static_scale,), out_dtype=out_dtype, out_dtype_native=out_dtype in formats)


def _norm_scale_shift_features(op, x, scale, shift, weight, bias, norm, eps, modulation_index, describe_call,
                               extra: Optional[Callable] = None) -> Optional[Features]:
    """The norm op's checks and features; ``extra``: the FP8 form's further checks, after these
    (``_fp8_arguments``: what describe() takes of them)."""
    validation.tensor(op, "x", x)
    device = x.device
    shape = validation.rows(op, "x", x)
    forms = validation.modulations(op, dict(scale=scale, shift=shift), shape, device, modulation_index)
    _norm_arguments(op, shape, device, weight, bias, norm, eps)
    extra = extra() if extra else {}
    if describe_call and x.numel():
        return describe((x,), (scale, shift, weight, bias, *extra.pop("params", ())), hidden_size=shape.hidden,
                        affine=weight is not None or bias is not None,
                        batch_size=shape.batch, norm=norm, modulation=forms, **extra)


def _check_norm_scale_shift(x, scale, shift, weight, bias, norm, eps, modulation_index,
                            describe_call=True) -> Optional[Features]:
    return _norm_scale_shift_features("norm_scale_shift", x, scale, shift, weight, bias, norm, eps, modulation_index,
                                      describe_call)


def _check_norm_scale_shift_fp8(x, scale, shift, weight, bias, norm, eps, fp8_dtype, static_scale, modulation_index,
                                describe_call=True) -> Optional[Features]:
    op = "norm_scale_shift_fp8"
    return _norm_scale_shift_features(op, x, scale, shift, weight, bias, norm, eps, modulation_index, describe_call,
                                      lambda: _fp8_arguments(op, x, fp8_dtype, static_scale))


def _residual_norm_scale_shift_features(op, x, residual, gate, scale, shift, weight, bias, norm, eps, modulation_index,
                                        describe_call, extra: Optional[Callable] = None) -> Optional[Features]:
    device = validation.activation_pair(op, "x", x, "residual", residual)
    shape = validation.rows(op, "x", x)
    named = dict(scale=scale, shift=shift) if gate is None else dict(gate=gate, scale=scale, shift=shift)  # None: a gate of 1
    forms = validation.modulations(op, named, shape, device, modulation_index)
    _norm_arguments(op, shape, device, weight, bias, norm, eps)
    extra = extra() if extra else {}
    if describe_call and x.numel():
        return describe(
            (x, residual), (gate, scale, shift, weight, bias, *extra.pop("params", ())), hidden_size=shape.hidden,
            affine=weight is not None or bias is not None,
            batch_size=shape.batch, norm=norm, modulation=forms, **extra,
        )


def _check_residual_norm_scale_shift(
    x, residual, gate, scale, shift, weight, bias, norm, eps, modulation_index, describe_call=True
) -> Optional[Features]:
    return _residual_norm_scale_shift_features("residual_norm_scale_shift", x, residual, gate, scale, shift, weight, bias,
                                               norm, eps, modulation_index, describe_call)


def _check_residual_norm_scale_shift_fp8(
    x, residual, gate, scale, shift, weight, bias, norm, eps, fp8_dtype, static_scale, modulation_index,
    describe_call=True
) -> Optional[Features]:
    op = "residual_norm_scale_shift_fp8"
    return _residual_norm_scale_shift_features(op, x, residual, gate, scale, shift, weight, bias, norm, eps,
                                               modulation_index, describe_call,
                                               lambda: _fp8_arguments(op, x, fp8_dtype, static_scale))


ACTIVATIONS = (None, "gelu_tanh")


def _check_quantize_fp8(x, activation, prefix, fp8_dtype, static_scale, describe_call=True) -> Optional[Features]:
    op = "quantize_fp8"
    validation.tensor(op, "x", x)
    shape = validation.rows(op, "x", x)
    validation.choice(op, "activation", activation, ACTIVATIONS)
    width = validation.prefix(op, "prefix", prefix, x)
    extra = _fp8_arguments(op, x, fp8_dtype, static_scale)
    # a row is P + D values (x may have none: its prefix alone is quantised)
    if describe_call and shape.batch * shape.tokens * (width + shape.hidden):
        return describe((x, prefix), extra.pop("params"), hidden_size=width + shape.hidden, batch_size=shape.batch,
                        prefix_size=width, **extra)


def _select_arguments(op, x, index, modulation, weight, bias, eps):
    """Checks shared by the select ops; ``modulation`` maps the six names to tensors."""
    device = x.device
    shape = validation.rows(op, "x", x)
    validation.selection_index(op, index, shape, device)
    for name, t in modulation.items():
        validation.per_batch(op, name, t, shape, device)
    _norm_arguments(op, shape, device, weight, bias, "layer", eps)
    return shape


def _norm_scale_shift_select_features(op, x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps,
                                       describe_call, extra: Optional[Callable] = None) -> Optional[Features]:
    """The select op's checks and features; ``extra``: the FP8 form's further checks (as
    _norm_scale_shift_features)."""
    validation.tensor(op, "x", x)
    modulation = dict(scale0=scale0, shift0=shift0, gate0=gate0, scale1=scale1, shift1=shift1, gate1=gate1)
    shape = _select_arguments(op, x, index, modulation, weight, bias, eps)
    extra = extra() if extra else {}
    if describe_call and x.numel():
        return describe(
            (x,), (*modulation.values(), weight, bias, *extra.pop("params", ())), hidden_size=shape.hidden,
            affine=weight is not None or bias is not None,
            batch_size=shape.batch, norm="layer", modulation=("batch",) * 6, **extra,
        )


def _check_norm_scale_shift_select(
    x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, describe_call=True
) -> Optional[Features]:
    return _norm_scale_shift_select_features("norm_scale_shift_select", x, index, scale0, shift0, gate0, scale1, shift1,
                                             gate1, weight, bias, eps, describe_call)


def _check_norm_scale_shift_select_fp8(
    x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, fp8_dtype, static_scale, describe_call=True
) -> Optional[Features]:
    op = "norm_scale_shift_select_fp8"
    return _norm_scale_shift_select_features(op, x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps,
                                             describe_call, lambda: _fp8_arguments(op, x, fp8_dtype, static_scale))


def _residual_norm_scale_shift_select_features(op, x, residual, residual_gate, index, scale0, shift0, gate0, scale1,
                                               shift1, gate1, weight, bias, eps, describe_call,
                                               extra: Optional[Callable] = None) -> Optional[Features]:
    validation.activation_pair(op, "x", x, "residual", residual)
    validation.tensor(op, "residual_gate", residual_gate, validation.ACTIVATION_DTYPES, x.device)
    validation.same_shape(op, "residual_gate", residual_gate, "x", x)
    modulation = dict(scale0=scale0, shift0=shift0, gate0=gate0, scale1=scale1, shift1=shift1, gate1=gate1)
    shape = _select_arguments(op, x, index, modulation, weight, bias, eps)
    extra = extra() if extra else {}
    if describe_call and x.numel():
        return describe(
            (x, residual),
            (residual_gate, *modulation.values(), weight, bias, *extra.pop("params", ())),
            affine=weight is not None or bias is not None,
            hidden_size=shape.hidden, batch_size=shape.batch,
            norm="layer",
            modulation=("token",) + ("batch",) * 6,
            **extra,
        )


def _check_residual_norm_scale_shift_select(
    x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, describe_call=True
) -> Optional[Features]:
    return _residual_norm_scale_shift_select_features("residual_norm_scale_shift_select", x, residual, residual_gate, index,
                                                      scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps,
                                                      describe_call)


def _check_residual_norm_scale_shift_select_fp8(
    x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, fp8_dtype,
    static_scale, describe_call=True
) -> Optional[Features]:
    op = "residual_norm_scale_shift_select_fp8"
    return _residual_norm_scale_shift_select_features(op, x, residual, residual_gate, index, scale0, shift0, gate0, scale1,
                                                      shift1, gate1, weight, bias, eps, describe_call,
                                                      lambda: _fp8_arguments(op, x, fp8_dtype, static_scale))


def _gate_norm_arguments(op, x, branch, gate, weight, bias, norm, eps, gate_act):
    device = validation.activation_pair(op, "x", x, "branch", branch)
    shape = validation.rows(op, "x", x)
    form = validation.modulation(op, "gate", gate, shape, device)
    _norm_arguments(op, shape, device, weight, bias, norm, eps)
    validation.choice(op, "gate_act", gate_act, validation.GATE_ACTIVATIONS)
    return shape, device, form


def _check_add_gate_norm(x, branch, gate, weight, bias, norm, eps, gate_act, describe_call=True) -> Optional[Features]:
    op = "add_gate_norm"
    shape, _, form = _gate_norm_arguments(op, x, branch, gate, weight, bias, norm, eps, gate_act)
    if describe_call and x.numel():
        return describe((x, branch), (gate, weight, bias), hidden_size=shape.hidden, batch_size=shape.batch, norm=norm,
                        affine=weight is not None or bias is not None,
                        modulation=(form,))


def _add_gate_norm_scale_features(op, x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act,
                                   describe_call, extra: Optional[Callable] = None) -> Optional[Features]:
    shape, device, form = _gate_norm_arguments(op, x, branch, gate, weight, bias, norm, eps, gate_act)
    scale_form = validation.modulation(op, "scale", scale, shape, device)
    validation.affine(op, "weight2", weight2, shape.hidden, device)
    validation.affine(op, "bias2", bias2, shape.hidden, device)
    if norm == "rms" and bias2 is not None:
        validation.fail(op, "bias2", "is a tensor with norm='rms'", "None (RMSNorm has no bias)")
    extra = extra() if extra else {}
    if describe_call and x.numel():
        return describe(
            (x, branch),
            (gate, scale, weight, bias, weight2, bias2, *extra.pop("params", ())),
            affine=any(t is not None for t in (weight, bias, weight2, bias2)),
            hidden_size=shape.hidden, batch_size=shape.batch,
            norm=norm,
            modulation=(form, scale_form),
            **extra,
        )


def _check_add_gate_norm_scale(
    x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, describe_call=True
) -> Optional[Features]:
    return _add_gate_norm_scale_features("add_gate_norm_scale", x, branch, gate, scale, weight, bias, weight2, bias2, norm,
                                         eps, gate_act, describe_call)


def _check_add_gate_norm_scale_fp8(
    x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, fp8_dtype, static_scale, describe_call=True
) -> Optional[Features]:
    op = "add_gate_norm_scale_fp8"
    return _add_gate_norm_scale_features(op, x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act,
                                         describe_call, lambda: _fp8_arguments(op, x, fp8_dtype, static_scale))


NORM_OVER = ("head", "token")  # qk_norm_rope_'s norm: over each head's Dh, or over a token's H * Dh


def _check_qk_norm_rope(
    q, k, q_weight, k_weight, cos_sin_cache, positions, interleaved, rotary_dim, eps, position_offset, norm_over, norm,
    q_bias, k_bias, describe_call=True
) -> Optional[Features]:
    op = "qk_norm_rope_"
    if k is None:
        validation.fail(op, "k", "is None", "a tensor (only rope_ takes k=None)")
    heads = validation.heads(op, q, k, cos_sin_cache, positions, rotary_dim, position_offset, interleaved)
    device = q.device
    validation.choice(op, "norm_over", norm_over, NORM_OVER)
    # over a token: a weight per value of the token's heads, and the widest of q's and k's
    # rows as the call's D (registry: max_hidden_size); per head, a weight per dim and no D
    per_token = norm_over == "token"
    q_width, k_width = (heads.head_size * t.shape[-2] if per_token else heads.head_size for t in (q, k))
    validation.affine(op, "q_weight", q_weight, q_width, device)
    validation.affine(op, "k_weight", k_weight, k_width, device)
    validation.choice(op, "norm", norm, validation.NORMS)
    for name, bias, width in (("q_bias", q_bias, q_width), ("k_bias", k_bias, k_width)):
        if norm == "rms" and bias is not None:
            validation.fail(op, name, "is a tensor with norm='rms'", "None (RMSNorm has no bias)")
        validation.affine(op, name, bias, width, device)
    validation.eps(op, eps)
    if describe_call and q.numel():
        return describe(
            (q, k),
            (q_weight, k_weight, cos_sin_cache, q_bias, k_bias),
            hidden_size=max(q_width, k_width) if per_token else 0,
            head_size=heads.head_size,
            rotary_dim=heads.rotary_dim,
            norm=norm,
            interleaved=interleaved,
            rope_cache=heads.rope_cache,
        )


def _check_rope(
    q, k, cos_sin_cache, positions, interleaved, rotary_dim, position_offset, describe_call=True
) -> Optional[Features]:
    heads = validation.heads("rope_", q, k, cos_sin_cache, positions, rotary_dim, position_offset, interleaved)
    if describe_call and q.numel():
        return describe(
            (q, k) if k is not None else (q,),
            (cos_sin_cache,),
            head_size=heads.head_size,
            rotary_dim=heads.rotary_dim,
            interleaved=interleaved,
            rope_cache=heads.rope_cache,
        )


def _in_place_checks(op: str, read_names: tuple) -> Callable:
    """The per-call checks of an in-place op, whose arguments are q, k, then ``read_names``
    and the rest: positions within the cache, and no memory shared with what it writes
    (validation.InPlaceAliasing, whose spans are fixed per plan; it reads the pointers that
    the call signature's check read: those of q, k and the tensors read, in that order)."""
    cache_at, positions_at = read_names.index("cos_sin_cache"), read_names.index("positions")

    def for_plan(q, k, *rest):
        aliasing = validation.InPlaceAliasing(op, q, k, dict(zip(read_names, rest)))
        if rest[positions_at] is None:  # None is in the call signature: nothing to read but pointers
            return aliasing  # a check(arguments, pointers) whose spans dispatch/cached_call.c also reads

        def check(arguments, pointers):
            rest = arguments[2:]
            validation.position_values(op, rest[positions_at], rest[cache_at])
            aliasing.check(pointers)

        return check

    return for_plan


# Inputs: each op's keyword arguments for a RowSpec or HeadSpec (ditops/inputs.py).


class _Rows:
    """The tensors of a norm-op call described by a RowSpec, drawn in the order they are asked for."""

    def __init__(self, spec: RowSpec, dtype, device, generator):
        self.spec, self.dtype, self.device, self.generator = spec, dtype, device, generator
        self.shape = (spec.tokens, spec.hidden) if spec.two_d else (spec.batch, spec.tokens, spec.hidden)
        self.param_dtype = spec.param_dtype or dtype
        self.weight_dtype = spec.weight_dtype or self.param_dtype

    def x(self) -> Tensor:
        return activation(self.generator, self.device, self.dtype, self.shape, self.spec.layout, self.spec.special_values)

    def modulation(self, form: str) -> Tensor:
        spec = self.spec
        return modulation(self.generator, self.device, self.param_dtype, form, spec.batch, spec.tokens, spec.hidden,
                          table_rows=spec.table_rows)

    def affine(self) -> Optional[Tensor]:
        return random(self.generator, self.device, self.weight_dtype, self.spec.hidden) if self.spec.affine else None

    def bias(self) -> Optional[Tensor]:
        return self.affine() if self.spec.norm == "layer" else None


def _norm_scale_shift_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    r = _Rows(spec, dtype, device, generator)
    return dict(x=r.x(), scale=r.modulation(spec.scale), shift=r.modulation(spec.shift), weight=r.affine(), bias=r.bias(),
                norm=spec.norm, modulation_index=modulation_index(spec, device, generator))


def _residual_norm_scale_shift_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    r = _Rows(spec, dtype, device, generator)
    return dict(x=r.x(), residual=r.x(), gate=r.modulation(spec.gate) if spec.gate else None, scale=r.modulation(spec.scale),
                shift=r.modulation(spec.shift), weight=r.affine(), bias=r.bias(), norm=spec.norm,
                modulation_index=modulation_index(spec, device, generator))


_SETS = ("scale0", "shift0", "gate0", "scale1", "shift1", "gate1")


def _norm_scale_shift_select_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    r = _Rows(spec, dtype, device, generator)
    index = selection_index(spec, device, generator)  # drawn before x: the conformance cases' values depend on the order
    arguments = dict(x=r.x(), index=index)
    arguments.update({name: r.modulation(spec.select_form) for name in _SETS})
    if spec.set1_dtype is not None:
        arguments.update({name: arguments[name].to(spec.set1_dtype) for name in _SETS[3:]})
    arguments.update(weight=r.affine(), bias=r.bias())
    return arguments


def _residual_norm_scale_shift_select_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    arguments = _norm_scale_shift_select_inputs(spec, dtype, device, generator)
    r = _Rows(spec, dtype, device, generator)
    residual = r.x()
    residual_gate = random(generator, device, r.param_dtype, *r.shape) if spec.gate_in_param_dtype else r.x()
    return dict(arguments, residual=residual, residual_gate=residual_gate)


def _add_gate_norm_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    r = _Rows(spec, dtype, device, generator)
    gate_act = "tanh" if spec.norm == "rms" else None  # Z-Image's RMS sandwich uses a tanh gate
    return dict(x=r.x(), branch=r.x(), gate=r.modulation(spec.gate), weight=r.affine(), bias=r.bias(), norm=spec.norm,
                eps=1e-5, gate_act=gate_act)


def _add_gate_norm_scale_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    arguments = _add_gate_norm_inputs(spec, dtype, device, generator)
    r = _Rows(spec, dtype, device, generator)
    return dict(arguments, scale=r.modulation(spec.scale), weight2=r.affine(), bias2=r.bias())


def _fp8_options(spec: RowSpec, device) -> dict:
    """The FP8 arguments: the spec's format, else the device's (e4m3fn where it has none: the
    reference computes it, and dispatch says why the kernels refuse)."""
    static = None if spec.static_scale is None else torch.tensor(spec.static_scale, dtype=torch.float32, device=device)
    fp8_dtype = spec.fp8_dtype or next(iter(fp8_dtypes("cpu" if is_meta(device) else device)), torch.float8_e4m3fn)
    return dict(fp8_dtype=fp8_dtype, static_scale=static)


def _norm_scale_shift_fp8_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    return dict(_norm_scale_shift_inputs(spec, dtype, device, generator), **_fp8_options(spec, device))


def _residual_norm_scale_shift_fp8_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    return dict(_residual_norm_scale_shift_inputs(spec, dtype, device, generator), **_fp8_options(spec, device))


def _norm_scale_shift_select_fp8_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    return dict(_norm_scale_shift_select_inputs(spec, dtype, device, generator), **_fp8_options(spec, device))


def _residual_norm_scale_shift_select_fp8_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    return dict(_residual_norm_scale_shift_select_inputs(spec, dtype, device, generator), **_fp8_options(spec, device))


def _add_gate_norm_scale_fp8_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    return dict(_add_gate_norm_scale_inputs(spec, dtype, device, generator), **_fp8_options(spec, device))


def _quantize_fp8_inputs(spec: RowSpec, dtype, device, generator) -> dict:
    r = _Rows(spec, dtype, device, generator)
    x = r.x()
    prefix = None
    if spec.prefix:  # drawn after x: the cases without a prefix draw what they drew before it existed
        prefix = activation(generator, device, dtype, (*r.shape[:-1], spec.prefix), spec.layout, spec.prefix_special_values)
    if spec.zero_rows and not is_meta(device):
        for t in (x, prefix) if prefix is not None else (x,):
            t[..., ::2, :] = 0
    return dict(x=x, activation=spec.activation, prefix=prefix, **_fp8_options(spec, device))


def _rope_inputs(spec: HeadSpec, dtype, device, generator) -> dict:
    head_size = spec.head_size
    if spec.layout == "qkv":
        width = (spec.q_heads + 2 * spec.k_heads) * head_size
        qkv = random(generator, device, dtype, *spec.leading, width)
        q = qkv[..., : spec.q_heads * head_size].unflatten(-1, (spec.q_heads, head_size))
        k = qkv[..., spec.q_heads * head_size : (spec.q_heads + spec.k_heads) * head_size].unflatten(-1, (spec.k_heads, head_size))
    else:
        q = activation(generator, device, dtype, (*spec.leading, spec.q_heads, head_size), spec.layout)
        k = activation(generator, device, dtype, (*spec.leading, spec.k_heads, head_size), spec.layout)
    rotary_dim = spec.rotary_dim or head_size
    rows = spec.position_offset + spec.leading[-1] + spec.spare_cache_rows
    # the cache's shape before the columns, as laid out in memory (head_major: heads before rows)
    heads, batch = spec.q_heads, spec.leading[0]
    leading = {"shared": (rows,), "head": (rows, heads), "batch_head": (batch, rows, heads),
               "batch1_head": (1, rows, heads), "head_major": (batch, heads, rows)}[spec.cache]
    if is_meta(device):
        cache = torch.empty((*leading, rotary_dim), dtype=spec.cache_dtype, device="meta")
        positions = None if spec.positions is None else torch.empty(spec.leading, dtype=spec.positions, device="meta")
    else:
        angle = torch.rand((*leading, rotary_dim // 2), generator=generator, device=generator.device, dtype=torch.float64) * 6.3
        cache = torch.cat([torch.cos(angle), torch.sin(angle)], dim=-1).to(device=device, dtype=spec.cache_dtype)
        positions = None
        if spec.positions is not None:
            positions = torch.randint(0, rows, spec.leading, generator=generator, device=generator.device).to(device=device, dtype=spec.positions)
    if spec.cache == "head_major":
        cache = cache.transpose(1, 2)
    return dict(q=q, k=None if spec.k_none else k, cos_sin_cache=cache, positions=positions, interleaved=spec.interleaved,
                rotary_dim=spec.rotary_dim, position_offset=spec.position_offset)


def _qk_norm_rope_inputs(spec: HeadSpec, dtype, device, generator) -> dict:
    arguments = _rope_inputs(spec, dtype, device, generator)
    q_weight_dtype, k_weight_dtype = (weight_dtype or dtype for weight_dtype in spec.weight_dtypes)
    q_width, k_width = ((heads * spec.head_size if spec.norm_over == "token" else spec.head_size)
                        for heads in (spec.q_heads, spec.k_heads))
    affine = dict(q_weight=None, k_weight=None, q_bias=None, k_bias=None)
    if spec.affine:
        affine.update(q_weight=random(generator, device, q_weight_dtype, q_width),
                      k_weight=random(generator, device, k_weight_dtype, k_width))
        if spec.norm == "layer":
            affine.update(q_bias=random(generator, device, q_weight_dtype, q_width),
                          k_bias=random(generator, device, k_weight_dtype, k_width))
    return dict(arguments, **affine, norm_over=spec.norm_over, norm=spec.norm)


def _typical_rows(norm: str) -> Callable:
    """A DiT block's norm-op call at x's [B, S, D] or [S, D]: per-batch [B, D] modulation views of
    [B, 6, D] tensors, float32 weights (param_dtype: every tensor but the activations, as Wan's float32)."""

    def typical(shape: tuple, param_dtype: Optional[torch.dtype]) -> RowSpec:
        batch, tokens, hidden = shape if len(shape) == 3 else (1, *shape)
        return RowSpec(batch, tokens, hidden, two_d=len(shape) == 2, norm=norm, param_dtype=param_dtype,
                       weight_dtype=param_dtype or torch.float32, index="halves", select_form="batch_view",
                       gate_in_param_dtype=True)

    return typical


def _typical_heads(shape: tuple, param_dtype: Optional[torch.dtype]) -> HeadSpec:
    """A DiT block's RoPE-op call at q's [T, H, Dh] or [B, S, H, Dh]: float32 weights and cache, no positions."""
    weight_dtype = param_dtype or torch.float32
    return HeadSpec(shape[:-2], shape[-2], shape[-2], shape[-1], cache_dtype=weight_dtype,
                    weight_dtypes=(weight_dtype, weight_dtype), spare_cache_rows=0)


# The oracle where an op stores an intermediate and normalises it as stored: rounded to the
# activations' dtype at the same point (or as a backend stored it: conformance.as_stored), then
# normalised with the call's own arguments.


def _residual_norm_scale_shift_oracle(named: dict, results: tuple, dtype, stored=None) -> tuple:
    residual_out = results[1]
    y = reference.norm_scale_shift(_stored(residual_out, dtype, stored), named["scale"], named["shift"], named["weight"],
                                   named["bias"], named["norm"], named["eps"], named["modulation_index"])
    return y, residual_out


def _residual_norm_scale_shift_fp8_oracle(named: dict, results: tuple, dtype, stored=None) -> tuple:
    residual_out = results[2]
    arguments = {key: named[key] for key in ("scale", "shift", "weight", "bias", "norm", "eps", "fp8_dtype", "static_scale",
                                             "modulation_index")}
    y, y_scale = reference.norm_scale_shift_fp8(_stored(residual_out, dtype, stored), **arguments)
    return y, y_scale, residual_out


def _residual_norm_scale_shift_select_oracle(named: dict, results: tuple, dtype, stored=None) -> tuple:
    residual_out = results[1]
    selection = {key: named[key] for key in ("index", *_SETS, "weight", "bias", "eps")}
    y, gate = reference.norm_scale_shift_select(_stored(residual_out, dtype, stored), **selection)
    return y, residual_out, gate


def _residual_norm_scale_shift_select_fp8_oracle(named: dict, results: tuple, dtype, stored=None) -> tuple:
    residual_out = results[2]
    selection = {key: named[key] for key in ("index", *_SETS, "weight", "bias", "eps", "fp8_dtype", "static_scale")}
    y, y_scale, gate = reference.norm_scale_shift_select_fp8(_stored(residual_out, dtype, stored), **selection)
    return y, y_scale, residual_out, gate


def _add_gate_norm_scale_oracle(named: dict, results: tuple, dtype, stored=None) -> tuple:
    out = results[0]
    zero_shift = torch.zeros((), dtype=torch.float64, device=out.device)
    y = reference.norm_scale_shift(_stored(out, dtype, stored), named["scale"], zero_shift, named["weight2"], named["bias2"],
                                   named["norm"], named["eps"])
    return out, y


def _add_gate_norm_scale_fp8_oracle(named: dict, results: tuple, dtype, stored=None) -> tuple:
    out = results[2]
    zero_shift = torch.zeros((), dtype=torch.float64, device=out.device)
    arguments = {key: named[key] for key in ("norm", "eps", "fp8_dtype", "static_scale")}
    y, y_scale = reference.norm_scale_shift_fp8(_stored(out, dtype, stored), named["scale"], zero_shift, named["weight2"],
                                                named["bias2"], **arguments)
    return y, y_scale, out


# Benchmark inputs: each op at the real shapes of docs/ops.md, plus a small latency case,
# laid out as the models pass them: modulation as [B, D] or [B, 1, D] views of [B, 6, D]
# tensors (float32 in Wan, the activations' dtype elsewhere), per-token cos/sin caches for
# multi-axis RoPE, int64 positions for the LLM-style RoPE rows.

TEXT_TOKENS = 512  # text tokens beside 4096 image tokens at 1024px (FLUX, FLUX.2, Qwen-Image, Z-Image)
_JOINT = 4096 + TEXT_TOKENS


def _rows(batch, tokens, hidden, *, modulation_dtype=None, norm="layer", affine=False, per_batch_3d=False) -> RowSpec:
    """A norm-op benchmark call; ``per_batch_3d`` gives [B, 1, D] modulation views (Wan) instead of [B, D]."""
    form = "batch3_view" if per_batch_3d else "batch_view"
    return RowSpec(batch, tokens, hidden, form, form, form, norm=norm, param_dtype=modulation_dtype, affine=affine,
                   index="halves", select_form="batch_view")


def _heads(tokens, q_heads, k_heads, head_size, *, interleaved=True, positions=False, norm_over="head",
           norm="rms", cache="shared") -> HeadSpec:
    """A RoPE-op benchmark call, q/k [T, H, Dh]: a per-token float32 cache (``cache="head"``: a
    row per token and head) and no positions (multi-axis RoPE), or int64 positions into the
    cache; the q/k norm weights in the activations' dtype, as the models hold them."""
    return HeadSpec((tokens,), q_heads, k_heads, head_size, interleaved=interleaved,
                    positions=torch.int64 if positions else None, weight_dtypes=(None, None), norm_over=norm_over,
                    norm=norm, cache=cache)


_WAN = dict(modulation_dtype=torch.float32, per_batch_3d=True)
_NORM_BENCH = (
    BenchShape("Wan2.1-1.3B 480p", "B1 S32760 D1536", _rows(1, 32760, 1536, **_WAN), quick=True),
    BenchShape("Wan2.1-14B 720p", "B1 S75600 D5120", _rows(1, 75600, 5120, **_WAN)),
    BenchShape("HunyuanVideo 720p", "B1 S118800 D3072", _rows(1, 118800, 3072)),
    # Qwen-Image's sizes with a norm weight and bias (its own norms have none): the affine form
    BenchShape("affine LayerNorm at Qwen-Image 1024px", "B1 S4096 D3072", _rows(1, 4096, 3072, affine=True)),
    # each token's modulation a row of the block's table of K = 6 (timestep, modality) rows:
    # [K, D] chunks of one [K, 6 * D] tensor, read through one [S] index for the batch
    BenchShape("MiniMax-H3 (K=6 modulation tables)", "B1 S4096 D5376",
               dataclasses.replace(_rows(1, 4096, 5376, norm="rms", affine=True), scale="table_view", shift="table_view",
                                   gate="table_view", table_rows=6, table_index="shared")),
)
_LATENCY_ROWS = BenchShape("latency", "B1 S128 D3072", _rows(1, 128, 3072))
_SELECT_BENCH = (
    BenchShape("affine LayerNorm at Qwen-Image-Edit 1024px", "B1 S8192 D3072", _rows(1, 8192, 3072, affine=True),
               quick=True),
    _LATENCY_ROWS,
)
_GATE_NORM_BENCH = (
    BenchShape("Z-Image-Turbo 1024px", f"B1 S{_JOINT} D3840",
               _rows(1, _JOINT, 3840, norm="rms", affine=True, modulation_dtype=torch.float32), quick=True),
    BenchShape("latency", "B1 S128 D3072", _rows(1, 128, 3072, norm="rms", affine=True)),
)
_QK_NORM_ROPE_BENCH = (
    BenchShape("FLUX.1-dev 1024px", f"T{_JOINT} H24 Dh128", _heads(_JOINT, 24, 24, 128), quick=True),
    BenchShape("HunyuanVideo 720p", "T118800 H24 Dh128", _heads(118800, 24, 24, 128)),
    BenchShape("FLUX.2-dev 1024px", f"T{_JOINT} H48 Dh128", _heads(_JOINT, 48, 48, 128)),
    BenchShape("Qwen-Image-Edit 1024px", f"T{8192 + TEXT_TOKENS} H24 Dh128", _heads(8192 + TEXT_TOKENS, 24, 24, 128)),
    BenchShape("Z-Image-Turbo 1024px", f"T{_JOINT} H30 Dh128", _heads(_JOINT, 30, 30, 128)),
    BenchShape("latency", "T128 H24 Dh128", _heads(128, 24, 24, 128), quick=True),
    # the RMSNorm over all heads of a token (norm_over="token"): Wan's and LTX-2's q/k norms
    BenchShape("Wan2.1-1.3B 480p (token norm)", "T32760 H12 Dh128", _heads(32760, 12, 12, 128, norm_over="token"),
               quick=True),
    BenchShape("Wan2.1-14B 720p (token norm)", "T75600 H40 Dh128", _heads(75600, 40, 40, 128, norm_over="token")),
    BenchShape("LTX-2 768x512 121 frames (token norm)", "T6144 H32 Dh128", _heads(6144, 32, 32, 128, norm_over="token")),
    # LTX-2's video self-attention as ltx2.py calls it: its split (NeoX) tables, each head its own
    # frequencies, as a float32 cache row per token and head. 6144 tokens: 768x512 pixels through
    # the VAE's 32x spatial compression are 24 x 16 latents a frame, 121 frames through its 8x
    # temporal one (the first frame alone) 1 + 120 / 8 = 16 latent frames, one token per latent
    BenchShape("LTX-2 768x512 121 frames (token norm, per-head cache)", "T6144 H32 Dh128 neox",
               _heads(6144, 32, 32, 128, interleaved=False, norm_over="token", cache="head")),
    # LayerNorm per head with weight and bias (norm="layer"): CogVideoX-5B's image tokens at 720x480, 49 frames
    BenchShape("CogVideoX-5B 720x480 49 frames (layer norm)", "T17550 H48 Dh64", _heads(17550, 48, 48, 64, norm="layer")),
)
_LLM = 16384
_ROPE_BENCH = (
    BenchShape("Wan2.1-1.3B 480p", "T32760 H12 Dh128", _heads(32760, 12, 12, 128), quick=True),
    BenchShape("Wan2.1-14B 720p", "T75600 H40 Dh128", _heads(75600, 40, 40, 128)),
    BenchShape("LLM GQA NeoX", f"T{_LLM} Hq32 Hk8 Dh128 neox", _heads(_LLM, 32, 8, 128, interleaved=False, positions=True)),
    BenchShape("LLM GQA interleaved", f"T{_LLM} Hq32 Hk8 Dh128", _heads(_LLM, 32, 8, 128, positions=True)),
    BenchShape("LLM Dh80 NeoX", f"T{_LLM} H16 Dh80 neox", _heads(_LLM, 16, 16, 80, interleaved=False, positions=True)),
    BenchShape("LLM GQA Dh96 NeoX", f"T{_LLM} Hq16 Hk2 Dh96 neox", _heads(_LLM, 16, 2, 96, interleaved=False, positions=True)),
    # a cos/sin row per token and head, split (NeoX) tables: LTX-2's video heads as above
    BenchShape("LTX-2 768x512 121 frames (per-head cache)", "T6144 H32 Dh128 neox",
               _heads(6144, 32, 32, 128, interleaved=False, cache="head")),
    BenchShape("latency", "T128 H24 Dh128", _heads(128, 24, 24, 128), quick=True),
)


# Conformance inputs: real model shapes scaled down (fewer tokens and heads, real D and Dh),
# odd sizes, every modulation form, strided, expanded and misaligned views, GQA/MQA, partial
# rotary, position offsets and empty inputs.

ROW_SPECS = {
    "wan1.3b-fp32-mod": RowSpec(1, 40, 1536, "batch3", "batch3", "batch3", param_dtype=torch.float32),
    "hunyuan-chunked-mod": RowSpec(2, 24, 3072),
    "flux2-rms": RowSpec(1, 16, 6144, norm="rms", affine=False),
    "odd-d1000-token-mod": RowSpec(2, 7, 1000, "token", "token1", "token"),
    "wide-d8200": RowSpec(1, 3, 8200),  # rows held by several warps (the compiled kernels' widest class)
    "d4104-rms": RowSpec(2, 3, 4104, "vector", "batch", "token", norm="rms"),
    "per-frame": RowSpec(1, 12, 256, "frame", "frame", "frame", param_dtype=torch.float32),
    "scalar-and-vector": RowSpec(2, 5, 128, "scalar", "vector", "scalar1"),
    "vector3-rms": RowSpec(1, 9, 384, "vector3", "vector", "vector3", norm="rms"),
    "strided-x": RowSpec(2, 6, 512, layout="strided"),
    "expanded-mod": RowSpec(2, 6, 256, "token_expanded", "batch", "token_expanded"),
    "misaligned": RowSpec(1, 5, 200, "batch", "batch", "batch", layout="misaligned", norm="rms"),
    "two-d-x": RowSpec(1, 11, 320, "vector", "batch", "token1", two_d=True),
    "gate-none": RowSpec(2, 4, 192, gate=None),
    "nan-inf": RowSpec(2, 4, 96, special_values=True),
    "empty": RowSpec(2, 0, 256),
    # tables of K rows read through a per-token modulation_index: MiniMax-H3's width and its
    # [K, D] chunks of one [K, 6 * D] table with one index for every batch item, K = 1 and 2
    # (Z-Image Omni's noisy and clean sets), [B, K, D] tables beside scalars and vectors, int32
    # indices, values outside [0, K) (clamped) and a 2-D x
    "table-minimax": RowSpec(2, 8, 5376, "table_view", "table_view", "table_view", norm="rms", table_rows=6,
                             table_index="shared"),
    "table-k1": RowSpec(2, 5, 256, "table", "batch_table", "table", table_rows=1),
    "table-k2-odd-d1000": RowSpec(2, 7, 1000, "batch_table", "vector", "table", table_rows=2,
                                  table_index="batch_int32"),
    "table-out-of-range": RowSpec(2, 9, 384, "table", "scalar", "batch_table", norm="rms", table_rows=6,
                                  table_index="out_of_range", param_dtype=torch.float32),
    "table-two-d-x": RowSpec(1, 11, 320, "batch_table", "table", "table", two_d=True, table_rows=6),
    "table-empty": RowSpec(2, 0, 256, "table", "table", "table", table_rows=6),
}

SELECT_SPECS = {
    "qwen-edit": RowSpec(1, 32, 3072, param_dtype=torch.float32),
    "sets-of-two-dtypes": RowSpec(2, 6, 256, param_dtype=torch.float16, set1_dtype=torch.bfloat16),
    "odd-d1000": RowSpec(2, 9, 1000),
    "d4104": RowSpec(1, 5, 4104),
    "strided-x": RowSpec(2, 6, 512, layout="strided"),
    "misaligned": RowSpec(1, 5, 200, layout="misaligned"),
    "empty": RowSpec(1, 0, 128),
}

GATE_NORM_SPECS = {
    "z-image": RowSpec(1, 24, 3840, norm="rms", param_dtype=torch.float32, affine=False),
    "odd-d1000-layer": RowSpec(2, 7, 1000, gate="token"),
    "wide-d8200-rms": RowSpec(1, 3, 8200, norm="rms"),
    "per-frame": RowSpec(1, 12, 256, gate="frame", scale="frame", norm="rms"),
    "scalar-gate": RowSpec(2, 5, 128, gate="scalar", scale="vector", norm="layer"),
    "strided-x": RowSpec(2, 6, 512, layout="strided", norm="rms"),
    "misaligned": RowSpec(1, 5, 200, layout="misaligned", norm="rms"),
    "empty": RowSpec(2, 0, 64),
}


HEAD_SPECS = {
    "flux-image-tokens": HeadSpec((1, 24), 4, 4, 128, position_offset=8),
    "llm-gqa-neox": HeadSpec((33,), 8, 2, 128, interleaved=False, positions=torch.int64),
    "dh80-int32-positions": HeadSpec((2, 9), 4, 4, 80, positions=torch.int32),
    "dh96-mqa-neox": HeadSpec((17,), 4, 1, 96, interleaved=False, positions=torch.int64),
    # a NeoX head of Dh 80 is 5 lanes of the CUDA kernel, 6 heads a 32-lane segment: 7 q heads
    # cross a segment's end
    "dh80-gqa-neox": HeadSpec((19,), 7, 3, 80, interleaved=False, positions=torch.int64),
    "partial-rotary": HeadSpec((2, 6), 2, 2, 128, rotary_dim=64, interleaved=False, position_offset=3),
    "partial-rotary-interleaved": HeadSpec((12,), 3, 3, 64, rotary_dim=32),
    # 2 * 64 rotated + 256 passed-through values per head: a tile of 2048 holds 5 heads, and a
    # block of heads must be a power of two (found by the GPU fuzz, seed 17, case 272).
    "partial-rotary-dh256": HeadSpec((3,), 8, 1, 256, rotary_dim=112, interleaved=False),
    "qkv-views": HeadSpec((2, 7), 4, 2, 128, layout="qkv", positions=torch.int64),
    "misaligned": HeadSpec((5,), 2, 2, 64, layout="misaligned"),
    "bf16-cache": HeadSpec((10,), 2, 2, 256, cache_dtype=torch.bfloat16),
    "dh256-gqa-neox": HeadSpec((2, 3), 5, 2, 256, interleaved=False),
    "dh16-neox": HeadSpec((6,), 3, 3, 16, interleaved=False, positions=torch.int32),
    "empty": HeadSpec((0,), 2, 2, 128),
}

ROPE_ONLY_SPECS = {"k-none": HeadSpec((2, 5), 3, 3, 64, k_none=True)}

# qk_norm_rope_'s RMSNorm over all heads of a token (norm_over="token"; Wan, LTX-2): the real
# widths, GQA, odd head counts (a Triton tile of masked heads), partial rotary, views.
TOKEN_NORM_SPECS = {
    "token-norm-wan1.3b": HeadSpec((1, 20), 12, 12, 128, norm_over="token"),
    "token-norm-wan14b": HeadSpec((9,), 40, 40, 128, norm_over="token"),
    "token-norm-ltx2-neox": HeadSpec((2, 5), 32, 32, 128, interleaved=False, norm_over="token"),
    "token-norm-gqa-neox": HeadSpec((11,), 8, 2, 128, interleaved=False, positions=torch.int64, norm_over="token"),
    "token-norm-odd-heads": HeadSpec((7,), 5, 3, 64, rotary_dim=32, position_offset=2, norm_over="token"),
    "token-norm-dh80": HeadSpec((6,), 7, 7, 80, positions=torch.int32, norm_over="token"),
    "token-norm-qkv-views": HeadSpec((2, 4), 6, 6, 128, layout="qkv", norm_over="token"),
    "token-norm-bf16-weights": HeadSpec((5,), 3, 3, 128, weight_dtypes=(torch.bfloat16, torch.bfloat16),
                                        norm_over="token"),
    "token-norm-empty": HeadSpec((0,), 4, 4, 128, norm_over="token"),
    "token-norm-layer": HeadSpec((2, 3), 6, 2, 64, interleaved=False, norm_over="token", norm="layer"),
}

# qk_norm_rope_(norm="layer"): CogVideoX's per-head LayerNorms with weight and bias
# (interleaved RoPE), CogView4's without affine (NeoX), partial rotary at Dh 80, GQA, views.
LAYER_NORM_SPECS = {
    "layer-cogvideox": HeadSpec((1, 12), 6, 6, 64, norm="layer"),
    "layer-no-affine-neox": HeadSpec((10,), 4, 4, 128, interleaved=False, norm="layer", affine=False),
    "layer-dh80-partial": HeadSpec((7,), 3, 3, 80, rotary_dim=32, positions=torch.int32, norm="layer"),
    "layer-gqa-bf16-weights": HeadSpec((2, 5), 8, 2, 128, interleaved=False, weight_dtypes=(torch.bfloat16, torch.bfloat16),
                                       norm="layer"),
    "layer-qkv-views": HeadSpec((2, 4), 4, 4, 64, layout="qkv", norm="layer"),
    "layer-empty": HeadSpec((0,), 2, 2, 64, norm="layer"),
    "layer-token-no-affine": HeadSpec((5,), 4, 4, 64, norm_over="token", norm="layer", affine=False),
    "token-norm-rms-no-weight": HeadSpec((4,), 3, 3, 128, norm_over="token", affine=False),
}

# A cos/sin cache with a row per head (LTX-2, LTX-Video, Mochi: each head its own frequencies):
# [P, H, R], a table per batch item [B, P, H, R], one table for every item [1, P, H, R], one read
# through strides from head-major memory; interleaved and NeoX, positions and offsets, a pairs'
# tail tile (Dh 80, 96, partial rotary), more heads than one tile holds, views, a bfloat16 cache.
HEAD_CACHE_SPECS = {
    "head-cache": HeadSpec((13,), 3, 3, 64, cache="head"),
    "head-cache-neox-positions": HeadSpec((17,), 4, 4, 128, interleaved=False, positions=torch.int64, cache="head"),
    "head-cache-batch-dh80": HeadSpec((2, 7), 5, 5, 80, positions=torch.int32, cache="batch_head"),
    "head-cache-one-table-offset": HeadSpec((3, 4), 2, 2, 96, interleaved=False, position_offset=3, cache="batch1_head"),
    "head-cache-head-major-neox": HeadSpec((2, 6), 6, 6, 128, interleaved=False, cache="head_major"),
    "head-cache-many-heads": HeadSpec((3,), 40, 40, 128, cache="head"),
    "head-cache-partial-rotary": HeadSpec((2, 5), 3, 3, 128, rotary_dim=48, interleaved=False, cache="batch_head"),
    "head-cache-partial-bf16-cache": HeadSpec((9,), 7, 7, 64, rotary_dim=32, cache="head", cache_dtype=torch.bfloat16),
    "head-cache-qkv-views": HeadSpec((2, 4), 4, 4, 64, layout="qkv", cache="batch_head"),
    "head-cache-misaligned": HeadSpec((5,), 2, 2, 16, layout="misaligned", cache="head"),
    "head-cache-empty": HeadSpec((2, 0), 3, 3, 64, cache="batch_head"),
}

# qk_norm_rope_ with a per-head cache: LTX-2's and LTX-Video's self-attentions (their q/k
# RMSNorm over all heads of a token, split or interleaved tables per batch item), odd heads
# with a tail tile and positions, views of a head-major cache, LayerNorms per token and per head.
NORM_HEAD_CACHE_SPECS = {
    "token-norm-ltx2-head-cache": HeadSpec((1, 6), 32, 32, 128, interleaved=False, norm_over="token", cache="batch_head"),
    "token-norm-ltx-video-head-cache": HeadSpec((2, 5), 4, 4, 64, norm_over="token", cache="batch_head"),
    "token-norm-odd-heads-head-cache": HeadSpec((7,), 5, 5, 80, rotary_dim=48, positions=torch.int64, norm_over="token",
                                                cache="head"),
    "token-norm-views-head-cache": HeadSpec((2, 4), 6, 6, 64, layout="qkv", interleaved=False, norm_over="token",
                                            cache="head_major"),
    "token-layer-head-cache": HeadSpec((2, 3), 4, 4, 64, norm_over="token", norm="layer", cache="batch1_head"),
    "layer-head-cache": HeadSpec((5,), 3, 3, 64, interleaved=False, norm="layer", cache="head"),
    "token-norm-empty-head-cache": HeadSpec((1, 0), 4, 4, 128, norm_over="token", cache="batch_head"),
}

# FP8 outputs: the bf16 ops' row cases that vary what the quantisation sees (widths, forms,
# layouts, NaN/Inf), plus a static scale small enough that values saturate, and the table cases.
FP8_ROW_SPECS = {
    **{name: ROW_SPECS[name] for name in ("wan1.3b-fp32-mod", "hunyuan-chunked-mod", "flux2-rms", "odd-d1000-token-mod",
                                          "wide-d8200", "per-frame", "strided-x", "misaligned", "two-d-x", "gate-none",
                                          "nan-inf", "empty")},
    "static-saturating": RowSpec(2, 6, 512, static_scale=2e-3),
    **{name: spec for name, spec in ROW_SPECS.items() if name.startswith("table-")},
}

# Long streams of rows without an affine, with a modulation per batch item (the calls of FLUX,
# Wan and HunyuanVideo, which the cuda backend's stream kernel takes on an H200): hundreds of
# rows a batch item, odd token counts, each launch class and a tail of D.
FP8_LONG_ROW_SPECS = {
    "stream-wan-fp32-mod": RowSpec(1, 1301, 1536, "batch3", "batch3", param_dtype=torch.float32, affine=False),
    "stream-three-items": RowSpec(3, 777, 3072, affine=False),
    "stream-d1000-scalar-vector": RowSpec(2, 250, 1000, "scalar", "vector", affine=False),
    "stream-d5120-rms": RowSpec(1, 1030, 5120, norm="rms", affine=False),
    "stream-d4104-strided-x": RowSpec(2, 333, 4104, "vector", "batch", layout="strided", affine=False),
    "stream-d2056-nan-inf": RowSpec(2, 40, 2056, special_values=True, affine=False),
    "stream-static-saturating": RowSpec(2, 64, 3072, static_scale=2e-3, affine=False, param_dtype=torch.float32),
    "stream-one-row": RowSpec(1, 1, 3072, affine=False),
}

# The select and sandwich-norm ops' FP8 forms: their bf16 cases of other widths and layouts,
# plus NaN/Inf rows and a saturating static scale, as FP8_ROW_SPECS.
FP8_SELECT_SPECS = {
    **{name: SELECT_SPECS[name] for name in ("qwen-edit", "sets-of-two-dtypes", "odd-d1000", "d4104", "strided-x",
                                             "misaligned", "empty")},
    "nan-inf": RowSpec(2, 4, 96, special_values=True),
    "static-saturating": RowSpec(2, 6, 512, static_scale=2e-3),
}

FP8_GATE_NORM_SPECS = {
    **{name: GATE_NORM_SPECS[name] for name in ("z-image", "odd-d1000-layer", "wide-d8200-rms", "per-frame", "strided-x",
                                                "misaligned", "empty")},
    "nan-inf": RowSpec(2, 4, 96, norm="rms", special_values=True),
    "static-saturating": RowSpec(2, 6, 512, norm="rms", static_scale=2e-3),
}

QUANTIZE_SPECS = {
    "flux-attention-out": RowSpec(1, 16, 3072),
    "flux-mlp-gelu": RowSpec(1, 6, 12288, activation="gelu_tanh"),
    "odd-d1000-gelu": RowSpec(2, 7, 1000, activation="gelu_tanh"),
    "zero-rows": RowSpec(2, 6, 256, zero_rows=True),
    "two-d-x": RowSpec(1, 11, 320, two_d=True),
    "strided-x": RowSpec(2, 6, 512, layout="strided"),
    "misaligned": RowSpec(1, 5, 200, layout="misaligned", activation="gelu_tanh"),
    "nan-inf": RowSpec(2, 4, 96, special_values=True),
    "static-saturating": RowSpec(2, 6, 512, static_scale=2e-3),
    "empty": RowSpec(2, 0, 256),
    # a prefix: FLUX's single block (attention output, then its GELU MLP hidden state), widths
    # the cuda/rocm kernels take (P and D multiples of 8) and odd ones they refuse
    "flux-single-block-prefix": RowSpec(1, 6, 12288, activation="gelu_tanh", prefix=3072),
    # FLUX.2: the SwiGLU output, and the single block's attention + SwiGLU output, rows wider
    # than the other row kernels take (Triton's alone)
    "flux2-mlp-out": RowSpec(1, 5, 18432),
    "flux2-single-block-prefix": RowSpec(1, 4, 18432, prefix=6144),
    "prefix-odd-p333": RowSpec(2, 7, 1000, activation="gelu_tanh", prefix=333),
    "prefix-odd-d203": RowSpec(2, 5, 203, prefix=64),
    "prefix-strided": RowSpec(2, 6, 512, layout="strided", activation="gelu_tanh", prefix=256),
    "prefix-two-d-misaligned": RowSpec(1, 11, 320, two_d=True, layout="misaligned", prefix=64),
    "prefix-zero-rows": RowSpec(2, 6, 256, zero_rows=True, prefix=128),
    "prefix-nan-inf": RowSpec(2, 4, 96, activation="gelu_tanh", prefix=64, prefix_special_values=True),
    "prefix-static-saturating": RowSpec(2, 6, 512, static_scale=2e-3, prefix=256),
    "prefix-empty-x": RowSpec(2, 3, 0, prefix=64),
    "prefix-empty": RowSpec(2, 0, 256, prefix=128),
}




# The ops. ``backend=`` (added to each public function) forces a backend for that call (see ditops.use_backend).

T, OT = Tensor, Optional[Tensor]


def norm_scale_shift(x: T, scale: T, shift: T, *, weight: OT = None, bias: OT = None, norm: str = "layer",
                     eps: float = 1e-6, modulation_index: OT = None) -> Tensor:
    """``y = norm(x) * (1 + scale) + shift``.

    x: [B, S, D] or [N, D]; scale, shift: a modulation form of docs/ops.md ([], [D], [B, D],
    [B, S, D], [B, F, 1, D], ...); weight, bias: [D] or None; norm: "layer" or "rms".
    modulation_index: None, or an int32/int64 [B, S] or [S]: then a 2-D or 3-D scale or shift
    is a table, [K, D] or [B, K, D], and token (b, s) reads its row modulation_index[b, s],
    clamped into [0, K). Returns a new y shaped and typed like x.

    >>> import torch, ditops
    >>> x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    >>> modulation = torch.randn(2, 6, 64)  # [B, 6, D] float32, as a DiT block's AdaLN gives it
    >>> y = ditops.norm_scale_shift(x, modulation[:, 1], modulation[:, 0])
    >>> y.shape, y.dtype
    (torch.Size([2, 16, 64]), torch.bfloat16)
    >>> table = torch.randn(6, 2, 64)  # K = 6 rows of (scale, shift), MiniMax-H3's (timestep, modality) pairs
    >>> rows = torch.randint(0, 6, (16,))  # each token's row, the same for every batch item
    >>> ditops.norm_scale_shift(x, table[:, 0], table[:, 1], modulation_index=rows).shape
    torch.Size([2, 16, 64])
    """


def residual_norm_scale_shift(x: T, residual: T, gate: OT, scale: T, shift: T, *, weight: OT = None, bias: OT = None,
                              norm: str = "layer", eps: float = 1e-6, modulation_index: OT = None) -> tuple:
    """``residual_out = residual + gate * x`` (stored in x.dtype), ``y = norm(residual_out) * (1 + scale) + shift``.

    x, residual: [B, S, D] or [N, D]; gate (None = 1), scale, shift: modulation forms, or
    tables read through modulation_index as in ``norm_scale_shift``. Returns (y, residual_out).

    >>> import torch, ditops
    >>> attention, residual = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    >>> gate, scale, shift = torch.randn(3, 2, 64)
    >>> y, residual = ditops.residual_norm_scale_shift(attention, residual, gate, scale, shift, norm="rms")
    >>> y.shape == residual.shape == attention.shape
    True
    """


def norm_scale_shift_select(x: T, index: T, scale0: T, shift0: T, gate0: T, scale1: T, shift1: T, gate1: T, *,
                            weight: OT = None, bias: OT = None, eps: float = 1e-6) -> tuple:
    """LayerNorm with a per-token choice of modulation: set 1 where index != 0, else set 0.

    x: [B, S, D]; index: [B, S] integer; the six modulation tensors: [B, D].
    Returns (y, gate_out), gate_out being the selected gate as a [B, S, D] tensor.

    >>> import torch, ditops
    >>> x = torch.randn(1, 8, 64)
    >>> index = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])  # the last 4 tokens take set 1
    >>> scale0, shift0, gate0, scale1, shift1, gate1 = torch.randn(6, 1, 64)
    >>> y, gate = ditops.norm_scale_shift_select(x, index, scale0, shift0, gate0, scale1, shift1, gate1)
    >>> torch.equal(gate[0, 5], gate1[0])
    True
    """


def residual_norm_scale_shift_select(x: T, residual: T, residual_gate: T, index: T, scale0: T, shift0: T, gate0: T,
                                     scale1: T, shift1: T, gate1: T, *, weight: OT = None, bias: OT = None,
                                     eps: float = 1e-6) -> tuple:
    """``residual_out = residual + residual_gate * x``, then ``norm_scale_shift_select`` of it.

    residual_gate: [B, S, D] (the gate_out of the previous call). Returns (y, residual_out, gate_out).

    >>> import torch, ditops
    >>> x, residual, residual_gate = torch.randn(3, 1, 8, 64)
    >>> index = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    >>> scale0, shift0, gate0, scale1, shift1, gate1 = torch.randn(6, 1, 64)
    >>> y, residual, gate = ditops.residual_norm_scale_shift_select(
    ...     x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1)
    >>> y.shape, residual.shape, gate.shape
    (torch.Size([1, 8, 64]), torch.Size([1, 8, 64]), torch.Size([1, 8, 64]))
    """


def add_gate_norm(x: T, branch: T, gate: T, *, weight: OT = None, bias: OT = None, norm: str = "rms", eps: float = 1e-5,
                  gate_act: Optional[str] = None) -> Tensor:
    """``out = x + act(gate) * norm(branch)``, act = identity or tanh (``gate_act="tanh"``).

    x, branch: [B, S, D] or [N, D]; gate: a modulation form. Returns out, typed like x.

    >>> import torch, ditops
    >>> x, branch, gate = torch.randn(2, 16, 64), torch.randn(2, 16, 64), torch.randn(2, 64)
    >>> out = ditops.add_gate_norm(x, branch, gate, weight=torch.ones(64), gate_act="tanh")
    >>> out.shape
    torch.Size([2, 16, 64])
    """


def add_gate_norm_scale(x: T, branch: T, gate: T, scale: T, *, weight: OT = None, bias: OT = None, weight2: OT = None,
                        bias2: OT = None, norm: str = "rms", eps: float = 1e-5, gate_act: Optional[str] = None) -> tuple:
    """``out = x + act(gate) * norm(branch)`` (stored in x.dtype), then ``y = norm2(out) * (1 + scale)``.

    norm2 uses weight2/bias2. Returns (out, y).

    >>> import torch, ditops
    >>> x, branch = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    >>> gate, scale = torch.randn(2, 2, 64)
    >>> out, y = ditops.add_gate_norm_scale(x, branch, gate, scale, weight=torch.ones(64), weight2=torch.ones(64))
    >>> out.shape, y.shape
    (torch.Size([2, 16, 64]), torch.Size([2, 16, 64]))
    """


def qk_norm_rope_(q: T, k: T, q_weight: OT, k_weight: OT, cos_sin_cache: T, positions: OT = None, *,
                  interleaved: bool = True, rotary_dim: Optional[int] = None, eps: float = 1e-6,
                  position_offset: int = 0, norm_over: str = "head", norm: str = "rms", q_bias: OT = None,
                  k_bias: OT = None) -> tuple:
    """In place: RMSNorm (or LayerNorm) per head over Dh (or per token over its heads), then RoPE on the first R dims.

    q: [T, Hq, Dh] or [B, S, Hq, Dh]; k: the same leading dims with Hk heads; q_weight,
    k_weight: [Dh]; cos_sin_cache: [P, R] (R/2 cos then R/2 sin columns), or a row per head
    where each head has its own frequencies (LTX-2), [P, H, R] or [B, P, H, R] (a table per
    batch item, or B = 1), H = Hq = Hk; positions: q's leading shape, or None for
    ``position_offset + token index``. ``norm_over="token"``:
    one RMSNorm over all heads of a token (Wan, LTX-2), q_weight [Hq * Dh], k_weight
    [Hk * Dh]; the RoPE is per head either way. ``norm="layer"``: LayerNorm (CogVideoX's q/k
    norms), with optional q_bias and k_bias shaped as the weights; weights and biases may be None. Returns (q, k); under
    torch.compile on a GPU, the graph's new tensors of their values: where q and k are slices
    of a wider projection, reading those spares the graph a copy of the projection.

    >>> import torch, ditops
    >>> q, k = torch.randn(2, 32, 4, 128, dtype=torch.bfloat16)  # [T, H, Dh] each
    >>> cache = ditops.rope_cos_sin_cache(32, 128)  # positions 0..31, all 128 dims rotated
    >>> q_out, k_out = ditops.qk_norm_rope_(q, k, torch.ones(128), torch.ones(128), cache)
    >>> q_out is q  # written in place
    True
    >>> _ = ditops.qk_norm_rope_(q, k, torch.ones(4 * 128), torch.ones(4 * 128), cache, norm_over="token")  # Wan's norms
    >>> _ = ditops.qk_norm_rope_(q, k, None, None, cache, norm="layer")  # LayerNorm without affine (CogView4's)
    >>> head_cache = cache[:, None].repeat(1, 4, 1)  # [P, H, R]: a row per head (here all alike)
    >>> _ = ditops.qk_norm_rope_(q, k, None, None, head_cache, norm_over="token")  # LTX-2's norms and tables
    """


def rope_(q: T, k: OT, cos_sin_cache: T, positions: OT = None, *, interleaved: bool = True,
          rotary_dim: Optional[int] = None, position_offset: int = 0) -> tuple:
    """In place: RoPE on the first R dims of every head of q and k (k may be None). Returns (q, k).

    Shapes as in ``qk_norm_rope_``; ``interleaved=False`` is the NeoX layout.

    >>> import torch, ditops
    >>> q, k = torch.randn(32, 8, 64), torch.randn(32, 2, 64)  # GQA: 8 query heads, 2 key heads
    >>> cache = ditops.rope_cos_sin_cache(4096, 64)
    >>> positions = torch.randint(0, 4096, (32,))
    >>> _ = ditops.rope_(q, k, cache, positions, interleaved=False)
    """


def norm_scale_shift_fp8(x: T, scale: T, shift: T, *, weight: OT = None, bias: OT = None, norm: str = "layer",
                         eps: float = 1e-6, fp8_dtype: Optional[torch.dtype] = None, static_scale: OT = None,
                         modulation_index: OT = None) -> tuple:
    """``norm_scale_shift`` with its y quantised for an FP8 GEMM, in the same pass.

    Returns (y, y_scale): y FP8 (fp8_dtype; None: the device's format, dispatch.fp8_dtypes)
    shaped like x, y_scale float32 [..., 1] (x's leading dims), y * y_scale ~ norm(x) * (1 +
    scale) + shift. Per row: y_scale = max(amax, 1e-12) / the format's max, so an all-zero row
    has a tiny scale and zero values, and a row holding NaN or Inf gives NaN (scale and values);
    with ``static_scale`` (a one-element float32 tensor) every row takes that scale and values
    beyond the format's range saturate. See docs/ops.md.

    >>> import torch, ditops
    >>> x, modulation = torch.randn(2, 16, 64, dtype=torch.bfloat16), torch.randn(2, 6, 64)
    >>> y, y_scale = ditops.norm_scale_shift_fp8(x, modulation[:, 1], modulation[:, 0], fp8_dtype=torch.float8_e4m3fn)
    >>> y.dtype, y_scale.shape
    (torch.float8_e4m3fn, torch.Size([2, 16, 1]))
    """


def residual_norm_scale_shift_fp8(x: T, residual: T, gate: OT, scale: T, shift: T, *, weight: OT = None,
                                  bias: OT = None, norm: str = "layer", eps: float = 1e-6,
                                  fp8_dtype: Optional[torch.dtype] = None, static_scale: OT = None,
                                  modulation_index: OT = None) -> tuple:
    """``residual_norm_scale_shift`` with its y quantised as ``norm_scale_shift_fp8`` does.

    Returns (y, y_scale, residual_out); residual_out is stored in x.dtype and y normalises it as stored.

    >>> import torch, ditops
    >>> attention, residual = torch.randn(2, 2, 16, 64)
    >>> gate, scale, shift = torch.randn(3, 2, 64)
    >>> y, y_scale, residual = ditops.residual_norm_scale_shift_fp8(attention, residual, gate, scale, shift)
    >>> y.dtype, residual.dtype
    (torch.float8_e4m3fn, torch.float32)
    """


def quantize_fp8(x: T, *, activation: Optional[str] = None, prefix: OT = None, fp8_dtype: Optional[torch.dtype] = None,
                 static_scale: OT = None) -> tuple:
    """Rows of x, after ``activation`` (None or "gelu_tanh", diffusers' GELU(approximate="tanh")),
    quantised for an FP8 GEMM in one pass: returns (y, y_scale) as ``norm_scale_shift_fp8`` does.

    prefix: [..., P] with x's leading dims and dtype, or None: y is then the rows of
    ``cat([prefix, act(x)], -1)``, [..., P + D], one scale per row over both parts (the
    activation applies to x only), without the concatenation in memory: the input of one FP8
    GEMM over both (FLUX's single block: attention output, then its GELU MLP hidden state).

    >>> import torch, ditops
    >>> hidden = torch.randn(8, 256, dtype=torch.bfloat16)  # an MLP's up-projection output
    >>> y, y_scale = ditops.quantize_fp8(hidden, activation="gelu_tanh")
    >>> y.shape, y_scale.shape
    (torch.Size([8, 256]), torch.Size([8, 1]))
    >>> attention = torch.randn(8, 64, dtype=torch.bfloat16)
    >>> ditops.quantize_fp8(hidden, activation="gelu_tanh", prefix=attention)[0].shape
    torch.Size([8, 320])
    """


def norm_scale_shift_select_fp8(x: T, index: T, scale0: T, shift0: T, gate0: T, scale1: T, shift1: T, gate1: T, *,
                                weight: OT = None, bias: OT = None, eps: float = 1e-6,
                                fp8_dtype: Optional[torch.dtype] = None, static_scale: OT = None) -> tuple:
    """``norm_scale_shift_select`` with its y quantised as ``norm_scale_shift_fp8`` does.

    Returns (y, y_scale, gate_out); gate_out is the selected gate in x's dtype, as the bf16 op gives it.

    >>> import torch, ditops
    >>> x = torch.randn(1, 8, 64, dtype=torch.bfloat16)
    >>> index = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])  # the last 4 tokens take set 1
    >>> scale0, shift0, gate0, scale1, shift1, gate1 = torch.randn(6, 1, 64)
    >>> y, y_scale, gate = ditops.norm_scale_shift_select_fp8(
    ...     x, index, scale0, shift0, gate0, scale1, shift1, gate1, fp8_dtype=torch.float8_e4m3fn)
    >>> y.dtype, y_scale.shape, gate.dtype
    (torch.float8_e4m3fn, torch.Size([1, 8, 1]), torch.bfloat16)
    """


def residual_norm_scale_shift_select_fp8(x: T, residual: T, residual_gate: T, index: T, scale0: T, shift0: T, gate0: T,
                                         scale1: T, shift1: T, gate1: T, *, weight: OT = None, bias: OT = None,
                                         eps: float = 1e-6, fp8_dtype: Optional[torch.dtype] = None,
                                         static_scale: OT = None) -> tuple:
    """``residual_norm_scale_shift_select`` with its y quantised as ``norm_scale_shift_fp8`` does.

    Returns (y, y_scale, residual_out, gate_out); residual_out is stored in x.dtype and y normalises it as stored.

    >>> import torch, ditops
    >>> x, residual, residual_gate = torch.randn(3, 1, 8, 64)
    >>> index = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
    >>> scale0, shift0, gate0, scale1, shift1, gate1 = torch.randn(6, 1, 64)
    >>> y, y_scale, residual, gate = ditops.residual_norm_scale_shift_select_fp8(
    ...     x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1)
    >>> y.dtype, y_scale.shape, residual.shape, gate.shape
    (torch.float8_e4m3fn, torch.Size([1, 8, 1]), torch.Size([1, 8, 64]), torch.Size([1, 8, 64]))
    """


def add_gate_norm_scale_fp8(x: T, branch: T, gate: T, scale: T, *, weight: OT = None, bias: OT = None,
                            weight2: OT = None, bias2: OT = None, norm: str = "rms", eps: float = 1e-5,
                            gate_act: Optional[str] = None, fp8_dtype: Optional[torch.dtype] = None,
                            static_scale: OT = None) -> tuple:
    """``add_gate_norm_scale`` with its y (the next GEMM's input) quantised as ``norm_scale_shift_fp8`` does.

    Returns (y, y_scale, out), FP8 rows first as the other FP8 ops give them; out is stored in
    x.dtype and y normalises it as stored.

    >>> import torch, ditops
    >>> x, branch = torch.randn(2, 2, 16, 64, dtype=torch.bfloat16)
    >>> gate, scale = torch.randn(2, 2, 64)
    >>> y, y_scale, out = ditops.add_gate_norm_scale_fp8(x, branch, gate, scale, weight=torch.ones(64),
    ...                                                  weight2=torch.ones(64), gate_act="tanh")
    >>> y.dtype, y_scale.shape, out.dtype
    (torch.float8_e4m3fn, torch.Size([2, 16, 1]), torch.bfloat16)
    """


_ROW_CASES = {name: inputs for name, inputs in ROW_SPECS.items() if inputs.gate is not None}  # gate=None: residual op only
_NORMS = dict(default_shape=(1, 4096, 3072), typical=_typical_rows("layer"))
_SELECTS = dict(conformance=SELECT_SPECS, bench=_SELECT_BENCH, default_shape=(1, 8192, 3072), typical=_typical_rows("layer"))
_GATE_NORMS = dict(conformance=GATE_NORM_SPECS, bench=_GATE_NORM_BENCH, default_shape=(1, 4096, 3840),
                   typical=_typical_rows("rms"))

_FLUX_ROWS = BenchShape("FLUX.1-dev 1024px", f"B1 S{_JOINT} D3072", _rows(1, _JOINT, 3072))
_FP8_NORM_BENCH = (_FLUX_ROWS,) + _NORM_BENCH + (_LATENCY_ROWS._replace(quick=True),)
_FP8 = dict(quantized=True, conformance=FP8_ROW_SPECS, long_conformance=FP8_LONG_ROW_SPECS, bench=_FP8_NORM_BENCH, **_NORMS)
_FP8_SELECTS = dict(_SELECTS, quantized=True, conformance=FP8_SELECT_SPECS)
_FP8_GATE_NORMS = dict(_GATE_NORMS, quantized=True, conformance=FP8_GATE_NORM_SPECS)
_QUANTIZE_BENCH = (
    BenchShape("FLUX.1-dev 1024px MLP (GELU)", f"B1 S{_JOINT} D12288",
               dataclasses.replace(_rows(1, _JOINT, 12288), activation="gelu_tanh"), quick=True),
    BenchShape("FLUX.1-dev 1024px attention out", f"B1 S{_JOINT} D3072", _rows(1, _JOINT, 3072)),
    BenchShape("Wan2.1-14B 720p MLP (GELU)", "B1 S75600 D13824", dataclasses.replace(_rows(1, 75600, 13824),
                                                                                     activation="gelu_tanh")),
    BenchShape("FLUX.1-dev 1024px single block (attention + MLP GELU)", f"B1 S{_JOINT} P3072 D12288",
               dataclasses.replace(_rows(1, _JOINT, 12288), activation="gelu_tanh", prefix=3072)),
    BenchShape("FLUX.2-dev 1024px single block (attention + SwiGLU)", f"B1 S{_JOINT} P6144 D18432",
               dataclasses.replace(_rows(1, _JOINT, 18432), prefix=6144)),
    BenchShape("latency", "B1 S128 D3072", _rows(1, 128, 3072), quick=True),
)

SPECS = {
    spec.name: spec
    for spec in (
        OpSpec(norm_scale_shift, _check_norm_scale_shift, reference.norm_scale_shift, _norm_scale_shift_inputs,
               outputs=("y",), conformance=_ROW_CASES, **_NORMS,
               bench=_NORM_BENCH + (
                   BenchShape("FLUX.2-dev 1024px", f"B1 S{_JOINT} D6144", _rows(1, _JOINT, 6144)),
                   BenchShape("Z-Image-Turbo (RMS)", f"B1 S{_JOINT} D3840", _rows(1, _JOINT, 3840, norm="rms", affine=True)),
                   _LATENCY_ROWS._replace(quick=True),
               )),
        OpSpec(residual_norm_scale_shift, _check_residual_norm_scale_shift, reference.residual_norm_scale_shift,
               _residual_norm_scale_shift_inputs, outputs=("y", "residual_out"), oracle=_residual_norm_scale_shift_oracle,
               intermediate="residual_out",
               conformance=ROW_SPECS, bench=_NORM_BENCH + (_LATENCY_ROWS._replace(quick=True),), **_NORMS),
        OpSpec(norm_scale_shift_fp8, _check_norm_scale_shift_fp8, reference.norm_scale_shift_fp8,
               _norm_scale_shift_fp8_inputs, outputs=("y", "y_scale"), **_FP8),
        OpSpec(residual_norm_scale_shift_fp8, _check_residual_norm_scale_shift_fp8, reference.residual_norm_scale_shift_fp8,
               _residual_norm_scale_shift_fp8_inputs, outputs=("y", "y_scale", "residual_out"),
               oracle=_residual_norm_scale_shift_fp8_oracle, intermediate="residual_out", **_FP8),
        OpSpec(quantize_fp8, _check_quantize_fp8, reference.quantize_fp8, _quantize_fp8_inputs, outputs=("y", "y_scale"),
               quantized=True, conformance=QUANTIZE_SPECS, bench=_QUANTIZE_BENCH, default_shape=(1, 4608, 12288),
               typical=_typical_rows("layer")),
        OpSpec(norm_scale_shift_select, _check_norm_scale_shift_select, reference.norm_scale_shift_select,
               _norm_scale_shift_select_inputs, outputs=("y", "gate_out"), **_SELECTS),
        OpSpec(residual_norm_scale_shift_select, _check_residual_norm_scale_shift_select,
               reference.residual_norm_scale_shift_select, _residual_norm_scale_shift_select_inputs,
               outputs=("y", "residual_out", "gate_out"), oracle=_residual_norm_scale_shift_select_oracle,
               intermediate="residual_out", **_SELECTS),
        OpSpec(norm_scale_shift_select_fp8, _check_norm_scale_shift_select_fp8, reference.norm_scale_shift_select_fp8,
               _norm_scale_shift_select_fp8_inputs, outputs=("y", "y_scale", "gate_out"), **_FP8_SELECTS),
        OpSpec(residual_norm_scale_shift_select_fp8, _check_residual_norm_scale_shift_select_fp8,
               reference.residual_norm_scale_shift_select_fp8, _residual_norm_scale_shift_select_fp8_inputs,
               outputs=("y", "y_scale", "residual_out", "gate_out"), oracle=_residual_norm_scale_shift_select_fp8_oracle,
               intermediate="residual_out", **_FP8_SELECTS),
        OpSpec(add_gate_norm, _check_add_gate_norm, reference.add_gate_norm, _add_gate_norm_inputs, outputs=("out",),
               **_GATE_NORMS),
        OpSpec(add_gate_norm_scale, _check_add_gate_norm_scale, reference.add_gate_norm_scale, _add_gate_norm_scale_inputs,
               outputs=("out", "y"), oracle=_add_gate_norm_scale_oracle, intermediate="out", **_GATE_NORMS),
        OpSpec(add_gate_norm_scale_fp8, _check_add_gate_norm_scale_fp8, reference.add_gate_norm_scale_fp8,
               _add_gate_norm_scale_fp8_inputs, outputs=("y", "y_scale", "out"), oracle=_add_gate_norm_scale_fp8_oracle,
               intermediate="out", **_FP8_GATE_NORMS),
        OpSpec(qk_norm_rope_, _check_qk_norm_rope, reference.qk_norm_rope_, _qk_norm_rope_inputs, inputs=HeadSpec, mutates=("q", "k"),
               check_values=_in_place_checks("qk_norm_rope_", ("q_weight", "k_weight", "cos_sin_cache", "positions")),
               conformance={**HEAD_SPECS, **TOKEN_NORM_SPECS, **LAYER_NORM_SPECS, **HEAD_CACHE_SPECS,
                            **NORM_HEAD_CACHE_SPECS}, bench=_QK_NORM_ROPE_BENCH, default_shape=(4608, 24, 128),
               typical=_typical_heads),
        OpSpec(rope_, _check_rope, reference.rope_, _rope_inputs, inputs=HeadSpec, mutates=("q", "k"),
               check_values=_in_place_checks("rope_", ("cos_sin_cache", "positions")),
               conformance={**HEAD_SPECS, **ROPE_ONLY_SPECS, **HEAD_CACHE_SPECS}, bench=_ROPE_BENCH, default_shape=(4096, 32, 128),
               typical=_typical_heads),
    )
}
