"""The eager call path (ditops/ops.py): one launch plan per call signature, what invalidates
it, the per-call checks that stay per call, and in-place arguments that share memory."""

import contextlib
import gc
import re
import threading
import types
import uuid
import weakref

import pytest
import torch

import ditops
from ditops import dispatch, ops
from ditops.dispatch import selector, simulated_device
from ditops.dispatch.contract import Kernel
from ditops.examples import example_arguments
from ditops.ops import OPS


def _plans():
    return dispatch.selector.dispatcher().plans


@pytest.fixture
def counted_checks(monkeypatch):
    """Counts validations (plan builds) of norm_scale_shift."""
    counts = []
    op = OPS["norm_scale_shift"]
    original = op.check

    def counting(*arguments, **keywords):
        counts.append(1)
        return original(*arguments, **keywords)

    monkeypatch.setattr(op, "check", counting)
    return counts


def test_a_cached_call_skips_validation_and_selection(counted_checks):
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32)
    first = ditops.norm_scale_shift(**arguments)
    second = ditops.norm_scale_shift(**arguments)
    assert len(counted_checks) == 1
    torch.testing.assert_close(first, second, rtol=0, atol=0)


def test_a_changed_signature_builds_a_new_plan(counted_checks):
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32)
    ditops.norm_scale_shift(**arguments)
    ditops.norm_scale_shift(**dict(arguments, x=torch.randn(2, 6, 64)))  # another shape
    ditops.norm_scale_shift(**dict(arguments, x=torch.randn(2, 5, 64)))  # new tensors of the same signature: cached
    ditops.norm_scale_shift(**dict(arguments, eps=1e-5))  # another non-tensor argument
    ditops.norm_scale_shift(**dict(arguments, x=arguments["x"].double()))  # another dtype
    assert len(counted_checks) == 4


def test_the_alignment_class_of_every_pointer_is_in_the_signature(counted_checks):
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32)
    base = torch.randn(2 * 5 * 64 + 8)

    def at(offset):  # x as a view starting ``offset`` float32 elements into base
        return base[offset:offset + 2 * 5 * 64].view(2, 5, 64)

    ditops.norm_scale_shift(**dict(arguments, x=at(0)))  # 16-byte aligned
    ditops.norm_scale_shift(**dict(arguments, x=at(1)))  # 4 bytes past: a new plan
    ditops.norm_scale_shift(**dict(arguments, x=at(1).clone()))  # a new aligned tensor: cached
    ditops.norm_scale_shift(**dict(arguments, x=at(2)))  # 8 bytes past: another class
    ditops.norm_scale_shift(**dict(arguments, x=base[5:5 + 2 * 5 * 64].view(2, 5, 64)))  # 20 bytes: 4 past 16, cached
    assert len(counted_checks) == 3


def test_tensor_type_and_requires_grad_are_in_the_signature(counted_checks):
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32)
    ditops.norm_scale_shift(**arguments)
    ditops.norm_scale_shift(**dict(arguments, scale=arguments["scale"].clone().requires_grad_()))
    ditops.norm_scale_shift(**dict(arguments, weight=torch.nn.Parameter(torch.ones(64))))
    ditops.norm_scale_shift(**dict(arguments, weight=torch.ones(64)))  # a plain tensor, as the first call's: cached
    ditops.norm_scale_shift(**dict(arguments, weight=None))
    with torch.no_grad():  # grad mode is in the key
        ditops.norm_scale_shift(**arguments)
    assert len(counted_checks) == 5


def test_a_call_that_passes_one_tensor_twice_finds_its_plan(counted_checks):
    """TensorGuards refuses a tensor at two places; the plan's guard checks that the same
    places hold one tensor again, so such calls reuse their plan, and calls with two tensors
    there get their own plan (with results right for each)."""
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32)
    twice = dict(arguments, shift=arguments["scale"])
    expected = ditops.norm_scale_shift(**twice, backend="reference")
    counted_checks.clear()
    results = [ditops.norm_scale_shift(**twice) for _ in range(3)]
    assert len(counted_checks) == 1
    apart = ditops.norm_scale_shift(**dict(twice, shift=twice["scale"].clone()))
    ditops.norm_scale_shift(**dict(twice, shift=torch.randn(2, 64)))
    ditops.norm_scale_shift(**dict(twice, x=torch.randn(2, 5, 64)))  # a new x, one tensor twice again
    assert len(counted_checks) == 2
    torch.testing.assert_close(results[-1], expected)
    torch.testing.assert_close(apart, results[0], rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["same", "other shape", "other strides", "other dtype", "requires grad",
                                     "parameter", "meta"])
