"""The public ops (docs/ops.md) and their call path, top to bottom: signature -> plan -> launch.

An eager call of an op:
1. checks its **call signature** (dispatch/signature.py: every tensor's type, shape, strides,
   dtype, device, 16-byte alignment class and requires_grad, the other arguments, grad mode
   and the backend override in force), a key in Python and the tensors' metadata compared
   in C++ by PyTorch's ``TensorGuards``;
2. finds the **plan** built for that signature on its first call: validation passed,
   the implementation chosen (registry, overrides), and a launcher fixed. Where the backend
   can pre-bind (Triton on NVIDIA: its compiled kernel's C launcher with the kernel's
   arguments laid out once, see backends/triton/kernel_launch.py; the CUDA backend: its
   parameter buffer packed once, backends/compiled.py), later calls skip Triton's own
   per-call argument specialization as well as ditops' validation and selection;
3. runs the checks that read values or data pointers (positions within the cache, in-place
   arguments that share memory): cheap, every call, before anything is written;
4. allocates the outputs and launches on the tensors' device and its current stream.
Everything a plan assumes is in its key, so a call that would fail validation never finds
a plan: it builds one, and fails there. The plan table is bounded and shared by threads.
A call whose plan exists and that no override touches runs steps 1-4 in C
(dispatch/cached_call.c, which tries the op's last few signatures before building a key and
issues a bound Triton launch itself); ``Op.run`` below is the same path in Python, which
builds plans, serves overrides and raises every error.

Under torch.compile the public functions emit graph nodes instead (``Op.__call__``), and
Dynamo reads nothing of the registry. An op on a GPU becomes ``<op>_traced``, a functional
``torch.library.triton_op`` whose body, run when the graph is traced, chooses the backend
from the tensors' metadata: Triton's kernel is handed to Inductor (``wrap_triton``), which
launches it from its own generated code; any other choice becomes the plain library op.
An in-place op's node returns new q and k, copied back into q and k (functionalization
drops those copies where q and k are intermediates of the graph). Every op on the CPU is
the plain ``torch.library`` op (``(a!)`` marks what the in-place ops write), whose kernel is
the eager path above.

Backends are called as ``function(*op_arguments, *outputs)``: the op's arguments in the
order of its signature, then the new output tensors to write (none for in-place ops).
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from . import validation
from .backends import reference
from .dispatch import Features, describe
from .dispatch.registry import Implementation
from .dispatch.selector import candidates, choose, dispatcher, format_table, select, signature_key
from .dispatch import selector
from .dispatch import device as _device
from .dispatch.signature import cached_call as _cached_call
from .dispatch.signature import configure_cached_call, data_pointers

_is_compiling = torch.compiler.is_compiling
_current_device = torch._C._cuda_getDevice if torch.cuda.is_available() else (lambda: -1)
_data_ptr = Tensor.data_ptr
_empty_like, _contiguous = torch.empty_like, torch.contiguous_format
if configure_cached_call is not None:
    configure_cached_call(vars(selector), _device._simulation, torch.is_grad_enabled, _current_device,
                          getattr(torch._C, "_cuda_getCurrentRawStream", None), _empty_like, _contiguous)


def _new(x: Tensor) -> Tensor:
    """A new contiguous tensor shaped, typed and placed like x (``empty_like`` parses its
    arguments in half the time of ``torch.empty(shape, dtype=, device=)``)."""
    return _empty_like(x, memory_format=_contiguous)


class Plan(NamedTuple):
    """What every call with one call signature runs: its implementation (None for an empty
    input: nothing to launch) and ``launch(values, pointers)``: the call's arguments and
    outputs, and the data pointers of the tensors among them, in order (read once per call:
    the signature check reads the arguments', a bound launcher passes them on)."""

    implementation: Optional[Implementation]
    launch: Callable[[tuple, tuple], None]
    check_values: Optional[Callable] = None  # (arguments, pointers): the checks that read pointers or values, every call
    direct: Optional[tuple] = None  # a bound Triton launch as data, which dispatch/cached_call.c issues from C
    spans: Optional[tuple] = None  # check_values as data where it is an aliasing check alone (InPlaceAliasing.spans), for C


def _nothing(values: tuple, pointers: tuple) -> None:
    pass


def _launcher(implementation: Implementation, values: tuple, device_index: int) -> tuple:
    """``(launch, direct)`` of a plan: the launch pre-bound where the backend can
    (``function.bind``), else the backend function; on a GPU it runs on the tensors' device
    whatever device is current (the stream is that device's current one: the backends read
    it at launch). ``direct``: the bound launcher's ``direct`` (a Triton launch as data,
    kernel_launch.bind), or None."""
    function = implementation.function
    bind = getattr(function, "bind", None)
    call = bind(values, device_index) if device_index >= 0 and bind is not None else None
    if call is None:
        call = lambda values, pointers: function(*values)  # noqa: E731
    if device_index < 0:
        return call, None

    def on_device(values: tuple, pointers: tuple) -> None:
        if _current_device() == device_index:
            call(values, pointers)
        else:
            with torch.cuda.device(device_index):
                call(values, pointers)

    return on_device, getattr(call, "direct", None)


@dataclass(frozen=True)
class Op:
    name: str
    check: Callable  # (*arguments, describe_call=True) -> Features, or None for an empty input
    outputs: Callable  # (*arguments) -> tuple of new tensors for the backend to fill
    schema: str  # torch.library schema, (a!) marking what is written in place; its last argument is the backend override
    check_values: Optional[Callable] = None  # (*arguments) -> the plan's per-call check (arguments, pointers), see Plan

    def __post_init__(self) -> None:
        # The non-tensor arguments, read into the call signature's key (positions in the schema).
        types = [str(argument.type) for argument in torch._C.parse_schema(self.name + self.schema).arguments[:-1]]
        positions = [i for i, text in enumerate(types) if text not in ("Tensor", "Optional[Tensor]")]
        object.__setattr__(self, "scalars", operator.itemgetter(*positions))

    @property
    def in_place(self) -> bool:
        return "!)" in self.schema

    def plan(self, arguments: tuple, backend: Optional[str]) -> Plan:
        return self._find(arguments, backend)[0]

    def _find(self, arguments: tuple, backend: Optional[str]) -> tuple:
        """(the call's plan, its tensors' data pointers): found by the call signature, or built."""
        table = (selector._dispatcher or dispatcher()).plans
        try:
            key = signature_key(self.name, self.scalars, arguments, backend)
            found = table.find(key, arguments)
        except (TypeError, AttributeError):  # unhashable or not a tensor: validation below names it
            key, found = None, None
        if found is None:
            plan = self._build_plan(arguments, backend)
            if key is not None:
                table.add(key, arguments, plan)
            found = plan, data_pointers(arguments)
        return found

    def _build_plan(self, arguments: tuple, backend: Optional[str]) -> Plan:
        features = self.check(*arguments)  # raises ValueError on bad input
        if features is None:
            return Plan(None, _nothing)
        implementation = select(self.name, features, backend)
        check = self.check_values(*arguments) if self.check_values is not None else None
        if check is not None:  # building the launcher may launch (a first compile): check the call first
            check(arguments, data_pointers(arguments))
        values = arguments + self.outputs(*arguments)
        device_index = values[0].get_device()
        launch, direct = _launcher(implementation, values, device_index)
        spans = check.spans() if isinstance(check, validation.InPlaceAliasing) else None
        return Plan(implementation, launch, check, direct, spans)

    def run(self, arguments: tuple, backend: Optional[str]) -> tuple:
        """The eager path: what the registered op does too."""
        plan, pointers = self._find(arguments, backend)
        if plan.check_values is not None:
            plan.check_values(arguments, pointers)
        outputs = self.outputs(*arguments)
        plan.launch(arguments + outputs, pointers + tuple(map(_data_ptr, outputs)))
        return outputs

    def __call__(self, arguments: tuple, backend: Optional[str]) -> tuple:
        if not _is_compiling():
            if _cached_call is not None:  # run() in C for a call whose plan exists (dispatch/cached_call.c)
                outputs = _cached_call(self, arguments, backend)
                if outputs is not NotImplemented:
                    return outputs
            return self.run(arguments, backend)
        if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in arguments):
            return self.traced_reference(arguments)
        # Dynamo reads nothing of the registry here: each object it read would be a guard
        # checked on every call of the compiled code, and a first read (a file, an import)
        # a graph break. The choice is made where the graph node is traced (_register_traced).
        result = getattr(torch.ops.ditops, self.name + ("_traced" if arguments[0].is_cuda else ""))(*arguments, backend)
        if self.in_place and arguments[0].is_cuda:
            # The functional node's new q and k, copied back: where q and k are intermediates
            # of the graph (every patched processor), functionalization removes the copies.
            q, k = arguments[:2]
            q.copy_(result[0])
            if k is not None:
                k.copy_(result[1])
            return ()
        return (result,) if isinstance(result, Tensor) else tuple(result or ())

    def traced_reference(self, arguments: tuple) -> tuple:
        """Under torch.compile with inputs that require grad: the reference math, traced into
        the graph so that autograd differentiates it (as the eager path does, by selecting
        the reference). The registered op has no autograd formula."""
        self.check(*arguments, describe_call=False)
        outputs = self.outputs(*arguments)
        getattr(reference, self.name)(*arguments, *outputs)
        return outputs

    def register(self) -> None:
        def fake(*arguments):
            self.check(*arguments[:-1], describe_call=False)
            outputs = self.outputs(*arguments[:-1])
            return outputs[0] if len(outputs) == 1 else (outputs or None)

        def real(*arguments):
            outputs = self.run(arguments[:-1], arguments[-1])
            return outputs[0] if len(outputs) == 1 else (outputs or None)

        _LIBRARY.define(self.name + self.schema)
        _LIBRARY.impl(self.name, real, "CompositeExplicitAutograd")
        torch.library.register_fake(f"ditops::{self.name}", fake, lib=_LIBRARY)
        self._register_traced()

    def _register_traced(self) -> None:
        """``ditops::<op>_traced``: the op on a GPU as a compiled graph holds it, a functional
        ``torch.library.triton_op`` (an in-place op returns new q and k, which ``__call__``
        copies back). Its body runs when the graph is traced (fake tensors, real Python: the
        registry is read there, not by Dynamo): it validates the call, chooses the backend from
        the tensors' metadata and the override, and hands the Triton kernel to Inductor
        (``wrap_triton``) when Triton is chosen, so that Inductor launches it from its own
        generated code. The reference, chosen for a functional op (the registry's row kernels
        say ``compiled_graph: false``: Inductor's fusion is faster there), is its math traced
        into the graph. Any other choice, an empty input, or positions whose values must be
        checked on every call (an in-place op's ``check_values``) become the library op,
        which dispatches again on every call (an in-place op: on copies of q and k).

        The rule for a mutating ``triton_op`` on q/k views (it crashed under compile, torch
        2.11) is why the in-place ops are functional here."""
        names = [argument.name for argument in torch._C.parse_schema(self.name + self.schema).arguments]
        positions_at = names.index("positions") if self.in_place else None

        def body(*arguments):
            op_arguments, backend = arguments[:-1], arguments[-1]
            features = self.check(*op_arguments)
            trace = None
            if features is not None and (positions_at is None or op_arguments[positions_at] is None):
                chosen = choose(self.name, features, backend)
                if chosen.name == "reference" and not self.in_place:
                    # its math traced into the graph, where Inductor fuses it (registry.yaml: compiled_graph)
                    outputs = self.traced_reference(op_arguments)
                    return outputs[0] if len(outputs) == 1 else outputs
                trace = getattr(chosen.function, "trace", None)
            if trace is None:
                if not self.in_place:
                    return getattr(torch.ops.ditops, self.name)(*arguments)
                q, k = (t.clone() if t is not None else None for t in op_arguments[:2])
                getattr(torch.ops.ditops, self.name)(q, k, *arguments[2:])
                return q, (k if k is not None else q.new_empty(0))
            if self.in_place:
                q, k = op_arguments[:2]
                outputs = (_new(q), _new(k) if k is not None else None)
                trace(*op_arguments, *outputs)
                return outputs[0], (outputs[1] if k is not None else q.new_empty(0))
            outputs = self.outputs(*op_arguments)
            trace(*op_arguments, *outputs)
            return outputs[0] if len(outputs) == 1 else outputs

        functional = torch._C.parse_schema(
            self.name + self.schema.replace("(a!)", "").replace("(b!)", "").replace("-> ()", "-> (Tensor, Tensor)"))
        body.__signature__ = _python_signature(functional)  # triton_op reads its schema from this
        torch.library.triton_op(f"ditops::{self.name}_traced", body, mutates_args=())


