"""The ditops command: info, explain, check, bench, warmup; --version, progress, bad arguments."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import ditops
from conftest import TESTS
from ditops import cli, dispatch
from ditops.bench.cases import CASES
from ditops.ops import PUBLIC


def run(capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def run_both(capsys, *argv):
    code = cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_info_lists_backends_and_dispatch(capsys):
    code, out = run(capsys, "info")
    assert code == 0
    assert f"device: {dispatch.current_device()}" in out
    assert "reference  available" in out
    expected = "triton" if torch.cuda.is_available() else "reference"
    for op in dispatch.OPS:
        assert re.search(rf"^  {op} +\[[0-9, ]+\] -> {expected}$", out, re.MULTILINE), op


def test_info_on_a_simulated_amd_device_with_a_plugged_backend(capsys, toy_registry):
    code, out = run(capsys, "info", "--arch", "gfx942")
    assert code == 0
    assert "device: rocm gfx942 [simulated]" in out
    assert "fast       refused: runs on cuda, not rocm" in out  # available on GPUs; its constraints refuse rocm
    assert "amd        available" in out
    assert re.search(r"^  norm_scale_shift +\[1, 128, 3072\] -> amd$", out, re.MULTILINE), out
    assert re.search(r"^  rope_ +\[128, 32, 128\] -> reference$", out, re.MULTILINE), out


def test_info_refuses_a_backend_as_explain_does(capsys):
    """On sm_70 the cuda and triton backends import and call themselves available, but their
    registry constraints (min_sm 80) refuse every call: info says so in explain's words."""
    code, out = run(capsys, "info", "--arch", "sm_70")
    assert code == 0
    _, explained = run(capsys, "explain", "norm_scale_shift", "--arch", "sm_70")
    for backend in ("cuda", "triton"):
        assert re.search(rf"^  {backend} +refused: needs sm_80 or newer, got sm_70$", out, re.MULTILINE), out
        # explain adds what else refuses its example call
        assert re.search(rf"^  {backend} +refused: needs sm_80 or newer, got sm_70(, and .*)?$", explained, re.MULTILINE), explained
    assert re.search(r"^  reference +available$", out, re.MULTILINE)
    for op in dispatch.OPS:
        assert re.search(rf"^  {op} +\[[0-9, ]+\] -> reference$", out, re.MULTILINE), op
    code, out = run(capsys, "info", "--arch", "sm_90")
    assert code == 0
    assert re.search(r"^  triton +available$", out, re.MULTILINE) and re.search(r"^  cuda +available$", out, re.MULTILINE)


def test_info_calls_a_backend_disabled_for_every_op_refused(capsys, toy_registry):
    code, out = run(capsys, "info", "--arch", "gfx942")
    assert code == 0
    assert re.search(r"^  triton +refused: no op has an enabled implementation of it$", out, re.MULTILINE), out


CALL_PATHS = {  # (TRITON_INTERPRET, torch.version.hip) -> the Triton half of info's call-path line
    ("1", None): "triton's own launcher (TRITON_INTERPRET=1)",
    ("0", "6.2"): "triton's own launcher (ROCm torch: Triton's AMD backend specializes on buffer sizes)",
    ("0", None): "pre-bound (kernel_launch.bind)",
}


@pytest.mark.parametrize("interpret, hip", CALL_PATHS, ids=["interpreter", "rocm", "nvidia"])
def test_info_names_the_call_path(capsys, monkeypatch, interpret, hip):
    """From kernel_launch.bind's own test of whether it can pre-bind a launch."""
    from ditops.backends.triton import kernel_launch

    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    monkeypatch.setattr(torch.version, "hip", hip)
    code, out = run(capsys, "info")
    assert code == 0
    line = f"call path: python plans (cached per call signature); triton launches: {CALL_PATHS[interpret, hip]}"
    assert line in out.splitlines()
    assert (kernel_launch.bound_launch_refusal() is None) == ((interpret, hip) == ("0", None))


def test_explain(capsys, toy_registry):
    code, out = run(capsys, "explain", "norm_scale_shift", "--shape", "2,64,1004", "--arch", "sm_90")
    assert code == 0
    assert out.startswith("ditops.norm_scale_shift -> reference")
    assert "needs D to be a multiple of 8, got D=1004" in out


def test_explain_reports_bad_input_without_a_traceback(capsys):
    code = cli.main(["explain", "rope_", "--shape", "4,3,7"])
    assert code == 2
    assert "q has head size Dh=7" in capsys.readouterr().err