def test_the_python_guard_agrees_with_tensor_guards(variant):
    """signature.py compares tensor metadata in Python where PyTorch lacks TensorGuards."""
    tensors = (torch.randn(4, 6), torch.randn(6))
    changed = {
        "same": lambda: (torch.randn(4, 6), torch.randn(6)),
        "other shape": lambda: (torch.randn(4, 7), torch.randn(6)),
        "other strides": lambda: (torch.randn(6, 4).t(), torch.randn(6)),
        "other dtype": lambda: (torch.randn(4, 6), torch.randn(6, dtype=torch.float64)),
        "requires grad": lambda: (torch.randn(4, 6, requires_grad=True), torch.randn(6)),
        "parameter": lambda: (torch.randn(4, 6), torch.nn.Parameter(torch.randn(6))),
        "meta": lambda: (torch.randn(4, 6, device="meta"), torch.randn(6)),
    }[variant]()
    verdict = dispatch.signature.tensor_guard(tensors)(*changed)
    assert dispatch.signature._python_guard(tensors)(*changed) == verdict == (variant == "same")


def test_a_cached_call_reuses_its_plan_and_an_override_builds_its_own(monkeypatch):
    """The first call builds the plan; a later call with the same signature finds it and gives
    the same result; backend= and use_backend build their own plans, which obey them; the
    per-call aliasing checks still run on a call whose plan exists."""
    runs = []
    original = ops.Op._build_plan
    monkeypatch.setattr(ops.Op, "_build_plan", lambda self, arguments, backend: runs.append(backend) or original(self, arguments, backend))
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32)
    first = ditops.norm_scale_shift(**arguments)
    second = ditops.norm_scale_shift(**dict(arguments, x=arguments["x"].clone()))
    assert runs == [None]
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    ditops.norm_scale_shift(**arguments, backend="reference")
    with ditops.use_backend("reference"):
        ditops.norm_scale_shift(**arguments)
    assert runs == [None, "reference"]
    q_and_k = example_arguments("rope_", (6, 2, 32), torch.float32)
    q_and_k["k"] = torch.randn_like(q_and_k["q"])
    ditops.rope_(**q_and_k)
    calls = len(runs)
    base = torch.randn(7 * 64)  # q and k overlapping by 5 of their 6 tokens: the same signature as above
    with pytest.raises(ValueError, match="shares memory"):  # the per-call checks run on a planned call
        ditops.rope_(**dict(q_and_k, q=base[:384].view(6, 2, 32), k=base[64:].view(6, 2, 32)))
    cache = q_and_k["cos_sin_cache"]
    within_q = torch.randn(cache.numel() + 384)  # a cache that overlaps q's last 64 values
    with pytest.raises(ValueError, match="cos_sin_cache shares memory with q"):
        ditops.rope_(**dict(q_and_k, q=within_q[:384].view(6, 2, 32), cos_sin_cache=within_q[320:320 + cache.numel()].view(cache.shape)))
    assert len(runs) == calls


def test_a_changed_override_builds_a_new_plan_and_is_obeyed(counted_checks, monkeypatch):
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32)
    ditops.norm_scale_shift(**arguments)
    with ditops.use_backend("nosuchbackend"):
        with pytest.raises(ditops.BackendUnavailable, match="nosuchbackend"):
            ditops.norm_scale_shift(**arguments)
    with pytest.raises(ditops.BackendUnavailable, match="nosuchbackend"):
        ditops.norm_scale_shift(**arguments, backend="nosuchbackend")
    monkeypatch.setenv("DITOPS_BACKEND", "nosuchbackend")
    dispatch.reset()  # the environment is read when the dispatcher (re)loads, which drops every plan
    assert not _plans()
    with pytest.raises(ditops.BackendUnavailable, match="nosuchbackend"):
        ditops.norm_scale_shift(**arguments)


def test_bad_input_fails_validation_after_a_good_call_was_cached():
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32)
    ditops.norm_scale_shift(**arguments)
    with pytest.raises(ValueError, match="scale"):
        ditops.norm_scale_shift(**dict(arguments, scale=torch.randn(3, 64)))
    with pytest.raises(ValueError, match="eps"):
        ditops.norm_scale_shift(**dict(arguments, eps=True))


