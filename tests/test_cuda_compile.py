"""Every CUDA kernel instance the registry can select compiles with NVRTC to machine code for
the archs where it can select it: sm_80 and sm_90, and the FP8 kernels on the archs whose
hardware converts to their format (registry.yaml's fp8_formats: OCP e4m3 on sm_89 and sm_90,
sm_89 the first GPU that converts to it in one instruction; e4m3fnuz instances are AMD's, whose
compiles test_rocm_compile.py checks), with no GPU: a real cubin (ELF for the CUDA machine)
holding the kernel, within the register file and with nothing in local memory (no spills, no
stack frame). That takes minutes on a CPU: it runs under ``-m exhaustive``, a test per arch,
source file and activation dtype, compiling PROGRAM_SIZE instances to an NVRTC program; the
default run compiles a few instances for sm_90, one at a time as the backend does."""

import itertools
import struct

import pytest
import torch

from ditops import conformance
from ditops.backends import compiled
from ditops.dispatch import fp8_dtypes, parse_arch
from ditops.ops import OPS, ordered_arguments
from ditops.opspec import SPECS

nvrtc = pytest.importorskip("ditops.backends.cuda.nvrtc")

EM_CUDA = 190  # ELF e_machine of NVIDIA cubins
INSTANCES = compiled.all_instances() + compiled.stream_instances()
SMOKE = (
    compiled.row_instance("modulated_norm", torch.bfloat16, torch.bfloat16, 3072, True),  # FLUX's norm, with an affine
    compiled.row_instance("modulated_norm", torch.bfloat16, torch.bfloat16, 3072, True, torch.float8_e4m3fn),  # its FP8 form
    # Qwen-Image-Edit's select norm and Z-Image's sandwich norm (float32 modulation), FP8 forms
    compiled.row_instance("selected_modulation_norm", torch.bfloat16, torch.bfloat16, 3072, True, torch.float8_e4m3fn),
    compiled.row_instance("gated_add_norm", torch.bfloat16, torch.float32, 3840, True, torch.float8_e4m3fn),
    compiled.quantize_instance(torch.bfloat16, torch.float8_e4m3fn, True, 12288),  # FLUX's MLP activation
    compiled.quantize_instance(torch.bfloat16, torch.float8_e4m3fn, True, 3072 + 12288, True),  # FLUX's single block
    compiled.rotary_instance(torch.bfloat16, 64, True, False, True),  # CogVideoX's q/k LayerNorm + RoPE
    compiled.rotary_token_norm_instance(torch.bfloat16, False, 5120, True),  # a LayerNorm per token
    compiled.rotary_token_norm_instance(torch.bfloat16, False, 4096, False, True),  # LTX-2's, a cos/sin row per head
    compiled.rotary_instance(torch.bfloat16, 128, False, True, False, True),  # LTX-2's rope_, a row per head
    compiled.stream_instance(torch.bfloat16, torch.bfloat16, torch.float8_e4m3fn, False,  # FLUX's FP8 norm on an H200
                             compiled._launch_settings()["modulated_norm_stream"]["H200"][1], 3072),
)
ARCHS = ("sm_80", "sm_89", "sm_90")
# Instances per NVRTC program: on a CI machine gated_add_norm's took 0.37 s each compiled one per
# program, 0.32 s 16 per program, 0.34 s 66 per program.
PROGRAM_SIZE = 16


def compiled_for(arch: str, instance) -> bool:
    """Whether the cuda backend can select ``instance`` on ``arch`` (sm_89's instances without
    an FP8 output are sm_80's and sm_90's code for a GPU between them: not compiled again)."""
    formats = [compiled.FP8_TYPES[dtype] for dtype in fp8_dtypes(parse_arch(arch))]
    fp8 = [name for name in compiled.FP8_TYPES.values() if name in instance.template_arguments]
    return bool(set(fp8) & set(formats)) if fp8 else arch != "sm_89"


GROUPS = {}
for _instance in INSTANCES:
    for _arch in ARCHS:
        if compiled_for(_arch, _instance):
            GROUPS.setdefault((_arch, _instance.source, _instance.template_arguments[0]), []).append(_instance)