def test_check_prints_the_table_and_its_progress_on_stderr(capsys):
    code, out, err = run_both(capsys, "check", "--dtypes", "float32")
    assert code == 0
    assert "qk_norm_rope_" in out and " 0 fail " in out and " 1 fail " not in out
    backends, cases = len(cli.conformance.backends()), len(cli.conformance.CASES)
    assert f"{backends} backends x {cases} cases x 1 dtypes = {backends * cases} runs" in err
    assert re.search(r"^  \[ *\d+/\d+\] reference rope_: \d+ cases x 1 dtypes \(\d+ s in\)$", err, re.MULTILINE), err
    assert re.search(r"^check took \d+ s$", err, re.MULTILINE), err
    assert "check on" not in out  # progress stays off stdout


def test_quiet_check_prints_no_progress(capsys, monkeypatch):
    # One op's cases keep this short: the flag, not the suite, is under test.
    monkeypatch.setattr(cli.conformance, "CASES", [case for case in cli.conformance.CASES if case.op == "rope_"])
    code, out, err = run_both(capsys, "check", "-q", "--dtypes", "float32")
    assert code == 0 and "rope_" in out
    assert err == ""


def test_explain_with_a_gpu_name_shows_the_measured_preference(capsys):
    argv = ["explain", "residual_norm_scale_shift", "--shape", "1,64,5120", "--arch", "sm_90"]
    code, named = run(capsys, *argv, "--gpu-name", "H200")
    _, unnamed = run(capsys, *argv)
    assert code == 0
    assert "cuda sm_90 (H200) [simulated]" in named
    assert "preference: cuda goes first here, measured: ditops bench" in named
    assert "preference" not in unnamed


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"ditops {ditops.__version__}\n"


# Each bad argument: exit code 2, one line on stderr naming the problem, no traceback.
BAD_ARGUMENTS = {
    "rope shape of rank 2": (["explain", "rope_", "--shape", "4096,32"], "--shape: shape for rope_ must be q's T,H,Dh or B,S,H,Dh"),
    "norm shape of rank 1": (["explain", "norm_scale_shift", "--shape", "3072"], "must be x's B,S,D or S,D"),
    "negative size": (["explain", "rope_", "--shape", "4,-3,8"], "sizes >= 0"),
    "shape that is no shape": (["explain", "rope_", "--shape", "4,a"], "is not a shape like"),
    "odd head size (the op's own ValueError)": (["explain", "rope_", "--shape", "4,3,7"], "q has head size Dh=7"),
    "unknown op": (["explain", "nope"], "invalid choice: 'nope'"),
    "unknown dtype": (["explain", "rope_", "--dtype", "float128"], "'float128' is not a torch dtype"),
    "arch given to check": (["check", "--device", "sm_90"], "--device 'sm_90' is not a torch device"),
    "meta given to check": (["check", "--device", "meta"], "check computes values on cpu or cuda[:N], got 'meta'"),
    "dtype without tolerances": (["check", "--dtypes", "float64"], "conformance has tolerances for float32, float16, bfloat16, got float64"),
    "AMD arch given to warmup": (["warmup", "--arch", "gfx942"], "NVIDIA sm_80 and newer, got 'gfx942'"),
    "arch that is no arch": (["warmup", "--arch", "sm_xx"], "device arch 'sm_xx' is not one of"),
    "arch below the cuda backend's": (["warmup", "--arch", "sm_70"], "got 'sm_70'"),
    "zero compile threads": (["warmup", "--arch", "sm_90", "--jobs", "0"], "wanted a positive whole number, got '0'"),
    "arch that is no arch, for info": (["info", "--arch", "sm_9x"], "device arch 'sm_9x' is not one of"),
    "unknown op for bench": (["bench", "--ops", "nope"], "--ops: unknown op 'nope'"),
    "GPU name without an arch": (["explain", "rope_", "--gpu-name", "H200"], "--gpu-name names the GPU of --arch"),
    "no subcommand": ([], "required: command"),
}
if not torch.cuda.is_available():
    BAD_ARGUMENTS["cuda without a GPU"] = (["check", "--device", "cuda"], "no GPU here")
    BAD_ARGUMENTS["warmup without a GPU or --arch"] = (["warmup"], "name the arch to compile for, e.g. --arch sm_90")


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS)
def test_bad_arguments_end_in_one_line_and_exit_code_2(capsys, argv, message):
    try:
        code = cli.main(argv)
    except SystemExit as exit_:  # argparse's own checks exit from parse_args
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert captured.err.endswith("\n") and captured.err.count("\n") == 1, captured.err
    assert message in captured.err and "Traceback" not in captured.err