def test_value_checks_run_on_every_call():
    """Positions are checked on CPU on every call, with the plan cached from a valid call."""
    arguments = example_arguments("rope_", (6, 2, 32), torch.float32)
    positions = torch.arange(6)
    ditops.rope_(**dict(arguments, positions=positions))
    q_before = arguments["q"].clone()
    with pytest.raises(ValueError, match="positions"):
        ditops.rope_(**dict(arguments, positions=positions + 10_000))
    assert torch.equal(arguments["q"], q_before)  # nothing written by the refused call


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op, shape", [("norm_scale_shift", (2, 5, 64)), ("rope_", (6, 2, 32))])
def test_a_plan_keeps_no_tensor_of_its_call_alive(op, shape, device):
    """The signature's guards hold metadata, the launchers constants: never a call's tensors
    (a plan first built inside a CUDA graph's warm-up, as torch.compile's reduce-overhead runs a
    library op, would leave them in the graph's memory pool, which the pool refuses)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    arguments = example_arguments(op, shape, dtype, device)
    references = [weakref.ref(t) for t in arguments.values() if isinstance(t, torch.Tensor)]
    result = getattr(ditops, op)(**arguments)
    assert len(_plans()) == 1
    del arguments, result
    gc.collect()
    assert all(reference() is None for reference in references)


def test_a_bound_triton_launcher_holds_no_tensor_of_the_launch_it_was_made_from(monkeypatch):
    """kernel_launch.bind on a stand-in compiled kernel (CPU): the launcher keeps the grid and
    the constants of the call that made it, not the KernelLaunch, whose arguments are tensors."""
    from ditops.backends.triton import kernel_launch

    class Compiled:
        run = function = packed_metadata = None

        def _init_handles(self):
            pass

    class StandIn:
        arg_names = ("x", "n")

        def warmup(self, *arguments, grid, **constexprs):
            return Compiled()

    monkeypatch.setattr(kernel_launch, "bound_launch_refusal", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    x = torch.randn(4)
    launch = kernel_launch.KernelLaunch(StandIn(), (1,), (x, 4), {"num_warps": 1})
    launcher = kernel_launch.bind(launch, (x,), 0)
    assert launcher is not None
    held = weakref.ref(x)
    del x, launch
    gc.collect()
    assert held() is None


def test_the_plan_table_is_bounded(monkeypatch):
    monkeypatch.setattr(dispatch.signature, "MAX_PLANS", 8)
    for tokens in range(1, 30):
        ditops.norm_scale_shift(**example_arguments("norm_scale_shift", (1, tokens, 16), torch.float32))
    assert len(_plans()) == 8


def test_threads_share_plans_and_get_their_own_results():
    inputs = [example_arguments("norm_scale_shift", (1, 3 + i % 4, 32), torch.float32, seed=i) for i in range(16)]
    expected = [ditops.norm_scale_shift(**arguments, backend="reference") for arguments in inputs]
    results = [None] * len(inputs)

    def work(i):
        for _ in range(20):
            results[i] = ditops.norm_scale_shift(**inputs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result, wanted in zip(results, expected):
        torch.testing.assert_close(result, wanted, rtol=0, atol=0)


def test_a_tensor_at_two_places_has_no_pointer_index():
    """A launcher bound to one place of a tensor passed twice would launch that pointer for
    both places in a later call that passes two tensors there: such a plan is not bound."""
    x, m, other = torch.randn(2, 4), torch.randn(4), torch.randn(4)
    values = (x, m, None, m, 1.0, other)
    assert dispatch.signature.pointer_index(values, x) == 0
    assert dispatch.signature.pointer_index(values, other) == 3
    assert dispatch.signature.pointer_index(values, m) is None
    assert dispatch.signature.pointer_index(values, torch.randn(4)) is None
    assert dispatch.signature.data_pointers(values) == (x.data_ptr(), m.data_ptr(), m.data_ptr(), other.data_ptr())


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_a_plan_built_with_one_tensor_at_two_places_launches_a_later_calls_two(device):
    """scale and shift as one tensor, then as two with the same signature: the cached plan
    (on a GPU, where its launcher would be bound) computes the second call's own result."""
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32, device)
    ditops.norm_scale_shift(**dict(arguments, shift=arguments["scale"]))
    second = dict(arguments, scale=torch.randn_like(arguments["scale"]), shift=torch.randn_like(arguments["shift"]))
    expected = ditops.norm_scale_shift(**second, backend="reference")
    torch.testing.assert_close(ditops.norm_scale_shift(**second), expected, rtol=1e-4, atol=1e-4)


# In-place arguments that share memory: refused before anything is written, on every backend.

BACKENDS_ON_CPU = [("reference", None), ("triton", "sm_90")]


