"""Benchmark output: the printed table, JSON and CSV files, and PNG bar charts."""

from __future__ import annotations

import csv
import json
import re
from collections import defaultdict
from pathlib import Path

COLUMNS = (
    "op",
    "model",
    "shape",
    "dtype",
    "candidate",
    "auto_backend",
    "us",
    "spread_pct",
    "eager_us",
    "same_size_copy_us",
    "bytes",
    "gbps",
    "pct_copy",
    "pct_same_size_copy",
    "speedup_vs_eager",
    "speedup_vs_compile",
    "correct",
    "max_error",
    "note",
)


def add_derived(rows: list, copy_gbps: float) -> None:
    """Fills gbps, pct_copy, pct_same_size_copy and the speedups against eager and torch.compile
    of the same case."""
    by_case = defaultdict(dict)
    for row in rows:
        if row.get("us"):
            by_case[(row["op"], row["model"], row["shape"], row["dtype"])][row["candidate"]] = row["us"]
    for row in rows:
        if not row.get("us"):
            continue
        row["gbps"] = row["bytes"] / (row["us"] * 1e3)
        row["pct_copy"] = 100 * row["gbps"] / copy_gbps
        row["pct_same_size_copy"] = 100 * row["same_size_copy_us"] / row["us"]
        times = by_case[(row["op"], row["model"], row["shape"], row["dtype"])]
        row["speedup_vs_eager"] = times["eager"] / row["us"] if "eager" in times else None
        row["speedup_vs_compile"] = times["torch.compile"] / row["us"] if "torch.compile" in times else None


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def summary(rows: list) -> str:
    """A markdown table with one line per case: the us of a copy of the same bytes, then one
    column per candidate: "us (% of copy)"; the auto cell is followed by the backend the
    dispatcher picked."""
    columns = ["same-size copy"] + list(dict.fromkeys(row["candidate"] for row in rows))
    cases = defaultdict(dict)
    for row in rows:
        cases[(row["op"], row["model"], row["shape"], row["dtype"])]["same-size copy"] = _cell(row["same_size_copy_us"])
        cell = "-"
        if row.get("us"):
            cell = f"{_cell(row['us'])} ({row['pct_copy']:.0f}%)"
            if row["candidate"] == "auto":
                cell += f" {row['auto_backend']}"  # the pick varies by case: the column header cannot name it
            cell += "" if row.get("correct", True) else " WRONG"
        elif row.get("note", "").startswith("failed"):
            cell = "failed"
        cases[(row["op"], row["model"], row["shape"], row["dtype"])][row["candidate"]] = cell
    lines = ["| op | model | shape | dtype | " + " | ".join(columns) + " |", "|" + "---|" * (4 + len(columns))]
    for case, cells in cases.items():
        lines.append("| " + " | ".join(case) + " | " + " | ".join(cells.get(name, "-") for name in columns) + " |")
    return "\n".join(lines)


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")


def write(rows: list, metadata: dict, directory: Path, stem: str, plots: bool = True) -> list:
    """Writes ``stem``.json, ``stem``.csv and one PNG per op; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = directory / f"{stem}.json", directory / f"{stem}.csv"
    json_path.write_text(json.dumps(dict(metadata, rows=rows), indent=1) + "\n")
    with csv_path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    paths = [json_path, csv_path]
    if plots:
        paths += plot(rows, metadata, directory, stem)
    return paths


PLOTTED_KEYS = ("op", "model", "shape", "candidate")  # what plot reads of a row besides pct_copy


def plot_file(path) -> list:
    """Draws the charts of a saved results file beside it (the GPU machine returns few files,
    so charts are drawn where the results are committed). A path that holds no results file
    is a ValueError saying what it holds, checked before anything is drawn."""
    path = Path(path)
    wanted = "wanted a results .json file written by ditops bench"
    if path.is_dir():
        raise ValueError(f"got {str(path)!r}, a folder; {wanted}")
    try:
        document = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"got {str(path)!r}, which does not exist; {wanted}") from None
    except OSError as error:
        raise ValueError(f"got {str(path)!r}, which cannot be read ({error.strerror or error}); {wanted}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"got {str(path)!r}, which is not JSON ({error}); {wanted}") from None
    rows = document.get("rows") if isinstance(document, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"got {str(path)!r}, which has no 'rows' list; {wanted}")
    for number, row in enumerate(rows):
        missing = [key for key in PLOTTED_KEYS if key not in row] if isinstance(row, dict) else list(PLOTTED_KEYS)
        if missing:
            raise ValueError(f"got {str(path)!r}, whose rows[{number}] lacks {', '.join(missing)}; {wanted}")
    return plot(rows, document, path.parent, path.stem)


def plot(rows: list, metadata: dict, directory: Path, stem: str) -> list:
    """One PNG per op: percent of copy bandwidth per shape, one bar per candidate (needs the [bench] extra)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'ditops[bench]'): no charts written")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    by_op = defaultdict(list)
    for row in rows:
        if row.get("pct_copy") is not None:
            by_op[row["op"]].append(row)
    for op, op_rows in by_op.items():
        cases = list(dict.fromkeys((row["model"], row["shape"]) for row in op_rows))
        candidates = list(dict.fromkeys(row["candidate"] for row in op_rows))
        width = 0.8 / len(candidates)
        figure, axes = plt.subplots(figsize=(max(6, 2.0 * len(cases)), 4.2))
        for index, candidate in enumerate(candidates):
            values = {(row["model"], row["shape"]): row["pct_copy"] for row in op_rows if row["candidate"] == candidate}
            positions = [case_index + index * width for case_index in range(len(cases))]
            axes.bar(positions, [values.get(case, 0) for case in cases], width, label=candidate)
        axes.set_xticks([case_index + 0.4 - width / 2 for case_index in range(len(cases))])
        axes.set_xticklabels([f"{model}\n{shape}" for model, shape in cases], fontsize=7)
        axes.set_ylabel("% of copy bandwidth")
        axes.set_title(f"{op} on {metadata.get('device', '?')} ({metadata.get('copy_gbps', 0):.0f} GB/s copy)", fontsize=9)
        axes.legend(fontsize=7)
        figure.tight_layout()
        path = directory / f"{stem}_{op}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths

