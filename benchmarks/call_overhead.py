"""Host cost of a ditops call, eager and inside a compiled graph.

Eager (``"mode": "eager"``): host microseconds per call, calls issued back to back (no
synchronization between them; what a model's forward sees; the best of 8 runs of 2000 calls,
in 4 rounds that alternate the candidates' order), at S=128 (D=3072 for the norm ops; q/k
of 24 x 128 heads, views of a fused qkv buffer, for the RoPE ops), bf16. Candidates:
- ``ditops``: the public call (signature, plan lookup, per-call checks, allocation, launch);
- ``bare_launch``: the kernel ditops chose for that call, launched through its lowest-level
  launcher with the same output allocation: Triton's ``CompiledKernel.run`` with the
  arguments laid out beforehand, or the CUDA driver's ``cuLaunchKernel`` with the
  parameters packed beforehand (only the outputs' pointers written per call);
- ``bare_launch_pointers`` (Triton): the same, with the tensors' data pointers read in Python
  and passed as ints, as ditops passes them (Triton's launcher asks the driver about each
  tensor's pointer, cuPointerGetAttribute, and takes an int as it is);
- ``unfused_eager``: the reference backend (the op's math as PyTorch ops) on its outputs.
On a CPU (``--device cpu``, tiny S=4, D=64 and 2 x 32 heads, so the math costs little) the
candidates are ``ditops`` and ``direct`` (the selected implementation called with its
outputs allocated): their difference is the dispatch cost.

Compiled (``"mode": "compiled"``): a block of 4 x (op -> linear 3072 -> 3072) at S=128 and
S=4096 (RoPE ops: linear 3072 -> 3 x 24 x 128, the op on the q/k views, q + k + v), under
torch.compile, ``"forward_ms"`` per forward (wall clock, synchronized: the median of 4 rounds,
``"rounds_ms"``, that alternate which candidate goes first, each the median of 7 repeats),
the GPU kernels launched per forward (``"kernels"``, from the profiler: copies around an op
show here) and the output's relative difference from the same block run eagerly. Candidates:
``ditops`` and ``inductor_unfused`` (the reference math, fused by Inductor).

Writes benchmarks/results/overhead_<GPU>_<date>.json: {"device", "rows": [...]}.
Usage: python benchmarks/call_overhead.py [--device cuda|cpu] [--output FILE]
       python benchmarks/call_overhead.py --table FILE   # the README's tables of a results file
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

import ditops
from ditops.backends import reference
from ditops.dispatch import OPS
from ditops.dispatch.signature import data_pointers
from ditops.examples import example_arguments
from ditops.ops import OPS as OP_TABLE
from ditops.ops import ordered_arguments

DTYPE = torch.bfloat16
HIDDEN, HEADS, HEAD_SIZE = 3072, 24, 128
ROPE_OPS = ("qk_norm_rope_", "rope_")


def host_us(call, number: int = 2000, repeat: int = 7) -> float:
    """Host microseconds per call, ``number`` calls back to back; the best of ``repeat`` runs."""
    for _ in range(50):
        call()
    synchronize()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(number):
            call()
        best = min(best, (time.perf_counter() - start) / number * 1e6)
        synchronize()
    return best


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def call_arguments(op: str, tokens: int, device: str) -> dict:
    """The op's keyword arguments at ``tokens`` tokens; q/k as views of a fused qkv buffer.
    On a CPU: tiny sizes (see the module docstring)."""
    hidden, heads, head_size = (HIDDEN, HEADS, HEAD_SIZE) if device != "cpu" else (64, 2, 32)
    tokens = tokens if device != "cpu" else 4
    if op not in ROPE_OPS:
        return example_arguments(op, (1, tokens, hidden), DTYPE, device)
    arguments = example_arguments(op, (tokens, heads, head_size), DTYPE, device)
    qkv = torch.randn(tokens, 3, heads, head_size, device=device, dtype=DTYPE)
    arguments.update(q=qkv[:, 0], k=qkv[:, 1])
    return arguments


def eager_rows(op: str, device: str) -> list:
    keywords = call_arguments(op, 128, device)
    arguments, _ = ordered_arguments(op, **keywords)
    spec = OP_TABLE[op]
    public = getattr(ditops, op)
    implementation = spec.plan(arguments, None).implementation
    function = implementation.kernel if device == "cpu" else getattr(reference, op)
    calls = {("ditops", implementation.name): lambda: public(**keywords)}
    if device == "cpu":
        calls["direct", implementation.name] = lambda: function(*arguments, *spec.outputs(*arguments))
    else:
        for candidate, pointers in (("bare_launch", False), ("bare_launch_pointers", True)):
            bare = bare_launch(op, implementation, arguments, pointers)
            if bare is not None:
                calls[candidate, implementation.name] = bare
        calls["unfused_eager", "reference"] = lambda: function(*arguments, *spec.outputs(*arguments))
    # The candidates take turns, in alternating order, and each keeps its best run: the
    # host's speed drifts over seconds, and a candidate timed only in a slow stretch would
    # carry it in its ratio to the others.
    best = dict.fromkeys(calls, float("inf"))
    order = list(calls)
    for turn in range(ROUNDS):
        for key in order if turn % 2 == 0 else order[::-1]:
            best[key] = min(best[key], host_us(calls[key], repeat=2))
    return [dict(op=op, mode="eager", candidate=candidate, backend=backend, host_us=best[candidate, backend])
            for candidate, backend in calls]


def bare_launch(op: str, implementation, arguments: tuple, pointers: bool = False):
    """The chosen kernel through its lowest-level launcher, outputs allocated per call.
    ``pointers`` (Triton): the tensors' data pointers read in Python and passed as ints, as
    ditops passes them, rather than the tensors (for each of which Triton's C launcher calls
    data_ptr() and asks the driver about the pointer)."""
    spec = OP_TABLE[op]
    outputs = spec.outputs(*arguments)
    device_index = arguments[0].get_device()
    if implementation.name == "triton":
        import ditops.backends.triton as backend

        launch = getattr(backend, op + "_launch")(*arguments, *outputs)
        compiled = launch.kernel.warmup(*launch.arguments, grid=launch.grid, **launch.constexprs)
        compiled._init_handles()
        names = launch.kernel.arg_names
        by_name = dict(zip(names, launch.arguments)) | {k: v for k, v in launch.constexprs.items() if k != "num_warps"}
        template = [by_name[name] for name in names]
        output_positions = [(names.index(name), i) for i, output in enumerate(outputs)
                            for name in names if by_name[name] is output]
        grid = (tuple(launch.grid) + (1, 1))[:3]
        run, function, metadata = compiled.run, compiled.function, compiled.packed_metadata
        stream = torch._C._cuda_getCurrentRawStream

        def call():
            new = spec.outputs(*arguments)
            values = template.copy()
            for position, index in output_positions:
                values[position] = new[index]
            if pointers:
                values = [value.data_ptr() if isinstance(value, torch.Tensor) else value for value in values]
            run(*grid, stream(device_index), function, metadata, None, None, None, *values)

        return call
    if implementation.name == "cuda" and not pointers:
        from ditops.backends import cuda
        from ditops.backends.compiled import PackedArguments
        from ditops.backends.cuda import driver

        launch = getattr(cuda.KERNELS, op + "_launch")(*arguments, *outputs)
        packed = PackedArguments(launch.arguments, arguments + outputs)
        kernel = driver.function(launch.instance, device_index)
        from cuda.bindings.driver import cuLaunchKernel

        stream = torch._C._cuda_getCurrentRawStream
        block = launch.instance.block

        def call():
            address = packed.rebind(data_pointers(arguments + spec.outputs(*arguments)))
            cuLaunchKernel(kernel, *launch.grid, block, 1, 1, 0, stream(device_index), address, 0)

        return call
    return None


def block(op: str, fused: bool, weights: list, keywords: dict):
    """4 x (op -> linear): the op's first output (or q + k + v) feeds the next linear."""
    function = getattr(ditops, op) if fused else None
    spec = OP_TABLE[op]

    def unfused(**call):
        arguments, _ = ordered_arguments(op, **call)
        outputs = spec.outputs(*arguments)
        getattr(reference, op)(*arguments, *outputs)
        return outputs

    def forward(x):
        h = x
        for weight in weights:
            if op in ROPE_OPS:
                qkv = torch.nn.functional.linear(h, weight).view(h.shape[0], 3, HEADS, HEAD_SIZE)
                q, k, v = qkv.unbind(1)
                call = dict(keywords, q=q, k=k)
                (function(**call) if fused else unfused(**call))
                h = (q + k + v).flatten(-2)
            else:
                call = dict(keywords, x=h)
                result = function(**call) if fused else unfused(**call)
                first = result if isinstance(result, torch.Tensor) else result[0]
                h = torch.nn.functional.linear(first, weight)
        return h

    return forward