@pytest.mark.parametrize("backend, simulated", BACKENDS_ON_CPU, ids=[b for b, _ in BACKENDS_ON_CPU])
@pytest.mark.parametrize("op", ["rope_", "qk_norm_rope_"])
@pytest.mark.parametrize("sharing", ["k is q", "k overlaps q"])
def test_q_and_k_that_share_memory_are_refused(op, backend, simulated, sharing):
    arguments = example_arguments(op, (6, 2, 32), torch.float32)
    if sharing == "k is q":
        q = k = arguments["q"]
    else:
        shape = arguments["q"].shape
        base = torch.randn(arguments["q"].numel() + 16)
        q, k = base[: -16].view(shape), base[16:].view(shape)
    q_before = q.clone()
    with simulated_device(simulated) if simulated else contextlib.nullcontext():
        with pytest.raises(ValueError, match="shares memory with q"):
            getattr(ditops, op)(**dict(arguments, q=q, k=k), backend=backend)
    assert torch.equal(q, q_before)


FUSED_LAYOUTS = {
    "qkv heads": lambda: (lambda qkv: (qkv[:, :, 0], qkv[:, :, 1]))(torch.randn(2, 6, 3, 4, 32)),
    # one token per batch item: its stride differs between q (640) and k (160) and means
    # nothing; q's 8 heads, then k's 2, in each 960-element batch row (a fuzzer's layout)
    "one token, q then k heads": lambda: (lambda rows: (rows[:, :640].view(2, 1, 8, 80), rows[:, 640:800].view(2, 1, 2, 80)))(
        torch.randn(2, 960)),
}


@pytest.mark.parametrize("op", ["rope_", "qk_norm_rope_"])
@pytest.mark.parametrize("layout", FUSED_LAYOUTS)
def test_q_and_k_as_head_blocks_of_one_fused_buffer_are_accepted(op, layout):
    q, k = FUSED_LAYOUTS[layout]()
    arguments = example_arguments(op, tuple(q.shape), torch.float32)
    expected_q, expected_k = q.clone(), k.clone()
    getattr(ditops, op)(**dict(arguments, q=expected_q, k=expected_k), backend="reference")
    getattr(ditops, op)(**dict(arguments, q=q, k=k))
    torch.testing.assert_close(q, expected_q, rtol=0, atol=0)
    torch.testing.assert_close(k, expected_k, rtol=0, atol=0)


def test_a_weight_that_is_a_view_of_q_is_refused():
    arguments = example_arguments("qk_norm_rope_", (6, 2, 32), torch.float32)
    q = arguments["q"]
    with pytest.raises(ValueError, match="q_weight shares memory with q"):
        ditops.qk_norm_rope_(**dict(arguments, q_weight=q[0, 0]))


def test_an_in_place_tensor_that_aliases_itself_is_refused():
    cache = ditops.rope_cos_sin_cache(8, 32)
    overlapping = torch.randn(8 * 32 * 4).as_strided((8, 4, 32), (16, 32, 1))  # tokens overlap heads
    with pytest.raises(ValueError, match="alias some of its elements"):
        ditops.rope_(overlapping, None, cache)


def test_describing_a_call_traces_with_dynamic_shapes():
    """Under torch.compile with dynamic shapes strides are SymInts. Describing a call must put
    nothing into the graph that Python cannot run (``0 |= s0`` once broke every compiled GPU
    graph that recompiled dynamic), and the call is taken as aligned (docs/call-path.md)."""
    from ditops.dispatch.features import MAX_ALIGNMENT, describe

    def scaled_by_alignment(x, weight):
        return x * describe((x,), (weight,), hidden_size=x.shape[-1]).alignment

    compiled = torch.compile(scaled_by_alignment, backend="eager", dynamic=True, fullgraph=True)
    for tokens in (5, 9):
        x = torch.randn(2, tokens, 12)[..., :7]  # a row-strided view
        assert torch.equal(compiled(x, torch.randn(7)), x * MAX_ALIGNMENT)


