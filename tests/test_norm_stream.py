"""The stream kernel (csrc/modulated_norm_stream.cu): norm_scale_shift_fp8 on a persistent grid,
taken by the cuda backend where compiled_launch.yaml's modulated_norm_stream table names the GPU
and the call is one it serves. Which calls it takes, and its grid, are checked anywhere; its
results on any sm_90 GPU (the H200's entries pointed at that GPU) against the float64
oracle: the long conformance cases (conformance.LONG_CASES, which every backend runs on a GPU)."""

import copy
import dataclasses

import pytest
import torch

import ditops
from ditops import conformance
from ditops.backends import compiled
from ditops.backends.views import modulation
from ditops.dispatch import parse_arch, simulated_device
from ditops.inputs import RowSpec
from ditops.ops import OPS, ordered_arguments
from ditops.opspec import FP8_LONG_ROW_SPECS, SPECS

OP = "norm_scale_shift_fp8"
H200 = compiled._launch_settings()["modulated_norm_stream"]["H200"]
STREAM_CASES = [case for case in conformance.LONG_CASES if case.op == OP]
ON_FP8_GPU = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                reason="the H200's entries need an sm_90 GPU (FP8, and up to 160 KB of shared memory a block)")


def _launch(arguments: dict):
    """The cuda backend's launch of a call (nothing is launched)."""
    ordered, _ = ordered_arguments(OP, **arguments)
    return compiled.CompiledOps(None, None).norm_scale_shift_fp8_launch(*ordered, *OPS[OP].outputs(*ordered))


def _on_cpu(spec: RowSpec) -> dict:
    return SPECS[OP].build(spec, torch.bfloat16, torch.device("cpu"), torch.Generator().manual_seed(0))


def _h200():
    return simulated_device(dataclasses.replace(parse_arch("sm_90"), name="NVIDIA H200"))


def test_the_stream_kernel_takes_calls_with_a_modulation_per_batch_item_and_no_affine():
    assert len(STREAM_CASES) >= 8
    with _h200():
        for case in STREAM_CASES:
            assert _launch(_on_cpu(FP8_LONG_ROW_SPECS[case.name])).instance.kernel == "modulated_norm_stream", case.id
        refused = {"affine": RowSpec(1, 40, 3072), "token modulation": RowSpec(2, 7, 1000, "token", "token1", affine=False),
                   "per frame": RowSpec(1, 12, 256, "frame", "frame", affine=False), "wider": RowSpec(1, 4, 6144, affine=False),
                   "e4m3fnuz": RowSpec(1, 40, 3072, affine=False, fp8_dtype=torch.float8_e4m3fnuz)}
        for name, spec in refused.items():
            assert _launch(_on_cpu(spec)).instance.kernel == "modulated_norm", name
        x, vector = torch.randn(1, 40, 3072), torch.randn(3072)  # float32 rows
        assert compiled.stream_entry(x, (modulation(vector, 40),) * 2, False, torch.float8_e4m3fn) is None
    with simulated_device("sm_90"):  # a GPU the table does not name
        x = x.to(torch.bfloat16)
        assert compiled.stream_entry(x, (modulation(vector, 40),) * 2, False, torch.float8_e4m3fn) is None


def test_the_grid_gives_every_row_group_as_many_rows_and_a_block_one_batch_item():
    with _h200():
        launch = _launch(_on_cpu(RowSpec(3, 777, 3072, affine=False)))
    entry = next(entry for entry in H200 if 3072 <= entry["max_hidden"])
    blocks, items, _ = launch.grid
    # a CPU tensor counts one SM: blocks_per_sm blocks of `groups` row groups a wave share the 3 x 777 rows
    assert items == 3 and blocks == -(-entry["blocks_per_sm"] // 3)
    assert launch.instance.shared == 16 * 64 * 6 * entry["groups"] * entry["stages"]


@pytest.fixture
def stream_here(monkeypatch):
    """The H200's stream entries for the GPU running the test."""
    settings = copy.deepcopy(compiled._launch_settings())
    settings["modulated_norm_stream"] = {torch.cuda.get_device_name(): H200}
    monkeypatch.setattr(compiled, "_launch_settings", lambda: settings)


@ON_FP8_GPU
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("case", STREAM_CASES, ids=lambda case: case.name)
def test_the_stream_kernel_meets_the_oracle(case, dtype, stream_here):
    assert _launch(case.arguments(dtype, "cuda")).instance.kernel == "modulated_norm_stream"
    outcome = conformance.run_case(case, "cuda", dtype, "cuda", automatic=False)
    assert outcome.status == "pass", outcome.detail


@ON_FP8_GPU
def test_an_all_zero_row_has_the_floor_scale_and_zero_codes_on_the_stream_kernel(stream_here):
    x = torch.randn(1, 600, 3072, dtype=torch.bfloat16, device="cuda")
    x[0, 17] = 0
    scale = torch.randn(1, 3072, dtype=torch.bfloat16, device="cuda")
    shift = torch.zeros(1, 3072, dtype=torch.bfloat16, device="cuda")
    assert _launch(dict(x=x, scale=scale, shift=shift)).instance.kernel == "modulated_norm_stream"
    y, y_scale = ditops.norm_scale_shift_fp8(x, scale, shift, backend="cuda")
    _, want_scale = ditops.norm_scale_shift_fp8(x, scale, shift, backend="reference")
    assert y_scale[0, 17, 0].item() == want_scale[0, 17, 0].item() == (torch.tensor(1e-12) / 448).item()  # float32 division, as stored
    assert not y[0, 17].view(torch.uint8).any()
