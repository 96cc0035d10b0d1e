"""The rocm backend is available only where hiprtc really loads through hip-python
(ditops/backends/rocm/hiprtc.py): otherwise it is refused with the reason and Triton serves;
a failure inside the binding at compile time is a CompileError naming the backend. CPU only:
the ROCm libraries, where present, are loaded but nothing runs on an AMD GPU."""

import os

import pytest
import torch

import ditops
from ditops import dispatch
from ditops.backends import rocm
from ditops.backends.compiled import all_instances
from ditops.backends.rocm import hiprtc
from ditops.examples import example_arguments

hip_python = pytest.importorskip("hip", reason="hip-python is not installed (pip install 'ditops[rocm]')")


@pytest.fixture(autouse=True)
def forget_hiprtc():
    """Each test finds hiprtc afresh, and leaves the process as it found it."""
    for cached in (hiprtc.library, hiprtc.load_error, hiprtc.version):
        cached.cache_clear()
    yield
    for cached in (hiprtc.library, hiprtc.load_error, hiprtc.version):
        cached.cache_clear()


def test_candidates_include_torch_wheels_rocm_trees_and_sonames(tmp_path, monkeypatch):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libhiprtc.so.6.3.0").write_bytes(b"")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    candidates = hiprtc._candidates()
    assert str(tmp_path / "lib" / "libhiprtc.so.6.3.0") in candidates
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    for path in (p for p in candidates if p.startswith(torch_lib)):
        assert os.path.basename(path).startswith("libhiprtc.so")
    assert candidates[-5:] == ["libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so.5", "libamdhip64.so.5"]


def test_no_loadable_hiprtc_refuses_rocm_with_the_reason_and_triton_serves(tmp_path, monkeypatch):
    fake = tmp_path / "libhiprtc.so.6"
    fake.write_bytes(b"not a library")
    monkeypatch.setattr(hiprtc, "_candidates", lambda: [str(fake), "libhiprtc_absent_for_this_test.so"])
    reason = rocm.available(dispatch.parse_arch("gfx942"))
    assert reason.startswith("rocm backend: no loadable hiprtc library") and str(fake) in reason
    dispatch.reset()  # the registry asks the backend again
    for op in dispatch.OPS:
        shape = (8, 4, 64) if op.endswith("_") else (2, 8, 64)
        with dispatch.simulated_device("gfx942"):
            explanation = ditops.explain(op, **example_arguments(op, shape, torch.bfloat16, param_dtype=torch.float32))
        assert explanation.selected == "triton", op
        assert {row.backend: row.refusal for row in explanation.candidates}["rocm"] == reason
    with pytest.raises(hiprtc.CompileError, match="rocm backend: no loadable hiprtc"):
        hiprtc.compile_instances(all_instances()[:1], "gfx90a")


def test_a_library_without_hiprtc_is_not_taken(monkeypatch):
    monkeypatch.setattr(hiprtc, "_candidates", lambda: ["libc.so.6"])
    with pytest.raises(hiprtc.CompileError, match=r"libc.so.6 \(has no hiprtc\)"):
        hiprtc.library()


def hiprtc_here():
    reason = hiprtc.load_error()
    if reason:
        if os.environ.get("DITOPS_REQUIRE_ROCM_TOOLS") == "1":
            pytest.fail(f"hiprtc must load on a machine that requires the ROCm tools: {reason}")
        pytest.skip(f"no hiprtc here: {reason}")


def test_hiprtc_found_without_a_libhiprtc_link():
    """Debian's ROCm 5.2 has hiprtc in libamdhip64.so.5 only: it is found by that name too."""
    hiprtc_here()
    assert hiprtc.version()
    assert rocm.available(dispatch.parse_arch("gfx942")) is None


def test_a_binding_failure_at_compile_time_names_the_backend(monkeypatch):
    hiprtc_here()
    from hip import hiprtc as binding

    def fails(*arguments):
        raise RuntimeError("failed to dlopen 'b'libhiprtc.so''")

    monkeypatch.setattr(binding, "hiprtcCreateProgram", fails)
    with pytest.raises(hiprtc.CompileError, match=r"^rocm backend: hiprtc .* failed on .* for gfx90a: failed to dlopen"):
        hiprtc.compile_instances(all_instances()[:1], "gfx90a")
