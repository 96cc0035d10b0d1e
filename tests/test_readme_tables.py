"""The benchmark tables of README.md and benchmarks/README.md are what the committed results
files generate (scripts/readme_tables.py)."""

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
