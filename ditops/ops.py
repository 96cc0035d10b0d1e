"""The public ops (docs/ops.md) and their call path, top to bottom: signature -> plan -> launch.

Each op is defined once, in ditops/opspec.py; this module makes its public function,
registers it with torch.library and runs it. An eager call of an op:
1. checks its **call signature** (dispatch/signature.py: every tensor's type, shape, strides,
   dtype, device, 16-byte alignment class and requires_grad, the other arguments, grad mode
   and the backend override in force), a key in Python and the tensors' metadata compared
   in C++ by PyTorch's ``TensorGuards``;
2. finds the **plan** built for that signature on its first call: validation passed,
   the implementation chosen (registry, overrides), and a launcher fixed. Where the backend's
   kernel can pre-bind (``Kernel.bind``, dispatch/contract.py: Triton on NVIDIA, its compiled
   kernel's C launcher with the kernel's arguments laid out once, backends/triton/kernel_launch.py;
   the CUDA backend, its parameter buffer packed once, backends/compiled.py), later calls skip
   Triton's own per-call argument specialization as well as ditops' validation and selection;
3. runs the checks that read values or data pointers (positions within the cache, in-place
   arguments that share memory): cheap, every call, before anything is written;
4. allocates the outputs and launches on the tensors' device and its current stream.
Everything a plan assumes is in its key, so a call that would fail validation never finds
a plan: it builds one, and fails there. The plan table is bounded and shared by threads.

Under torch.compile the public functions emit graph nodes instead (``Op.__call__``), and
Dynamo reads nothing of the registry. An op on a GPU becomes ``<op>_traced``, a functional
``torch.library.triton_op`` whose body, run when the graph is traced, chooses the backend
from the tensors' metadata: a kernel that traces (``Kernel.trace``: Triton's, handed to
Inductor through ``wrap_triton``) is launched by Inductor from its own generated code; any
other choice becomes the plain library op. The node's last argument, ``traced_state``, names
the settings that choice read (dispatch/selector.py), so that a changed override traces again
and torch's compile caches never serve a graph traced under other settings. An in-place
op's node returns new q and k, copied back into q and k (functionalization drops those
copies where q and k are intermediates of the graph). Every op on the CPU is the plain
``torch.library`` op (``(a!)`` marks what the in-place ops write), whose kernel is the eager
path above.

Kernels are called as ``run(*op_arguments, *outputs)``: the op's arguments in the order of
its signature, then the new output tensors to write (none for in-place ops).
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor

from .dispatch import Features
from .dispatch.registry import Implementation, declare_op
from .dispatch.selector import candidates, choose, dispatcher, format_table, select, signature_key, traced_state
from .dispatch import selector
from .dispatch.signature import data_pointers
from .opspec import SPECS, OpSpec, fp8_format

_is_compiling = torch.compiler.is_compiling
_current_device = torch._C._cuda_getDevice if torch.cuda.is_available() else (lambda: -1)
_data_ptr = Tensor.data_ptr
_empty_like, _contiguous = torch.empty_like, torch.contiguous_format


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


def _nothing(values: tuple, pointers: tuple) -> None:
    pass


def _launcher(implementation: Implementation, values: tuple, device_index: int) -> Callable[[tuple, tuple], None]:
    """A plan's launch: the kernel pre-bound where it can be (``Kernel.bind``), else its
    ``run``; on a GPU it runs on the tensors' device whatever device is current (the stream
    is that device's current one: the backends read it at launch)."""
    kernel = implementation.kernel
    call = kernel.bind(values, device_index) if device_index >= 0 else None
    if call is None:
        run = kernel.run
        call = lambda values, pointers: run(*values)  # noqa: E731
    if device_index < 0:
        return call

    def on_device(values: tuple, pointers: tuple) -> None:
        if _current_device() == device_index:
            call(values, pointers)
        else:
            with torch.cuda.device(device_index):
                call(values, pointers)

    return on_device


