"""Host cost of ditops' dispatch: a public op call versus calling its implementation directly.

For each op, on tiny tensors:
- direct: allocate the outputs and call the selected implementation (what any caller must do);
- public: ``ditops.<op>(...)``: call signature, cached validation and selection, allocation, the same call;
- overhead = public - direct, measured with the implementation swapped for a no-op, so that
  the reference's own time (tens of microseconds of small kernels) does not hide it;
- first call: validation, features and selection as on a cache miss;
- custom op: ``torch.ops.ditops.<op>`` (torch's dispatcher, the path under torch.compile),
  with the real implementation, beside the public call with it;
- issued: the host time per call when calls go back to back without a synchronization each
  (what a model's forward sees), for the public call, torch.ops and the kernel launch alone
  (the implementation with its outputs already allocated).
Each figure is the minimum over repeats of the mean of many calls (the least-disturbed
estimate of a fixed host cost). Usage: python benchmarks/dispatch_overhead.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import platform
import timeit

import torch

import ditops
from ditops.dispatch import OPS, select
from ditops.examples import example_arguments
from ditops.ops import OPS as OP_TABLE
from ditops.ops import PUBLIC, ordered_arguments

TINY_SHAPES = {op: (1, 4, 64) for op in OPS} | {"qk_norm_rope_": (4, 2, 64), "rope_": (4, 2, 64)}


def microseconds(function, number: int, repeat: int) -> float:
    return min(timeit.repeat(function, number=number, repeat=repeat)) / number * 1e6


def measure(op: str, device: str, number: int, repeat: int) -> dict:
    keywords = example_arguments(op, TINY_SHAPES[op], torch.bfloat16, device)
    arguments, _ = ordered_arguments(op, **keywords)
    spec = OP_TABLE[op]
    features = spec.check(*arguments)
    implementation = select(op, features)
    public = PUBLIC[op]
    library_op = getattr(torch.ops.ditops, op)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(function):
        def run():
            function()
            synchronize()

        run()
        return microseconds(run, number, repeat)

    def direct():
        implementation.function(*arguments, *spec.outputs(*arguments))

    def issued(function):
        """Host time per call when calls are issued back to back (the tiny kernels finish
        faster than the host issues them), with one synchronization at the end."""
        def run():
            for _ in range(number):
                function()
            synchronize()

        run()
        return min(timeit.repeat(run, number=1, repeat=repeat)) / number * 1e6

    outputs = spec.outputs(*arguments)
    result = dict(
        op=op,
        implementation=implementation.name,
        public_us=timed(lambda: public(**keywords)),
        custom_op_us=timed(lambda: library_op(*arguments, None)),
        issue_public_us=issued(lambda: public(**keywords)),
        issue_torch_ops_us=issued(lambda: library_op(*arguments, None)),
        issue_kernel_us=issued(lambda: implementation.function(*arguments, *outputs)),
        first_call_us=microseconds(lambda: (spec.check(*arguments), select(op, spec.check(*arguments))), number, repeat),
    )
    real_function = implementation.function
    implementation.__dict__["function"] = lambda *_: None  # a no-op kernel: what remains is overhead
    try:
        result["noop_direct_us"] = microseconds(direct, number, repeat)
        result["noop_public_us"] = microseconds(lambda: public(**keywords), number, repeat)
    finally:
        implementation.__dict__["function"] = real_function
    result["overhead_us"] = result["noop_public_us"] - result["noop_direct_us"]
    return result

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", help="also write the rows to this file")
    arguments = parser.parse_args()
    rows = [measure(op, arguments.device, arguments.number, arguments.repeat) for op in OPS]
    print(f"dispatch overhead on {arguments.device} ({platform.processor() or platform.machine()}), torch {torch.__version__}, ditops {ditops.__version__}")
    header = ("op", "impl", "dispatch overhead us", "no-op direct us", "no-op public us", "first call us", "public us",
              "torch.ops us", "issued: public us", "issued: torch.ops us", "issued: kernel only us")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    keys = ("overhead_us", "noop_direct_us", "noop_public_us", "first_call_us", "public_us", "custom_op_us",
            "issue_public_us", "issue_torch_ops_us", "issue_kernel_us")
    for row in rows:
        print(f"| {row['op']} | {row['implementation']} | " + " | ".join(f"{row[key]:.2f}" for key in keys) + " |")
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(dict(device=arguments.device, torch=torch.__version__, rows=rows), file, indent=1)


if __name__ == "__main__":
    main()
