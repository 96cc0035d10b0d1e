"""The device guard on two GPUs: every op, on every backend that runs on the GPU, with its
tensors on one GPU while the other is current (both ways round), launches on the tensors'
device and on that device's current stream, leaves the current device as it was, and gives
bitwise the result of the same call made on the tensors' own device. Tensors on two devices
raise a ValueError naming the argument before anything is written.

The stream is checked by ordering, not by inspection: the inputs are poisoned, and the good
values are copied in on the tensors' device's current (non-default) stream behind a long GPU
sleep. A kernel launched on any other stream reads the poison.

Needs two GPUs: skipped otherwise (the 2-GPU run is
``python -m pytest -q tests/test_device_guard.py`` on a machine with two).
"""

import pytest
import torch

import ditops
from ditops import conformance
from ditops.examples import example_arguments
from ditops.ops import PUBLIC

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the device guard needs two GPUs")

OPS = sorted(PUBLIC)
IN_PLACE = ("qk_norm_rope_", "rope_")
BACKENDS = conformance.backends()
SHAPES = {op: (64, 8, 128) if op in IN_PLACE else (2, 96, 1024) for op in OPS}


def arguments_on(op, device, param_dtype):
    return example_arguments(op, SHAPES[op], torch.bfloat16, device, seed=7, param_dtype=param_dtype)


def outputs(op, arguments, result):
    if op in IN_PLACE:
        return [arguments["q"], arguments["k"]]
    return [result] if isinstance(result, torch.Tensor) else list(result)


def runnable_arguments(op, backend, device):
    """The op's arguments on ``device`` in a parameter dtype the backend takes (the cuda backend
    takes one only); skips where the backend cannot run here. ``backend`` None: no override,
    so that a call whose plan exists runs the C path (dispatch/cached_call.c)."""
    if backend is None:
        return arguments_on(op, device, torch.float32)
    reason = conformance.unavailable_reason(backend, device)
    if reason:
        pytest.skip(f"{backend} cannot run on {device}: {reason}")
    for param_dtype in (torch.float32, torch.bfloat16):
        arguments = arguments_on(op, device, param_dtype)
        if ditops.explain(op, **arguments, backend=backend).selected == backend:
            return arguments
    pytest.skip(f"{backend} takes no typical call of {op}")


@pytest.mark.parametrize("data, current", [(1, 0), (0, 1)], ids=["tensors_on_1", "tensors_on_0"])
@pytest.mark.parametrize("backend", BACKENDS + [None], ids=BACKENDS + ["auto"])
@pytest.mark.parametrize("op", OPS)
def test_launch_follows_the_tensors_device_and_stream(op, backend, data, current):
    """backend "auto": the expected call builds the plan, so the poisoned call runs the C path."""
    source = runnable_arguments(op, backend, f"cuda:{data}")
    clone = lambda: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in source.items()}  # noqa: E731

    with torch.cuda.device(data):  # the same call with its own device current: the expected result
        expected_arguments = clone()
        expected = outputs(op, expected_arguments, PUBLIC[op](**expected_arguments, backend=backend))
        torch.cuda.synchronize(data)

    arguments = clone()
    for value in arguments.values():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value.fill_(float("nan"))  # poison: the good values come in on the side stream only
    side = torch.cuda.Stream(device=data)
    with torch.cuda.stream(side), torch.cuda.device(current):
        assert torch.cuda.current_stream(data) == side
        with torch.cuda.device(data):
            torch.cuda._sleep(20_000_000)  # ~10 ms: a launch on another stream would overtake the copies
            for name, value in arguments.items():
                if isinstance(value, torch.Tensor):
                    value.copy_(source[name])
        result = PUBLIC[op](**arguments, backend=backend)
        assert torch.cuda.current_device() == current, "the call changed the current device"
    got = outputs(op, arguments, result)
    torch.cuda.synchronize(data)

    assert all(t.device == torch.device("cuda", data) for t in got)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert conformance._bitwise_equal(g, e), f"{op} on {backend}: differs from the call made on cuda:{data}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", OPS)
def test_tensors_on_two_devices_raise_before_writing(op, backend):
    arguments = runnable_arguments(op, backend, "cuda:0")
    tensors = [name for name, value in arguments.items() if isinstance(value, torch.Tensor)]
    moved = tensors[1]  # the first tensor fixes the device; any later one on cuda:1 is refused
    arguments[moved] = arguments[moved].to("cuda:1")
    before = {name: arguments[name].clone() for name in tensors}
    with pytest.raises(ValueError, match=moved):
        PUBLIC[op](**arguments, backend=backend)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert all(conformance._bitwise_equal(arguments[name], before[name]) for name in tensors), "written before the error"
