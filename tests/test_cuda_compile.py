"""Every CUDA kernel instance the registry can select compiles with NVRTC to machine code for
sm_80 and sm_90, with no GPU: a real cubin (ELF for the CUDA machine) holding the kernel,
within the register file and with nothing in local memory (no spills, no stack frame)."""

import struct

import pytest

from ditops.backends.compiled import all_instances

nvrtc = pytest.importorskip("ditops.backends.cuda.nvrtc")

EM_CUDA = 190  # ELF e_machine of NVIDIA cubins
INSTANCES = all_instances()


@pytest.mark.parametrize("instance", INSTANCES, ids=lambda instance: instance.name_expression.replace(" ", ""))
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_instance_compiles_to_cubin_without_local_memory(arch, instance):
    compiled = nvrtc.compile_instance(instance, arch)
    assert compiled.cubin[:4] == b"\x7fELF"
    (machine,) = struct.unpack_from("<H", compiled.cubin, 18)
    assert machine == EM_CUDA
    assert compiled.lowered_name.encode() in compiled.cubin
    assert 0 < compiled.registers <= 255, f"{compiled.registers} registers"
    assert compiled.spill_bytes == 0, f"{compiled.spill_bytes} bytes of spills"
    assert compiled.stack_bytes == 0, f"{compiled.stack_bytes} bytes of local-memory stack"


def test_the_instances_cover_every_dtype_and_row_class():
    names = {instance.name_expression for instance in INSTANCES}
    assert "modulated_norm<bfloat16, float, 64, 6, 128>" in names  # Wan: bf16 rows, fp32 modulation, D=3072 class
    assert "rotary<bfloat16, 16, 128>" in names  # Dh = 80..128
    assert len(names) == len(INSTANCES)