def check_cubin(cubin: bytes, lowered_names) -> None:
    assert cubin[:4] == b"\x7fELF"
    (machine,) = struct.unpack_from("<H", cubin, 18)
    assert machine == EM_CUDA
    for name in lowered_names:
        assert name.encode() in cubin, f"{name} missing"


def section(cubin: bytes, name: str) -> bytes:
    """The contents of an ELF64 section of a cubin, by name."""
    offset, entry_size, count, names_index = struct.unpack_from("<Q", cubin, 40)[0], *struct.unpack_from("<HHH", cubin, 58)
    headers = [struct.unpack_from("<IIQQQQ", cubin, offset + i * entry_size) for i in range(count)]
    names = headers[names_index]
    for name_at, _, _, _, at, size in headers:
        end = cubin.index(b"\0", names[4] + name_at)
        if cubin[names[4] + name_at:end].decode() == name:
            return cubin[at:at + size]
    raise KeyError(name)


def resource_problems(instance, registers: int, spill_bytes: int, stack_bytes: int) -> list:
    problems = [f"{registers} registers"] if not 0 < registers <= 255 else []
    problems += [f"{spill_bytes} bytes of spills"] if spill_bytes else []
    problems += [f"{stack_bytes} bytes of local-memory stack"] if stack_bytes else []
    return [f"{instance.name_expression}: {problem}" for problem in problems]


@pytest.mark.parametrize("instance", SMOKE, ids=lambda instance: instance.name_expression.replace(" ", ""))
def test_instance_compiles_to_cubin_without_local_memory(instance):
    """The default run's: one instance compiled for sm_90, with ptxas' report."""
    result = nvrtc.compile_instance(instance, "sm_90")
    check_cubin(result.cubin, [result.lowered_name])
    assert not resource_problems(instance, result.registers, result.spill_bytes, result.stack_bytes)


def test_a_batch_reports_each_instance_as_its_own_compile_does():
    """compile_instances' per-instance figures are those of compile_instance (one instance alone)."""
    together = SMOKE[:2]  # FLUX's norm and its FP8 form: one source
    program = nvrtc.compile_instances(together, "sm_90")
    assert not program.other_spills
    for instance in together:
        alone = nvrtc.compile_instance(instance, "sm_90")
        assert (program.lowered_names[instance], *program.resources[instance]) == (
            alone.lowered_name, alone.registers, alone.spill_bytes, alone.stack_bytes)


def test_the_backend_compiles_without_ptxas_report(monkeypatch, tmp_path):
    """The backend's compile (driver.cubin, through the disk cache) asks ptxas for no report: NVRTC
    13.0 left it out of the log in some processes where torch had initialised CUDA (an H200 host),
    and the report's check then failed the compile. Its machine code is the reported compile's."""
    from ditops.backends.cuda import driver

    instance = SMOKE[0]
    reported = nvrtc.compile_instance(instance, "sm_90")
    monkeypatch.setattr(nvrtc, "_log", lambda program: "")  # a log without ptxas' report
    with pytest.raises(nvrtc.CompileError, match="ptxas reported no registers"):
        nvrtc.compile_instance(instance, "sm_90")
    monkeypatch.setenv("DITOPS_CACHE_DIR", str(tmp_path))
    binary, lowered, compiled_now = driver.cubin(instance, "sm_90")
    assert compiled_now and lowered.decode() == reported.lowered_name
    text = f".text.{reported.lowered_name}"
    assert section(binary, text) == section(reported.cubin, text) != b""
    assert list(tmp_path.glob("*.bin")), "stored in the disk cache"


