"""The dispatcher: device detection, constraints with reasons, the selection cache, the
overrides, strict failures, the fallback warning and explain; on simulated devices."""

import dataclasses
import logging
import re
import types

import pytest
import torch
import toy_backends
from conftest import TESTS

import ditops
from ditops import dispatch
from ditops.dispatch import device as device_module
from ditops.examples import HeadSpec, build, example_arguments
from ditops.inputs import RowSpec
from ditops.opspec import SPECS

KERNEL_OPS = [op for op in dispatch.OPS if not SPECS[op].quantized]  # the toy registries have no rows for the FP8 ops

BF16 = torch.bfloat16


def norm_arguments(hidden=3072, dtype=BF16, **overrides):
    arguments = example_arguments("norm_scale_shift", (2, 16, hidden), dtype)
    arguments.update(overrides)
    return arguments


def chosen(op, **arguments):
    return ditops.explain(op, **arguments).selected


def refusals(op, **arguments):
    return {row.backend: row.refusal for row in ditops.explain(op, **arguments).candidates}


# Device detection.


def test_parse_arch():
    assert dispatch.parse_arch("sm_90") == dispatch.DeviceInfo("cuda", "sm_90", simulated=True)
    assert dispatch.parse_arch("sm90a").sm == 90
    assert dispatch.parse_arch("gfx942").vendor == "rocm"
    assert dispatch.parse_arch("gfx942").warp_size == 64
    assert dispatch.parse_arch("cpu") == device_module.CPU
    with pytest.raises(ValueError, match="'tpu'"):
        dispatch.parse_arch("tpu")


@pytest.mark.parametrize(
    "hip, properties, expected",
    [
        (None, dict(major=9, minor=0, name="NVIDIA H100"), ("cuda", "sm_90")),
        ("6.2", dict(gcnArchName="gfx942:sramecc+:xnack-", name="AMD Instinct MI300X"), ("rocm", "gfx942")),
        ("6.2", dict(gcnArchName="gfx90a:sramecc+:xnack-", name="AMD Instinct MI250X"), ("rocm", "gfx90a")),
    ],
)
def test_gpu_detection_reads_torch_version_and_device_properties(monkeypatch, hip, properties, expected):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(**properties))
    info = device_module._detect_gpu(0)
    assert (info.vendor, info.arch, info.name) == (*expected, properties["name"])


def test_cpu_tensors_are_seen_on_the_simulated_device():
    assert dispatch.device_of(-1) == device_module.CPU
    with dispatch.simulated_device("gfx90a") as device:
        assert dispatch.device_of(-1) is device
    assert dispatch.device_of(-1) == device_module.CPU


# Selection on simulated devices, with a test backend plugged in by YAML alone.


def test_builtin_registry_serves_every_op_with_the_reference():
    for op in dispatch.OPS:
        assert [impl.name for impl in dispatch.dispatcher().implementations[op]][-1] == "reference"


def test_more_batch_items_than_a_triton_grid_holds_go_to_another_backend():
    """The Triton row kernels put the batch items on their grid's second dimension (at most
    65535 on CUDA): a call with more goes to the next backend that takes it, with the reason."""
    x = torch.randn(65536, 1, 8)
    with described("sm_90"):
        explanation = ditops.explain("norm_scale_shift", x, torch.randn(65536, 8), torch.randn(65536, 8))
        fewer = ditops.explain("norm_scale_shift", x[:65535], torch.randn(65535, 8), torch.randn(65535, 8))
    assert "triton     refused: supports B <= 65535 batch items, got B=65536" in str(explanation)
    assert explanation.selected == "cuda" and fewer.selected == "triton"


def test_yaml_backend_is_picked_on_sm90(toy_registry):
    with dispatch.simulated_device("sm_90"):
        assert chosen("norm_scale_shift", **norm_arguments()) == "fast"
        toy_backends.CALLS.clear()
        ditops.norm_scale_shift(**norm_arguments())
        assert toy_backends.CALLS == ["norm_scale_shift"]


@pytest.mark.parametrize(
    "arguments, reason",
    [
        (dict(hidden=1004), "needs D to be a multiple of 8, got D=1004"),
        (dict(dtype=torch.float32), "activations must be float16, bfloat16, got float32"),
        (dict(scale=torch.randn(2, 16, 3072, dtype=BF16)), "supports modulation forms ['scalar', 'vector', 'batch'], got ['token']"),
        (dict(x=torch.randn(2 * 16 * 3072 + 1, dtype=BF16)[1:].view(2, 16, 3072)), "needs 16-byte aligned data pointers and strides, got 2-byte"),
        (dict(x=torch.randn(2, 16, 3072 * 2, dtype=BF16)[..., ::2]), "needs every tensor's last dimension to have stride 1"),
    ],
    ids=["odd-D", "float32", "per-token-modulation", "misaligned", "last-dim-stride"],
)
def test_refusals_name_the_constraint(toy_registry, arguments, reason):
    with dispatch.simulated_device("sm_90"):
        arguments = norm_arguments(**arguments)
        assert chosen("norm_scale_shift", **arguments) == "reference"
        assert reason in refusals("norm_scale_shift", **arguments)["fast"]


def test_old_nvidia_arch_is_refused(toy_registry):
    with dispatch.simulated_device("sm_75"):
        assert refusals("norm_scale_shift", **norm_arguments())["fast"] == "needs sm_80 or newer, got sm_75"