class Op:
    """An op of ditops/opspec.py as this module runs it."""

    def __init__(self, spec: OpSpec):
        self.spec, self.name = spec, spec.name
        self.check = spec.check  # (*arguments, describe_call=True) -> Features, or None for an empty input
        self.check_values = spec.check_values  # (*arguments) -> the plan's per-call check (arguments, pointers), see Plan
        self.schema = spec.schema()  # its last argument is the backend override
        self.in_place = bool(spec.mutates)
        # The non-tensor arguments, read into the call signature's key (positions in the schema).
        types = [str(argument.type) for argument in torch._C.parse_schema(self.name + self.schema).arguments[:-1]]
        self.scalars = operator.itemgetter(*[i for i, text in enumerate(types) if text not in ("Tensor", "Optional[Tensor]")])
        self._count = len(spec.outputs)
        names = list(inspect.signature(spec.signature).parameters)
        self._fp8_at = names.index("fp8_dtype") if spec.quantized else None
        self._prefix_at = names.index("prefix") if "prefix" in names else None  # quantize_fp8: y is [..., P + D]

    def outputs(self, x, *rest) -> tuple:
        """The new tensors a kernel fills: contiguous, like the first argument (none for an in-place
        op); an op with an FP8 output gives its FP8 rows (quantize_fp8 with a prefix: P + D wide) and
        their float32 scales [..., 1] first."""
        if self._fp8_at is None:
            return tuple(_new(x) for _ in range(self._count))
        fp8_dtype = fp8_format(x, rest[self._fp8_at - 1])
        prefix = rest[self._prefix_at - 1] if self._prefix_at is not None else None
        width = x.shape[-1] if prefix is None else prefix.shape[-1] + x.shape[-1]
        scales = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        if width == 0 and scales.numel():  # rows of no values: no kernel runs, the zero-row rule holds
            static_scale = rest[self._fp8_at]
            scales.fill_(static_scale.reshape(()) if static_scale is not None else 1e-12 / torch.finfo(fp8_dtype).max)
        if prefix is None:
            y = _empty_like(x, dtype=fp8_dtype, memory_format=_contiguous)
        else:  # the rows of cat([prefix, act(x)], -1)
            y = x.new_empty((*x.shape[:-1], width), dtype=fp8_dtype)
        quantized = (y, scales)
        return quantized + tuple(_new(x) for _ in range(self._count - 2))

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
        return Plan(implementation, _launcher(implementation, values, values[0].get_device()), check)

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
            return self.run(arguments, backend)
        if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in arguments):
            return self.traced_reference(arguments)
        # Dynamo reads nothing of the registry here: each object it read would be a guard
        # checked on every call of the compiled code, and a first read (a file, an import)
        # a graph break. The choice is made where the graph node is traced (_register_traced),
        # and the node carries what that choice depends on (selector.traced_state).
        if arguments[0].is_cuda:
            result = getattr(torch.ops.ditops, self.name + "_traced")(*arguments, backend, traced_state(self.name, backend))
        else:
            result = getattr(torch.ops.ditops, self.name)(*arguments, backend)
        if self.in_place and arguments[0].is_cuda:
            # The functional node's new q and k, copied back: where q and k are intermediates
            # of the graph (every patched processor), functionalization removes the copies.
            # They are returned too: a caller that reads them rather than q and k (slices of a
            # joint projection) spares the graph rebuilding the projection around them.
            q, k = arguments[:2]
            q.copy_(result[0])
            if k is not None:
                k.copy_(result[1])
            return result[0], (result[1] if k is not None else None)
        return (result,) if isinstance(result, Tensor) else tuple(result or ())

    def traced_reference(self, arguments: tuple) -> tuple:
        """Under torch.compile with inputs that require grad: the reference math, traced into
        the graph so that autograd differentiates it (as the eager path does, by selecting
        the reference). The registered op has no autograd formula."""
        self.check(*arguments, describe_call=False)
        outputs = self.outputs(*arguments)
        self.spec.reference(*arguments, *outputs)
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
        the tensors' metadata and the override, and traces the chosen kernel where it can
        (``Kernel.trace``: Triton's, handed to Inductor through ``wrap_triton``), so that
        Inductor launches it from its own generated code. The reference, chosen for a functional op (the registry's row kernels
        say ``compiled_graph: false``: Inductor's fusion is faster there), is its math traced
        into the graph. Any other choice, an empty input, or positions whose values must be
        checked on every call (an in-place op's ``check_values``) become the library op,
        which dispatches again on every call (an in-place op: on copies of q and k).

        The rule for a mutating ``triton_op`` on q/k views (it crashed under compile, torch
        2.11) is why the in-place ops are functional here."""
        names = [argument.name for argument in torch._C.parse_schema(self.name + self.schema).arguments]
        positions_at = names.index("positions") if self.in_place else None

        def body(*arguments):
            # the last argument, selector.traced_state, only keys the compile caches
            op_arguments, backend, library_arguments = arguments[:-2], arguments[-2], arguments[:-1]
            features = self.check(*op_arguments)
            trace = None
            if features is not None and (positions_at is None or op_arguments[positions_at] is None):
                chosen = choose(self.name, features, backend)
                if chosen.name == "reference" and not self.in_place:
                    # its math traced into the graph, where Inductor fuses it (registry.yaml: compiled_graph)
                    outputs = self.traced_reference(op_arguments)
                    return outputs[0] if len(outputs) == 1 else outputs
                trace = chosen.kernel.trace if chosen.kernel.traces else None
            if trace is None:
                if not self.in_place:
                    return getattr(torch.ops.ditops, self.name)(*library_arguments)
                q, k = (t.clone() if t is not None else None for t in op_arguments[:2])
                getattr(torch.ops.ditops, self.name)(q, k, *library_arguments[2:])
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
            self.name + self.schema.replace("(a!)", "").replace("(b!)", "").replace("-> ()", "-> (Tensor, Tensor)")
            .replace("str? backend)", "str? backend, str traced_state)"))
        body.__signature__ = _python_signature(functional)  # triton_op reads its schema from this
        torch.library.triton_op(f"ditops::{self.name}_traced", body, mutates_args=())


_PYTHON_TYPES = {"Tensor": Tensor, "str": str, "float": float, "bool": bool, "SymInt": int, "int": int,
                 "ScalarType": torch.dtype}


def _python_signature(schema) -> inspect.Signature:
    """The annotated Python signature of a torch.library schema."""

    def annotation(type_text: str):
        optional = type_text.startswith("Optional[")
        python_type = _PYTHON_TYPES[type_text.removeprefix("Optional[").removesuffix("]")]
        return Optional[python_type] if optional else python_type

    parameters = [
        inspect.Parameter(argument.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation(str(argument.real_type)))
        for argument in schema.arguments
    ]
    returns = [Tensor] * len(schema.returns)
    return_annotation = returns[0] if len(returns) == 1 else tuple.__class_getitem__(tuple(returns))
    return inspect.Signature(parameters, return_annotation=return_annotation)


_LIBRARY = torch.library.Library("ditops", "DEF")


def public_function(op: Op) -> Callable:
    """``ditops.<op>``: the spec's signature and docstring plus ``backend=None``, calling ``op``
    with its arguments in order. Written as source (as dataclasses writes ``__init__``): a
    call binds its arguments as any Python function does, with no ``inspect`` on the hot path.
    It returns the op's one output, its outputs as a tuple, or an in-place op's written
    arguments (q, k)."""
    stub = op.spec.signature
    parameters = list(inspect.signature(stub).parameters.values())
    names = [p.name for p in parameters]
    positional = [p.name for p in parameters if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    keyword = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    if len(positional) + len(keyword) != len(names):
        raise ValueError(f"{op.name}: its signature takes *args or **kwargs; wanted named arguments only")
    call = f"_op(({', '.join(names)},), backend)"
    if op.in_place:  # the op writes its arguments and returns them (under torch.compile: Op.__call__'s)
        body = f"    written = {call}\n    return written or ({', '.join(op.spec.mutates)})\n"
    else:
        body = f"    return {call}{'[0]' if len(op.spec.outputs) == 1 else ''}\n"
    source = f"def {op.name}({', '.join(positional)}, *, {', '.join(keyword + ['backend'])}):\n{body}"
    namespace = {"_op": op}
    exec(source, namespace)  # noqa: S102 - source built above from the spec's argument names alone
    function = namespace[op.name]
    function.__defaults__ = stub.__defaults__
    function.__kwdefaults__ = {**(stub.__kwdefaults__ or {}), "backend": None}
    function.__doc__, function.__module__, function.__qualname__ = stub.__doc__, __name__, op.name
    function.__signature__ = inspect.signature(stub).replace(
        parameters=parameters + [inspect.Parameter("backend", inspect.Parameter.KEYWORD_ONLY, default=None,
                                                   annotation=Optional[str])])
    return function


OPS: dict = {}  # op name -> Op
PUBLIC: dict = {}  # op name -> its public function, ditops.<op>


def add_op(spec: OpSpec) -> Callable:
    """Makes ``spec`` an op: the spec table (opspec.SPECS: conformance, bench and examples read
    it), the registry (it and its reference), torch.library (its schema), ``explain`` and
    ``ditops.ops.PUBLIC`` (its public function, which is returned)."""
    if spec.name in OPS:
        raise ValueError(f"spec: an op named {spec.name!r} exists already")
    SPECS.setdefault(spec.name, spec)
    op = Op(spec)
    declare_op(spec.name, spec.reference)
    op.register()
    OPS[spec.name], PUBLIC[spec.name] = op, public_function(op)
    if selector._dispatcher is not None:  # one built before the op knows nothing of it: re-read, user configs kept
        selector._dispatcher.reload()
    return PUBLIC[spec.name]


for _spec in SPECS.values():
    add_op(_spec)

norm_scale_shift = PUBLIC["norm_scale_shift"]
residual_norm_scale_shift = PUBLIC["residual_norm_scale_shift"]
norm_scale_shift_select = PUBLIC["norm_scale_shift_select"]
residual_norm_scale_shift_select = PUBLIC["residual_norm_scale_shift_select"]
add_gate_norm = PUBLIC["add_gate_norm"]
add_gate_norm_scale = PUBLIC["add_gate_norm_scale"]
qk_norm_rope_ = PUBLIC["qk_norm_rope_"]
rope_ = PUBLIC["rope_"]
norm_scale_shift_fp8 = PUBLIC["norm_scale_shift_fp8"]
residual_norm_scale_shift_fp8 = PUBLIC["residual_norm_scale_shift_fp8"]
quantize_fp8 = PUBLIC["quantize_fp8"]
norm_scale_shift_select_fp8 = PUBLIC["norm_scale_shift_select_fp8"]
residual_norm_scale_shift_select_fp8 = PUBLIC["residual_norm_scale_shift_select_fp8"]
add_gate_norm_scale_fp8 = PUBLIC["add_gate_norm_scale_fp8"]


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
    preferred = str(rule) if rule is not None else None
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
