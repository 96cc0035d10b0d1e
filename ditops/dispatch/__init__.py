"""The dispatcher: registry (YAML), device detection, capability checks, selection, overrides."""

from .device import DeviceInfo, current_device, device_info, device_of, parse_arch, simulated_device
from .features import Features, describe
from .registry import OPS, op_name
from .selector import (
    BackendUnavailable,
    Candidate,
    candidates,
    dispatcher,
    format_table,
    fp8_dtypes,
    load_config,
    reset,
    select,
    use_backend,
)

__all__ = [
    "OPS",
    "BackendUnavailable",
    "Candidate",
    "DeviceInfo",
    "Features",
    "candidates",
    "current_device",
    "describe",
    "device_info",
    "device_of",
    "dispatcher",
    "format_table",
    "fp8_dtypes",
    "load_config",
    "op_name",
    "parse_arch",
    "reset",
    "select",
    "simulated_device",
    "use_backend",
]
