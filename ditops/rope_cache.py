"""Building the cos/sin cache that the RoPE ops read."""

from __future__ import annotations

import numbers

from typing import Optional, Sequence, Union

import torch
from torch import Tensor


def rope_cos_sin_cache(
    positions: Union[int, Tensor],
    rotary_dim: Union[int, Sequence[int]],
    *,
    theta: Union[float, Sequence[float]] = 10000.0,
    dtype: torch.dtype = torch.float32,
    device: Optional[torch.device] = None,
) -> Tensor:
    """The [P, R] cache of the RoPE ops: columns [0, R/2) hold cos, [R/2, R) hold sin.

    - ``positions=P`` (an int): rows for positions 0 .. P-1, one axis of ``rotary_dim`` dims.
    - ``positions`` a 1-D tensor [N]: one row per given position.
    - ``positions`` a 2-D tensor [N, A] and ``rotary_dim`` a list of A even sizes (multi-axis
      RoPE as in FLUX, Wan, HunyuanVideo): one row per token; axis a owns rotary_dim[a] / 2
      consecutive pairs, so R = sum(rotary_dim). ``theta`` may be one value per axis.

    Pair j of an axis with d dims turns by ``position * theta ** (-2j / d)``. Angles are
    computed in float64, then rounded once to ``dtype``.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"rope_cos_sin_cache: dtype is {dtype!r}; wanted a floating torch.dtype")
    if not isinstance(positions, Tensor):
        # Any integer (numpy's too) counts; bool is an int to Python but never a count, and a
        # float (2.5) or a list is a mistake worth naming.
        if isinstance(positions, bool) or not isinstance(positions, numbers.Integral):
            raise ValueError(
                f"rope_cos_sin_cache: positions is a {type(positions).__name__}; "
                "wanted an int count P >= 0 or a tensor [N] or [N, A]"
            )
        positions = int(positions)
        if positions < 0:
            raise ValueError(f"rope_cos_sin_cache: positions is {positions}; wanted a count P >= 0 or a tensor [N] or [N, A]")
        positions = torch.arange(positions, device=device)
    elif positions.dtype.is_complex or positions.dtype == torch.bool:
        raise ValueError(f"rope_cos_sin_cache: positions has dtype {positions.dtype}; wanted integer or real positions")
    if device is not None:  # device= holds for given positions too, not only for a count
        positions = positions.to(device)
    if positions.dim() == 1:
        positions = positions[:, None]
    axes_dims = list(rotary_dim) if isinstance(rotary_dim, (list, tuple)) else [rotary_dim]
    thetas = [float(theta)] * len(axes_dims) if isinstance(theta, (int, float)) else [float(t) for t in theta]
    if positions.dim() != 2 or positions.shape[1] != len(axes_dims) or len(thetas) != len(axes_dims):
        raise ValueError(
            f"rope_cos_sin_cache: positions has shape {list(positions.shape)} with {len(axes_dims)} axis dims "
            f"and {len(thetas)} thetas; wanted [N] or P with one rotary_dim, or [N, A] with A rotary dims and thetas"
        )
    if not axes_dims:
        raise ValueError("rope_cos_sin_cache: rotary_dim is an empty list; wanted at least one even size > 0")
    for axis_theta in thetas:
        if not axis_theta > 0:
            raise ValueError(f"rope_cos_sin_cache: theta {theta!r} has an entry {axis_theta}; wanted values > 0")
    for dims in axes_dims:
        if isinstance(dims, bool) or not isinstance(dims, numbers.Integral) or dims <= 0 or dims % 2:
            raise ValueError(f"rope_cos_sin_cache: rotary_dim {rotary_dim!r} has an entry {dims}; wanted even sizes > 0")
    angles = []
    for axis, (dims, axis_theta) in enumerate(zip(axes_dims, thetas)):
        exponents = torch.arange(0, dims, 2, dtype=torch.float64, device=positions.device) / dims
        angles.append(positions[:, axis, None].to(torch.float64) * axis_theta**-exponents)
    angles = torch.cat(angles, dim=1)
    return torch.cat((angles.cos(), angles.sin()), dim=1).to(dtype)