_PYTHON_TYPES = {"Tensor": Tensor, "str": str, "float": float, "bool": bool, "SymInt": int, "int": int}


def _python_signature(schema) -> inspect.Signature:
    """The annotated Python signature of a torch.library schema."""

    def annotation(type_text: str):
        optional = type_text.startswith("Optional[")
        python_type = _PYTHON_TYPES[type_text.removeprefix("Optional[").removesuffix("]")]
        return Optional[python_type] if optional else python_type

    parameters = [
        inspect.Parameter(argument.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation(str(argument.type)))
        for argument in schema.arguments
    ]
    returns = [Tensor] * len(schema.returns)
    return_annotation = returns[0] if len(returns) == 1 else tuple.__class_getitem__(tuple(returns))
    return inspect.Signature(parameters, return_annotation=return_annotation)


_LIBRARY = torch.library.Library("ditops", "DEF")


# Checks: validation (raises ValueError), then the features the dispatcher reads.


def _norm_arguments(op, shape, device, weight, bias, norm, eps):
    validation.affine(op, "weight", weight, shape.hidden, device)
    validation.affine(op, "bias", bias, shape.hidden, device)
    validation.norm_kind(op, norm, bias)
    validation.eps(op, eps)


def _check_norm_scale_shift(x, scale, shift, weight, bias, norm, eps, describe_call=True) -> Optional[Features]:
    op = "norm_scale_shift"
    validation.tensor(op, "x", x)
    device = x.device
    shape = validation.rows(op, "x", x)
    forms = (validation.modulation(op, "scale", scale, shape, device), validation.modulation(op, "shift", shift, shape, device))
    _norm_arguments(op, shape, device, weight, bias, norm, eps)
    if describe_call and x.numel():
        return describe((x,), (scale, shift, weight, bias), hidden_size=shape.hidden, batch_size=shape.batch, norm=norm,
                        modulation=forms)


