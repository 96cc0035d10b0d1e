"""Regenerate the benchmark tables of README.md and benchmarks/README.md from the committed results.

A table sits between ``<!-- table: NAME -->`` and ``<!-- end -->``; NAME picks its generator in
``TABLES``. The tables come from the files in ``benchmarks/results/`` through the benchmarks'
own table functions (``ditops.bench.report.summary``, ``benchmarks/models.py``'s and
``benchmarks/multigpu.py``'s ``table``); the README's headline tables are a few rows of the
``ditops bench`` files.

Usage: python scripts/readme_tables.py           # rewrite the tables in place
       python scripts/readme_tables.py --check   # exit 1, naming the tables, if a file differs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCUMENTS = (ROOT / "README.md", ROOT / "benchmarks" / "README.md")

BENCH = {"H100": RESULTS / "NVIDIA-H100-80GB-HBM3_2026-11-26.json", "H200": RESULTS / "NVIDIA-H200_2026-11-26.json"}
# A GPU's model rows may come from several runs (files); a model's rows come from one of them.
MODELS = {"H100": (RESULTS / "models_H100_2026-11-27.json",),
          "H200": (RESULTS / "models_H200_2026-11-29.json", RESULTS / "models_H200_2026-11-28.json")}
MULTIGPU = {"H100x2": RESULTS / "multigpu_H100x2_2026-11-25.json", "H200x2": RESULTS / "multigpu_H200x2_2026-11-28.json"}
# the FP8 ops' and qk_norm_rope_'s `ditops bench --ops` runs
BENCH_FP8 = {"H100": RESULTS / "NVIDIA-H100-80GB-HBM3_2026-11-28.json", "H200": RESULTS / "NVIDIA-H200_2026-11-28.json"}
FP8 = {"H100": RESULTS / "fp8_H100_2026-11-28.json", "H200": RESULTS / "fp8_H200_2026-11-29.json"}

# The README's headline rows: per op, one model shape (the `model` of a bench case).
HEADLINE = (
    ("norm_scale_shift", "affine LayerNorm at Qwen-Image 1024px"),
    ("residual_norm_scale_shift", "Wan2.1-14B 720p"),
    ("norm_scale_shift_select", "affine LayerNorm at Qwen-Image-Edit 1024px"),
    ("residual_norm_scale_shift_select", "affine LayerNorm at Qwen-Image-Edit 1024px"),
    ("add_gate_norm", "Z-Image-Turbo 1024px"),
    ("add_gate_norm_scale", "Z-Image-Turbo 1024px"),
    ("qk_norm_rope_", "FLUX.1-dev 1024px"),
    ("rope_", "LLM GQA NeoX"),
)
HEADLINE_MODES = ("eager", "compile")  # the README's model-level rows (every mode: benchmarks/README.md)

MARKER = re.compile(r"(<!-- table: (?P<name>[^>]+?) -->\n)(?P<body>.*?)(<!-- end -->)", re.DOTALL)


@cache
def _benchmark_module(name: str):
    """benchmarks/<name>.py as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_ditops_benchmarks_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _relative(path: Path) -> str:
    """path from the repository root (as the documents cite it), or as given outside it."""
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def _bench_caption(path: Path) -> str:
    document = json.loads(path.read_text())
    return (f"{document['device']}, torch {document['torch']}, triton {document['triton']}, "
            f"{document['date']}; copy {document['copy_gbps']:.0f} GB/s (`{_relative(path)}`)")


def bench_full(path: Path) -> str:
    """Every case of one `ditops bench` file, as `ditops bench` prints it."""
    from ditops.bench.report import summary

    return f"**{_bench_caption(path)}**\n\n" + summary(json.loads(path.read_text())["rows"])