def test_spills_outside_the_entry_functions_are_reported():
    """ptxas lists a device function compiled as a call (not inlined) under each entry function
    that calls it, with its own spills: they are other_spills, which the exhaustive compile test
    fails on, not the caller's. The log is NVRTC 13.5's for a __noinline__ function called from a
    kernel capped at 32 registers. An entry function missing from the log is a CompileError."""
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z4kernILi64EEvPfi' for 'sm_90'
ptxas info    : Function properties for _Z4kernILi64EEvPfi
ptxas         .     1544 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 1544 bytes cumulative stack size
ptxas info    : Compile time = 113.778 ms
ptxas info    : Function properties for _Z3devPfi
ptxas         .     0 bytes stack frame, 1536 bytes spill stores, 4148 bytes spill loads"""
    entries, others = nvrtc.ptxas_report(log, ["_Z4kernILi64EEvPfi"])
    assert entries == {"_Z4kernILi64EEvPfi": (32, 0, 1544)}
    assert others == {"_Z3devPfi": 1536 + 4148}
    with pytest.raises(nvrtc.CompileError, match="no registers or stack frame for entry function _Z3devPfi"):
        nvrtc.ptxas_report(log, ["_Z3devPfi"])


@pytest.mark.exhaustive
@pytest.mark.parametrize("arch, source, dtype", sorted(GROUPS))
def test_every_instance_compiles_to_cubin_without_local_memory(arch, source, dtype):
    instances, problems = GROUPS[arch, source, dtype], []
    for start in range(0, len(instances), PROGRAM_SIZE):
        program = nvrtc.compile_instances(instances[start:start + PROGRAM_SIZE], arch)
        check_cubin(program.cubin, program.lowered_names.values())
        problems += [problem for instance, resources in program.resources.items() for problem in resource_problems(instance, *resources)]
        problems += [f"{name} (no instance's entry function): {spills} bytes of spills" for name, spills in program.other_spills.items()]
    assert not problems, "\n".join(problems)


def test_every_instance_compiles_for_each_arch_that_can_select_it():
    def on(arch: str) -> list:
        return [instance for (where, *_), batch in GROUPS.items() if where == arch for instance in batch]

    plain = [i for i in INSTANCES if not any(name in i.template_arguments for name in compiled.FP8_TYPES.values())]
    e4m3fn = [i for i in INSTANCES if compiled.FP8_TYPES[torch.float8_e4m3fn] in i.template_arguments]
    assert plain and e4m3fn
    assert sorted(on("sm_80"), key=str) == sorted(plain, key=str)
    assert sorted(on("sm_89"), key=str) == sorted(e4m3fn, key=str)
    assert sorted(on("sm_90"), key=str) == sorted(plain + e4m3fn, key=str)


def test_every_call_the_registry_accepts_maps_to_a_tested_instance():
    """The registry lets cuda take D % 8 == 0 up to 16384 and Dh % 8 == 0 up to 256 in any of
    three activation dtypes and one parameter dtype, with or without a norm weight or bias, on
    any device class: each such call's instance is compiled above."""
    tested = set(INSTANCES)
    dtypes = list(compiled.C_TYPES)
    for dtype, param_dtype in itertools.product(dtypes, dtypes):
        for hidden in range(8, 16384 + 1, 8):
            for kernel, affine in itertools.product(compiled.ROW_KERNELS, (False, True)):
                assert compiled.row_instance(kernel, dtype, param_dtype, hidden, affine) in tested
    for dtype, head_size in itertools.product(dtypes, range(8, 256 + 1, 8)):
        assert {compiled.rotary_instance(dtype, head_size, interleaved, streaming, layer)
                for interleaved, streaming, layer in itertools.product((False, True), (False, True), (False, True))} <= tested
    for dtype, interleaved, hidden in itertools.product(dtypes, (False, True), range(8, 8192 + 1, 8)):  # norm_over="token"
        assert {compiled.rotary_token_norm_instance(dtype, interleaved, hidden, layer) for layer in (False, True)} <= tested
    for dtype, fp8_dtype, hidden in itertools.product(dtypes, compiled.FP8_TYPES, range(8, 16384 + 1, 8)):
        assert {compiled.quantize_instance(dtype, fp8_dtype, gelu, hidden, prefix)
                for gelu, prefix in itertools.product((False, True), (False, True))} <= tested
        assert {compiled.row_instance(kernel, dtype, param_dtype, hidden, affine, fp8_dtype)
                for kernel, param_dtype, affine in itertools.product(compiled.ROW_KERNELS, dtypes, (False, True))} <= tested