def _check_residual_norm_scale_shift(
    x, residual, gate, scale, shift, weight, bias, norm, eps, describe_call=True
) -> Optional[Features]:
    op = "residual_norm_scale_shift"
    device = validation.activation_pair(op, "x", x, "residual", residual)
    shape = validation.rows(op, "x", x)
    gate_form = () if gate is None else (validation.modulation(op, "gate", gate, shape, device),)  # None: a gate of 1
    forms = gate_form + (validation.modulation(op, "scale", scale, shape, device), validation.modulation(op, "shift", shift, shape, device))
    _norm_arguments(op, shape, device, weight, bias, norm, eps)
    if describe_call and x.numel():
        return describe(
            (x, residual), (gate, scale, shift, weight, bias), hidden_size=shape.hidden, batch_size=shape.batch, norm=norm,
            modulation=forms,
        )


def _select_arguments(op, x, index, modulation, weight, bias, eps):
    """Checks shared by the select ops; ``modulation`` maps the six names to tensors."""
    device = x.device
    shape = validation.rows(op, "x", x)
    validation.selection_index(op, index, shape, device)
    for name, t in modulation.items():
        validation.per_batch(op, name, t, shape, device)
    _norm_arguments(op, shape, device, weight, bias, "layer", eps)
    return shape


