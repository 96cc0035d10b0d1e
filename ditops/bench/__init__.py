"""``ditops bench``: every op at real model shapes, every backend the dispatcher can run here
and ``auto`` (the public call, the backend the dispatcher picks), against eager PyTorch,
torch.compile and the peer libraries.

Each result: microseconds per call (CUDA-graph replay, cold L2; and eager, with host
overhead), the fewest bytes the op must move, GB/s, percent of the device-to-device copy
bandwidth measured in the same run, percent of a copy of the same bytes timed the same way,
and speedups against eager and torch.compile. Every timed candidate is first checked
against the reference on the same inputs.
Output: a printed table, and JSON, CSV and PNG files under benchmarks/results/.
"""

from __future__ import annotations

import contextlib
import datetime
import platform
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch

from .. import __version__, dispatch, explain
from ..conformance import TOLERANCES
from ..dispatch.selector import device_refusal
from ..ops import PUBLIC
from ..opspec import SPECS
from . import baselines, report, timing
from .cases import CASES, BenchCase, cpu_case, minimum_bytes

DEFAULT_OUTPUT = Path("benchmarks") / "results"


def select_cases(ops: Optional[Iterable[str]] = None, shapes: Optional[Iterable[str]] = None, quick: bool = False) -> list:
    """The cases kept by the filters: op names, substrings of the model or shape, --quick."""
    ops = {dispatch.op_name(op) for op in ops} if ops else None
    shapes = list(shapes or [])
    return [
        case
        for case in CASES
        if (ops is None or case.op in ops)
        and (not quick or case.quick)
        and (not shapes or any(text in case.model or text in case.shape for text in shapes))
    ]


def candidate_names() -> list:
    """What ``backends`` may name: auto (the public call), each backend of the registry, the
    eager and torch.compile baselines, and the peer libraries."""
    return ["auto", *dispatch.dispatcher().registry.backends, "eager", "torch.compile", *baselines.PEERS]


def checked_cases(ops=None, shapes=None, backends=None, quick: bool = False, dtype: torch.dtype = torch.bfloat16) -> list:
    """The cases a run measures. A filter that selects nothing, or that names no case or
    candidate, is a ValueError naming it as the command line spells it (``--backends`` for
    ``backends``): checked before any output, so that such a run prints and writes nothing."""
    try:
        cases = select_cases(ops, shapes, quick)
    except ValueError as error:
        raise ValueError(f"--ops: {error}") from None
    unmatched = [text for text in shapes or () if not any(text in case.model or text in case.shape for case in CASES)]
    if unmatched:
        models = ", ".join(dict.fromkeys(case.model for case in CASES))
        raise ValueError(f"--shapes: no case's model or shape contains {', '.join(map(repr, unmatched))}; the models are {models}")
    known = candidate_names()
    unknown = [name for name in backends or () if name not in known]
    if unknown:
        raise ValueError(f"--backends: got {', '.join(map(repr, unknown))}; wanted some of {', '.join(known)}")
    device = dispatch.current_device()
    registry = dispatch.dispatcher().registry
    for name in backends or ():
        reason = device_refusal(name, device) if name in registry.backends else None
        if reason:
            raise ValueError(f"--backends: {name} can run nothing on {device}: {reason}")
    if dtype not in TOLERANCES:
        wanted = ", ".join(str(checked).removeprefix("torch.") for checked in TOLERANCES)
        raise ValueError(f"--dtype: results are checked with tolerances for {wanted}; got {str(dtype).removeprefix('torch.')}")
    if not cases:
        given = [f"--ops {' '.join(ops)}" if ops else "", f"--shapes {' '.join(shapes)}" if shapes else "", "--quick" if quick else ""]
        raise ValueError(f"no case matches {' '.join(filter(None, given))} together; each of them alone matches cases")
    return cases


def _clone(arguments: dict) -> dict:
    return {name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in arguments.items()}


def _outputs(result) -> tuple:
    """A call's output tensors (ditops' in-place RoPE ops return q and k; k may be None)."""
    if isinstance(result, torch.Tensor):
        return (result,)
    return tuple(t for t in result if t is not None)