def test_min_blocks_come_from_the_launch_table_for_16_bit_rows_only():
    """A class's min_blocks (blocks an SM must hold, which caps registers) is the launch table's,
    per kernel, for 16-bit activations; float32 rows, twice the registers, keep 1 (capped as
    tightly they spill: the test above would fail)."""
    for entry in compiled._launch_settings()["rows"]:
        for kernel in compiled.ROW_KERNELS:
            wanted = entry.get("min_blocks", {}).get(kernel, 1)
            for dtype in (torch.float16, torch.bfloat16):
                assert compiled.row_instance(kernel, dtype, torch.float32, entry["max_hidden"], True).template_arguments[6] == wanted
            assert compiled.row_instance(kernel, torch.float32, torch.bfloat16, entry["max_hidden"], True).template_arguments[6] == 1
    assert any(entry.get("min_blocks") for entry in compiled._launch_settings()["rows"])


def test_a_block_that_splits_a_row_group_does_not_compile():
    """96 threads a row in a block of 128 would leave a partial group whose warps read past the
    shared partial sums (seen as wrong results in a sweep): the reduction refuses it."""
    instance = compiled.Instance("modulated_norm.cu", "modulated_norm", ("bfloat16", "bfloat16", "false", 96, 4, 128, 1, "bfloat16"),
                                 128, 96)
    with pytest.raises(nvrtc.CompileError, match="whole groups"):
        nvrtc.compile_instance(instance, "sm_90")


def test_a_row_call_takes_the_affine_instance_exactly_when_it_has_a_weight_or_bias():
    """The instance without an affine compiles the weight and bias away, so a call that has
    either must get the other one: checked on every row-op conformance case's launch (built
    on the CPU, nothing launched). An FP8 call's instance stores y's format."""
    from ditops.backends.cuda import KERNELS

    seen = set()
    for case in conformance.CASES:
        if case.op in ("qk_norm_rope_", "rope_", "quantize_fp8"):  # no norm weight or bias
            continue
        values = case.arguments(torch.bfloat16, "cpu")
        arguments, _ = ordered_arguments(case.op, **values)
        if OPS[case.op].check(*arguments) is None:
            continue  # empty input: nothing is launched
        outputs = OPS[case.op].outputs(*arguments)
        launch = getattr(KERNELS, case.op + "_launch")(*arguments, *outputs)
        affine = any(values.get(name) is not None for name in ("weight", "bias", "weight2", "bias2"))
        assert launch.instance.template_arguments[2] == ("true" if affine else "false"), case.id
        if SPECS[case.op].quantized:
            assert launch.instance.template_arguments[-1] == compiled.FP8_TYPES[outputs[0].dtype], case.id
        seen.add(affine)
    assert seen == {False, True}


def test_a_rope_call_takes_the_layer_norm_and_head_cache_instances_exactly_when_it_needs_them():
    """The RMSNorm instances compile the LayerNorm path away, so each RoPE-op conformance case's
    launch (built on the CPU) takes the LayerNorm instance (the rotary kernels' LAYER flag, their
    last template argument but one) exactly for norm="layer", and passes the call's biases, q's
    then k's, after the weights; rope_ never takes it. Likewise the instance reading a cos/sin
    row per head (HEAD_CACHE, the last) exactly for such a cache, whose strides it is passed:
    position, batch item (0 for one table of every item) and head."""
    from ditops.backends.cuda import KERNELS

    seen = set()
    for case in conformance.CASES:
        if case.op not in ("qk_norm_rope_", "rope_"):
            continue
        values = case.arguments(torch.bfloat16, "cpu")
        arguments, _ = ordered_arguments(case.op, **values)
        if OPS[case.op].check(*arguments) is None:
            continue  # empty input: nothing is launched
        launch = getattr(KERNELS, case.op + "_launch")(*arguments)
        layer = values.get("norm") == "layer"
        assert launch.instance.kernel == ("rotary_token_norm" if values.get("norm_over") == "token" else "rotary"), case.id
        assert launch.instance.template_arguments[-2] == ("true" if layer else "false"), case.id
        biases = [field[0] for field in launch.arguments[4:6]]
        assert all(a is b for a, b in zip(biases, (values.get("q_bias"), values.get("k_bias")))), case.id
        cache = values["cos_sin_cache"]
        per_head = cache.dim() > 2
        assert launch.instance.template_arguments[-1] == ("true" if per_head else "false"), case.id
        batch_stride = cache.stride(0) if cache.dim() == 4 and cache.shape[0] > 1 else 0
        strides = (cache.stride(-3), batch_stride, cache.stride(-2)) if per_head else (cache.stride(0), 0, 0)
        assert launch.arguments[6][0] is cache and launch.arguments[6][2:] == strides, case.id
        seen.add((values.get("norm_over", "head"), layer, values.get("q_bias") is not None, per_head))
    assert {("head", True, True, False), ("head", True, False, False), ("token", True, False, False),
            ("head", False, False, False), ("token", False, False, False), ("head", False, False, True),
            ("token", False, False, True), ("token", True, True, True), ("head", True, True, True)} <= seen