def _check_norm_scale_shift_select(
    x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, describe_call=True
) -> Optional[Features]:
    op = "norm_scale_shift_select"
    validation.tensor(op, "x", x)
    modulation = dict(scale0=scale0, shift0=shift0, gate0=gate0, scale1=scale1, shift1=shift1, gate1=gate1)
    shape = _select_arguments(op, x, index, modulation, weight, bias, eps)
    if describe_call and x.numel():
        return describe(
            (x,), (*modulation.values(), weight, bias), hidden_size=shape.hidden, batch_size=shape.batch, norm="layer",
            modulation=("batch",) * 6,
        )


def _check_residual_norm_scale_shift_select(
    x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, describe_call=True
) -> Optional[Features]:
    op = "residual_norm_scale_shift_select"
    validation.activation_pair(op, "x", x, "residual", residual)
    validation.tensor(op, "residual_gate", residual_gate, validation.ACTIVATION_DTYPES, x.device)
    validation.same_shape(op, "residual_gate", residual_gate, "x", x)
    modulation = dict(scale0=scale0, shift0=shift0, gate0=gate0, scale1=scale1, shift1=shift1, gate1=gate1)
    shape = _select_arguments(op, x, index, modulation, weight, bias, eps)
    if describe_call and x.numel():
        return describe(
            (x, residual),
            (residual_gate, *modulation.values(), weight, bias),
            hidden_size=shape.hidden, batch_size=shape.batch,
            norm="layer",
            modulation=("token",) + ("batch",) * 6,
        )


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
                        modulation=(form,))