def compiled_rows(op: str, tokens: int) -> list:
    keywords = call_arguments(op, tokens, "cuda")
    if op in ROPE_OPS:
        keywords = {k: v for k, v in keywords.items() if k not in ("q", "k")}
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=DTYPE)
        weights = [torch.randn(3 * HIDDEN, HIDDEN, device="cuda", dtype=DTYPE) / HIDDEN**0.5 for _ in range(4)]
    else:
        x = keywords.pop("x")
        weights = [torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=DTYPE) / HIDDEN**0.5 for _ in range(4)]
    torch._dynamo.reset()
    compiled, rows = {}, []
    for candidate, fused in CANDIDATES:
        forward = block(op, fused, weights, keywords)
        compiled[candidate] = torch.compile(forward, fullgraph=True)
        with torch.no_grad():
            eager, result = forward(x).float(), compiled[candidate](x).float()
            kernels = kernels_per_call(lambda: compiled[candidate](x))
        rows.append(dict(op=op, mode="compiled", candidate=candidate, tokens=tokens,
                         kernels=kernels, rel_diff_vs_eager=((result - eager).norm() / eager.norm()).item()))
    # Both candidates timed in alternating rounds: at S=128 a forward is host-bound, and the
    # host's speed drifts over seconds (one run timed identical Inductor code 0.21 and 0.46 ms).
    rounds = {candidate: [] for candidate, _ in CANDIDATES}
    with torch.no_grad():
        for turn in range(ROUNDS):
            for candidate, _ in CANDIDATES[::1 if turn % 2 == 0 else -1]:
                rounds[candidate].append(wall_ms(lambda: compiled[candidate](x)))
    for row in rows:
        row.update(forward_ms=statistics.median(rounds[row["candidate"]]), rounds_ms=rounds[row["candidate"]])
    return rows