def test_bench_refuses_an_unwritable_output_folder_before_running(capsys, tmp_path, monkeypatch):
    from ditops import bench

    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("the benchmark ran before the folder was checked"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, out, err = run_both(capsys, "bench", "--output", str(blocker / "results"))
    assert code == 2 and out == ""
    assert err.startswith(f"ditops bench: --output: cannot write results to '{blocker / 'results'}'")


def _bench_error(capsys, *argv) -> str:
    """The one stderr line of a ditops bench call that must fail with exit code 2, printing nothing else."""
    code, out, err = run_both(capsys, "bench", *argv)
    assert code == 2 and out == ""
    assert err.endswith("\n") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.removesuffix("\n")


def test_bench_plot_from_a_path_without_results(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "rows.json").write_text('{"rows": [{"op": "rope_"}]}')
    (tmp_path / "table.csv").write_text("op,model\n")
    (tmp_path / "results").mkdir()
    wanted = "wanted a results .json file written by ditops bench"
    assert _bench_error(capsys, "--plot-from", "missing.json") == f"ditops bench: --plot-from: got 'missing.json', which does not exist; {wanted}"
    assert _bench_error(capsys, "--plot-from", "empty.json") == f"ditops bench: --plot-from: got 'empty.json', which has no 'rows' list; {wanted}"
    assert _bench_error(capsys, "--plot-from", "results") == f"ditops bench: --plot-from: got 'results', a folder; {wanted}"
    assert _bench_error(capsys, "--plot-from", "rows.json") == (
        f"ditops bench: --plot-from: got 'rows.json', whose rows[0] lacks model, shape, candidate; {wanted}")
    assert _bench_error(capsys, "--plot-from", "table.csv").startswith(
        "ditops bench: --plot-from: got 'table.csv', which is not JSON (Expecting value: line 1 column 1")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["empty.json", "results", "rows.json", "table.csv"]
    assert not any((tmp_path / "results").iterdir())


def test_bench_plot_from_a_results_file(capsys, tmp_path):
    row = dict(op="rope_", model="latency", shape="T1 H1 Dh64", candidate="eager", pct_copy=10.0)
    (tmp_path / "run.json").write_text(json.dumps(dict(device="CPU", copy_gbps=1.0, rows=[row])))
    code, out = run(capsys, "bench", "--plot-from", str(tmp_path / "run.json"))
    assert code == 0
    if importlib.util.find_spec("matplotlib"):
        assert out == f"wrote {tmp_path / 'run_rope_.png'}\n" and (tmp_path / "run_rope_.png").is_file()


BENCH_ERRORS = {  # argv -> the whole stderr line; each before any output and any file or folder
    "unknown backend": (["--backends", "eager", "triton_fast"],
                        "--backends: got 'triton_fast'; wanted some of auto, reference, cuda, rocm, triton, eager, torch.compile, liger, flashinfer"),
    "unknown op": (["--ops", "nope"], "--ops: unknown op 'nope'; the ops are " + ", ".join(dispatch.OPS)),
    "shape of no case": (["--shapes", "latency", "FLUX.3"], "--shapes: no case's model or shape contains 'FLUX.3'; the models are "
                         + ", ".join(dict.fromkeys(case.model for case in CASES))),
    "dtype without tolerances": (["--dtype", "float64"], "--dtype: results are checked with tolerances for float32, float16, bfloat16; got float64"),
    "filters that exclude each other": (["--ops", "rope", "--shapes", "LLM", "--quick"],
                                        "no case matches --ops rope --shapes LLM --quick together; each of them alone matches cases"),
}
if not torch.cuda.is_available():
    BENCH_ERRORS["backend refused here"] = (["--backends", "triton"], "--backends: triton can run nothing on cpu: Triton kernels run on "
                                            "NVIDIA and AMD GPUs (on CPU tensors: TRITON_INTERPRET=1 and a simulated device)")


@pytest.mark.parametrize("argv, message", BENCH_ERRORS.values(), ids=BENCH_ERRORS)
def test_bench_checks_its_filters_before_any_output(capsys, tmp_path, monkeypatch, argv, message):
    from ditops import bench

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "run_case", lambda *a, **k: pytest.fail("a case ran before the filters were checked"))
    assert _bench_error(capsys, *argv) == f"ditops bench: {message}"
    assert not any(tmp_path.iterdir())  # no ./benchmarks/results


def test_bench_that_fails_after_checking_its_output_leaves_no_folder(capsys, tmp_path, monkeypatch):
    from ditops import bench

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "run", lambda *a, **k: ([], {}, []))  # every candidate refused every case
    assert _bench_error(capsys, "--backends", "reference") == (
        "ditops bench: --backends: reference accepted none of the selected cases (ditops explain says why)")
    assert not any(tmp_path.iterdir())
    assert bench.prepare_output(tmp_path / "a" / "b") == tmp_path / "a" / "b"  # writable, proved without a trace
    assert not any(tmp_path.iterdir())


