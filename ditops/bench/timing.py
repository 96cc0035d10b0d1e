"""Timing GPU work the way the best harnesses do.

- Warm-up first (compilation, autotuning and allocation stay out of the numbers).
- CUDA-graph replay: several calls captured in one graph and replayed, which removes the
  launch gaps between them; the per-call time is the replay time over the calls.
- Inputs rotate over several buffer sets whose total is larger than the L2 cache, so
  that each call reads from memory, not from a cache the previous call warmed.
- The median of repeats, with the interquartile range as a spread.
- An eager mode (the same calls launched from Python, host overhead included).
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Callable, NamedTuple

import torch

TARGET_REPLAY_MS = 20.0  # calls per graph are chosen so that one replay takes about this long
MAX_CALLS_PER_GRAPH = 200


class Timing(NamedTuple):
    us: float  # median time per call, microseconds
    spread_pct: float  # interquartile range of the repeats over the median, in percent


def _summary(per_call_us: list) -> Timing:
    median = statistics.median(per_call_us)
    quartiles = statistics.quantiles(per_call_us, n=4) if len(per_call_us) > 1 else [median] * 3
    return Timing(median, 100 * (quartiles[2] - quartiles[0]) / median if median else 0.0)


def rotation_sets(bytes_per_call: int, l2_bytes: int, limit: int = 16) -> int:
    """How many input sets make one pass over them larger than twice the L2 cache."""
    return max(1, min(limit, math.floor(2 * l2_bytes / max(bytes_per_call, 1)) + 1))


def _event_time_ms(function: Callable) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    function()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def cuda_graph(calls: list, repeats: int = 15) -> Timing:
    """Per-call time of ``calls`` (one per input set) captured round-robin in one CUDA graph."""
    for call in calls * 2:  # warm-up: compilation, autotuning, caching-allocator growth
        call()
    torch.cuda.synchronize()
    estimate_ms = _event_time_ms(lambda: [call() for call in calls]) / len(calls)
    rounds = max(1, min(MAX_CALLS_PER_GRAPH // len(calls), round(TARGET_REPLAY_MS / max(estimate_ms, 1e-3) / len(calls))))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()  # one call on the capture stream before capture, as torch's docs advise
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(rounds):
            for call in calls:
                call()
    graph.replay()
    torch.cuda.synchronize()
    count = rounds * len(calls)
    return _summary([_event_time_ms(graph.replay) * 1e3 / count for _ in range(repeats)])


def cuda_eager(calls: list, repeats: int = 15) -> Timing:
    """Per-call time of ``calls`` launched from Python, host overhead included."""
    for call in calls * 2:
        call()
    torch.cuda.synchronize()
    estimate_ms = _event_time_ms(lambda: [call() for call in calls]) / len(calls)
    rounds = max(1, min(MAX_CALLS_PER_GRAPH // len(calls), round(TARGET_REPLAY_MS / max(estimate_ms, 1e-3) / len(calls))))

    def many():
        for _ in range(rounds):
            for call in calls:
                call()

    return _summary([_event_time_ms(many) * 1e3 / (rounds * len(calls)) for _ in range(repeats)])


def host(calls: list, repeats: int = 7) -> Timing:
    """Per-call time on the CPU (no GPU): wall clock over rounds of the calls."""
    for call in calls:
        call()
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        for call in calls:
            call()
        per_call.append((time.perf_counter() - start) * 1e6 / len(calls))
    return _summary(per_call)


def copy_us(device: str, moved_bytes: int, sets: int = 1) -> dict:
    """Per-call time of a device-to-device copy moving ``moved_bytes`` (half read, half
    written), two ways: ``memcpy`` (copy_, a copy-engine memcpy) and ``kernel`` (an
    elementwise kernel writing what it reads, as the ops' kernels do). The copies rotate
    over ``sets`` buffer pairs, as the ops' inputs do, so that they too read from memory."""
    elements = max(1, moved_bytes // 4)  # bfloat16: 2 bytes read and 2 written per element
    sources = [torch.randn(elements, device=device).to(torch.bfloat16) for _ in range(sets)]
    pairs = [(source, torch.empty_like(source)) for source in sources]
    ways = {"memcpy": lambda source, target: target.copy_(source), "kernel": lambda source, target: torch.mul(source, 1, out=target)}
    measure = cuda_graph if device != "cpu" else (lambda calls: host(calls * 3))
    return {name: measure([functools.partial(way, *pair) for pair in pairs]).us for name, way in ways.items()}


def copy_bandwidth(device: str, size_bytes: int = 1 << 30) -> dict:
    """Device-to-device copy bandwidth in GB/s of copying ``size_bytes``, counting bytes read
    plus bytes written, both ways of ``copy_us``. The higher is the reference figure."""
    moved = 2 * size_bytes
    return {name: moved / (us * 1e3) for name, us in copy_us(device, moved).items()}
