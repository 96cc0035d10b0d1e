"""Reliability on a real GPU, for every op and every kernel backend that runs here (triton,
cuda), and for the automatic choice (no override: after a signature's first call, the cached
call in C, dispatch/cached_call.c, as users' calls run), through the public API:

- 8 threads, each on its own stream, running mixed shapes and dtypes against a cold plan
  cache, give bitwise the single-thread results;
- the first-ever call of each op inside ``torch.cuda.graph`` capture, in a fresh process with
  empty ditops and Triton caches, captures and replays right;
- the same call twice is bitwise equal, and each row's output is bitwise the same whether it
  is computed in a batch of 1, 7 or 4096 rows;
- 10^5 calls over rotating shapes keep host and device memory flat (the plan table is bounded).

GPU only (the Triton interpreter is not thread-safe and has no streams or graphs): skipped on
CPU. ``DITOPS_RELIABILITY_OUT`` names a JSON file that gets a summary (tests/test_fuzz.py).
"""

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import ditops
from ditops import conformance, dispatch
from ditops.examples import example_arguments
from ditops.ops import PUBLIC

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="threads, streams and CUDA graphs need a GPU")

sys.path.insert(0, os.path.dirname(__file__))
from reliability_summary import record  # noqa: E402

OPS = sorted(PUBLIC)
ROPE = ("qk_norm_rope_", "rope_")
KERNEL_BACKENDS = [b for b in ("triton", "cuda") if b in conformance.backends()]
BACKENDS = pytest.mark.parametrize("backend", [*KERNEL_BACKENDS, None], ids=lambda backend: backend or "auto")


def runnable(backend):
    reason = conformance.unavailable_reason(backend, "cuda") if backend is not None else None
    if reason:
        pytest.skip(f"{backend} cannot run here: {reason}")


def arguments_for(op, shape, dtype, seed):
    # float32 modulation and weights (as Wan passes them): every kernel backend takes them
    return example_arguments(op, shape, dtype, "cuda", seed=seed, param_dtype=torch.float32)


def copies(arguments):
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in arguments.items()}


def results(op, arguments, backend):
    """The op's outputs (q and k for the in-place ops), called on ``arguments`` as given;
    None where the backend's constraints refuse the call (the cuda backend takes D % 8 == 0
    and one parameter dtype only): that case is the other backend's. backend None: the
    automatic choice, which takes every call."""
    if backend is not None and ditops.explain(op, **arguments, backend=backend).selected != backend:
        return None
    result = PUBLIC[op](**arguments, backend=backend)
    if op in ROPE:
        return [arguments["q"], arguments["k"]]
    return [result] if isinstance(result, torch.Tensor) else list(result)


def bitwise_equal(first, second):
    if first is None or second is None:
        return first is second
    return all(conformance._bitwise_equal(a, b) for a, b in zip(first, second)) and len(first) == len(second)


def shapes_of(op):
    if op in ROPE:
        return [(33, 4, 128), (7, 2, 64), (2, 17, 3, 80), (256, 8, 128)]
    return [(2, 40, 1000), (1, 7, 3072), (3, 128, 512), (1, 300, 5120)]


JOBS = [(op, shape, dtype) for op in OPS for shape in shapes_of(op) for dtype in (torch.bfloat16, torch.float16)]