@pytest.mark.parametrize("arch, expected", [("gfx942", "amd"), ("gfx90a", "reference")])
def test_amd_archs(toy_registry, arch, expected):
    with dispatch.simulated_device(arch):
        assert chosen("norm_scale_shift", **norm_arguments()) == expected
        reasons = refusals("norm_scale_shift", **norm_arguments())
        assert reasons["fast"] == "runs on cuda, not rocm"
        if arch == "gfx90a":
            assert reasons["amd"] == "supports AMD gfx942, gfx950, not gfx90a"


def test_rope_constraints(toy_registry):
    q_shape = (64, 8, 128)
    with dispatch.simulated_device("sm_90"):
        neox = example_arguments("rope_", q_shape) | dict(interleaved=False)
        assert chosen("rope_", **neox) == "fast"
        assert refusals("rope_", **example_arguments("rope_", q_shape))["fast"] == "supports RoPE layouts ['neox'], got interleaved"
        odd = example_arguments("rope_", (64, 8, 80)) | dict(interleaved=False)
        assert refusals("rope_", **odd)["fast"] == "supports Dh in [64, 128], got Dh=80"


def test_cpu_never_picks_a_gpu_backend(toy_registry):
    reasons = refusals("norm_scale_shift", **norm_arguments())
    assert reasons["fast"] == "needs a GPU"
    assert reasons["reference"] is None


# The selection cache.


def test_selection_is_cached_by_features(toy_registry, monkeypatch):
    checked = []
    original = dispatch.registry.Implementation.refusal
    monkeypatch.setattr(dispatch.registry.Implementation, "refusal", lambda self, f: checked.append(self.name) or original(self, f))
    with dispatch.simulated_device("sm_90"):
        ditops.norm_scale_shift(**norm_arguments())
        assert checked == ["fast"]
        ditops.norm_scale_shift(**norm_arguments())  # new tensors, same features: no new checks
        assert checked == ["fast"]
        ditops.norm_scale_shift(**norm_arguments(hidden=1004))  # another D: checked again
        assert checked[:4] == ["fast", "fast", "amd", "reference"]
        count = len(checked)
        ditops.norm_scale_shift(**norm_arguments(hidden=1004))
        assert len(checked) == count


# Overrides.


def test_backend_argument_forces(toy_registry):
    with dispatch.simulated_device("sm_90"):
        toy_backends.CALLS.clear()
        ditops.norm_scale_shift(**norm_arguments(), backend="reference")
        assert toy_backends.CALLS == []


def test_forced_backend_that_refuses_raises_with_every_reason(toy_registry):
    with dispatch.simulated_device("sm_90"), pytest.raises(ditops.BackendUnavailable) as error:
        ditops.norm_scale_shift(**norm_arguments(hidden=1004), backend="fast")
    message = str(error.value)
    assert "backend 'fast' (forced by the backend= argument) cannot run this call" in message
    assert "fast       refused: needs 16-byte aligned data pointers and strides, got 8-byte alignment, and needs D to be a multiple of 8, got D=1004" in message
    assert "amd        refused: runs on cuda" not in message  # reasons are per candidate, in order
    assert "amd        refused: runs on rocm, not cuda" in message
    assert "reference  refused: not forced (fast is); it would accept" in message


def test_unknown_backend_is_named():
    with pytest.raises(ditops.BackendUnavailable, match="backend 'nope' .* does not exist; known: reference"):
        ditops.norm_scale_shift(**norm_arguments(), backend="nope")


def test_use_backend_scopes_nest_and_take_per_op_settings(toy_registry):
    with dispatch.simulated_device("sm_90"):
        toy_backends.CALLS.clear()
        with ditops.use_backend("reference"):
            ditops.norm_scale_shift(**norm_arguments())
            with ditops.use_backend(norm_scale_shift="fast"):
                ditops.norm_scale_shift(**norm_arguments())
                with pytest.raises(ditops.BackendUnavailable, match="forced by use_backend"):
                    ditops.norm_scale_shift(**norm_arguments(hidden=1004))
            ditops.norm_scale_shift(**norm_arguments())
        assert toy_backends.CALLS == ["norm_scale_shift"]
        with ditops.use_backend("reference"):
            ditops.norm_scale_shift(**norm_arguments(), backend="fast")  # the call argument is stronger
        assert toy_backends.CALLS == ["norm_scale_shift"] * 2


def test_environment_variable_forces(toy_registry, monkeypatch):
    monkeypatch.setenv("DITOPS_BACKEND", "rope=fast,norm_scale_shift=reference")
    dispatch.load_config(toy_registry)
    with dispatch.simulated_device("sm_90"):
        assert chosen("norm_scale_shift", **norm_arguments()) == "reference"
        with pytest.raises(ditops.BackendUnavailable, match="forced by DITOPS_BACKEND"):
            ditops.rope_(**example_arguments("rope_", (8, 2, 128)))  # interleaved: fast refuses
        with ditops.use_backend("fast"):  # the scope is stronger than the environment
            assert chosen("norm_scale_shift", **norm_arguments()) == "fast"


def test_bad_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv("DITOPS_BACKEND", "nosuchop=cuda")
    with pytest.raises(ValueError, match="unknown op 'nosuchop'"):
        dispatch.reset()


def test_config_from_environment_variable(monkeypatch):
    monkeypatch.setenv("DITOPS_CONFIG", str(TESTS / "toy_registry.yaml"))
    dispatch.reset()
    with dispatch.simulated_device("sm_90"):
        assert chosen("norm_scale_shift", **norm_arguments()) == "fast"


