"""The ditops command: info, explain, check."""

import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import TESTS
from ditops import cli, dispatch


def run(capsys, *argv):
    code = cli.main(list(argv))
    return code, capsys.readouterr().out


def test_info_lists_backends_and_dispatch(capsys):
    code, out = run(capsys, "info")
    assert code == 0
    assert f"device: {dispatch.current_device()}" in out
    assert "reference  available" in out
    expected = "triton" if torch.cuda.is_available() else "reference"
    for op in dispatch.OPS:
        assert re.search(rf"^  {op} +\[[0-9, ]+\] -> {expected}$", out, re.MULTILINE), op


def test_info_on_a_simulated_amd_device_with_a_plugged_backend(capsys, toy_registry):
    code, out = run(capsys, "info", "--device", "gfx942")
    assert code == 0
    assert "device: rocm gfx942 [simulated]" in out
    assert "fast       available" in out  # available on GPUs; its constraints then refuse rocm
    assert "norm_scale_shift                  [1, 128, 3072] -> amd" in out
    assert "rope_                             [128, 32, 128] -> reference" in out


def test_explain(capsys, toy_registry):
    code, out = run(capsys, "explain", "norm_scale_shift", "--shape", "2,64,1004", "--device", "sm_90")
    assert code == 0
    assert out.startswith("ditops.norm_scale_shift -> reference")
    assert "needs D to be a multiple of 8, got D=1004" in out


def test_explain_reports_bad_input_without_a_traceback(capsys):
    code = cli.main(["explain", "rope_", "--shape", "4,3,7"])
    assert code == 2
    assert "q has head size Dh=7" in capsys.readouterr().err


def test_check_prints_the_table(capsys):
    code, out = run(capsys, "check", "--dtypes", "float32")
    assert code == 0
    assert "qk_norm_rope_" in out and " 0 fail " in out and " 1 fail " not in out


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