def candidates(case: BenchCase, arguments: dict, explanation, wanted: Optional[set]) -> list:
    """(name, make_call or None, note): make_call(arguments) returns a zero-argument callable.
    ``explanation`` is ``explain`` of the call: each backend that accepts it is forced in turn."""
    op = case.op
    # what a user gets: the public call with no override, through the dispatcher and its plan cache
    found = [("auto", lambda a: (lambda: PUBLIC[op](**a)), "")]
    for row in explanation.candidates:
        if row.refusal is None:
            found.append((row.backend, lambda a, name=row.backend: (lambda: PUBLIC[op](**a, backend=name)), ""))
    eager = baselines.EAGER[op]
    found.append(("eager", lambda a: (lambda: eager(**a)), ""))
    # dynamo caches compiled code by the function's code object, shared by an op's cases: past
    # its recompile limit (8) an op's next shape would fail under fullgraph
    torch._dynamo.reset()
    compiled = torch.compile(eager, dynamic=False, fullgraph=True)
    found.append(("torch.compile", lambda a: (lambda: compiled(**a)), ""))
    for peer, status in baselines.peer_status().items():
        adapter = baselines.PEERS[peer][1]
        if status.startswith("missing") or adapter is None:
            found.append((peer, None, status))
        elif adapter(op, arguments) is None:
            found.append((peer, None, "no equivalent op for this call"))
        else:
            found.append((peer, lambda a, adapter=adapter: adapter(op, a), ""))
    return [item for item in found if wanted is None or item[0] in wanted]


def _dequantized(outputs: tuple, quantized: bool) -> tuple:
    """An FP8 op's FP8 rows and their scales (its first two outputs, ``quantized``: the op spec's)
    as the float32 values they stand for, then the other outputs; any other op's as they are."""
    return (outputs[0].float() * outputs[1],) + outputs[2:] if quantized else outputs


def _check(call: Callable, expected: tuple, dtype: torch.dtype, quantized: bool) -> tuple:
    """(correct, max abs error) of one call's outputs against the reference's; FP8 outputs
    (``quantized``) dequantised, within one FP8 step (a value computed in another order may
    round to the neighbouring step) of the reference's row amax."""
    actual = _outputs(call())
    if len(actual) != len(expected):
        return False, None
    actual, expected = _dequantized(actual, quantized), _dequantized(expected, quantized)
    worst, correct = 0.0, True
    for position, (got, want) in enumerate(zip(actual, expected)):
        got, want = got.float().reshape(want.shape), want.float()
        error = (got - want).abs().nan_to_num(nan=float("inf"))
        worst = max(worst, error.max().item())
        if quantized and position == 0:
            bound = 0.125 * want.abs().amax(-1, keepdim=True).nan_to_num(nan=float("inf"))
            correct = correct and bool((error <= bound).all() or not want.numel())
        else:
            tolerance = 2 * TOLERANCES[dtype]
            correct = correct and torch.allclose(got, want, rtol=tolerance, atol=tolerance)
    return correct, worst