@pytest.mark.parametrize("op", ["rope_", "qk_norm_rope_"])
def test_a_symbolic_position_offset_compiles_like_eager(op):
    """FLUX passes its text length as position_offset: a SymInt when compiled with dynamic shapes."""
    arguments = example_arguments(op, (16, 2, 32), torch.float32, seed=3)  # a cache of 16 positions
    arguments.pop("positions", None)
    arguments.update(q=arguments["q"][:8], k=arguments["k"][:8])  # 8 tokens after the text

    def rotate(text, q, k):
        call = {**arguments, "q": q, "k": k, "position_offset": text.shape[0]}
        ops.PUBLIC[op](**call)
        return q, k

    compiled = torch.compile(rotate, backend="aot_eager", dynamic=True, fullgraph=True)
    for text in (3, 5):
        marker = torch.empty(text)
        expected = rotate(marker, arguments["q"].clone(), arguments["k"].clone())
        got = compiled(marker, arguments["q"].clone(), arguments["k"].clone())
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize("bound", [False, True], ids=["backend_function", "bound_launch"])
def test_a_plan_launches_on_the_tensors_device_whatever_device_is_current(monkeypatch, bound):
    """The device guard as the CPU can see it (tests/test_device_guard.py runs it on two GPUs):
    a plan for tensors on device 1 launches inside ``torch.cuda.device(1)`` when device 0 is
    current, and switches nothing when device 1 already is."""
    import types

    events, current = [], [0]

    @contextlib.contextmanager
    def device(index):
        events.append(("enter", index))
        yield
        events.append(("exit", index))

    def run(*values):
        events.append(("launch", values))

    def bind(values, device_index):
        def launcher(values, pointers):
            events.append(("launch", values, device_index))

        return launcher

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(ops, "_current_device", lambda: current[0])
    kernel = Kernel(run, bind if bound else None)
    launch = ops._launcher(types.SimpleNamespace(kernel=kernel), ("x",), 1)

    launch(("x",), ())
    assert [event[0] for event in events] == ["enter", "launch", "exit"] and events[0] == ("enter", 1)
    if bound:
        assert events[1][2] == 1  # the bound launcher was built for device 1
    events.clear()
    current[0] = 1
    launch(("x",), ())
    assert [event[0] for event in events] == ["launch"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: only a GPU call has a bound Triton launcher")
def test_a_bound_triton_launch_calls_the_launch_hooks_only_while_one_is_set():
    """The bound launcher skips Triton's launch hooks while none is set (the cost of an empty
    chain and its launch metadata) and calls them, as Triton's own launch does, once a
    profiler sets one: both on calls that reuse a plan built before the hook was set."""
    from triton import knobs

    arguments = example_arguments("norm_scale_shift", (2, 64, 256), torch.bfloat16, device="cuda", seed=9)
    assert ops.OPS["norm_scale_shift"].plan(ops.ordered_arguments("norm_scale_shift", **arguments)[0], None).implementation.name == "triton"
    ditops.norm_scale_shift(**arguments)  # the plan, built without a hook
    seen = []

    def hook(metadata):
        seen.append(metadata.get()["name"])

    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # Triton >= 3.5: a HookChain
        chain.add(hook)
        remove = lambda: chain.remove(hook)  # noqa: E731
    else:
        knobs.runtime.launch_enter_hook = hook
        remove = lambda: setattr(knobs.runtime, "launch_enter_hook", chain)  # noqa: E731
    try:
        y = ditops.norm_scale_shift(**arguments)
    finally:
        remove()
    assert seen and "modulated" in seen[0], seen
    ditops.norm_scale_shift(**arguments)
    assert len(seen) == 1
    torch.testing.assert_close(y, ditops.norm_scale_shift(**arguments, backend="reference"), rtol=2e-2, atol=2e-2)


def test_a_compiled_library_op_obeys_an_override_set_after_compiling():
    """A library-op node (every op on the CPU; on a GPU the in-place ops and cuda/rocm choices)
    dispatches on each call, so an override set after compiling applies at once, no reset."""
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32)
    compiled = torch.compile(lambda x: ditops.norm_scale_shift(**dict(arguments, x=x)), backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(arguments["x"]), ditops.norm_scale_shift(**arguments))
    with ditops.use_backend("nosuchbackend"):
        with pytest.raises(ditops.BackendUnavailable, match="nosuchbackend"):
            compiled(arguments["x"])
    torch.testing.assert_close(compiled(arguments["x"]), ditops.norm_scale_shift(**arguments))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: only a GPU call chooses its backend while traced")
