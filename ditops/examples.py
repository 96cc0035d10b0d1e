"""Calls of the ops built from their specs (ditops/opspec.py): ``build`` for a described call
(a RowSpec or HeadSpec of ditops/inputs.py), ``example_arguments`` for the typical call of a
DiT block at a shape, as ``ditops info`` / ``ditops explain`` and the tests use them.

``shape`` is x's [B, S, D] or [S, D] for an op whose inputs are rows (RowSpec), q's [T, H, Dh]
or [B, S, H, Dh] for one whose inputs are heads (HeadSpec).
"""

from __future__ import annotations

import inspect
from typing import Optional, Sequence, Union

import torch

from .inputs import HeadSpec, RowSpec
from .opspec import SPECS

DEFAULT_SHAPES = {name: spec.default_shape for name, spec in SPECS.items()}

HEAD_OPS = tuple(name for name, spec in SPECS.items() if spec.inputs is HeadSpec)


def build(op: str, spec: Union[RowSpec, HeadSpec], dtype, device, generator) -> dict:
    """Keyword arguments of ``ditops.<op>`` for a described call."""
    return SPECS[op].build(spec, dtype, device, generator)


def check_shape(op: str, shape: Sequence[int]) -> tuple:
    """``shape`` as a tuple if it fits op (see the module docstring), else a ValueError saying what fits."""
    if op not in SPECS:
        raise ValueError(f"op must be one of {', '.join(SPECS)}, got {op!r}")
    shape = tuple(shape)
    heads = op in HEAD_OPS
    wanted = "q's T,H,Dh or B,S,H,Dh" if heads else "x's B,S,D or S,D"
    ranks = (3, 4) if heads else (2, 3)
    if len(shape) not in ranks or any(not isinstance(size, int) or size < 0 for size in shape):
        raise ValueError(f"shape for {op} must be {wanted} (sizes >= 0), got {','.join(map(str, shape))}")
    return shape


def typical_spec(op: str, shape: Sequence[int], param_dtype: Optional[torch.dtype] = None) -> Union[RowSpec, HeadSpec]:
    """The described call of a DiT block at ``shape`` (the op spec's ``typical``). With
    param_dtype, every tensor but the activations has that dtype (as in Wan: float32)."""
    return SPECS[op].typical(check_shape(op, shape), param_dtype)


def example_arguments(
    op: str,
    shape: Optional[Sequence[int]] = None,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
    param_dtype: Optional[torch.dtype] = None,
) -> dict:
    """Keyword arguments for ``ditops.<op>`` as a DiT block passes them (``typical_spec``); those
    equal to the op's defaults are left out, so that a caller may pass them (``interleaved=False``)."""
    spec = typical_spec(op, shape or DEFAULT_SHAPES[op], param_dtype)
    arguments = build(op, spec, dtype, device, torch.Generator().manual_seed(seed))
    parameters = inspect.signature(SPECS[op].signature).parameters
    defaults = {name: p.default for name, p in parameters.items() if p.default is not p.empty}
    return {name: value for name, value in arguments.items() if not (name in defaults and _is_default(value, defaults[name]))}


def _is_default(value, default) -> bool:
    if value is None or default is None:
        return value is default
    return not isinstance(value, torch.Tensor) and type(value) is type(default) and value == default