def test_user_config_reorders_and_disables(toy_registry, tmp_path):
    config = tmp_path / "mine.yaml"
    config.write_text("ops:\n  norm_scale_shift: [reference]\n")
    dispatch.load_config(config)
    with dispatch.simulated_device("sm_90"):
        assert chosen("norm_scale_shift", **norm_arguments()) == "reference"
        config.write_text("disable: [reference, norm_scale_shift=amd]\n")
        dispatch.reset()
        dispatch.load_config(toy_registry)
        dispatch.load_config(config)
        assert [impl.name for impl in dispatch.dispatcher().implementations["norm_scale_shift"]] == ["fast"]
        with pytest.raises(ditops.BackendUnavailable, match="no enabled implementation accepts this call"):
            ditops.norm_scale_shift(**norm_arguments(hidden=1004))


def test_prefer_moves_a_backend_first_for_every_op(toy_registry, tmp_path):
    config = tmp_path / "prefer.yaml"
    config.write_text("prefer: [reference]\n")
    dispatch.load_config(config)
    assert [impl.name for impl in dispatch.dispatcher().implementations["rope_"]] == ["reference", "fast"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("ops:\n  norm_scale_shift:\n    - backend: fast\n      hidden_multiple: 8\n", "unknown constraint 'hidden_multiple'"),
        ("ops:\n  norm_scale_shift:\n    - backend: fast\n      dtypes: [bfloat17]\n", "'bfloat17' is not a torch dtype"),
        ("ops:\n  norm_scale_shift: [ghost]\n", "backend 'ghost' is not defined"),
        ("backend:\n  x: 1\n", "unknown top-level keys ['backend']"),
        ("ops:\n  not_an_op: [reference]\n", "unknown op 'not_an_op'"),
        ("backends:\n  x:\n    modul: y\n", "backend 'x' needs 'module'"),
        ("ops: [", "cannot read ditops config"),
    ],
)
def test_bad_config_is_rejected_and_leaves_the_registry_as_it_was(toy_registry, tmp_path, text, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    before = [impl.name for impl in dispatch.dispatcher().implementations["norm_scale_shift"]]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        dispatch.load_config(config)
    assert [impl.name for impl in dispatch.dispatcher().implementations["norm_scale_shift"]] == before


def test_unimportable_backend_is_refused_at_load_with_the_import_error(tmp_path):
    """A user config's backend that cannot be imported is a typo to report, not a backend to skip."""
    config = tmp_path / "missing.yaml"
    config.write_text("backends:\n  missing:\n    module: no_such_module\nops:\n  rope_: [missing]\n")
    with pytest.raises(ValueError, match="cannot import no_such_module: ModuleNotFoundError"):
        dispatch.load_config(config)
    assert chosen("rope_", **example_arguments("rope_", (4, 2, 64))) == "reference"  # the config was not applied


# Fallback warning and autograd.


def test_fallback_to_reference_on_a_gpu_warns_once(toy_registry, caplog):
    caplog.set_level(logging.INFO, logger="ditops")
    with dispatch.simulated_device("sm_90"):
        for _ in range(3):
            ditops.norm_scale_shift(**norm_arguments(hidden=1004))
        ditops.norm_scale_shift(**norm_arguments(), backend="reference")  # forced: no warning
        ditops.explain("norm_scale_shift", **norm_arguments(hidden=1000))  # a query: no warning
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "norm_scale_shift runs on the slow reference backend" in warnings[0].getMessage()
    assert "fast: needs 16-byte aligned data pointers and strides, got 8-byte alignment, and needs D to be a multiple of 8" in warnings[0].getMessage()


def test_fallback_warning_names_each_refusal_once(caplog):
    """cuda's two registry entries for norm_scale_shift (the Wan-14B rows and the general
    ones) refuse float64 at D=4608 alike: the warning says so once."""
    caplog.set_level(logging.WARNING, logger="ditops")
    with dispatch.simulated_device("sm_90"):
        ditops.norm_scale_shift(**norm_arguments(hidden=4608, dtype=torch.float64))
    message = caplog.records[-1].getMessage()
    reasons = message.removesuffix(")").split("; ")
    assert sum(reason.startswith("cuda: ") for reason in reasons) == 1, message


def test_no_warning_on_cpu(caplog):
    caplog.set_level(logging.INFO, logger="ditops")
    ditops.norm_scale_shift(**norm_arguments())
    assert not caplog.records


def test_inputs_requiring_grad_go_to_an_autograd_backend(toy_registry, caplog):
    caplog.set_level(logging.INFO, logger="ditops")
    arguments = norm_arguments()
    arguments["x"].requires_grad_(True)
    with dispatch.simulated_device("sm_90"):
        assert refusals("norm_scale_shift", **arguments)["fast"] == "is forward-only and an input requires grad"
        y = ditops.norm_scale_shift(**arguments)
        with pytest.raises(ditops.BackendUnavailable, match="forward-only"):
            ditops.norm_scale_shift(**arguments, backend="fast")
        with torch.no_grad():
            assert chosen("norm_scale_shift", **arguments) == "fast"
    y.float().sum().backward()
    assert arguments["x"].grad is not None and arguments["x"].grad.abs().sum() > 0
    assert [r.levelno for r in caplog.records] == [logging.INFO]


def test_explain_prints_the_candidate_table(toy_registry):
    with dispatch.simulated_device("sm_90"):
        text = str(ditops.explain("norm_scale_shift", **norm_arguments(hidden=1004)))
    assert text.splitlines()[0] == "ditops.norm_scale_shift -> reference"
    assert "input: bfloat16 on cuda sm_90 [simulated], D=1004, norm=layer" in text
    assert "fast       refused: needs 16-byte aligned data pointers and strides, got 8-byte alignment, and needs D to be a multiple of 8, got D=1004" in text
    assert "reference  accepts" in text


def test_explain_of_empty_input():
    arguments = norm_arguments()
    arguments["x"] = arguments["x"][:, :0]
    assert "empty input" in str(ditops.explain("norm_scale_shift", **arguments))


def test_cached_calls_still_check_what_the_signature_does_not_hold():
    """Validation is cached per call signature; values (positions) are checked on every call,
    and arguments equal in value but not in type (True, 1) do not share a cache entry."""
    arguments = example_arguments("rope_", (6, 2, 64))
    arguments["positions"] = torch.tensor([0, 1, 2, 3, 4, 5])
    ditops.rope_(**arguments)
    arguments["positions"] = torch.tensor([0, 1, 2, 3, 4, 6])  # same metadata, row 6 is past the cache
    with pytest.raises(ValueError, match=r"positions has values in \[0, 6\]"):
        ditops.rope_(**arguments)
    arguments["positions"] = None
    ditops.rope_(**arguments, interleaved=True)
    with pytest.raises(ValueError, match="interleaved is 1; wanted True or False"):
        ditops.rope_(**arguments, interleaved=1)


SIMULATED_PICKS = {
    "sm_90": ("nvidia_kernels", {"amd_kernels": "runs on rocm, not cuda"}),
    "gfx942": ("amd_kernels", {"nvidia_kernels": "runs on cuda, not rocm"}),
    "gfx90a": ("reference", {"nvidia_kernels": "runs on cuda, not rocm", "amd_kernels": "supports AMD gfx942, not gfx90a"}),
}


@pytest.mark.parametrize("arch", SIMULATED_PICKS)
@pytest.mark.parametrize("op", KERNEL_OPS)
def test_every_op_on_simulated_devices(op, arch):
    """What each op picks on NVIDIA sm_90, AMD gfx942 and AMD gfx90a, and why the others refused."""
    dispatch.load_config(TESTS / "simulated_registry.yaml")
    expected, reasons = SIMULATED_PICKS[arch]
    with dispatch.simulated_device(arch):
        shape = (8, 4, 64) if op.endswith("_") else (2, 8, 64)
        explanation = ditops.explain(op, **example_arguments(op, shape))
        assert explanation.selected == expected
        refused = {row.backend: row.refusal for row in explanation.candidates if row.refusal}
        assert refused == reasons
        assert ditops.explain(op, **example_arguments(op, shape, torch.float32)).selected == "reference"


def described(arch: str):
    """The device as dispatch would see the real one (cuda and rocm may serve it): these tests
    ask what it would choose and run nothing. Simulated by name, calls run here on CPU tensors
    and the backends that launch through a driver refuse it (tests/test_simulated_devices.py)."""
    return dispatch.simulated_device(dispatch.parse_arch(arch))


@pytest.fixture
def rocm_6(monkeypatch):
    """A ROCm release whose hiprtc knows gfx90a and gfx942 (registry.yaml: min_rocm), whatever
    this machine has (CI: ROCm 5.2, whose hiprtc does not know gfx942)."""
    monkeypatch.setitem(dispatch.constraints.RELEASES, "rocm", lambda: "6.0")


# The example arguments mix bfloat16 modulation with float32 weights: the compiled row kernels
# (rocm, cuda) take one parameter dtype, so triton serves those rows; rocm takes RoPE on AMD.
AMD = {"rows": "triton", "heads": "rocm"}
REGISTRY_PICKS = [
    ("sm_90", torch.bfloat16, "triton", None),
    ("sm_80", torch.float16, "triton", None),
    ("sm_75", torch.bfloat16, "reference", "needs sm_80 or newer, got sm_75"),
    ("gfx942", torch.bfloat16, AMD, None),
    ("gfx90a", torch.float32, {"rows": "rocm", "heads": "rocm"}, None),  # float32 everywhere: one dtype
    ("gfx950", torch.bfloat16, "triton", None),
    ("gfx1100", torch.bfloat16, "reference", "supports AMD gfx90a, gfx942, gfx950, not gfx1100"),
    ("sm_90", torch.float64, "reference", "activations must be float16, bfloat16, float32, got float64"),
]


@pytest.mark.parametrize("arch, dtype, expected, reason", REGISTRY_PICKS, ids=lambda value: str(value))
@pytest.mark.parametrize("op", dispatch.OPS)
def test_builtin_registry_on_simulated_devices(op, arch, dtype, expected, reason, rocm_6):
    shape = (8, 4, 64) if op.endswith("_") else (2, 8, 64)
    with described(arch):
        explanation = ditops.explain(op, **example_arguments(op, shape, dtype))
    if isinstance(expected, dict):
        expected = expected["heads" if op.endswith("_") else "rows"]
        if expected == "rocm" and ROCM_REFUSAL:  # without hip-python, triton is next
            expected = "triton"
    if SPECS[op].quantized:  # FP8 outputs: kernels only where the device has an FP8 format
        if reason is None and arch in ("sm_80", "gfx90a"):
            expected, reason = "reference", f"needs a GPU with hardware float8_e4m3fn (fp8_formats), not {arch}"
        elif op == "quantize_fp8" and arch == "gfx942" and not ROCM_REFUSAL:  # no parameters to mix: rocm takes it
            expected = "rocm"
    assert explanation.selected == expected
    refusal = {row.backend: row.refusal for row in explanation.candidates}["triton"]
    assert refusal is None if reason is None else refusal.startswith(reason)


def test_triton_refuses_rows_it_cannot_hold_in_registers():
    with dispatch.simulated_device("sm_90"):
        explanation = ditops.explain("norm_scale_shift", **example_arguments("norm_scale_shift", (1, 2, 20000)))
    assert explanation.selected == "reference"
    assert {row.backend: row.refusal for row in explanation.candidates}["triton"] == "supports D <= 16384, got D=20000"


@pytest.mark.parametrize("op", dispatch.OPS)
def test_cuda_serves_nvidia_when_triton_is_disabled(op, tmp_path):
    """cuda is the next NVIDIA kernel backend: with triton disabled it takes every op at one
    parameter dtype, and mixed parameter dtypes fall to the reference with the reason."""
    config = tmp_path / "no_triton.yaml"
    config.write_text("disable: [triton]\n")
    shape = (8, 4, 64) if op.endswith("_") else (2, 8, 64)
    dispatch.load_config(config)
    with described("sm_90"):
        uniform = ditops.explain(op, **example_arguments(op, shape, torch.bfloat16, param_dtype=torch.float32))
        mixed = ditops.explain(op, **example_arguments(op, shape, torch.bfloat16))
    assert uniform.selected == "cuda"
    if not op.endswith("_") and op != "quantize_fp8":  # quantize_fp8 has no parameters
        assert mixed.selected == "reference"
        assert {row.backend: row.refusal for row in mixed.candidates}["cuda"].startswith("needs modulation/weight tensors of one dtype")


ROCM_REFUSAL = dispatch.dispatcher().registry.backends["rocm"].refusal(dispatch.parse_arch("gfx942"))
CUDA_REFUSAL = dispatch.dispatcher().registry.backends["cuda"].refusal(dispatch.parse_arch("sm_90"))


@pytest.mark.skipif(bool(ROCM_REFUSAL), reason=f"rocm backend unavailable here: {ROCM_REFUSAL}")
@pytest.mark.parametrize("arch", ["gfx942", "gfx90a"])
@pytest.mark.parametrize("op", dispatch.OPS)
def test_rocm_serves_cdna_gpus(op, arch, rocm_6):
    """On gfx90a and gfx942 every op goes to rocm when its parameters share a dtype; rows
    with mixed parameter dtypes and misaligned views go to triton, with rocm's reason. The FP8
    ops go to rocm on gfx942 only (gfx90a has no FP8 format: the reference serves them)."""
    if SPECS[op].quantized and arch == "gfx90a":
        with described(arch):
            explanation = ditops.explain(op, **example_arguments(op, (2, 8, 64), torch.bfloat16, param_dtype=torch.float32))
        assert explanation.selected == "reference"
        assert refusals_of(explanation)["rocm"] == "needs a GPU with hardware float8_e4m3fn (fp8_formats), not gfx90a"
        return
    shape = (8, 4, 64) if op.endswith("_") else (2, 8, 64)
    with described(arch):
        uniform = ditops.explain(op, **example_arguments(op, shape, torch.bfloat16, param_dtype=torch.float32))
        mixed = ditops.explain(op, **example_arguments(op, shape, torch.bfloat16))
        arguments = example_arguments(op, shape, torch.bfloat16, param_dtype=torch.float32)
        first = "q" if op.endswith("_") else "x"
        arguments[first] = torch.randn(arguments[first].numel() + 1, dtype=torch.bfloat16)[1:].view(shape)
        misaligned = ditops.explain(op, **arguments)
    assert uniform.selected == "rocm"
    if SPECS[op].quantized:  # traced into a compiled graph: Triton's kernel, launched by Inductor
        with described(arch):
            traced = ditops.explain(op, **example_arguments(op, shape, torch.bfloat16, param_dtype=torch.float32),
                                    compiled=True)
        assert traced.selected == "triton"
        assert refusals_of(traced)["rocm"].startswith("leaves calls in a compiled graph")
    assert misaligned.selected == "triton"
    assert refusals_of(misaligned)["rocm"].startswith("needs 16-byte aligned data pointers and strides")
    if not op.endswith("_") and op != "quantize_fp8":  # quantize_fp8 has no parameters
        assert mixed.selected == "triton"
        assert refusals_of(mixed)["rocm"].startswith("needs modulation/weight tensors of one dtype")


@pytest.mark.skipif(bool(ROCM_REFUSAL), reason=f"rocm backend unavailable here: {ROCM_REFUSAL}")
@pytest.mark.parametrize("op", dispatch.OPS)
def test_gfx950_goes_to_triton(op):
    shape = (8, 4, 64) if op.endswith("_") else (2, 8, 64)
    with described("gfx950"):
        explanation = ditops.explain(op, **example_arguments(op, shape, torch.bfloat16, param_dtype=torch.float32))
    assert explanation.selected == "triton"
    assert refusals_of(explanation)["rocm"] == "supports AMD gfx90a, gfx942, not gfx950"


def refusals_of(explanation) -> dict:
    return {row.backend: row.refusal for row in explanation.candidates}


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
@pytest.mark.parametrize("op", ["norm_scale_shift", "residual_norm_scale_shift", "norm_scale_shift_fp8",
                                "residual_norm_scale_shift_fp8"])
def test_modulation_tables_go_to_triton_with_the_compiled_backends_reason(op, arch, rocm_6):
    """cuda and rocm take no table (registry.yaml: modulation); beside an index, scalars and
    vectors alone are no table, and every backend may take the call."""
    index = torch.randint(0, 6, (2, 8))
    compiled = "cuda" if arch.startswith("sm_") else "rocm"
    with described(arch):  # the FP8 ops' arguments in the device's format
        arguments = example_arguments(op, (2, 8, 64), torch.bfloat16, param_dtype=torch.float32)
        names = [name for name in ("gate", "scale", "shift") if name in arguments]
        tables = ditops.explain(op, **{**arguments, **{name: torch.randn(6, 64) for name in names}}, modulation_index=index)
        vectors = ditops.explain(op, **{**arguments, **{name: torch.randn(64) for name in names}}, modulation_index=index)
    assert tables.selected == "triton" and tables.features.modulation == ("table",) * len(names)
    assert "supports modulation forms ['scalar', 'vector', 'batch', 'token', 'frame'], got ['table']" in refusals_of(tables)[compiled]
    assert "modulation forms" not in (refusals_of(vectors)[compiled] or "")


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
@pytest.mark.parametrize("op", ["qk_norm_rope_", "rope_"])
def test_the_compiled_backends_take_a_cache_row_per_head(op, arch, rocm_6):
    """The cuda and rocm rotary kernels read a cos/sin row per head as well as one per token: a
    per-head cache takes the order of ops (rocm first on AMD, triton first on NVIDIA)."""
    compiled = "cuda" if arch.startswith("sm_") else "rocm"
    with described(arch):
        arguments = example_arguments(op, (2, 8, 4, 64), torch.bfloat16, param_dtype=torch.float32)
        per_head = dict(arguments, cos_sin_cache=arguments["cos_sin_cache"][None, :, None].expand(2, -1, 4, -1))
        head_cache = ditops.explain(op, **per_head)
    assert head_cache.features.rope_cache == "per_head" and refusals_of(head_cache)[compiled] is None
    assert head_cache.selected == ("rocm" if compiled == "rocm" else "triton")


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
@pytest.mark.parametrize("op, norm_over, heads", [("qk_norm_rope_", "token", 40), ("rope_", "head", 4)])
def test_the_rope_preferences_keep_to_the_shared_caches_they_were_measured_with(name, op, norm_over, heads):
    """The cuda preferences of the RoPE ops (registry.yaml) cite rows with a shared cache: a
    call with a cos/sin row per head that they would otherwise match keeps the order of ops."""
    if CUDA_REFUSAL:
        pytest.skip(CUDA_REFUSAL)
    spec = HeadSpec((8,), heads, heads, 128, interleaved=False, norm_over=norm_over)
    arguments = build(op, spec, torch.bfloat16, "cpu", torch.Generator().manual_seed(0))
    per_head = dict(arguments, cos_sin_cache=arguments["cos_sin_cache"][:, None].expand(-1, heads, -1))
    with _named("sm_90", name):
        assert ditops.explain(op, **arguments).selected == "cuda"
        assert ditops.explain(op, **per_head).selected == "triton"


def _qk_layer_norm_arguments(norm_over: str) -> dict:
    """qk_norm_rope_(norm="layer") with weights and biases, GQA heads of 64."""
    spec = HeadSpec((8,), 4, 2, 64, norm="layer", norm_over=norm_over)
    return build("qk_norm_rope_", spec, torch.bfloat16, "cpu", torch.Generator().manual_seed(0))


@pytest.mark.parametrize("norm_over", ["head", "token"])
@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_qk_layer_norm_runs_on_the_compiled_backends(arch, norm_over, rocm_6, tmp_path):
    """The cuda and rocm rotary kernels take norm="layer" with biases, per head and per token:
    with triton disabled the compiled backend serves such calls."""
    compiled = "cuda" if arch.startswith("sm_") else "rocm"
    if (ROCM_REFUSAL if compiled == "rocm" else CUDA_REFUSAL):
        pytest.skip(f"{compiled} backend unavailable here")
    config = tmp_path / "no_triton.yaml"
    config.write_text("disable: [triton]\n")
    dispatch.load_config(config)
    with described(arch):
        explanation = ditops.explain("qk_norm_rope_", **_qk_layer_norm_arguments(norm_over))
    assert explanation.selected == compiled and explanation.features.norm == "layer"


# Measured preferences (registry.yaml: preferences): a device class and a size range move
# one backend first; elsewhere the order of `ops` holds.

def _named(arch: str, name: str):
    return dispatch.simulated_device(dataclasses.replace(dispatch.parse_arch(arch), name=name))


@pytest.mark.parametrize("name, hidden, expected", [
    ("NVIDIA H200", 5120, "cuda"),
    ("NVIDIA H100 80GB HBM3", 5120, "triton"),  # triton as fast there: the order of ops
    ("NVIDIA H200", 3072, "triton"),  # outside the measured range
    ("NVIDIA H100 80GB HBM3", 3072, "cuda"),
    ("NVIDIA H100 80GB HBM3", 2048, "triton"),
    ("NVIDIA H200", 5128, "triton"),
    ("NVIDIA A100-SXM4-80GB", 5120, "triton"),  # not measured there: the order of ops
    ("", 5120, "triton"),
])
def test_a_measured_preference_moves_its_backend_first_where_it_was_measured(name, hidden, expected):
    arguments = example_arguments("residual_norm_scale_shift", (1, 4, hidden), torch.bfloat16, param_dtype=torch.float32)
    with _named("sm_90" if "A100" not in name else "sm_80", name):
        explanation = ditops.explain("residual_norm_scale_shift", **arguments)
    assert explanation.selected == expected
    assert ("measured:" in str(explanation)) == (expected == "cuda")
    # A row's choice never depends on how many rows its call has.
    arguments = example_arguments("residual_norm_scale_shift", (1, 333, hidden), torch.bfloat16, param_dtype=torch.float32)
    with _named("sm_90" if "A100" not in name else "sm_80", name):
        assert ditops.explain("residual_norm_scale_shift", **arguments).selected == expected


@pytest.mark.parametrize("name, head_size, interleaved, compiled, expected", [
    ("NVIDIA H200", 128, False, False, "cuda"),
    ("NVIDIA H100 80GB HBM3", 128, False, False, "cuda"),
    ("NVIDIA H100 80GB HBM3", 96, False, False, "cuda"),
    ("NVIDIA H200", 96, False, False, "triton"),  # measured: triton there
    ("NVIDIA H100 80GB HBM3", 80, False, False, "triton"),  # a tie: the order of ops
    ("NVIDIA H200", 128, True, False, "triton"),  # interleaved
    ("NVIDIA H200", 128, False, True, "triton"),  # traced into a compiled graph: Inductor launches triton
    ("NVIDIA A100-SXM4-80GB", 128, False, False, "triton"),
])
def test_the_rope_preference_holds_for_the_measured_layout_and_head_sizes(name, head_size, interleaved, compiled, expected):
    for tokens in (16, 333):  # never by token count
        arguments = example_arguments("rope_", (tokens, 4, head_size), torch.bfloat16)
        with _named("sm_90" if "A100" not in name else "sm_80", name):
            explanation = ditops.explain("rope_", **arguments, interleaved=interleaved, compiled=compiled)
        assert explanation.selected == expected, tokens


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_a_token_rmsnorm_runs_cuda_where_measured_faster(name):
    """qk_norm_rope_(norm_over="token") with RMSNorm, eager and compiled (registry.yaml): cuda on
    the H100 at every D; on the H200 above D 4096 only (Wan2.1-14B), where below it Triton's
    kernel was the faster (Wan2.1-1.3B, LTX-2)."""
    if CUDA_REFUSAL:
        pytest.skip(CUDA_REFUSAL)
    for heads, compiled in ((12, False), (32, False), (40, False), (12, True), (40, True)):  # D = heads * 128
        spec = HeadSpec((8,), heads, heads, 128, norm_over="token")
        arguments = build("qk_norm_rope_", spec, torch.bfloat16, "cpu", torch.Generator().manual_seed(0))
        with _named("sm_90", name):
            selected = ditops.explain("qk_norm_rope_", **arguments, compiled=compiled).selected
        assert selected == ("cuda" if "H100" in name or heads * 128 > 4096 else "triton"), (heads, compiled)


@pytest.mark.parametrize("norm_over", ["token", "head"])
def test_a_layer_norm_keeps_the_order_of_ops_where_only_rmsnorm_was_measured(norm_over):
    """On the H200 the token-norm preference (registry.yaml) was measured with RMSNorm: a
    LayerNorm per token or per head keeps the order of ops (triton), which cuda would serve."""
    with _named("sm_90", "NVIDIA H200"):
        explanation = ditops.explain("qk_norm_rope_", **_qk_layer_norm_arguments(norm_over))
    assert explanation.selected == "triton"
    assert refusals_of(explanation)["cuda"] is None


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
@pytest.mark.parametrize("op", [op for op in dispatch.OPS if SPECS[op].quantized])
def test_fp8_ops_run_triton_on_nvidia_and_cuda_only_where_measured_faster_in_eager_calls(op, name):
    """triton first for the FP8 ops on NVIDIA (registry.yaml); cuda for the H100's quantize_fp8
    rows wider than 12288 and the H200's residual_norm_scale_shift_fp8 at D 2049-4096, in eager
    calls only: a compiled graph launches Triton's kernel itself, where cuda would be a library op
    that costs host time every call. A forced backend is obeyed there too."""
    if CUDA_REFUSAL:
        pytest.skip(CUDA_REFUSAL)
    for hidden in (3072, 12288, 13824):
        for tokens in (16, 333):  # never by token count
            arguments = example_arguments(op, (1, tokens, hidden), torch.bfloat16, param_dtype=torch.bfloat16)
            with _named("sm_90", name):
                preferred = ((op == "quantize_fp8" and hidden > 12288 and "H100" in name)
                             or (op == "residual_norm_scale_shift_fp8" and "H200" in name and hidden <= 4096))
                assert ditops.explain(op, **arguments).selected == ("cuda" if preferred else "triton"), hidden
                traced = ditops.explain(op, **arguments, compiled=True)
                assert traced.selected == "triton"
                assert refusals_of(traced)["cuda"].startswith("leaves calls in a compiled graph")
                assert ditops.explain(op, **arguments, compiled=True, backend="cuda").selected == "cuda"


@pytest.mark.parametrize("name", ["NVIDIA H100 80GB HBM3", "NVIDIA H200"])
def test_the_fp8_norm_takes_cuda_on_an_h200_where_its_stream_kernel_was_measured(name):
    """norm_scale_shift_fp8 (registry.yaml): cuda on the H200 in eager calls at D 1536, 3072 and
    5120, without a norm weight or bias and with a modulation per batch item, the calls of the
    stream kernel its rows were measured with; anything else keeps triton."""
    if CUDA_REFUSAL:
        pytest.skip(CUDA_REFUSAL)

    def selected(hidden, compiled=False, **spec):
        choices = set()
        for tokens in (16, 333):  # never by token count
            spec = dict(dict(affine=False), **spec)
            arguments = build("norm_scale_shift_fp8", RowSpec(2, tokens, hidden, **spec), torch.bfloat16, "cpu",
                              torch.Generator().manual_seed(0))
            with _named("sm_90", name):
                choices.add(ditops.explain("norm_scale_shift_fp8", **arguments, compiled=compiled).selected)
        (choice,) = choices
        return choice

    measured = "cuda" if "H200" in name else "triton"
    assert [selected(hidden) for hidden in (1536, 3072, 5120)] == [measured] * 3
    assert selected(3072, scale="vector", shift="scalar") == measured
    assert selected(3072, affine=True, param_dtype=torch.bfloat16) == "triton"
    assert selected(3072, scale="token", shift="token") == "triton"
    assert selected(4096) == "triton" and selected(2048) == "triton"  # widths not measured
    assert selected(3072, compiled=True) == "triton"


def test_a_preferred_backend_that_refuses_leaves_the_order_of_ops():
    arguments = example_arguments("residual_norm_scale_shift", (1, 4, 5120), torch.bfloat16)  # mixed parameter dtypes
    with _named("sm_90", "NVIDIA H200"):
        explanation = ditops.explain("residual_norm_scale_shift", **arguments)
    assert explanation.selected == "triton"
    assert refusals_of(explanation)["cuda"].startswith("needs modulation/weight tensors of one dtype")


def test_a_user_order_drops_the_measured_preferences_it_replaces(tmp_path):
    arguments = example_arguments("residual_norm_scale_shift", (1, 4, 5120), torch.bfloat16, param_dtype=torch.float32)
    config = tmp_path / "order.yaml"
    config.write_text("ops:\n  residual_norm_scale_shift: [triton, cuda]\n")
    dispatch.load_config(config)
    with _named("sm_90", "NVIDIA H200"):
        assert ditops.explain("residual_norm_scale_shift", **arguments).selected == "triton"
    config.write_text(
        "preferences:\n  residual_norm_scale_shift:\n"
        "    - {backend: cuda, when: {device_names: [H200]}, evidence: [{file: results/a_test.json, model: toy,"
        " shape: B1 S4 D64, dtype: bfloat16, backends: [cuda, triton]}]}\n")
    dispatch.load_config(config)
    with _named("sm_90", "NVIDIA H200"):
        explanation = ditops.explain("residual_norm_scale_shift", **dict(arguments, x=arguments["x"][..., :64].contiguous(),
                                                                        residual=arguments["residual"][..., :64].contiguous(),
                                                                        gate=arguments["gate"][..., :64].contiguous(),
                                                                        scale=arguments["scale"][..., :64].contiguous(),
                                                                        shift=arguments["shift"][..., :64].contiguous(),
                                                                        weight=None, bias=None))
    assert explanation.selected == "cuda"
    assert "measured: ditops bench results/a_test.json: toy B1 S4 D64 bfloat16 (cuda vs triton)" in str(explanation)


ROW = "file: r/h100.json, model: m, shape: s, dtype: bfloat16"


@pytest.mark.parametrize("rule, message", [
    ("{backend: cuda, when: {device_names: [H200]}}", "exactly the keys backend, when, evidence"),
    ("{backend: cuda, when: {}, measured: x}", "exactly the keys backend, when, evidence"),
    (f"{{backend: nosuch, when: {{}}, evidence: [{{{ROW}, backends: [nosuch, triton]}}]}}", "backend 'nosuch' is not defined"),
    (f"{{backend: cuda, when: {{device_names: H200}}, evidence: [{{{ROW}, backends: [cuda, triton]}}]}}", "constraint device_names"),
    (f"{{backend: cuda, when: {{min_hidden: 4}}, evidence: [{{{ROW}, backends: [cuda, triton]}}]}}", "unknown constraint 'min_hidden'"),
    ("{backend: cuda, when: {}, evidence: []}", "evidence: got [], wanted a list of one or more rows"),
    ("{backend: cuda, when: {}, evidence: [{file: r/h100.json}]}", "evidence[0]: got {'file': 'r/h100.json'}, wanted a mapping with exactly the keys file, model, shape, dtype, backends"),
    ("{backend: cuda, when: {}, evidence: [{file: ../h100.json, model: m, shape: s, dtype: bfloat16, backends: [cuda, triton]}]}",
     "evidence[0].file: got '../h100.json', wanted the path of a ditops bench JSON file"),
    ("{backend: cuda, when: {}, evidence: [{file: r/h100.csv, model: m, shape: s, dtype: bfloat16, backends: [cuda, triton]}]}",
     "evidence[0].file: got 'r/h100.csv'"),
    ("{backend: cuda, when: {}, evidence: [{file: r/h100.json, model: 7, shape: s, dtype: bfloat16, backends: [cuda, triton]}]}",
     "evidence[0].model: got int 7, wanted a string"),
    ("{backend: cuda, when: {}, evidence: [{file: r/h100.json, model: m, shape: s, dtype: bf16, backends: [cuda, triton]}]}",
     "evidence[0].dtype: constraint dtypes: 'bf16' is not a torch dtype"),
    (f"{{backend: cuda, when: {{}}, evidence: [{{{ROW}, backends: [triton, reference]}}]}}",
     "evidence[0].backends: got ['triton', 'reference'], wanted cuda and at least one other backend"),
    (f"{{backend: cuda, when: {{}}, evidence: [{{{ROW}, backends: [cuda]}}]}}", "wanted cuda and at least one other backend"),
])
def test_a_bad_preference_is_refused_by_name(tmp_path, rule, message):
    config = tmp_path / "bad.yaml"
    config.write_text(f"preferences:\n  rope_:\n    - {rule}\n")
    with pytest.raises(ValueError, match=re.escape(message)):
        dispatch.load_config(config)