@pytest.mark.parametrize("op", ["norm_scale_shift", "qk_norm_rope_"])
def test_a_first_call_compiled_on_a_gpu_makes_one_graph(op):
    """The first ditops call after the registry is loaded is a compiled one: fullgraph=True
    raises at any graph break, and the result equals eager's."""
    dispatch.reset()  # a new registry: nothing known about the GPU yet
    torch._dynamo.reset()
    arguments = example_arguments(op, None, torch.bfloat16, device="cuda", seed=5)
    names = ("q", "k") if op == "qk_norm_rope_" else ("x",)

    def call(*tensors):
        result = ops.PUBLIC[op](**dict(arguments, **dict(zip(names, tensors))))
        return tensors if result is None else result

    compiled = torch.compile(call, fullgraph=True)
    got = compiled(*(arguments[name].clone() for name in names))
    expected = call(*(arguments[name].clone() for name in names))
    for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
        torch.testing.assert_close(g, e)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: only a GPU call compiles to a Triton node")
def test_a_compiled_triton_node_is_traced_again_when_the_override_changes():
    """A Triton node chose its backend when traced and Inductor launches it with no ditops code
    in between; the node's traced_state argument makes Dynamo guard on the overrides, so an
    override set after compiling traces the call again, and leaving it uses the first graph."""
    torch._dynamo.reset()
    arguments = example_arguments("rope_", (64, 4, 64), torch.bfloat16, device="cuda", seed=6)

    def call(q, k):
        return ditops.rope_(**dict(arguments, q=q, k=k))

    def fresh() -> tuple:  # rope_ writes q and k
        return arguments["q"].clone(), arguments["k"].clone()

    expected = call(*fresh())
    compiled = torch.compile(call, fullgraph=True)
    torch.testing.assert_close(compiled(*fresh()), expected)
    with ditops.use_backend("nosuchbackend"):
        # raised by the node's body while Dynamo traces it, which wraps what it raises
        with pytest.raises((ditops.BackendUnavailable, torch._dynamo.exc.TorchDynamoException), match="nosuchbackend"):
            compiled(*fresh())
    torch.testing.assert_close(compiled(*fresh()), expected)
    torch._dynamo.reset()