@BACKENDS
def test_eight_threads_on_their_own_streams_match_one_thread(backend):
    runnable(backend)
    inputs = [arguments_for(op, shape, dtype, seed) for seed, (op, shape, dtype) in enumerate(JOBS)]
    expected = [results(op, copies(arguments), backend) for (op, _, _), arguments in zip(JOBS, inputs)]
    torch.cuda.synchronize()
    dispatch.reset()  # the threads race on a cold plan table
    barrier = threading.Barrier(8)
    got, errors = {}, []

    def worker(thread):
        try:
            stream = torch.cuda.Stream()
            order = list(range(len(JOBS)))
            start = 5 * thread % len(order)
            order = order[start:] + order[:start]  # each thread its own order, half of them backwards
            order = order[::-1] if thread % 2 else order
            barrier.wait(timeout=60)
            with torch.cuda.stream(stream):
                got[thread] = {j: results(JOBS[j][0], copies(inputs[j]), backend) for j in order}
            stream.synchronize()
        except Exception as error:  # reported by the main thread
            errors.append(f"thread {thread}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=worker, args=(thread,)) for thread in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert not errors, errors
    mismatches = [(t, JOBS[j]) for t, outputs in got.items() for j, out in outputs.items() if not bitwise_equal(out, expected[j])]
    record(f"threads/{backend or 'auto'}", {"threads": 8, "calls_per_thread": len(JOBS), "mismatches": len(mismatches)})
    assert not mismatches, mismatches[:5]


GRAPH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from ditops import conformance
    from ditops.examples import example_arguments
    from ditops.ops import PUBLIC

    backend = None if sys.argv[1] == "auto" else sys.argv[1]
    report = {}
    for op in sorted(PUBLIC):
        shape = (33, 4, 128) if op.endswith("_") else (2, 40, 1024)
        make = lambda seed: example_arguments(op, shape, torch.bfloat16, "cuda", seed=seed, param_dtype=torch.float32)
        pick = lambda arguments, result: [arguments["q"], arguments["k"]] if op.endswith("_") else (
            [result] if isinstance(result, torch.Tensor) else list(result))
        static = make(1)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):  # the first call of this op in this process
                captured = pick(static, PUBLIC[op](**static, backend=backend))
        except Exception as error:
            report[op] = f"capture failed: {type(error).__name__}: {error}"
            continue
        problems = []
        for seed in (2, 3):
            for name, value in make(seed).items():
                if isinstance(value, torch.Tensor):
                    static[name].copy_(value)
            graph.replay()
            eager = make(seed)
            expected = pick(eager, PUBLIC[op](**eager, backend=backend))
            torch.cuda.synchronize()
            if not all(conformance._bitwise_equal(a, b) for a, b in zip(captured, expected)):
                problems.append(f"replay {seed} differs from eager")
        report[op] = "; ".join(problems) or "ok"
    print(json.dumps(report))
    """
)


@BACKENDS
def test_first_ever_call_inside_graph_capture(backend, tmp_path):
    runnable(backend)
    environment = dict(os.environ, DITOPS_CACHE_DIR=str(tmp_path / "ditops-cache"), TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    environment.pop("DITOPS_BACKEND", None)
    environment.pop("DITOPS_CONFIG", None)
    done = subprocess.run([sys.executable, "-c", GRAPH_SCRIPT, backend or "auto"], capture_output=True, text=True, timeout=600, env=environment)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    record(f"graph_first_call/{backend or 'auto'}", report)
    assert report == {op: "ok" for op in OPS}, report


@BACKENDS
@pytest.mark.parametrize("op", OPS)
def test_same_call_twice_is_bitwise_equal(op, backend):
    runnable(backend)
    for shape in shapes_of(op):
        for dtype in (torch.float32, torch.bfloat16):
            arguments = arguments_for(op, shape, dtype, seed=5)
            first = results(op, copies(arguments), backend)
            second = results(op, copies(arguments), backend)
            assert bitwise_equal(first, second), (op, shape, dtype)


def _rows(op, arguments, rows: slice, total: int):
    """The same call on a slice of its rows (tokens): every tensor with a token axis is sliced
    and copied to a new buffer; modulation per batch item and weights stay whole. RoPE rows
    keep their positions through position_offset."""
    sliced = {"position_offset": rows.start} if op in ROPE else {}
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            axis = 0 if op in ROPE else 1
            if name in ("q", "k") or (op not in ROPE and value.dim() >= 2 and value.shape[axis] == total and name != "cos_sin_cache"):
                value = value.narrow(axis, rows.start, rows.stop - rows.start).clone()
        sliced[name] = value
    return sliced


@BACKENDS
@pytest.mark.parametrize("op", OPS)
def test_a_rows_output_does_not_depend_on_the_batch(op, backend):
    runnable(backend)
    total = 4096
    for dtype in (torch.bfloat16, torch.float32):
        shape = (total, 8, 128) if op in ROPE else (1, total, 3072)
        arguments = arguments_for(op, shape, dtype, seed=9)
        whole = results(op, copies(arguments), backend)
        if whole is None:
            continue
        for rows in (slice(0, 1), slice(0, 7), slice(total - 7, total), slice(1000, 1007)):
            part = results(op, _rows(op, arguments, rows, total), backend)
            axis = 0 if op in ROPE else 1
            for got, want in zip(part, whole):
                want = want.narrow(axis, rows.start, rows.stop - rows.start) if want.dim() > axis and want.shape[axis] == total else want
                assert conformance._bitwise_equal(got, want), (op, dtype, rows)


def _host_memory() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@BACKENDS
def test_memory_stays_flat_over_rotating_shapes(backend):
    runnable(backend)
    calls = 100_000
    # Rotating over more call signatures than the plan table holds keeps it evicting.
    shapes = [(tokens, 2, 64) for tokens in range(1, 5001)]
    cache = torch.randn(5001, 64, device="cuda")
    buffers = {dtype: torch.randn(5000, 2, 64, device="cuda", dtype=dtype) for dtype in (torch.bfloat16, torch.float16)}
    samples = []
    torch.cuda.synchronize()
    device_start = torch.cuda.memory_allocated()
    for call in range(calls):
        tokens = shapes[call % len(shapes)][0]
        dtype = torch.bfloat16 if (call // len(shapes)) % 2 == 0 else torch.float16
        q = buffers[dtype][:tokens]
        PUBLIC["rope_"](q, None, cache, backend=backend)
        if call % 10_000 == 9_999:
            torch.cuda.synchronize()
            samples.append((call + 1, _host_memory(), torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
    warm = samples[2]  # after 30000 calls: every signature seen in both dtypes
    growth = samples[-1][1] - warm[1]
    record(f"memory/{backend or 'auto'}", {"calls": calls, "signatures": 2 * len(shapes), "host_growth_bytes_after_warmup": growth,
                                 "samples": samples})
    assert growth < 32 << 20, f"host memory grew by {growth / 2**20:.1f} MiB after warm-up: {samples}"
    assert samples[-1][2] == device_start, f"device memory allocated grew: {samples}"
    assert samples[-1][3] == warm[3], f"device memory reserved grew: {samples}"
