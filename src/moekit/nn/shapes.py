"""The (..., features) contract of moekit's modules: the input's last dimension checked in one
place, and the (rows, features) result given back in the input's leading shape without being a
view (FSDP2 warns about modules that return views: an in-place op on one would lose its hooks)."""

from __future__ import annotations

from typing import Any

import torch


def check_last_dim(x: torch.Tensor, name: str, size: int) -> None:
    """Refuse, in one line, an input whose last dimension is not `size` (the argument `name`)."""
    if x.dim() < 1 or x.shape[-1] != size:
        raise ValueError(
            f"input's last dimension is {x.shape[-1] if x.dim() else None}; expected {name}={size} "
            f"(input shape {tuple(x.shape)})"
        )


class _RowsAs(torch.autograd.Function):
    """y (R, D) -> y in `shape` (sharing y's storage and version counter, not a view); the backward
    reshapes the gradient back."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        ctx.rows_shape = y.shape
        return y.reshape(shape).detach()

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        return d_out.reshape(ctx.rows_shape), None


def rows_as(y: torch.Tensor, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """An (R, D) result in `shape` (same elements), differentiable, never a view: `y` itself when the
    shapes agree and y is no view, else a tensor sharing y's storage (a copy if y's strides allow
    no other)."""
    if tuple(shape) == tuple(y.shape) and y._base is None:
        return y
    return _RowsAs.apply(y, tuple(shape))
