"""Times launch settings of the Triton row kernels at `ditops bench`'s shapes: how the entries of
ditops/configs/triton_launch.yaml are chosen, and how to check them on another GPU (with
--token-norm, those of the compiled token-norm RoPE kernel).

Each setting replaces every row kernel's entries in the launch table for the run (num_warps,
rows per program, a row loop of programs_per_sm x stages, 0x1 for none, and fold_reductions,
1 for folded row reductions, which the modulated-norm and select kernels take), then the op is timed
through its public call with the Triton backend (its real call path; CUDA-graph replay
over input sets larger than the L2 cache, as `ditops bench`), beside the launch table as it is
and the same-size copy. A row loop runs only where the call's modulation is the same for every
token of a batch item (launch.row_grid); elsewhere that setting times the plain grid.

With --token-norm, the compiled (CUDA) kernel of qk_norm_rope_(norm_over="token") instead: each
setting, block threads x items, becomes the one rotary_token_norm class of
ditops/configs/compiled_launch.yaml for the run, timed with the cuda backend at the bench's
token-norm cases.

Usage: python benchmarks/launch_sweep.py --ops norm_scale_shift_fp8 --shapes Wan \\
           --warps 1 2 4 --rows 1 2 --loops 0x1 4x3 8x3 [--folds 0 1] [--output FILE.json]
       python benchmarks/launch_sweep.py --token-norm 64x3 128x2 128x4 128x5 256x2 [--output FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from ditops.backends import compiled
from ditops.backends.triton import launch
from ditops.bench import timing
from ditops.bench.cases import CASES, minimum_bytes
from ditops.dispatch import reset
from ditops.ops import PUBLIC

def table_with(settings: dict, num_warps: int, rows_per_program: int, loop: tuple, fold: bool = False) -> dict:
    """The launch table with every row kernel's entries, for every device class and vendor, set
    to one launch setting (their max_hidden classes kept)."""
    programs_per_sm, stages = loop
    row_loop = {"row_loop": dict(programs_per_sm=programs_per_sm, stages=stages)} if programs_per_sm else {}

    def entry(old: dict) -> dict:
        return dict(max_hidden=old["max_hidden"], num_warps=num_warps, rows_per_program=rows_per_program,
                    fold_reductions=fold, **row_loop)

    return dict(settings, **{kernel: {owner: [entry(old) for old in entries] for owner, entries in settings[kernel].items()}
                             for kernel in launch.ROW_TABLES})


def case_inputs(case) -> list:
    """The case's argument sets, as many as `ditops bench` rotates over: one pass larger than twice the L2 cache."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    first = case.build("cuda", torch.bfloat16, generator)
    sets = timing.rotation_sets(minimum_bytes(case.op, first), torch.cuda.get_device_properties(0).L2_cache_size)
    return [first] + [case.build("cuda", torch.bfloat16, generator) for _ in range(sets - 1)]


# Where each timed backend reads its launch table: Triton's row kernels (configs/triton_launch.yaml),
# the compiled kernels (configs/compiled_launch.yaml).
_TABLES = {"triton": (launch, "_settings"), "cuda": (compiled, "_launch_settings")}


def time_case(case, inputs: list, table, backend: str = "triton") -> float:
    """Microseconds per call of the case's op on ``backend`` under its launch table ``table``
    (None: as it is)."""
    owner, name = _TABLES[backend]
    original = getattr(owner, name)
    if table is not None:
        setattr(owner, name, lambda: table)
    reset()  # a new plan table: the calls bind kernels under this launch table
    try:
        return timing.cuda_graph([lambda a=a: PUBLIC[case.op](**a, backend=backend) for a in inputs]).us
    finally:
        setattr(owner, name, original)
        reset()


def baseline(case, backend: str) -> tuple:
    """(inputs, same-size copy us, us under the launch table as it is) of a case, printed."""
    inputs = case_inputs(case)
    copy = min(timing.copy_us("cuda", minimum_bytes(case.op, inputs[0]), len(inputs)).values())
    tabled = time_case(case, inputs, None, backend)
    print(f"\n{case.op} {case.model} {case.shape}: same-size copy {copy:.1f} us, launch table {tabled:.1f} us")
    return inputs, copy, tabled


def token_norm_table(settings: dict, block: int, items: int) -> dict:
    """The compiled launch table with one rotary_token_norm class, block x items, for every D
    up to the registry's limit (the last class's max_hidden)."""
    widest = settings["rotary_token_norm"][-1]["max_hidden"]
    return dict(settings, rotary_token_norm=[dict(max_hidden=widest, block=block, items=items)])


def sweep_token_norm(settings_text: list) -> list:
    settings = compiled._launch_settings()
    results = []
    for case in CASES:
        if case.op != "qk_norm_rope_" or "token norm" not in case.model:
            continue
        inputs, copy, tabled = baseline(case, "cuda")
        for text in settings_text:
            block, items = (int(part) for part in text.split("x"))
            us = time_case(case, inputs, token_norm_table(settings, block, items), "cuda")
            results.append(dict(op=case.op, model=case.model, shape=case.shape, block=block, items=items, us=us,
                                tabled_us=tabled, same_size_copy_us=copy))
            print(f"  block {block:4d} items {items}: {us:8.1f} us ({100 * copy / us:.0f}% of the copy, "
                  f"{tabled / us:.2f}x the table's)", flush=True)
    return results


def sweep_rows(options) -> list:
    loops = [tuple(int(part) for part in text.split("x")) for text in options.loops]
    settings = launch._settings()
    results = []
    for case in CASES:
        if case.op not in options.ops or not any(s in case.model or s in case.shape for s in options.shapes):
            continue
        inputs, copy, tabled = baseline(case, "triton")
        for warps, rows, loop, fold in itertools.product(options.warps, options.rows, loops, options.folds):
            setting = f"num_warps {warps:2d} rows {rows} loop {loop[0]}x{loop[1]} fold {fold}"
            try:
                us = time_case(case, inputs, table_with(settings, warps, rows, loop, bool(fold)))
            except Exception as error:  # e.g. Triton's OutOfResources: a setting the GPU cannot run
                print(f"  {setting}: failed: {error!r:.200}")
                continue
            results.append(dict(op=case.op, model=case.model, shape=case.shape, num_warps=warps, rows_per_program=rows,
                                row_loop=f"{loop[0]}x{loop[1]}", fold_reductions=bool(fold), us=us, tabled_us=tabled,
                                same_size_copy_us=copy))
            print(f"  {setting}: {us:8.1f} us "
                  f"({100 * copy / us:.0f}% of the copy, {tabled / us:.2f}x the table's)", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+")
    parser.add_argument("--token-norm", nargs="+", metavar="BLOCKxITEMS",
                        help="sweep the compiled rotary_token_norm classes instead (block threads x items)")
    parser.add_argument("--shapes", nargs="+", default=[""], help="only cases whose model or shape contains one of these")
    parser.add_argument("--warps", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--rows", nargs="+", type=int, default=[1], help="rows per program")
    parser.add_argument("--loops", nargs="+", default=["0x1"], help="row loops, programs_per_sm x stages; 0x1: none")
    parser.add_argument("--folds", nargs="+", type=int, choices=(0, 1), default=[0], help="fold_reductions off (0), on (1)")
    parser.add_argument("--output", type=Path)
    options = parser.parse_args()
    if options.token_norm:
        results = sweep_token_norm(options.token_norm)
    elif options.ops:
        results = sweep_rows(options)
    else:
        parser.error("--ops or --token-norm")
    if options.output:
        options.output.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=results), indent=1) + "\n")


if __name__ == "__main__":
    main()
