"""Why the Triton row kernels miss copy bandwidth on some shapes (issue 4): profiler inputs and timings.

Modes (GPU, bf16, cases from ditops/bench/cases.py):
  --count         print how many kernels one --profile pass launches (for ncu --launch-skip/--launch-count)
  --profile       build each case, then launch every job twice (a warm-up pass, then the profiled pass);
                  run it under ncu with --launch-skip N --launch-count N
  --time          CUDA-graph timing (cold L2, as `ditops bench`): the default launch of each case, a copy
                  of the same bytes (torch), a Triton row copy with the case's launch, a num_warps x
                  rows_per_program sweep, and a persistent-grid prototype (this file only)
  --summarize F   a compact table from `ncu --import R --page raw --csv --print-units base` output F

Jobs of a profile pass: each case with backend="triton"; "rowcopy" (one program per row copying x to y
with the case's BLOCK and num_warps: the row grid without the norm math); "persistent" (the prototype:
a grid of a few programs per SM, each looping over rows with the next row's load in flight and the
modulation vectors loaded once; B=1 norm_scale_shift only).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import re
import sys

import torch
import triton
import triton.language as tl

CASE_NAMES = [
    ("norm_scale_shift", "Qwen-Image 1024px"),
    ("norm_scale_shift", "HunyuanVideo 720p"),
    ("norm_scale_shift", "Wan2.1-14B 720p"),
    ("norm_scale_shift", "FLUX.2-dev 1024px"),
    ("norm_scale_shift", "Z-Image-Turbo (RMS)"),
    ("add_gate_norm", "Z-Image-Turbo 1024px"),
    ("residual_norm_scale_shift", "Qwen-Image 1024px"),
]
ROWCOPY_CASES = CASE_NAMES[:6]
PERSISTENT_PROFILE = [("norm_scale_shift", "Qwen-Image 1024px", 8, 1, 4), ("norm_scale_shift", "Wan2.1-14B 720p", 16, 1, 2)]
KERNEL_OF = {"norm_scale_shift": "modulated_norm", "residual_norm_scale_shift": "modulated_norm", "add_gate_norm": "gated_add_norm"}


@triton.jit
def rowcopy_kernel(x, y, hidden, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    mask = columns < hidden
    tl.store(y + row * hidden + columns, tl.load(x + row * hidden + columns, mask=mask), mask=mask)


@triton.jit
def persistent_norm_kernel(x, scale, shift, weight, bias, y, rows, hidden, eps,
                           RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr, PREFETCH: tl.constexpr):
    """Prototype (B=1, contiguous [S, D] x, [D] modulation): each program keeps weight, bias, scale
    and shift in registers and walks rows pid, pid + nprog, ...; with PREFETCH the next row's load
    is issued before this row's reductions."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    columns = tl.arange(0, BLOCK)
    mask = columns < hidden
    zero64 = tl.zeros([], tl.int64)  # 64-bit row offsets
    a = 1.0 + tl.load(scale + columns, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(shift + columns, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        c = c + tl.load(bias + columns, mask=mask, other=0.0).to(tl.float32) * a
    if HAS_WEIGHT:
        a = a * tl.load(weight + columns, mask=mask, other=0.0).to(tl.float32)
    if PREFETCH:
        upcoming = tl.load(x + pid.to(tl.int64) * hidden + columns, mask=columns < tl.where(pid < rows, hidden, 0), other=0.0)
        for row in range(pid, rows, nprog):
            v = upcoming.to(tl.float32)
            following = row + nprog
            upcoming = tl.load(x + (following + zero64) * hidden + columns, mask=columns < tl.where(following < rows, hidden, 0), other=0.0)
            if RMS:
                normalized = v * tl.rsqrt(tl.sum(v * v, axis=0) / hidden + eps)
            else:
                centered = tl.where(mask, v - tl.sum(v, axis=0) / hidden, 0.0)
                normalized = centered * tl.rsqrt(tl.sum(centered * centered, axis=0) / hidden + eps)
            tl.store(y + (row + zero64) * hidden + columns, (normalized * a + c).to(y.dtype.element_ty), mask=mask)
    else:
        for row in range(pid, rows, nprog):
            v = tl.load(x + (row + zero64) * hidden + columns, mask=mask, other=0.0).to(tl.float32)
            if RMS:
                normalized = v * tl.rsqrt(tl.sum(v * v, axis=0) / hidden + eps)
            else:
                centered = tl.where(mask, v - tl.sum(v, axis=0) / hidden, 0.0)
                normalized = centered * tl.rsqrt(tl.sum(centered * centered, axis=0) / hidden + eps)
            tl.store(y + (row + zero64) * hidden + columns, (normalized * a + c).to(y.dtype.element_ty), mask=mask)


def _case(op, model):
    from ditops.bench.cases import CASES

    return next(c for c in CASES if c.op == op and c.model == model)


def _build(op, model, seed=0):
    return _case(op, model).build("cuda", torch.bfloat16, torch.Generator(device="cuda").manual_seed(seed))


def _launch(op, hidden):
    from ditops.backends.triton import launch

    return launch.row_launch(KERNEL_OF[op], hidden, "cuda")


def _rowcopy(x, y, launch):
    rows, hidden = x.numel() // x.shape[-1], x.shape[-1]
    rowcopy_kernel[(rows,)](x, y, hidden, BLOCK=launch.block, num_warps=launch.num_warps)


def _persistent(a, y, warps, prefetch, per_sm, sms):
    x = a["x"]
    hidden = x.shape[-1]
    rows = x.numel() // hidden
    assert x.is_contiguous() and x.shape[0] == 1
    scale, shift = a["scale"].reshape(-1), a["shift"].reshape(-1)
    assert scale.stride(0) == 1 and shift.stride(0) == 1 and scale.numel() == hidden
    weight, bias = a.get("weight"), a.get("bias")
    persistent_norm_kernel[(min(rows, per_sm * sms),)](
        x, scale, shift, weight if weight is not None else scale, bias if bias is not None else scale, y,
        rows, hidden, 1e-6, RMS=a.get("norm") == "rms", HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK=triton.next_power_of_2(hidden), PREFETCH=prefetch, num_warps=warps)


def _jobs():
    """(name, callable) of one profile pass, each launching exactly one kernel that ncu's filter matches."""
    from ditops.ops import PUBLIC

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    jobs, built = [], {}
    for op, model in CASE_NAMES:
        a = built[(op, model)] = _build(op, model)
        jobs.append((f"{op} | {model}", lambda a=a, op=op: PUBLIC[op](**a, backend="triton")))
    for op, model in ROWCOPY_CASES:
        x = built[(op, model)]["x"]
        y = torch.empty_like(x)
        launch = _launch(op, x.shape[-1])
        jobs.append((f"rowcopy | {model} ({op} launch: BLOCK {launch.block}, {launch.num_warps} warps)",
                     lambda x=x, y=y, launch=launch: _rowcopy(x, y, launch)))
    for op, model, warps, prefetch, per_sm in PERSISTENT_PROFILE:
        a = built[(op, model)]
        y = torch.empty_like(a["x"])
        jobs.append((f"persistent | {model} ({warps} warps, prefetch {prefetch}, {per_sm}/SM)",
                     lambda a=a, y=y, w=warps, p=prefetch, s=per_sm: _persistent(a, y, w, p, s, sms)))
    return jobs


def count_jobs() -> int:
    return len(CASE_NAMES) + len(ROWCOPY_CASES) + len(PERSISTENT_PROFILE)


def _report_compiled():
    """Registers, spills and shared memory of each compiled specialisation (Triton's own report)."""
    from ditops.backends.triton.gated_add_norm import gated_add_norm_kernel
    from ditops.backends.triton.modulated_norm import modulated_norm_kernel

    for function in (modulated_norm_kernel, gated_add_norm_kernel, rowcopy_kernel, persistent_norm_kernel):
        try:
            for entry in function.device_caches.values():
                for compiled in entry[0].values():
                    meta = compiled.metadata
                    print(f"compiled {function.__name__}: num_warps={meta.num_warps} regs={compiled.n_regs} "
                          f"spills={compiled.n_spills} shared={meta.shared}", flush=True)
        except Exception as error:  # Triton-version specific; the profile has the same numbers
            print(f"compiled {function.__name__}: no report ({type(error).__name__}: {error})")


def profile(jobs_file=None) -> None:
    jobs = _jobs()
    assert len(jobs) == count_jobs()
    for _, call in jobs:  # warm-up pass: compilation (skipped by ncu)
        call()
    torch.cuda.synchronize()
    for index, (name, call) in enumerate(jobs):
        print(f"profiled job {index}: {name}", flush=True)
        call()
    torch.cuda.synchronize()
    _report_compiled()
    if jobs_file:
        with open(jobs_file, "w") as file:
            json.dump([name for name, _ in jobs], file, indent=1)


def _measure(calls):
    from ditops.bench import timing

    return timing.cuda_graph(calls).us


def time_all(out_json=None) -> None:
    import ditops.backends.triton as triton_backend
    from ditops.backends.triton import launch as launch_module
    from ditops.bench import timing
    from ditops.bench.cases import minimum_bytes
    from ditops.ops import PUBLIC

    props = torch.cuda.get_device_properties(0)
    l2, sms = props.L2_cache_size, props.multi_processor_count
    copy = timing.copy_bandwidth("cuda")
    copy_gbps = max(copy.values())
    print(f"{torch.cuda.get_device_name()} {sms} SMs, L2 {l2 >> 20} MiB: 1 GiB copy {copy}", flush=True)
    results = dict(device=torch.cuda.get_device_name(), copy_gbps=copy, rows=[])
    original_row = triton_backend.row_launch

    def record(kind, op, model, setting, us, size):
        gbps = size / (us * 1e3)
        row = dict(kind=kind, op=op, model=model, setting=setting, us=us, bytes=size, gbps=gbps, pct_copy=100 * gbps / copy_gbps)
        results["rows"].append(row)
        print(f"{kind:10s} {op:26s} {model:22s} {setting:34s} {us:9.2f} us {gbps:7.0f} GB/s {row['pct_copy']:5.1f}%", flush=True)

    sweeps = {("norm_scale_shift", "Qwen-Image 1024px"): list(itertools.product((2, 4, 8, 16), (1, 2, 4)))}
    for key in CASE_NAMES[1:6]:
        sweeps[key] = [(w, 1) for w in (4, 8, 16)]
    persistent = {("norm_scale_shift", "Qwen-Image 1024px"): list(itertools.product((4, 8, 16), (0, 1), (2, 4)))}
    for key in CASE_NAMES[1:5]:
        persistent[key] = list(itertools.product((8, 16), (1,), (1, 2)))

    for op, model in CASE_NAMES:
        first = _build(op, model)
        size = minimum_bytes(op, first)
        sets = [first] + [_build(op, model, seed) for seed in range(1, timing.rotation_sets(size, l2))]
        calls = [lambda a=a: PUBLIC[op](**a, backend="triton") for a in sets]
        default = original_row(KERNEL_OF[op], first["x"].shape[-1], "cuda")
        record("default", op, model, f"warps={default.num_warps} rows={default.rows_per_program}", _measure(calls), size)
        # the same bytes through torch's copy kernel, and the row grid alone (x -> y with the case's launch)
        elements = size // 4
        sources = [torch.randn(elements, device="cuda").to(torch.bfloat16) for _ in range(timing.rotation_sets(size, l2))]
        targets = [torch.empty_like(s) for s in sources]
        record("torchcopy", op, model, f"{elements} bf16 elements", _measure(
            [lambda s=s, t=t: torch.mul(s, 1, out=t) for s, t in zip(sources, targets)]), size)
        del sources, targets
        copies = [(a["x"], torch.empty_like(a["x"])) for a in sets]
        x_bytes = 2 * first["x"].numel() * first["x"].element_size()
        record("rowcopy", op, model, f"BLOCK={default.block} warps={default.num_warps}", _measure(
            [lambda x=x, y=y: _rowcopy(x, y, default) for x, y in copies]), x_bytes)
        del copies
        for warps, rows in sweeps.get((op, model), []):
            def row_launch(kernel, hidden, vendor, rows=rows, warps=warps):
                return launch_module.RowLaunch(original_row(kernel, hidden, vendor).block, warps, rows)

            triton_backend.row_launch = row_launch
            try:
                record("sweep", op, model, f"warps={warps} rows={rows}", _measure(calls), size)
            except Exception as error:
                print(f"sweep {op} {model} warps={warps} rows={rows}: {type(error).__name__}: {error}", flush=True)
            finally:
                triton_backend.row_launch = original_row
        variants = persistent.get((op, model), [])
        if variants:
            reference = PUBLIC[op](**first, backend="triton")
            outputs = [torch.empty_like(a["x"]) for a in sets]
        for warps, prefetch, per_sm in variants:
            setting = f"warps={warps} prefetch={prefetch} {per_sm}/SM"
            try:
                outputs[0].fill_(float("nan"))
                _persistent(first, outputs[0], warps, prefetch, per_sm, sms)
                error = ((outputs[0].float() - reference.float()).abs().max() / reference.float().abs().max()).item()
                if not error <= 1e-2:  # relative to the largest output; bf16 rounding is 4e-3
                    print(f"persistent {op} {model} {setting}: max error {error}, not timed", flush=True)
                    continue
                us = _measure([lambda a=a, y=y: _persistent(a, y, warps, prefetch, per_sm, sms) for a, y in zip(sets, outputs)])
                record("persistent", op, model, setting + f" relerr={error:.2g}", us, size)
            except Exception as failure:
                print(f"persistent {op} {model} {setting}: {type(failure).__name__}: {failure}", flush=True)
        del sets, calls, first
        torch.cuda.empty_cache()
    _report_compiled()
    if out_json:
        with open(out_json, "w") as file:
            json.dump(results, file, indent=1)


STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(.+)_per_issue_active\.ratio$")
COLUMNS = [
    ("us", "gpu__time_duration.sum", 1e-3),
    ("dram%", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("dramMB", None, None),
    ("GB/s", None, None),
    ("smAct%", None, None),
    ("achOcc%", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    ("thOcc%", "sm__maximum_warps_per_active_cycle_pct", 1),
    ("blk/SM reg,smem,warp,blk", None, None),
    ("regs", "launch__registers_per_thread", 1),
    ("grid", "launch__grid_size", 1),
    ("block", "launch__block_size", 1),
    ("waves", "launch__waves_per_multiprocessor", 1),
    ("L2hit%", "lts__t_sector_hit_rate.pct", 1),
    ("L2%", "lts__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("L1%", "l1tex__throughput.avg.pct_of_peak_sustained_active", 1),
    ("cyc/inst", "smsp__average_warp_latency_per_inst_issued.ratio", 1),
    ("issue%", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("alu%", "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed", 1),
    ("Minst", "inst_executed", 1e-6),
    ("inst/prog", None, None),
    ("issueFloor_us", None, None),
]


def _number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def summarize(path, jobs_file=None) -> None:
    with open(path, newline="") as file:
        lines = [line for line in file if line.startswith('"')]
    table = list(csv.reader(lines))
    header, units, data = table[0], table[1], table[2:]
    names = json.load(open(jobs_file)) if jobs_file else [None] * len(data)
    print("ncu raw units:", {h: u for h, u in zip(header, units) if h in ("gpu__time_duration.sum", "dram__bytes_read.sum")})
    for index, row in enumerate(data):
        value = dict(zip(header, row))
        get = lambda metric: _number(value.get(metric))  # noqa: E731
        name = names[index] if index < len(names) else None
        print(f"[{value.get('ID')}] {name or value.get('Kernel Name')}")
        duration = get("gpu__time_duration.sum")
        dram = (get("dram__bytes_read.sum") or 0) + (get("dram__bytes_write.sum") or 0)
        parts = []
        for label, metric, factor in COLUMNS:
            if label == "dramMB":
                parts.append(f"dramMB={dram / 1e6:.1f} (rd {get('dram__bytes_read.sum') / 1e6:.1f})" if dram else "dramMB=?")
            elif label == "GB/s":
                parts.append(f"GB/s={dram / duration:.0f}" if dram and duration else "GB/s=?")
            elif label == "smAct%":
                active, elapsed = get("sm__cycles_active.avg"), get("sm__cycles_elapsed.avg")
                parts.append(f"smAct%={100 * active / elapsed:.1f}" if active and elapsed else "smAct%=?")
            elif label == "inst/prog":  # warp instructions per program (per row when one row per program)
                instructions, grid = get("inst_executed"), get("launch__grid_size")
                parts.append(f"inst/prog={instructions / grid:.0f}" if instructions and grid else "inst/prog=?")
            elif label == "issueFloor_us":  # the time at one warp instruction per scheduler per cycle
                instructions, clock = get("inst_executed"), get("gpc__cycles_elapsed.avg.per_second")
                sms = get("device__attribute_multiprocessor_count") or 132
                parts.append(f"issueFloor_us={instructions / (4 * sms * clock) * 1e6:.2f}" if instructions and clock else "issueFloor_us=?")
            elif label.startswith("blk/SM"):
                limits = [value.get(f"launch__occupancy_limit_{k}", "?") for k in ("registers", "shared_mem", "warps", "blocks")]
                parts.append(f"{label}={'/'.join(limits)}")
            else:
                number = get(metric)
                parts.append(f"{label}={number * factor:.4g}" if number is not None else f"{label}=?")
        print("   " + " ".join(parts))
        stalls = sorted(((get(h) or 0.0, STALL.match(h).group(1)) for h in header if STALL.match(h) and "not_issued" not in h),
                        reverse=True)
        total = sum(s for s, _ in stalls) or 1.0
        print("   stalls (warp cycles per issued instruction): " + ", ".join(f"{n} {s:.2f} ({100 * s / total:.0f}%)" for s, n in stalls[:5]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--summarize")
    parser.add_argument("--jobs", help="job names file: written by --profile, read by --summarize")
    parser.add_argument("--json", help="--time: write the timings here")
    arguments = parser.parse_args()
    if arguments.count:
        print(count_jobs())
    if arguments.profile:
        profile(arguments.jobs)
    if arguments.time:
        time_all(arguments.json)
    if arguments.summarize:
        summarize(arguments.summarize, arguments.jobs)


if __name__ == "__main__":
    sys.exit(main())
