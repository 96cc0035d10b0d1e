"""What device a tensor lives on, as the registry's constraints see it: vendor and arch.

NVIDIA is recognised from ``torch.version.cuda`` and the compute capability, AMD from
``torch.version.hip`` and ``gcnArchName`` (ROCm builds of torch expose AMD GPUs as
``torch.cuda``). A device can be simulated: inside ``simulated_device("sm_90")`` every tensor
is seen as living on that GPU. Simulated by name, its calls run here on CPU tensors (Triton's
interpreter with ``TRITON_INTERPRET=1``), so the backends that launch through a GPU driver
refuse it (registry.yaml: ``needs_real_device``). Simulated with a ``DeviceInfo``
(``parse_arch``, as ``ditops explain --arch`` does), it describes the real device: dispatch
chooses as that device would, and nothing may run under it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from dataclasses import dataclass
from typing import Iterator, Optional, Union

import torch


def warp_size_of(vendor: str) -> int:
    """Threads that run in lockstep on a vendor's GPU: a warp (32) or an AMD wavefront (64)."""
    return 64 if vendor == "rocm" else 32


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(t: torch.Tensor) -> int:
    """SMs of t's GPU; one for a CPU tensor (a launch planned on a simulated device: Triton's
    interpreter, or the tests of a launch's grid), so that a persistent grid still has blocks."""
    return _multiprocessors(t.device.index) if t.is_cuda else 1


@dataclass(frozen=True)
class DeviceInfo:
    vendor: str  # "cuda" (NVIDIA), "rocm" (AMD) or "cpu"
    arch: str  # "sm_90", "gfx942" or "cpu"
    name: str = ""
    simulated: bool = False
    runs_here: bool = False  # simulated for calls that run on this machine's CPU tensors: no GPU behind them

    @property
    def sm(self) -> Optional[int]:
        """The compute capability as one number (90 for sm_90), None off NVIDIA."""
        return int(self.arch[3:]) if self.vendor == "cuda" else None

    @property
    def is_gpu(self) -> bool:
        return self.vendor != "cpu"

    @property
    def warp_size(self) -> int:
        return warp_size_of(self.vendor)

    def __str__(self) -> str:
        label = f"{self.vendor} {self.arch}" if self.is_gpu else "cpu"
        if self.name:
            label += f" ({self.name})"
        return label + (" [simulated]" if self.simulated else "")


CPU = DeviceInfo("cpu", "cpu")


def parse_arch(arch: str) -> DeviceInfo:
    """``"sm_90"`` / ``"sm90"`` -> NVIDIA, ``"gfx942"`` -> AMD, ``"cpu"`` -> CPU."""
    text = arch.strip().lower()
    if text == "cpu":
        return CPU
    nvidia = re.fullmatch(r"sm_?(\d+)a?", text)
    if nvidia:
        return DeviceInfo("cuda", f"sm_{nvidia.group(1)}", simulated=True)
    if re.fullmatch(r"gfx[0-9a-f]+", text):
        return DeviceInfo("rocm", text, simulated=True)
    raise ValueError(f"device arch {arch!r} is not one of sm_XY (NVIDIA), gfxNNN (AMD) or cpu")


_detected: dict = {}


def _detect_gpu(index: int) -> DeviceInfo:
    properties = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        return DeviceInfo("rocm", properties.gcnArchName.split(":")[0], properties.name)
    return DeviceInfo("cuda", f"sm_{properties.major}{properties.minor}", properties.name)


class _Simulation(threading.local):
    device: Optional[DeviceInfo] = None


_simulation = _Simulation()


def device_of(index: int) -> DeviceInfo:
    """The device behind ``tensor.get_device()`` (-1 for CPU), or the simulated one."""
    simulated = _simulation.device
    if simulated is not None:
        return simulated
    info = _detected.get(index)
    if info is None:
        info = CPU if index < 0 else _detect_gpu(index)
        _detected[index] = info
    return info


def device_info(device) -> DeviceInfo:
    """The DeviceInfo of a torch.device or device string ("cpu", "cuda", "cuda:1")."""
    device = torch.device(device)
    if device.type == "cpu":
        return device_of(-1)
    return device_of(device.index if device.index is not None else torch.cuda.current_device())


def current_device() -> DeviceInfo:
    """The device a new tensor would go to by default: the current GPU if any, else the CPU."""
    return device_of(torch.cuda.current_device() if torch.cuda.is_available() else -1)


@contextlib.contextmanager
def simulated_device(arch: Union[str, DeviceInfo]) -> Iterator[DeviceInfo]:
    """Dispatch as if every tensor were on ``arch``. A name ("sm_90", "gfx942") simulates the
    device for calls that run here on CPU tensors: Triton in its interpreter
    (``TRITON_INTERPRET=1``) and the reference serve them, never a backend that launches through
    a GPU driver. A ``DeviceInfo`` is kept as given: ``parse_arch("gfx942")`` describes that GPU
    for ``explain`` (what it would choose; its calls must not run), a detected one keeps its
    name and is not labelled simulated."""
    if not isinstance(arch, DeviceInfo):
        arch = parse_arch(arch)
        arch = dataclasses.replace(arch, runs_here=arch.is_gpu)
    previous = _simulation.device
    _simulation.device = arch
    try:
        yield _simulation.device
    finally:
        _simulation.device = previous