CANDIDATES = (("ditops", True), ("inductor_unfused", False))
ROUNDS = 4


def wall_ms(call, number: int = 50, repeat: int = 7) -> float:
    for _ in range(10):
        call()
    times = []
    for _ in range(repeat):
        synchronize()
        start = time.perf_counter()
        for _ in range(number):
            call()
        synchronize()
        times.append((time.perf_counter() - start) / number * 1e3)
    return statistics.median(times)


def kernels_per_call(call) -> int:
    from torch.profiler import ProfilerActivity, profile

    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        call()
        synchronize()
    return sum(1 for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def table(path: Path) -> str:
    """Markdown tables of a results file: eager host cost, then the compiled block."""
    rows = json.loads(path.read_text())["rows"]
    eager = {(row["op"], row["candidate"]): row["host_us"] for row in rows if row["mode"] == "eager"}
    ops = list(dict.fromkeys(op for op, _ in eager))
    lines = [] if not ops else [
        "| op | ditops (us) | bare launch (us) | ditops / bare | bare launch, pointers (us) | ditops / bare, pointers "
        "| unfused eager (us) |", "|---|---|---|---|---|---|---|"]
    for op in ops:
        ditops, bare, pointers, unfused = (eager.get((op, c)) for c in
                                           ("ditops", "bare_launch", "bare_launch_pointers", "unfused_eager"))
        ratios = [f"{ditops / base:.2f}x" if base else "-" for base in (bare, pointers)]
        cells = [f"{value:.1f}" if value is not None else "-" for value in (ditops, bare, pointers, unfused)]
        lines.append(f"| `{op}` | {cells[0]} | {cells[1]} | {ratios[0]} | {cells[2]} | {ratios[1]} | {cells[3]} |")
    compiled = {(row["op"], row["tokens"], row["candidate"]): row for row in rows if row["mode"] == "compiled"}
    if compiled:
        lines += [""] * bool(lines) + ["| op | S | ditops (ms) | Inductor unfused (ms) | ditops / Inductor | kernels (ditops / Inductor) |",
                  "|---|---|---|---|---|---|"]
        for (op, tokens, candidate), row in compiled.items():
            if candidate == "ditops":
                other = compiled[op, tokens, "inductor_unfused"]
                lines.append(f"| `{op}` | {tokens} | {row['forward_ms']:.3f} | {other['forward_ms']:.3f} | "
                             f"{row['forward_ms'] / other['forward_ms']:.2f}x | {row['kernels']} / {other['kernels']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, help="print the markdown tables of a results file and exit")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--output", help="JSON file (default: benchmarks/results/overhead_<GPU>_<date>.json)")
    parser.add_argument("--ops", nargs="*", default=list(OPS))
    parser.add_argument("--no-compiled", action="store_true", help="eager rows only")
    options = parser.parse_args()
    if options.table:
        print(table(options.table))
        return
    gpu = options.device != "cpu"
    name = torch.cuda.get_device_name() if gpu else "CPU"
    short = name.split()[1] if gpu and len(name.split()) > 1 else name
    output = Path(options.output or Path(__file__).parent / "results" / f"overhead_{short}_{datetime.date.today()}.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for op in options.ops:
        rows += eager_rows(op, options.device)
        for row in rows:
            if row["op"] == op:
                print(f"{op:34} eager    {row['candidate']:14} {row['backend']:10} {row['host_us']:8.1f} us", flush=True)
    if gpu and not options.no_compiled:
        for op in options.ops:
            for tokens in (128, 4096):
                for row in compiled_rows(op, tokens):
                    rows.append(row)
                    print(f"{op:34} compiled S={tokens:<5} {row['candidate']:16} {row['forward_ms']:8.3f} ms "
                          f"{row['kernels']:3d} kernels  diff {row['rel_diff_vs_eager']:.1e}", flush=True)
    document = dict(device=name, torch=torch.__version__, date=str(datetime.date.today()), rows=rows)
    output.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