def _check_add_gate_norm_scale(
    x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, describe_call=True
) -> Optional[Features]:
    op = "add_gate_norm_scale"
    shape, device, form = _gate_norm_arguments(op, x, branch, gate, weight, bias, norm, eps, gate_act)
    scale_form = validation.modulation(op, "scale", scale, shape, device)
    validation.affine(op, "weight2", weight2, shape.hidden, device)
    validation.affine(op, "bias2", bias2, shape.hidden, device)
    if norm == "rms" and bias2 is not None:
        validation.fail(op, "bias2", "is a tensor with norm='rms'", "None (RMSNorm has no bias)")
    if describe_call and x.numel():
        return describe(
            (x, branch),
            (gate, scale, weight, bias, weight2, bias2),
            hidden_size=shape.hidden, batch_size=shape.batch,
            norm=norm,
            modulation=(form, scale_form),
        )


def _check_qk_norm_rope(
    q, k, q_weight, k_weight, cos_sin_cache, positions, interleaved, rotary_dim, eps, position_offset, describe_call=True
) -> Optional[Features]:
    op = "qk_norm_rope_"
    if k is None:
        validation.fail(op, "k", "is None", "a tensor (only rope_ takes k=None)")
    heads = validation.heads(op, q, k, cos_sin_cache, positions, rotary_dim, position_offset, interleaved)
    device = q.device
    validation.affine(op, "q_weight", q_weight, heads.head_size, device)
    validation.affine(op, "k_weight", k_weight, heads.head_size, device)
    validation.eps(op, eps)
    if describe_call and q.numel():
        return describe(
            (q, k),
            (q_weight, k_weight, cos_sin_cache),
            head_size=heads.head_size,
            rotary_dim=heads.rotary_dim,
            interleaved=interleaved,
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


class _LikeX:
    """An op's outputs: ``count`` new contiguous tensors like x (``_new``; none for the in-place
    ops). dispatch/cached_call.c reads ``count`` and allocates them itself, the same way."""

    def __init__(self, count: int):
        self.count = count

    def __call__(self, x, *_) -> tuple:
        return tuple(_new(x) for _ in range(self.count))


_one_like_x, _two_like_x, _three_like_x, _in_place = _LikeX(1), _LikeX(2), _LikeX(3), _LikeX(0)


_NORM = "Tensor? weight, Tensor? bias, str norm, float eps"
_SELECT = "Tensor scale0, Tensor shift0, Tensor gate0, Tensor scale1, Tensor shift1, Tensor gate1, Tensor? weight, Tensor? bias, float eps"
_ROPE = "Tensor cos_sin_cache, Tensor? positions, bool interleaved, SymInt? rotary_dim"

OPS = {
    op.name: op
    for op in (
        Op(
            "norm_scale_shift",
            _check_norm_scale_shift,
            _one_like_x,
            f"(Tensor x, Tensor scale, Tensor shift, {_NORM}, str? backend) -> Tensor",
        ),
        Op(
            "residual_norm_scale_shift",
            _check_residual_norm_scale_shift,
            _two_like_x,
            f"(Tensor x, Tensor residual, Tensor? gate, Tensor scale, Tensor shift, {_NORM}, str? backend) -> (Tensor, Tensor)",
        ),
        Op(
            "norm_scale_shift_select",
            _check_norm_scale_shift_select,
            _two_like_x,
            f"(Tensor x, Tensor index, {_SELECT}, str? backend) -> (Tensor, Tensor)",
        ),
        Op(
            "residual_norm_scale_shift_select",
            _check_residual_norm_scale_shift_select,
            _three_like_x,
            f"(Tensor x, Tensor residual, Tensor residual_gate, Tensor index, {_SELECT}, str? backend) -> (Tensor, Tensor, Tensor)",
        ),
        Op(
            "add_gate_norm",
            _check_add_gate_norm,
            _one_like_x,
            f"(Tensor x, Tensor branch, Tensor gate, {_NORM}, str? gate_act, str? backend) -> Tensor",
        ),
        Op(
            "add_gate_norm_scale",
            _check_add_gate_norm_scale,
            _two_like_x,
            "(Tensor x, Tensor branch, Tensor gate, Tensor scale, Tensor? weight, Tensor? bias, Tensor? weight2, "
            "Tensor? bias2, str norm, float eps, str? gate_act, str? backend) -> (Tensor, Tensor)",
        ),
        Op(
            "qk_norm_rope_",
            _check_qk_norm_rope,
            _in_place,
            f"(Tensor(a!) q, Tensor(b!) k, Tensor? q_weight, Tensor? k_weight, {_ROPE}, float eps, SymInt position_offset, "
            "str? backend) -> ()",
            check_values=_in_place_checks("qk_norm_rope_", ("q_weight", "k_weight", "cos_sin_cache", "positions")),
        ),
        Op(
            "rope_",
            _check_rope,
            _in_place,
            f"(Tensor(a!) q, Tensor(b!)? k, {_ROPE}, SymInt position_offset, str? backend) -> ()",
            check_values=_in_place_checks("rope_", ("cos_sin_cache", "positions")),
        ),
    )
}

for _op in OPS.values():
    _op.register()


# The public functions. ``backend=`` forces a backend for this call (see ditops.use_backend).


def norm_scale_shift(x, scale, shift, *, weight=None, bias=None, norm="layer", eps=1e-6, backend=None) -> Tensor:
    """``y = norm(x) * (1 + scale) + shift``.

    x: [B, S, D] or [N, D]; scale, shift: a modulation form of docs/ops.md ([], [D], [B, D],
    [B, S, D], [B, F, 1, D], ...); weight, bias: [D] or None; norm: "layer" or "rms".
    Returns a new y shaped and typed like x.

    >>> import torch, ditops
    >>> x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    >>> modulation = torch.randn(2, 6, 64)  # [B, 6, D] float32, as a DiT block's AdaLN gives it
    >>> y = ditops.norm_scale_shift(x, modulation[:, 1], modulation[:, 0])
    >>> y.shape, y.dtype
    (torch.Size([2, 16, 64]), torch.bfloat16)
    """
    return OPS["norm_scale_shift"]((x, scale, shift, weight, bias, norm, eps), backend)[0]


def residual_norm_scale_shift(
    x, residual, gate, scale, shift, *, weight=None, bias=None, norm="layer", eps=1e-6, backend=None
) -> tuple:
    """``residual_out = residual + gate * x`` (stored in x.dtype), ``y = norm(residual_out) * (1 + scale) + shift``.

    x, residual: [B, S, D] or [N, D]; gate (None = 1), scale, shift: modulation forms.
    Returns (y, residual_out).

    >>> import torch, ditops
    >>> attention, residual = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    >>> gate, scale, shift = torch.randn(3, 2, 64)
    >>> y, residual = ditops.residual_norm_scale_shift(attention, residual, gate, scale, shift, norm="rms")
    >>> y.shape == residual.shape == attention.shape
    True
    """
    return OPS["residual_norm_scale_shift"]((x, residual, gate, scale, shift, weight, bias, norm, eps), backend)


def norm_scale_shift_select(
    x, index, scale0, shift0, gate0, scale1, shift1, gate1, *, weight=None, bias=None, eps=1e-6, backend=None
) -> tuple:
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
    arguments = (x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps)
    return OPS["norm_scale_shift_select"](arguments, backend)


def residual_norm_scale_shift_select(
    x,
    residual,
    residual_gate,
    index,
    scale0,
    shift0,
    gate0,
    scale1,
    shift1,
    gate1,
    *,
    weight=None,
    bias=None,
    eps=1e-6,
    backend=None,
) -> tuple:
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
    arguments = (x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps)
    return OPS["residual_norm_scale_shift_select"](arguments, backend)


def add_gate_norm(x, branch, gate, *, weight=None, bias=None, norm="rms", eps=1e-5, gate_act=None, backend=None) -> Tensor:
    """``out = x + act(gate) * norm(branch)``, act = identity or tanh (``gate_act="tanh"``).

    x, branch: [B, S, D] or [N, D]; gate: a modulation form. Returns out, typed like x.

    >>> import torch, ditops
    >>> x, branch, gate = torch.randn(2, 16, 64), torch.randn(2, 16, 64), torch.randn(2, 64)
    >>> out = ditops.add_gate_norm(x, branch, gate, weight=torch.ones(64), gate_act="tanh")
    >>> out.shape
    torch.Size([2, 16, 64])
    """
    return OPS["add_gate_norm"]((x, branch, gate, weight, bias, norm, eps, gate_act), backend)[0]


def add_gate_norm_scale(
    x,
    branch,
    gate,
    scale,
    *,
    weight=None,
    bias=None,
    weight2=None,
    bias2=None,
    norm="rms",
    eps=1e-5,
    gate_act=None,
    backend=None,
) -> tuple:
    """``out = x + act(gate) * norm(branch)`` (stored in x.dtype), then ``y = norm2(out) * (1 + scale)``.

    norm2 uses weight2/bias2. Returns (out, y).

    >>> import torch, ditops
    >>> x, branch = torch.randn(2, 16, 64), torch.randn(2, 16, 64)
    >>> gate, scale = torch.randn(2, 2, 64)
    >>> out, y = ditops.add_gate_norm_scale(x, branch, gate, scale, weight=torch.ones(64), weight2=torch.ones(64))
    >>> out.shape, y.shape
    (torch.Size([2, 16, 64]), torch.Size([2, 16, 64]))
    """
    arguments = (x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act)
    return OPS["add_gate_norm_scale"](arguments, backend)


def qk_norm_rope_(
    q,
    k,
    q_weight,
    k_weight,
    cos_sin_cache,
    positions=None,
    *,
    interleaved=True,
    rotary_dim=None,
    eps=1e-6,
    position_offset=0,
    backend=None,
) -> tuple:
    """In place: per token and head, RMSNorm over Dh, then RoPE on the first R dims.

    q: [T, Hq, Dh] or [B, S, Hq, Dh]; k: the same leading dims with Hk heads; q_weight,
    k_weight: [Dh]; cos_sin_cache: [P, R] (R/2 cos then R/2 sin columns); positions:
    q's leading shape, or None for ``position_offset + token index``. Returns (q, k).

    >>> import torch, ditops
    >>> q, k = torch.randn(2, 32, 4, 128, dtype=torch.bfloat16)  # [T, H, Dh] each
    >>> cache = ditops.rope_cos_sin_cache(32, 128)  # positions 0..31, all 128 dims rotated
    >>> q_out, k_out = ditops.qk_norm_rope_(q, k, torch.ones(128), torch.ones(128), cache)
    >>> q_out is q  # written in place
    True
    """
    arguments = (q, k, q_weight, k_weight, cos_sin_cache, positions, interleaved, rotary_dim, eps, position_offset)
    OPS["qk_norm_rope_"](arguments, backend)
    return q, k


def rope_(
    q, k, cos_sin_cache, positions=None, *, interleaved=True, rotary_dim=None, position_offset=0, backend=None
) -> tuple:
    """In place: RoPE on the first R dims of every head of q and k (k may be None). Returns (q, k).

    Shapes as in ``qk_norm_rope_``; ``interleaved=False`` is the NeoX layout.

    >>> import torch, ditops
    >>> q, k = torch.randn(32, 8, 64), torch.randn(32, 2, 64)  # GQA: 8 query heads, 2 key heads
    >>> cache = ditops.rope_cos_sin_cache(4096, 64)
    >>> positions = torch.randint(0, 4096, (32,))
    >>> _ = ditops.rope_(q, k, cache, positions, interleaved=False)
    """
    OPS["rope_"]((q, k, cos_sin_cache, positions, interleaved, rotary_dim, position_offset), backend)
    return q, k


PUBLIC = {
    function.__name__: function
    for function in (
        norm_scale_shift,
        residual_norm_scale_shift,
        norm_scale_shift_select,
        residual_norm_scale_shift_select,
        add_gate_norm,
        add_gate_norm_scale,
        qk_norm_rope_,
        rope_,
    )
}


def ordered_arguments(op: str, *args, **kwargs) -> tuple:
    """The arguments of a public call in the order backends take them, and the backend override."""
    bound = inspect.signature(PUBLIC[op]).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    backend = arguments.pop("backend")
    return tuple(arguments.values()), backend


def explain(op: str, *args, compiled: bool = False, **kwargs) -> "Explanation":
    """Which implementation ``ditops.<op>(*args, **kwargs)`` would run, and why each other one
    refused; ``compiled=True``: the choice for the call traced into a torch.compile graph."""
    if op not in OPS:
        raise ValueError(f"explain: op is {op!r}; wanted one of {', '.join(OPS)}")
    arguments, backend = ordered_arguments(op, *args, **kwargs)
    features = OPS[op].check(*arguments)
    if features is None:
        return Explanation(op, None, [], None, "empty input: no kernel runs")
    if compiled:
        features = features._replace(traced=True)
    rows = candidates(op, features)
    try:
        chosen = choose(op, features, backend).name
        error = None
    except Exception as failure:
        chosen, error = None, str(failure)
    rule = dispatcher().registry.preference(op, features)
    preferred = f"{rule.backend} goes first here, measured: {rule.measured}" if rule is not None else None
    return Explanation(op, features, rows, chosen, error, preferred)


@dataclass
class Explanation:
    op: str
    features: Optional[Features]
    candidates: list
    selected: Optional[str]
    error: Optional[str] = None
    preferred: Optional[str] = None  # the measured preference that ordered the candidates

    def __str__(self) -> str:
        if self.features is None:
            return f"ditops.{self.op}: {self.error}"
        head = f"ditops.{self.op} -> {self.selected}" if self.selected else f"ditops.{self.op}: {self.error}"
        if self.preferred:
            head += f"\n  preference: {self.preferred}"
        return head + "\n" + format_table(self.features, self.candidates)
