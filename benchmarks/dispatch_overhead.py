"""Host cost of ditops' dispatch: a public op call versus calling its implementation directly.

For each op, on tiny tensors (so that the op's own work is small and constant):
- direct: allocate the outputs and call the selected implementation (what any caller must do);
- public: ``ditops.<op>(...)``: validation, cached selection, allocation, the same call;
- overhead = public - direct, and its two parts measured alone: validation + features, selection;
- custom op: ``torch.ops.ditops.<op>`` (torch's dispatcher, the path under torch.compile).
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

    def direct():
        implementation.function(*arguments, *spec.outputs(*arguments))

    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(function):
        def run():
            function()
            synchronize()

        run()
        return microseconds(run, number, repeat)

    result = dict(
        op=op,
        implementation=implementation.name,
        direct_us=timed(direct),
        public_us=timed(lambda: public(**keywords)),
        custom_op_us=timed(lambda: library_op(*arguments, None)),
        validation_us=microseconds(lambda: spec.check(*arguments), number, repeat),
        selection_us=microseconds(lambda: select(op, features), number, repeat),
    )
    result["overhead_us"] = result["public_us"] - result["direct_us"]
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
    header = ("op", "impl", "direct us", "public us", "overhead us", "validate+features us", "select us", "torch.ops us")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        values = (row["direct_us"], row["public_us"], row["overhead_us"], row["validation_us"], row["selection_us"], row["custom_op_us"])
        print(f"| {row['op']} | {row['implementation']} | " + " | ".join(f"{value:.2f}" for value in values) + " |")
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(dict(device=arguments.device, torch=torch.__version__, rows=rows), file, indent=1)


if __name__ == "__main__":
    main()