@pytest.mark.parametrize("simulated", [False, pytest.param(True, marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton runs CPU tensors only in its interpreter, which the tests use without a GPU"))],
    ids=["cpu_reference", "simulated_gpu_triton"])
def test_the_traced_node_chooses_when_it_runs(simulated):
    """``<op>_traced``, the node a compiled graph holds for a functional op on a GPU, chooses
    its backend in its own body: the library op (CPU: the reference) or Triton's kernel through
    wrap_triton (a simulated GPU: Triton's interpreter). Both give the eager result, and a
    forced backend that cannot run the call is refused there."""
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32, seed=4)
    ordered, _ = ops.ordered_arguments("norm_scale_shift", **arguments)
    context = simulated_device("sm_90") if simulated else contextlib.nullcontext()
    with context:
        got = torch.ops.ditops.norm_scale_shift_traced(*ordered, None, "")
        expected = ditops.norm_scale_shift(**arguments, backend="reference")
        # traced as a graph is: the body runs on fake tensors
        node = torch.compile(lambda *values: torch.ops.ditops.norm_scale_shift_traced(*values, None, ""),
                             backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(node(*ordered), expected)
        with pytest.raises(ditops.BackendUnavailable, match="nosuchbackend"):
            torch.ops.ditops.norm_scale_shift_traced(*ordered, "nosuchbackend", "")
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("op, compiled_choice", [("norm_scale_shift", "reference"), ("add_gate_norm", "reference"),
                                                 ("qk_norm_rope_", "triton"), ("rope_", "triton")])
def test_the_compiled_choice_follows_the_registry_and_yields_to_a_force(op, compiled_choice):
    """Traced into a compiled graph, the row ops leave their kernels for the reference math
    (registry.yaml: compiled_graph: false) and the RoPE ops keep Triton; explain says so, and a
    forced backend is obeyed there as in eager."""
    arguments = example_arguments(op, None, torch.bfloat16, device="meta")
    with simulated_device("sm_90"):
        assert ditops.explain(op, **arguments).selected == "triton"
        explained = ditops.explain(op, **arguments, compiled=True)
        assert explained.selected == compiled_choice
        assert "traced into a compiled graph" in str(explained)
        if compiled_choice == "reference":
            assert "leaves calls in a compiled graph to what Inductor launches" in str(explained)
        assert ditops.explain(op, **arguments, backend="triton", compiled=True).selected == "triton"


def _compiled_node(op: str):
    """A compiled function holding ``op``'s graph node as ``Op.__call__`` emits it on a GPU."""
    return torch.compile(lambda *values: getattr(torch.ops.ditops, op + "_traced")(
        *values, None, selector.traced_state(op, None)), fullgraph=True)


def test_a_compiled_node_is_traced_again_when_an_override_or_config_changes(tmp_path):
    """The node's last argument names the settings its traced choice read: a use_backend scope
    set after compiling makes Dynamo trace again (its guard on the scopes fails), and after
    ``torch._dynamo.reset()`` a graph compiled under another config is not served from torch's
    compile caches (AOTAutograd's, in memory and on disk), which key on the graph: the choice
    itself is made inside the node, after the cache lookup."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32, seed=9)
    ordered, _ = ops.ordered_arguments("norm_scale_shift", **arguments)
    expected = ditops.norm_scale_shift(**arguments, backend="reference")
    compiled = _compiled_node("norm_scale_shift")
    torch.testing.assert_close(compiled(*ordered), expected)
    with ditops.use_backend("nosuchbackend"):  # raised by the node's body while Dynamo traces it again
        with pytest.raises((ditops.BackendUnavailable, torch._dynamo.exc.TorchDynamoException), match="nosuchbackend"):
            compiled(*ordered)
    torch.testing.assert_close(compiled(*ordered), expected)

    def cache_hits() -> int:
        torch._dynamo.reset()
        before = counters["aot_autograd"]["autograd_cache_hit"]
        torch.testing.assert_close(_compiled_node("norm_scale_shift")(*ordered), expected)
        return counters["aot_autograd"]["autograd_cache_hit"] - before

    assert cache_hits() == 1  # the same settings: served from the cache
    config = tmp_path / "order.yaml"  # a config no earlier run compiled under (the on-disk cache outlives runs)
    config.write_text(f"# {uuid.uuid4()}\nops:\n  rope_: [triton, cuda]\n")
    dispatch.load_config(config)
    try:
        assert cache_hits() == 0
    finally:
        dispatch.reset()
        torch._dynamo.reset()


def test_the_traced_state_changes_with_each_setting_a_traced_choice_reads(tmp_path, monkeypatch):
    state = selector.traced_state("rope_", None)
    assert selector.traced_state("rope_", "triton") == state  # a backend= argument is in the graph itself
    with ditops.use_backend("triton"):
        assert selector.traced_state("rope_", None) != state
        assert selector.traced_state("rope_", "cuda") == state
    with ditops.use_backend(rope_="cuda"):
        assert selector.traced_state("rope_", None) != state
        assert selector.traced_state("norm_scale_shift", None) == state
    config = tmp_path / "order.yaml"
    config.write_text("ops:\n  rope_: [triton, cuda]\n")
    dispatch.load_config(config)
    first = selector.traced_state("rope_", None)
    config.write_text("ops:\n  rope_: [cuda, triton]\n")
    dispatch.load_config(config)
    assert len({state, first, selector.traced_state("rope_", None)}) == 3
    dispatch.reset()
    assert selector.traced_state("rope_", None) == state
    monkeypatch.setenv("DITOPS_BACKEND", "triton")
    dispatch.reset()
    assert selector.traced_state("rope_", None) != state
    monkeypatch.delenv("DITOPS_BACKEND")
    dispatch.reset()
    assert selector.traced_state("rope_", None) == state
    # ditops' own files: another kernel or registry is another state
    for name, text in (("a", "x = 1\n"), ("b", "x = 2\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "kernel.py").write_text(text)
    assert selector.package_digest(tmp_path / "a") != selector.package_digest(tmp_path / "b")


def test_a_reference_choice_is_traced_into_the_graph_as_math():
    """The node's reference choice is the reference math in the graph, which Inductor
    compiles with its neighbours: no ditops op is left in the generated code."""
    torch._dynamo.reset()
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32, seed=8)
    ordered, _ = ops.ordered_arguments("norm_scale_shift", **arguments)
    compiled = torch.compile(lambda *values: torch.ops.ditops.norm_scale_shift_traced(*values, None, "") * 2, fullgraph=True)
    got, codes = torch._inductor.utils.run_and_get_code(compiled, *ordered)
    torch.testing.assert_close(got, ditops.norm_scale_shift(**arguments, backend="reference") * 2)
    assert codes and not any("ditops" in code for code in codes)
    torch._dynamo.reset()


def test_the_traced_node_returns_an_empty_input_as_eager_does():
    """An empty input has no features to choose a backend by: the node returns what eager does."""
    arguments = example_arguments("norm_scale_shift", (2, 5, 64), torch.float32, seed=4)
    arguments["x"] = arguments["x"][:, :0]
    ordered, _ = ops.ordered_arguments("norm_scale_shift", **arguments)
    got = torch.ops.ditops.norm_scale_shift_traced(*ordered, None, "")
    assert got.shape == (2, 0, 64) and got.dtype == torch.float32
    torch.testing.assert_close(got, ditops.norm_scale_shift(**arguments))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: only a GPU call compiles to the functional node")
@pytest.mark.parametrize("op", ["qk_norm_rope_", "rope_"])
@pytest.mark.parametrize("form", ["views_of_a_projection", "graph_inputs", "positions", "k_none"])
def test_an_in_place_op_compiles_to_its_eager_result(op, form):
    """Compiled, an in-place op is a functional node whose new q and k are copied back. On q/k
    views of a fused projection (the case that crashed a mutating triton_op), on tensors
    passed into the graph (the copy back must reach the caller's tensors), with positions
    (checked per call: the library op) and rope_ without k, it matches eager, and in the
    views case Inductor launches no copy kernel for it."""
    if op == "qk_norm_rope_" and form == "k_none":
        pytest.skip("qk_norm_rope_ needs k")
    torch._dynamo.reset()
    generator = torch.Generator(device="cuda").manual_seed(11)
    batch, tokens, heads, head_size = 2, 96, 4, 64
    dtype = torch.bfloat16
    x = torch.randn(batch, tokens, 3 * heads * head_size, device="cuda", dtype=dtype, generator=generator)
    cache = ditops.rope_cos_sin_cache(tokens, head_size).to("cuda")
    weights = [torch.randn(head_size, device="cuda", generator=generator) for _ in range(2)]
    positions = torch.randint(0, tokens, (batch, tokens), device="cuda", generator=generator) if form == "positions" else None

    def rotate(q, k):
        if op == "qk_norm_rope_":
            return ditops.qk_norm_rope_(q, k, *weights, cache, positions, interleaved=False)
        return ditops.rope_(q, None if form == "k_none" else k, cache, positions, interleaved=False)

    def block(x):  # q and k: views of the projection, an intermediate of the graph (as in a processor)
        q, k, v = (x * 1.5).unflatten(-1, (3, heads, head_size)).unbind(-3)
        rotate(q, k)
        return torch.cat([q, k, v], dim=-1) * 2

    if form == "graph_inputs":
        q, k = (torch.randn(batch, tokens, heads, head_size, device="cuda", dtype=dtype, generator=generator) for _ in range(2))
        expected = rotate(q.clone(), k.clone())
        compiled = torch.compile(lambda q, k: rotate(q, k), fullgraph=True)
        compiled(q, k)
        torch.testing.assert_close((q, k), expected)
        return
    expected = block(x.clone())
    got, (code,) = torch._inductor.utils.run_and_get_code(torch.compile(block, fullgraph=True), x.clone())
    torch.testing.assert_close(got, expected)
    if form == "views_of_a_projection":
        # Inductor's own kernels compute the block's scale or cat (a copy fused into one of
        # them is free); a kernel that only copies q/k back (named copy/view/unbind alone) is not
        generated = set(re.findall(r"^(triton_\w+) = async_compile\.triton\(", code, flags=re.MULTILINE))
        assert generated and all("mul" in name or "cat" in name for name in generated), generated


@pytest.mark.parametrize("simulated", [False, pytest.param(True, marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="Triton runs CPU tensors only in its interpreter, which the tests use without a GPU"))],
    ids=["cpu_reference", "simulated_gpu_triton"])
@pytest.mark.parametrize("op", ["qk_norm_rope_", "rope_"])
@pytest.mark.parametrize("with_positions", [False, True], ids=["offsets", "positions"])
def test_the_traced_node_of_an_in_place_op_returns_new_q_and_k(simulated, op, with_positions):
    """``<op>_traced`` of an in-place op leaves q and k as they were and returns what eager
    writes into them: through Triton's kernel writing new tensors, or (positions, whose values
    are checked per call) through the library op on copies."""
    arguments = example_arguments(op, None, torch.float32, seed=3)
    if not with_positions:
        arguments["positions"] = None
    ordered, _ = ops.ordered_arguments(op, **arguments)
    before = [arguments[name].clone() for name in ("q", "k")]
    with simulated_device("sm_90") if simulated else contextlib.nullcontext():
        new_q, new_k = getattr(torch.ops.ditops, op + "_traced")(*ordered, None, "")
    torch.testing.assert_close([arguments["q"], arguments["k"]], before, rtol=0, atol=0)
    expected = dict(arguments, q=before[0].clone(), k=before[1].clone())
    ops.PUBLIC[op](**expected, backend="reference")
    torch.testing.assert_close([new_q, new_k], [expected["q"], expected["k"]])