def run_case(case: BenchCase, device: str, dtype: torch.dtype, wanted: Optional[set], l2_bytes: int) -> list:
    def generator(seed):
        return torch.Generator(device=device).manual_seed(seed)

    first = case.build(device, dtype, generator(0))
    size = minimum_bytes(case.op, first)
    sets = [first] + [case.build(device, dtype, generator(seed)) for seed in range(1, timing.rotation_sets(size, l2_bytes))]
    pristine = _clone(first)  # the in-place RoPE ops rotate the timed sets: checks start from this copy
    expected = _outputs(PUBLIC[case.op](**_clone(pristine), backend="reference"))
    explanation = explain(case.op, **first)
    # A small op pays launch ramp and tail that a 1 GiB copy hides: a copy of its own bytes,
    # over as many buffer sets, is the fair 100% mark for it. The faster way, as for copy_gbps.
    copy_us = min(timing.copy_us(device, size, len(sets)).values())
    rows = []
    for name, make_call, note in candidates(case, first, explanation, wanted):
        row = dict(op=case.op, model=case.model, shape=case.shape, dtype=str(dtype).removeprefix("torch."), candidate=name, bytes=size, note=note)
        row["auto_backend"] = explanation.selected  # on every row of the case: which of them is what auto runs
        row["same_size_copy_us"] = copy_us
        rows.append(row)
        if make_call is None:
            continue
        try:
            row["correct"], row["max_error"] = _check(make_call(_clone(pristine)), expected, dtype,
                                                      SPECS[case.op].quantized)
            calls = [make_call(arguments) for arguments in sets]
            if device == "cpu":
                row["us"], row["spread_pct"] = timing.host(calls)
            else:
                row["us"], row["spread_pct"] = timing.cuda_graph(calls)
                row["eager_us"] = timing.cuda_eager(calls).us
        except Exception as error:  # a candidate that fails here is reported, and the run goes on
            row["note"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return rows


def metadata(device: str, copy_gbps: float, l2_bytes: int, quick: bool) -> dict:
    import triton

    info = dict(
        date=datetime.date.today().isoformat(),
        ditops=__version__,
        torch=torch.__version__,
        triton=triton.__version__,
        cuda=torch.version.cuda,
        hip=torch.version.hip,
        python=platform.python_version(),
        copy_gbps=copy_gbps,
        l2_bytes=l2_bytes,
        quick=quick,
        timing="CUDA-graph replay, inputs rotated over more than 2x L2, median of 15" if device != "cpu" else "CPU wall clock",
        peers=baselines.peer_status(),
    )
    if device == "cpu":
        info.update(device=f"CPU ({platform.processor() or platform.machine()})", driver=None)
    else:
        properties = torch.cuda.get_device_properties(0)
        info.update(device=properties.name, driver=_driver_version(), arch=str(dispatch.current_device()))
    return info


def _driver_version() -> Optional[str]:
    try:
        import subprocess

        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout.strip().splitlines()[0]
    except Exception:  # no nvidia-smi (ROCm, containers): the driver is then not recorded
        return None


def prepare_output(folder) -> Path:
    """Proves ``folder`` writable before any time is spent measuring, by writing a file there.
    The folders made for that are removed again: a run that fails leaves none behind (``write``
    makes them)."""
    folder = Path(folder)
    made = [path for path in (folder, *folder.parents) if not path.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ditops-write-test-"):
            pass
    except OSError as error:
        raise ValueError(f"cannot write results to {str(folder)!r}: {error.strerror or error}") from None
    finally:
        for path in made:
            with contextlib.suppress(OSError):  # not made (the mkdir failed before it), or filled meanwhile
                path.rmdir()
    return folder


def write(rows: list, info: dict, output, plots: bool = True) -> list:
    """Writes the JSON, CSV and (with plots) PNG files of a run; returns their paths."""
    stem = f"{report.slug(info['device'])}_{info['date']}" + ("_quick" if info["quick"] else "")
    return report.write(rows, info, Path(output), stem, plots)


def run(
    ops=None,
    shapes=None,
    backends=None,
    quick: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    output: Path = DEFAULT_OUTPUT,
    plots: bool = True,
    write_files: bool = True,
    progress: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True),
) -> tuple:
    """Runs the benchmark; returns (rows, metadata, paths written). The filters (``checked_cases``)
    and, with ``write_files``, the output folder are checked before the run, and the files
    written after it; ``progress`` receives one line per case."""
    cases = checked_cases(ops, shapes, backends, quick, dtype)
    if write_files:
        prepare_output(output)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        print("No GPU here: running the reference and the baselines on the CPU at small stand-in shapes.", file=sys.stderr)
        print("These are not GPU numbers; GPU numbers need a GPU.\n", file=sys.stderr)
        cases = [cpu_case(case) for case in cases]
        l2_bytes = 32 << 20
    else:
        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copy = timing.copy_bandwidth(device, (1 << 30) if device != "cpu" else (64 << 20))
    copy_gbps = max(copy.values())
    wanted = set(backends) if backends else None
    rows = []
    for number, case in enumerate(cases, 1):
        progress(f"[{number:2}/{len(cases)}] {case.op}  {case.model}  {case.shape}")
        rows += run_case(case, device, dtype, wanted, l2_bytes)
        if device != "cpu":
            torch.cuda.empty_cache()
    report.add_derived(rows, copy_gbps)
    info = metadata(device, copy_gbps, l2_bytes, quick)
    info["copy_gbps_by_method"] = copy
    return rows, info, write(rows, info, output, plots) if write_files else []