def test_a_quantize_call_takes_the_instance_of_its_format_and_activation():
    """quantize_fp8's launch (built on the CPU) picks the row_quantize instance of y's FP8
    format, with GELU exactly when the call asks for it and the prefix flag exactly when it
    has a prefix, in the row class of its width (P + D with a prefix), and launches that width."""
    from ditops.backends.cuda import KERNELS

    widest = compiled._launch_settings()["rows"][-1]["max_hidden"]
    gelus, prefixes = set(), set()
    for case in conformance.CASES:
        if case.op != "quantize_fp8":
            continue
        for fp8_dtype in compiled.FP8_TYPES:
            values = dict(case.arguments(torch.bfloat16, "cpu"), fp8_dtype=fp8_dtype)
            gelu, prefix = values["activation"] == "gelu_tanh", values["prefix"]
            width = values["x"].shape[-1] + (prefix.shape[-1] if prefix is not None else 0)
            arguments, _ = ordered_arguments(case.op, **values)
            if OPS[case.op].check(*arguments) is None or width > widest:
                continue  # empty input: nothing is launched; wider (FLUX.2's rows): the registry refuses cuda
            launch = KERNELS.quantize_fp8_launch(*arguments, *OPS[case.op].outputs(*arguments))
            assert launch.instance == compiled.quantize_instance(torch.bfloat16, fp8_dtype, gelu, width, prefix is not None)
            assert launch.arguments[2] == width - values["x"].shape[-1] and launch.arguments[-1] == width, case.id
            gelus.add(gelu)
            prefixes.add(prefix is not None)
    assert gelus == prefixes == {False, True}