def test_bench_prints_the_table_before_writing_files(capsys, tmp_path, monkeypatch):
    from ditops import bench

    def failing_write(*arguments, **keywords):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "write", failing_write)
    code, out, err = run_both(capsys, "bench", "-q", "--quick", "--ops", "rope_", "--backends", "eager", "--output", str(tmp_path))
    assert code == 1
    assert "| rope_ |" in out  # the table is out, the results are not lost
    assert "could not write the files" in err and "No space left on device" in err
    assert "[ 1/" not in err  # -q: no progress lines


def test_bench_progress_counts_the_cases(capsys, tmp_path):
    code, out, err = run_both(capsys, "bench", "--quick", "--ops", "rope_", "--backends", "eager", "--output", str(tmp_path), "--no-plots")
    assert code == 0
    quick = [case for case in CASES if case.op == "rope_" and case.quick]
    for number in range(1, len(quick) + 1):
        assert f"[{number:2}/{len(quick)}] rope_" in err
    assert "wrote " in out


def test_explain_describes_a_huge_call_from_shapes_alone(capsys):
    """1e9 tokens x 3072 in bfloat16 is 6 TB: only meta tensors (no memory) can answer this."""
    code, out, err = run_both(capsys, "explain", "norm_scale_shift", "--shape", f"1,{10**9},3072", "--arch", "sm_90")
    assert code == 0, err
    assert out.startswith("ditops.norm_scale_shift -> triton")
    code, out, err = run_both(capsys, "explain", "rope_", "--shape", f"{10**9},32,128", "--arch", "gfx942")
    assert code == 0, err
    assert out.startswith("ditops.rope_ -> ")


def test_device_is_the_deprecated_spelling_of_arch(capsys):
    code, out, err = run_both(capsys, "explain", "rope_", "--shape", "64,4,80", "--device", "sm_90")
    assert code == 0
    assert "--device ARCH is deprecated here, use --arch sm_90" in err
    assert out.startswith("ditops.rope_ -> triton")
    assert "cuda sm_90 [simulated]" in out


def test_console_script_check_fails_on_a_broken_backend():
    environment = dict(os.environ, DITOPS_CONFIG=str(TESTS / "broken_registry.yaml"), PYTHONPATH=str(TESTS))
    result = subprocess.run(
        [sys.executable, "-m", "ditops.cli", "check", "--dtypes", "float32"], capture_output=True, text=True, env=environment
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "norm_scale_shift-hunyuan-chunked-mod [broken, float32]" in result.stdout
    assert "norm_scale_shift-hunyuan-chunked-mod [sloppy, float32]" in result.stdout


@pytest.mark.skipif(not any(os.access(os.path.join(p, "ditops"), os.X_OK) for p in os.environ["PATH"].split(os.pathsep)),
                    reason="the ditops console script is not on PATH (package not installed)")
def test_console_script_is_installed():
    result = subprocess.run(["ditops", "info"], capture_output=True, text=True)
    assert result.returncode == 0 and "reference  available" in result.stdout


README = TESTS.parent / "README.md"


def test_readme_explain_sample_is_the_real_output(capsys):
    """The README's `ditops explain` sample (after its `<!-- sample -->` marker) must be what the command prints."""
    text = README.read_text()
    marker = "<!-- sample: checked against the real output by tests/test_cli.py -->\n```console\n"
    assert marker in text
    block = text.split(marker, 1)[1].split("```", 1)[0]
    command, expected = block.split("\n", 1)
    assert command.startswith("$ ditops ")
    code, out = run(capsys, *command.removeprefix("$ ditops ").split())
    assert code == 0
    assert out == expected


@pytest.mark.parametrize("arch", [None, "sm_90", "gfx942"])
@pytest.mark.parametrize("op", sorted(PUBLIC))
def test_explain_says_each_line_once(capsys, op, arch):
    """A backend with several registry entries (cuda's Wan-14B rows and its general rows) that
    refuse a call for the same reason is listed once."""
    code, out = run(capsys, "explain", op, *(["--arch", arch] if arch else []))
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == len(set(lines)), out


@pytest.mark.parametrize("command", [["explain", "norm_scale_shift"], ["info"]], ids=lambda command: command[0])
def test_a_real_gpu_is_named_and_not_called_simulated(capsys, monkeypatch, command):
    """On a machine with a GPU, explain and info dispatch on meta tensors as if on that GPU:
    the label is the detected device's, without the "[simulated]" that --arch adds."""
    gpu = dispatch.DeviceInfo("cuda", "sm_90", "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dispatch, "current_device", lambda: gpu)
    code, out = run(capsys, *command)
    assert code == 0 and "cuda sm_90 (NVIDIA H100 80GB HBM3)" in out and "[simulated]" not in out, out
    code, out = run(capsys, *command, "--arch", "sm_90")
    assert code == 0 and "cuda sm_90 [simulated]" in out, out
