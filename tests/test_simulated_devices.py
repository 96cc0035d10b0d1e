"""A device simulated by name (``simulated_device("gfx942")``, the CPU recipe with
TRITON_INTERPRET=1) runs its calls here on CPU tensors: the backends that launch through a GPU
driver (cuda, rocm: registry.yaml ``needs_real_device``) refuse it with the reason, and Triton's
interpreter serves. On a machine with ROCm libraries and no AMD GPU (CI: Debian's ROCm 5.2),
reaching rocm there killed the process (gfx942) or failed the call (gfx90a). The rocm backend
also refuses an arch its ROCm release's hiprtc does not know (registry.yaml ``min_rocm``)."""

import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import ditops
from ditops import dispatch
from ditops.dispatch import constraints
from ditops.examples import example_arguments
from ditops.opspec import SPECS

ROCM_REFUSAL = dispatch.dispatcher().registry.backends["rocm"].refusal(dispatch.parse_arch("gfx90a"))


def shape_of(op):
    return (8, 4, 64) if op.endswith("_") else (2, 8, 64)


def rocm_here():
    if ROCM_REFUSAL:
        if os.environ.get("DITOPS_REQUIRE_ROCM_TOOLS") == "1":
            pytest.fail(f"the rocm backend must be available on a machine that requires the ROCm tools: {ROCM_REFUSAL}")
        pytest.skip(f"rocm backend unavailable here: {ROCM_REFUSAL}")


# In a child process: a call that reaches the HIP runtime without a GPU may kill the process.
RUN_EVERY_OP = textwrap.dedent("""
    import json, sys, torch, ditops
    from ditops import dispatch
    from ditops.examples import example_arguments
    from ditops.opspec import SPECS
    results = []
    with dispatch.simulated_device(sys.argv[1]):
        for op in (op for op in dispatch.OPS if not SPECS[op].quantized):  # FP8: the interpreter converts wrongly (tests/conformance)
            shape = (8, 4, 64) if op.endswith("_") else (2, 8, 64)
            for dtype, param_dtype in ((torch.bfloat16, torch.float32), (torch.float32, None)):
                arguments = example_arguments(op, shape, dtype, param_dtype=param_dtype)
                explanation = ditops.explain(op, **arguments)
                refusal = {row.backend: row.refusal for row in explanation.candidates}["rocm"]
                expected = getattr(ditops, op)(**example_arguments(op, shape, dtype, param_dtype=param_dtype), backend="reference")
                got = getattr(ditops, op)(**arguments)
                close = all(torch.allclose(a.float(), b.float(), atol=0.05, rtol=0.05)
                            for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (got, expected))))
                results.append([op, str(dtype), explanation.selected, refusal, close])
    print(json.dumps(results))
""")


@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
def test_a_device_simulated_by_name_never_reaches_rocm_and_every_call_runs_in_triton(arch):
    rocm_here()
    environment = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", RUN_EVERY_OP, arch], capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.splitlines()[-1])
    assert len(results) == 2 * sum(not SPECS[op].quantized for op in dispatch.OPS)
    for op, dtype, selected, refusal, close in results:
        assert selected == "triton", (op, dtype)
        assert refusal.startswith(f"launches through the GPU driver, and {arch} is simulated here"), (op, dtype, refusal)
        assert close, (op, dtype)


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_cuda_refuses_a_device_simulated_by_name_and_serves_the_described_one(arch, tmp_path):
    config = tmp_path / "no_triton.yaml"
    config.write_text("disable: [triton]\n")
    dispatch.load_config(config)
    arguments = example_arguments("rope_", shape_of("rope_"), torch.bfloat16, param_dtype=torch.float32)
    with dispatch.simulated_device(arch):
        explanation = ditops.explain("rope_", **arguments)
    assert explanation.selected == "reference"
    assert {row.backend: row.refusal for row in explanation.candidates}["cuda"] == (
        f"launches through the GPU driver, and {arch} is simulated here: the calls run on CPU tensors "
        "(Triton's interpreter with TRITON_INTERPRET=1, else the reference)")
    with dispatch.simulated_device(dispatch.parse_arch(arch)):  # described: what the real GPU would choose
        assert ditops.explain("rope_", **arguments).selected == "cuda"


def test_the_simulation_by_name_is_marked_and_the_described_device_is_not():
    with dispatch.simulated_device("gfx942") as device:
        assert device.simulated and device.runs_here
        assert str(device) == "rocm gfx942 [simulated]"
    with dispatch.simulated_device(dispatch.parse_arch("gfx942")) as device:
        assert device.simulated and not device.runs_here
    with dispatch.simulated_device("cpu") as device:
        assert device == dispatch.DeviceInfo("cpu", "cpu")


# registry.yaml: min_rocm {gfx90a: "5.2", gfx942: "6.0"}.

@pytest.mark.parametrize("release, refused", [("5.2", {"gfx942"}), ("5.7", {"gfx942"}), ("6.0", set()), ("6.4", set()),
                                              ("10.1", set())])
def test_the_rocm_release_decides_which_archs_rocm_serves(monkeypatch, release, refused):
    rocm_here()
    monkeypatch.setitem(constraints.RELEASES, "rocm", lambda: release)
    for arch in ("gfx90a", "gfx942"):
        with dispatch.simulated_device(dispatch.parse_arch(arch)):
            explanation = ditops.explain("rope_", **example_arguments("rope_", shape_of("rope_"), torch.bfloat16))
        reason = {row.backend: row.refusal for row in explanation.candidates}["rocm"]
        if arch in refused:
            assert explanation.selected == "triton"
            assert reason == f"needs ROCm 6.0 or newer for {arch} (its hiprtc's LLVM), got ROCm {release}"
        else:
            assert (explanation.selected, reason) == ("rocm", None)


def test_the_release_check_reads_only_the_device():
    call = types.SimpleNamespace(device=dispatch.parse_arch("gfx942"))
    wanted = {"gfx90a": "5.2", "gfx942": "6.0"}
    assert constraints.min_rocm(wanted, types.SimpleNamespace(device=dispatch.parse_arch("gfx950"))) is None  # not listed
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(constraints.RELEASES, "rocm", raising=False)
        assert constraints.min_rocm(wanted, call) == "needs ROCm 6.0 or newer for gfx942; no ROCm runtime is loaded in this process"


@pytest.mark.parametrize("value", [{"gfx942": 6.0}, {"sm_90": "6.0"}, ["gfx942"], {"gfx942": "six"}])
def test_a_bad_min_rocm_is_refused_by_name(tmp_path, value):
    config = tmp_path / "bad.yaml"
    config.write_text(f"ops:\n  rope_:\n    - {{backend: rocm, min_rocm: {json.dumps(value)}}}\n")
    with pytest.raises(ValueError, match="constraint min_rocm: got .*, wanted a mapping of AMD arch names to ROCm releases"):
        dispatch.load_config(config)


def test_the_rocm_release_is_read_from_the_hip_runtime():
    rocm_here()
    from ditops.backends.rocm import hiprtc

    major, minor = hiprtc.rocm_release().split(".")
    assert int(major) >= 5 and minor.isdigit()
    assert constraints.RELEASES["rocm"] is hiprtc.rocm_release
