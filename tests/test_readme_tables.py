"""The benchmark tables of README.md and benchmarks/README.md are what the committed results
files generate (scripts/readme_tables.py)."""

import json

from conftest import script_module


def _script():
    return script_module("scripts/readme_tables.py")


def test_tables_match_the_committed_results():
    script = _script()
    assert script.main(["--check"]) == 0, (
        f"tables out of date: {script.stale()}; run python scripts/readme_tables.py")


def test_every_table_has_a_marker():
    script = _script()
    names = {match.group("name").strip() for path in script.DOCUMENTS
             for match in script.MARKER.finditer(path.read_text())}
    assert names == set(script.TABLES)


def test_a_changed_table_is_found(tmp_path):
    script = _script()
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- table: bench-headline H100 -->\nold\n<!-- end -->\noutro\n")
    assert [(path, names) for path, names in script.stale([readme])] == [(readme, ["bench-headline H100"])]
    regenerated = script.regenerate(readme.read_text())
    assert regenerated.startswith("intro\n<!-- table: bench-headline H100 -->\n**NVIDIA H100")
    assert regenerated.endswith("|\n<!-- end -->\noutro\n")
    readme.write_text(regenerated)
    assert script.stale([readme]) == []


def test_fp8_combine_keeps_a_static_launch_run_apart_and_its_sources(tmp_path):
    """benchmarks/fp8.py --combine: a run with Inductor's static launcher gives rows of their own
    (a process setting, not the model's), shown as such in the table; a combined file's sources
    are carried into the next combination."""
    fp8 = script_module("benchmarks/fp8.py")
    row = dict(model="flux", resolution="512", mode="compile", bf16_ms=10.0, torchao_ms=12.0, ditops_ms=8.0,
               rel_err_ditops=0.04, rel_err_torchao=0.04, compile_s_ditops=20.0, compile_s_torchao=200.0,
               weight_bytes_bf16=100, weight_bytes_ditops=53)
    combined = tmp_path / "old.json"
    combined.write_text(json.dumps(dict(device="GPU", rows=[dict(row, ditops_ms=16.0)], combined_from=["a", "b"])))
    static = tmp_path / "static.json"
    static.write_text(json.dumps(dict(device="GPU", static_launch_user_kernels=True, rows=[row])))
    merged = fp8.combine([combined, static])
    assert merged["combined_from"] == ["a", "b", str(static)] and "static_launch_user_kernels" not in merged
    default, launched = merged["rows"]
    assert (default["ditops_ms"], default["speedup_vs_bf16"], default["static_launch_user_kernels"]) == (16.0, 0.625, False)
    assert (launched["ditops_ms"], launched["speedup_vs_bf16"], launched["runs"]) == (8.0, 1.25, {
        way: str(static) for way in ("bf16", "torchao", "ditops")})
    path = tmp_path / "merged.json"
    path.write_text(json.dumps(merged))
    assert [line.split(" | ")[2] for line in fp8.table(path).splitlines()[2:]] == ["compile", "compile, static launch"]