def bench_headline(gpu: str) -> str:
    """A few cases of one `ditops bench` file: auto's time, its share of a same-size copy's
    speed and its backend, against torch.compile and Liger (us per call, bf16)."""
    path = BENCH[gpu]
    rows = json.loads(path.read_text())["rows"]
    by_case = {}
    for row in rows:
        by_case.setdefault((row["op"], row["model"]), {})[row["candidate"]] = row
    lines = [f"**{_bench_caption(path)}**", "",
             "| op | model | shape | auto (us) | % of a same-size copy | backend | torch.compile (us) | Liger (us) |",
             "|---|---|---|---|---|---|---|---|"]
    for op, model in HEADLINE:
        candidates = by_case[(op, model)]
        auto = candidates["auto"]

        def time_of(name):
            row = candidates.get(name)
            return f"{row['us']:.1f}" if row and row.get("us") else "-"

        lines.append(f"| `{op}` | {model} | {auto['shape']} | {auto['us']:.1f} | "
                     f"{auto['pct_same_size_copy']:.0f}% | {auto['auto_backend']} | "
                     f"{time_of('torch.compile')} | {time_of('liger')} |")
    return "\n".join(lines)


def _models_caption(path: Path) -> str:
    document = json.loads(path.read_text())
    return f"{document['device']}, torch {document['torch']}, {document['date']} (`{_relative(path)}`)"


def models_full(gpu: str) -> str:
    """Every row of one GPU's `benchmarks/models.py` files, as `models.py --table` prints them."""
    return "\n\n".join(f"**{_models_caption(path)}**\n\n" + _benchmark_module("models").table(path)
                       for path in MODELS[gpu])


def models_headline() -> str:
    """Both GPUs' `benchmarks/models.py` files side by side, a row per model and resolution, a
    column per GPU and HEADLINE_MODES mode: diffusers -> ditops ms per forward (speedup)."""
    rows = {gpu: [row for path in paths for row in json.loads(path.read_text())["rows"]] for gpu, paths in MODELS.items()}
    captions = "; ".join(_models_caption(path) for paths in MODELS.values() for path in paths)
    columns = [(gpu, mode) for gpu in rows for mode in HEADLINE_MODES]
    header = "| model | resolution | " + " | ".join(f"{gpu} {mode} (ms)" for gpu, mode in columns) + " |"
    lines = [f"**{captions}**", "", header, "|---|---|" + "---|" * len(columns)]
    keyed = {gpu: {(row["model"], row["resolution"], row["mode"]): row for row in gpu_rows} for gpu, gpu_rows in rows.items()}
    for model, resolution in dict.fromkeys((row["model"], row["resolution"]) for row in next(iter(rows.values()))):
        cells = []
        for gpu, mode in columns:
            row = keyed[gpu].get((model, resolution, mode))
            cells.append("-" if row is None else f"{row['baseline_ms']:.2f} -> {row['ditops_ms']:.2f} ({row['speedup']:.2f}x)")
        lines.append(f"| {model} | {resolution} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fp8_caption(path: Path) -> str:
    document = json.loads(path.read_text())
    return f"{document['device']}, torch {document['torch']}, torchao {document['torchao']}, {document['date']} (`{_relative(path)}`)"


def fp8_full(gpu: str) -> str:
    """One GPU's `benchmarks/fp8.py` file, as `fp8.py --table` prints it."""
    return f"**{_fp8_caption(FP8[gpu])}**\n\n" + _benchmark_module("fp8").table(FP8[gpu])


def fp8_headline() -> str:
    """Both GPUs' `benchmarks/fp8.py` files side by side, a row per model, resolution and mode:
    ditops FP8 ms per forward and its speedup over diffusers bf16 and torchao FP8 in that mode,
    the larger of the GPUs' ratios of ditops' rel_err to torchao's, and the weights' bytes
    against bf16 as built and, where measured, at the released model's depth (the same blocks on
    both GPUs; the row with full depth preferred)."""
    fp8 = _benchmark_module("fp8")
    documents = {gpu: json.loads(path.read_text()) for gpu, path in FP8.items()}
    keyed = {gpu: {(row["model"], row["resolution"], fp8.mode_shown(row)): row for row in document["rows"]}
             for gpu, document in documents.items()}
    lines = ["**" + "; ".join(_fp8_caption(path) for path in FP8.values()) + "**", "",
             "| model | resolution | mode | " + " | ".join(f"{gpu}: ditops FP8 ms (vs bf16, vs torchao)" for gpu in FP8)
             + " | rel_err ditops / torchao (worst GPU) | weights vs bf16, as built (full depth) |",
             "|---|---|---|" + "---|" * len(FP8) + "---|---|"]

    def ratio(value) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for key in dict.fromkeys(key for rows in keyed.values() for key in rows):
        rows = [keyed[gpu].get(key) for gpu in FP8]
        cells = ["-" if row is None else
                 f"{row['ditops_ms']:.2f} ({ratio(row['speedup_vs_bf16'])}, {ratio(row['speedup_vs_torchao'])})"
                 for row in rows]
        present = [row for row in rows if row is not None]
        errors = [row["rel_err_ditops"] / row["rel_err_torchao"] for row in present if row.get("rel_err_torchao")]
        error = f"{max(errors):.2f}" if errors else "-"
        weights = fp8.weights(max(present, key=lambda row: "weight_bytes_full_depth_ditops" in row))
        lines.append(f"| {' | '.join(key)} | " + " | ".join(cells) + f" | {error} | {weights} |")
    return "\n".join(lines)


def multigpu_full(gpus: str) -> str:
    """A `benchmarks/multigpu.py` file, as `multigpu.py --table` prints it."""
    path = MULTIGPU[gpus]
    document = json.loads(path.read_text())
    return (f"**{document['device']}, {document['date']} (`{_relative(path)}`)**\n\n"
            + _benchmark_module("multigpu").table(path))


TABLES = {
    "bench-headline H100": lambda: bench_headline("H100"),
    "bench-headline H200": lambda: bench_headline("H200"),
    "models-headline": models_headline,
    "bench H100": lambda: bench_full(BENCH["H100"]),
    "bench H200": lambda: bench_full(BENCH["H200"]),
    "bench-fp8 H100": lambda: bench_full(BENCH_FP8["H100"]),
    "bench-fp8 H200": lambda: bench_full(BENCH_FP8["H200"]),
    "fp8-headline": fp8_headline,
    "fp8 H100": lambda: fp8_full("H100"),
    "fp8 H200": lambda: fp8_full("H200"),
    "models H100": lambda: models_full("H100"),
    "models H200": lambda: models_full("H200"),
    "multigpu H100x2": lambda: multigpu_full("H100x2"),
    "multigpu H200x2": lambda: multigpu_full("H200x2"),
}


def regenerate(text: str, where: str = "") -> str:
    """text with the body of every table marker replaced by its generated table."""

    def body(match):
        name = match.group("name").strip()
        if name not in TABLES:
            raise ValueError(f"{where}: unknown table {name!r} (known: {', '.join(TABLES)})")
        return match.group(1) + TABLES[name]() + "\n" + match.group(4)

    return MARKER.sub(body, text)


def stale(documents=DOCUMENTS) -> list:
    """(path, table names) of each document whose tables differ from what the files generate."""
    found = []
    for path in documents:
        text = path.read_text()
        new = regenerate(text, _relative(path))
        if new != text:
            old_bodies = {m.group("name").strip(): m.group("body") for m in MARKER.finditer(text)}
            new_bodies = {m.group("name").strip(): m.group("body") for m in MARKER.finditer(new)}
            found.append((path, [name for name in new_bodies if old_bodies.get(name) != new_bodies[name]]))
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs")
    options = parser.parse_args(argv)
    differing = stale()
    if options.check:
        for path, names in differing:
            print(f"{_relative(path)}: tables out of date: {', '.join(names)} "
                  f"(run python scripts/readme_tables.py)", file=sys.stderr)
        return 1 if differing else 0
    for path, names in differing:
        path.write_text(regenerate(path.read_text(), _relative(path)))
        print(f"{_relative(path)}: rewrote {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
