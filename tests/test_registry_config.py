"""User config files (ditops.dispatch.registry): the schema is checked at load, so a typo
fails naming the file and the field; a file that would hang the process (alias bombs, huge
or deeply nested files) is refused at once; a backend module that is not a ditops backend is
refused by name. CPU only."""

import json
import subprocess
import sys
import textwrap
import time

import pytest

import ditops
from ditops import dispatch
from ditops.dispatch import registry
from ditops.examples import example_arguments


def write(tmp_path, text, name="mine.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def order(op="rope_"):
    return [implementation.name for implementation in dispatch.dispatcher().implementations[op]]


def refuses(path, *fragments):
    """load_config(path) raises a ValueError naming the file and every fragment, quickly, in a
    short message, and leaves the registry as it was."""
    before = {op: order(op) for op in registry.OPS}
    start = time.perf_counter()
    with pytest.raises(ValueError) as raised:
        dispatch.load_config(path)
    assert time.perf_counter() - start < 10, "refusing a config must not take long"
    message = str(raised.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    assert len(message) < 1500, "a message must not hold a whole field"
    assert {op: order(op) for op in registry.OPS} == before
    return message


def bomb(levels=9):
    """A YAML flow sequence whose aliases expand to 9**(levels + 1) strings (the billion laughs)."""
    text = "&l0 [" + ", ".join(["lol"] * 9) + "]"
    for level in range(1, levels + 1):
        text = f"&l{level} [{text}, " + ", ".join([f"*l{level - 1}"] * 8) + "]"
    return text


@pytest.fixture
def backend_module(tmp_path, monkeypatch):
    """Writes a Python module on sys.path for a test backend; returns its name."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def make(source):
        name = f"ditops_test_backend_{len(written)}_{tmp_path.name}".replace("-", "_")
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield make
    for name in written:
        sys.modules.pop(name, None)


# Typos must raise, naming the file and the field.


@pytest.mark.parametrize(
    "text, fragments",
    [
        ("prefer: [nosuchbackend]\n", ["prefer[0]", "'nosuchbackend' is not defined"]),
        ("prefer: reference\n", ["prefer", "got str 'reference', wanted a list"]),
        ("disable: [nosuchbackend]\n", ["disable[0]", "'nosuchbackend' is not defined"]),
        ("disable: reference\n", ["disable", "got str 'reference', wanted a list"]),
        ("disable: [rope_=nosuchbackend]\n", ["disable[0]", "'nosuchbackend' is not defined"]),
        ("disable: [nosuchop=triton]\n", ["disable[0]", "unknown op 'nosuchop'"]),
        ("disable: [[triton]]\n", ["disable[0]", "wanted 'backend' or 'op=backend'"]),
        ("ops:\n  rope_: triton\n", ["ops.rope_", "got str 'triton', wanted a list"]),
        ("ops:\n  rope_: [nosuchbackend]\n", ["ops.rope_[0]", "'nosuchbackend' is not defined"]),
        ("ops:\n  rope_: [{backend: triton, function: 3}]\n", ["ops.rope_[0].function", "got 3"]),
        ("ops:\n  rope_: [{backend: triton, max_head_size: '256'}]\n", ["ops.rope_[0]", "constraint max_head_size: got '256'"]),
        ("ops:\n  rope_: [{backend: triton, layouts: neox}]\n", ["ops.rope_[0]", "constraint layouts: got 'neox'"]),
        ("ops:\n  rope_: [{backend: triton, unit_stride: 1}]\n", ["constraint unit_stride: got 1, wanted true or false"]),
        ("ops:\n  rope_: [{backend: triton, head_sizes: [64, true]}]\n", ["constraint head_sizes"]),
        ("ops:\n  rope_: [{backend: triton, norms: [layer, batch]}]\n", ["constraint norms"]),
        ("ops:\n  rope_: [7]\n", ["ops.rope_[0]", "got 7, wanted a backend name"]),
        ("ops:\n  7: [reference]\n", ["ops: the key 7", "wanted a string"]),
        ("ops:\n  nosuchop: [reference]\n", ["ops: unknown op 'nosuchop'"]),
        ("ops: [reference]\n", ["ops", "got list"]),
        ("- reference\n", ["the document", "got list"]),
        ("7: x\n", ["unknown top-level keys [7]"]),
        ("fp8_formats:\n  sm89: [float8_e4m3fn]\n", ["fp8_formats.sm89", "wanted sm_<number> or an AMD gfx arch"]),
        ("fp8_formats:\n  sm_89: [float16]\n", ["fp8_formats.sm_89", "wanted FP8 torch dtype names"]),
        ("fp8_formats:\n  gfx942: float8_e4m3fnuz\n", ["fp8_formats.gfx942", "wanted a list of FP8 dtype names"]),
        ("backends:\n  mine: {module: os, constraints: {devices: cuda}}\n", ["backends.mine.constraints", "constraint devices: got 'cuda'"]),
        ("backends:\n  mine: {module: os, constraints: [devices]}\n", ["backends.mine.constraints", "got list"]),
        ("backends:\n  mine: {module: os, description: [a]}\n", ["backends.mine.description", "got list"]),
        ("backends:\n  mine: {module: 'os; rm -rf'}\n", ["backends.mine.module", "wanted a dotted Python module name"]),
        ("backends:\n  mine: {module: .relative}\n", ["backends.mine.module"]),
        ("backends:\n  mine: {module: os, available: 'a b'}\n", ["backends.mine.available"]),
        ("backends:\n  3: {module: os}\n", ["backends: the name 3"]),
        ("backends:\n  [a]: {module: os}\n", ["cannot read ditops config", "unhashable key"]),
        ("backends:\n  mine: os\n", ["backend 'mine' needs 'module'"]),
    ],
)
def test_a_typo_raises_naming_file_and_field(tmp_path, text, fragments):
    refuses(write(tmp_path, text), *fragments)


def test_backend_module_that_cannot_be_imported_is_refused_at_load(tmp_path):
    path = write(tmp_path, "backends:\n  mine: {module: no_such_pkg_xyz.kernels}\nops:\n  rope_: [mine]\n")
    refuses(path, "backend 'mine'", "cannot import no_such_pkg_xyz.kernels: ModuleNotFoundError")


def test_module_that_is_not_a_ditops_backend_is_refused_by_name(tmp_path):
    refuses(write(tmp_path, "backends:\n  mine: {module: os}\n"), "module os", "not a ditops backend")
    refuses(write(tmp_path, "backends:\n  mine: {module: os}\nops:\n  rope_: [mine]\n"), "module os", "no function 'rope_'")
    refuses(write(tmp_path, "backends:\n  mine: {module: os, available: getcwd}\nops:\n  rope_: [{backend: mine, function: getcwd}]\n"),
            "os.getcwd must be a function of the DeviceInfo")


def test_module_lacking_a_named_function_is_refused(tmp_path, backend_module):
    name = backend_module("def rope_(*arguments):\n    pass\n")
    path = write(tmp_path, f"backends:\n  mine: {{module: {name}}}\nops:\n  rope_: [mine]\n  norm_scale_shift: [mine]\n")
    refuses(path, f"module {name}", "ops.norm_scale_shift", "no function 'norm_scale_shift'")


def test_a_valid_user_backend_loads_and_serves(tmp_path, backend_module):
    name = backend_module(
        """
        from ditops.backends import reference
        CALLS = []

        def available(device):
            return None

        def rope_(*arguments):
            CALLS.append("rope_")
            return reference.rope_(*arguments)
        """
    )
    # A small file may use aliases, as the built-in registry does.
    path = write(tmp_path, f"backends:\n  mine: {{module: {name}, available: available}}\nprefer: &first [mine]\nops:\n  rope_: *first\n")
    dispatch.load_config(path)
    assert order()[0] == "mine"
    ditops.rope_(**example_arguments("rope_", (4, 2, 64)))
    assert sys.modules[name].CALLS == ["rope_"]


@pytest.mark.parametrize(
    "source, reason",
    [
        ("def available(device):\n    raise RuntimeError('no driver')\n", "raised RuntimeError: no driver"),
        ("def available(device):\n    return 42\n", "returned 42; wanted None or a reason string"),
    ],
)
def test_a_broken_availability_check_makes_the_backend_unavailable_with_the_reason(tmp_path, backend_module, source, reason):
    name = backend_module(source + "from ditops.backends.reference import rope_\n")
    dispatch.load_config(write(tmp_path, f"backends:\n  mine: {{module: {name}, available: available}}\nops:\n  rope_: [mine]\n"))
    arguments = example_arguments("rope_", (4, 2, 64))
    explanation = str(ditops.explain("rope_", **arguments))
    assert reason in explanation and f"{name}.available" in explanation
    ditops.rope_(**arguments)  # the reference serves
    with pytest.raises(ditops.BackendUnavailable, match=reason):
        ditops.rope_(**example_arguments("rope_", (4, 2, 64)), backend="mine")


# Files that would hang or exhaust the process are refused at once.


@pytest.mark.parametrize(
    "text",
    [
        f"ops:\n  rope_: [{bomb()}]\n",
        f"backends:\n  mine:\n    module: os\n    description: {bomb()}\n",
        f"prefer: {bomb()}\n",
        f"x: {bomb()}\n",  # under an unknown key too: nothing walks the document before the cap
        "ops:\n  rope_: &a [reference, *a]\n",  # an alias inside itself
    ],
    ids=["ops", "description", "prefer", "unknown-key", "recursive"],
)
def test_alias_bomb_is_refused_at_once(tmp_path, text):
    refuses(write(tmp_path, text), "aliases expand to more than")


def test_oversized_and_deeply_nested_files_are_refused(tmp_path):
    refuses(write(tmp_path, "# " + "x" * registry.MAX_CONFIG_BYTES + "\n"), "larger than")
    refuses(write(tmp_path, "ops: " + "[" * 100_000 + "]" * 100_000 + "\n"), "cannot read ditops config")
    refuses(write(tmp_path, "ops: {rope_: [reference\n"), "cannot read ditops config")
    refuses(write(tmp_path, "backends:\n  " + "b" * 1000 + ": {module: os}\n"), "backends: the name")


def test_expanded_size_counts_shared_nodes_once_per_use():
    loader = __import__("yaml").SafeLoader("a: &x [1, 2]\nb: [*x, *x]\n")
    node = loader.get_single_node()
    # mapping + 2 keys + [1, 2] (3 nodes) + [*x, *x] (1 + 2 * 3 nodes)
    assert registry._expanded_size(node, 1000) == 1 + 2 + 3 + 7
    assert registry._expanded_size(node, 5) > 5


def test_the_built_in_registry_uses_aliases_and_loads():
    text = registry.BUILTIN_REGISTRY.read_text()
    assert "*rocm_rows" in text
    assert order("norm_scale_shift")[-1] == "reference"


def test_every_call_reports_a_bad_environment_config(tmp_path):
    """DITOPS_CONFIG with an alias bomb: the first call fails quickly with the config error."""
    path = write(tmp_path, f"ops:\n  rope_: [{bomb()}]\n")
    script = (
        "import ditops\n"
        "from ditops.examples import example_arguments\n"
        "for _ in range(2):\n"
        "    try:\n"
        "        ditops.rope_(**example_arguments('rope_', (4, 2, 64)))\n"
        "    except ValueError as error:\n"
        "        print('ValueError:', error)\n"
    )
    environment = {"DITOPS_CONFIG": str(path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environment)
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and all(str(path) in line and "aliases expand" in line for line in lines), result.stdout + result.stderr


# The built-in registry's measured preferences cite rows of committed bench files.

REPOSITORY = registry.BUILTIN_REGISTRY.parents[2]


def cited_rows():
    rules = registry.read_config(registry.BUILTIN_REGISTRY)["preferences"]
    return [(op, rule["backend"], row) for op, op_rules in rules.items() for rule in op_rules for row in rule["evidence"]]


@pytest.mark.skipif(not (REPOSITORY / "benchmarks" / "results").is_dir(), reason="not a source checkout: no committed results")
@pytest.mark.parametrize("op, backend, row", cited_rows(), ids=lambda value: value if isinstance(value, str) else None)
def test_every_preference_cites_committed_rows_where_its_backend_is_fastest(op, backend, row):
    path = REPOSITORY / row["file"]
    assert path.is_file(), f"{row['file']} is not a committed file"
    times = {
        found["candidate"]: found["us"]
        for found in json.loads(path.read_text())["rows"]
        if (found["op"], found["model"], found["shape"], found["dtype"]) == (op, row["model"], row["shape"], row["dtype"])
        and found.get("us")
    }
    missing = [name for name in row["backends"] if name not in times]
    assert not missing, f"{row['file']} times no {', '.join(missing)} on {op} {row['model']} {row['shape']} {row['dtype']}"
    fastest = min(row["backends"], key=lambda name: times[name])
    assert fastest == backend, f"{row['file']}: {op} {row['model']} {row['shape']}: {times}"


def test_explain_cites_the_preferences_rows():
    preference = dispatch.dispatcher().registry.preferences["rope_"][0]
    text = str(preference)
    assert text.startswith("cuda goes first here, measured: ditops bench benchmarks/results/")
    for row in preference.evidence:
        assert f"{row.file}: {row.model} {row.shape} {row.dtype} (cuda vs triton)" in text


def test_a_config_file_may_give_a_device_its_fp8_formats(tmp_path):
    import torch

    from ditops.dispatch import DeviceInfo, fp8_dtypes, load_config, reset

    gfx1201 = DeviceInfo("rocm", "gfx1201")
    assert fp8_dtypes(gfx1201) == ()
    try:
        load_config(write(tmp_path, "fp8_formats:\n  gfx1201: [float8_e4m3fn]\n"))
        assert fp8_dtypes(gfx1201) == (torch.float8_e4m3fn,)
        assert fp8_dtypes(DeviceInfo("cuda", "sm_90")) == (torch.float8_e4m3fn,)  # the built-in entries stay
        assert fp8_dtypes(DeviceInfo("cuda", "sm_86")) == ()
    finally:
        reset()