def test_the_instance_stats_script_reports_the_compiled_registers():
    """scripts/cuda_instance_stats.py (the no-GPU screen for a kernel change) prints what the
    compile reports for the instance a call would take."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "cuda_instance_stats.py"
    result = subprocess.run([sys.executable, str(script), "modulated_norm", "--hidden", "3072", "--affine"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    instance = compiled.row_instance("modulated_norm", torch.bfloat16, torch.bfloat16, 3072, True)
    expected = nvrtc.compile_instance(instance, "sm_90")
    assert f"{instance.name_expression} for sm_90: {expected.registers} registers, 0 bytes of spills" in result.stdout


def test_divisor_gives_the_exact_quotient_of_every_index_below_2_31():
    """rotary.cu divides slot and row indices by multiplying (Divisor in memory.cuh): the high
    32 bits of 2 * n * multiplier, shifted right by shift, must be n // d for every n < 2**31 and
    every d the launch code passes (here: all d up to 4096, powers of two and their neighbours,
    random d; n at the edges of the range and of the last quotient, and random n)."""
    rng = torch.Generator().manual_seed(0)
    divisors = set(range(1, 4097)) | {2**k + j for k in range(1, 31) for j in (-1, 0, 1)} | {2**31 - 1}
    divisors |= {int(d) for d in torch.randint(1, 2**31, (2000,), generator=rng)}
    for d in sorted(divisors):
        multiplier, shift = compiled.divisor(d)
        assert 0 < multiplier < 2**32
        last = (2**31 - 1) // d * d  # the largest multiple of d below 2**31
        values = {0, 1, d - 1, d, d + 1, last - 1, last, 2**31 - 1} | {int(n) for n in torch.randint(0, 2**31, (20,), generator=rng)}
        for n in values:
            if 0 <= n < 2**31:
                assert ((2 * n * multiplier) >> 32) >> shift == n // d, (n, d)


def test_rotary_calls_whose_padded_slots_reach_2_31_are_refused():
    """Divisor is exact below 2**31 only, and the last block's padding slots are divided too
    (they store nothing only if their row comes out past the end): a call whose grid reaches
    2**31 slots is a ValueError even where its own slots stay below (expanded views: no memory)."""
    from ditops.backends.cuda import KERNELS

    cache = torch.empty(16, 80)
    head = torch.empty(1, 1, 80, dtype=torch.bfloat16)  # Dh 80 NeoX: 24 slots a block, which 2**31 is no multiple of
    launch = KERNELS.rope__launch(head.expand(2**31 - 8, 1, 80), None, cache, None, False, 80, 0)
    assert launch.grid[0] * 24 <= 2**31
    with pytest.raises(ValueError, match=r"q: 2147483647 tokens make 2147483664 head slots"):
        KERNELS.rope__launch(head.expand(2**31 - 1, 1, 80), None, cache, None, False, 80, 0)


def _rotary_table(monkeypatch, streaming_stores):
    """The compiled launch table with the rotary kernel's streaming-store token range replaced."""
    settings = {**compiled._launch_settings()}
    settings["rotary"] = {**settings["rotary"], "streaming_stores": streaming_stores}
    monkeypatch.setattr(compiled, "_launch_settings", lambda: settings)


def test_rotary_calls_in_the_token_range_store_with_the_streaming_hint(monkeypatch):
    """Calls whose B * S lies in the launch table's range take the rotary instance that stores q
    and k with the streaming hint (built on the CPU)."""
    from ditops.backends.cuda import KERNELS
    from ditops.examples import HeadSpec, build

    _rotary_table(monkeypatch, {"min_tokens": 513, "max_tokens": 16384})
    hinted = {}
    for leading in ((512,), (513,), (2, 300), (16384,), (16385,)):
        values = build("rope_", HeadSpec(leading, 4, 2, 64), torch.bfloat16, "cpu", torch.Generator().manual_seed(0))
        arguments, _ = ordered_arguments("rope_", **values)
        hinted[leading] = KERNELS.rope__launch(*arguments).instance.template_arguments[5]
    assert hinted == {(512,): "false", (513,): "true", (2, 300): "true", (16384,): "true", (16385,): "false"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches the kernel")
def test_streaming_stores_change_no_result(monkeypatch):
    """The streaming hint is a cache policy: every RoPE conformance case the cuda backend takes
    gives the same bits in every dtype with it on every call and on none."""
    written = {}
    for hint, streaming_stores in (("on", {"min_tokens": 0, "max_tokens": 2**62}), ("off", None)):
        _rotary_table(monkeypatch, streaming_stores)
        for case in conformance.CASES:
            if case.op not in ("qk_norm_rope_", "rope_"):
                continue
            for dtype in conformance.DTYPES:
                arguments, _ = ordered_arguments(case.op, **case.arguments(dtype, "cuda"))
                features = OPS[case.op].check(*arguments)
                taking = [i for i in conformance.implementations_of(case.op, "cuda") if features and not i.refusal(features)]
                if not taking:
                    continue  # nothing launched, or served by another backend (e.g. misaligned views)
                taking[0].kernel(*arguments)
                written.setdefault((case.id, dtype), {})[hint] = [t.clone() for t in arguments[:2] if t is not None]
    assert len(written) > 20
    for key, runs in written.items():
        assert all(conformance._bitwise_equal(a, b) for a, b in zip(runs["on"], runs["off"])), key
