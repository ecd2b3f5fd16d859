"""Host side of the row kernels (`moekit.ops.kernels.rows`): the one row primitive of the package and the
zeroing of padding rows, planned and launched by the recipe of `moekit.ops.runtime.launch`.

Legend: D features of a row; J source rows summed into each output row.
"""

from __future__ import annotations

import torch
import triton

from moekit.ops.kernels.rows import gather_sum_rows_kernel, zero_rows_from_kernel
from moekit.ops.runtime.configs import ROWS, ZERO_ROWS_TILE, rows_tile
from moekit.ops.runtime.launch import Launcher, LaunchPlan, device_ctx, plan_launch, tensor_key

_GATHER_SUM = Launcher(gather_sum_rows_kernel)
_ZERO_ROWS = Launcher(zero_rows_from_kernel)


def _plan_gather_sum(src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None) -> LaunchPlan:
    num_out, per_out = index.shape
    num_features = src.shape[1]
    copy = per_out == 1 and weight is None
    block_rows, block_d = rows_tile(num_features, src.element_size(), copy)
    grid = (triton.cdiv(num_out, block_rows), triton.cdiv(num_features, block_d))
    ints = (num_out, num_features, per_out, src.stride(0), num_features)
    constexprs = dict(
        HAS_WEIGHT=weight is not None,
        COPY=copy,
        BLOCK_ROWS=block_rows,
        BLOCK_D=block_d,
        UNROLL_J=1 if copy else ROWS["UNROLL_J"],
        num_warps=ROWS["num_warps"],
    )
    return LaunchPlan(_GATHER_SUM, grid, ints, constexprs)


def gather_sum_rows(src: torch.Tensor, index: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """out (rows of index, D): out[r] = sum over j of (weight[r, j] *) src[index[r, j]], j in ascending
    order, fp32 sums, one rounding, in src's dtype (J = 1 without weight: a gather, the values as they
    are, in any dtype the kernel can load). src (S, D) with unit column stride; index (rows, J)
    integer, contiguous, every value in [0, S) (not checked: the values stay on the device); weight
    (rows, J) float or None. Deterministic: each output element has one writer."""
    num_out, per_out = index.shape
    out = src.new_empty(num_out, src.shape[1])
    if out.numel() == 0:
        return out
    if per_out == 0:
        return out.zero_()
    key = (tensor_key(src), tensor_key(index), tensor_key(weight))
    plan = plan_launch("gather_sum_rows", key, lambda: _plan_gather_sum(src, index, weight))
    with device_ctx(src.device):
        plan(src, index, weight if weight is not None else src, out)
    return out


def checked_row_map(rows: torch.Tensor, name: str, source: torch.Tensor, source_name: str) -> torch.Tensor:
    """A row map (each routed row's row of `source`, e.g. its token) as the kernels read it: (M, 1)
    contiguous int32/int64 on the source's device; one-line errors naming `name` otherwise. The values
    are not checked (they stay on the device)."""
    if rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {rows.dtype}")
    if rows.dim() not in (1, 2) or (rows.dim() == 2 and rows.shape[1] != 1):
        raise ValueError(f"{name} must be (M,) or (M, 1), got shape {tuple(rows.shape)}")
    if rows.device != source.device:
        raise ValueError(f"{name} is on {rows.device}, {source_name} on {source.device}")
    return rows.reshape(-1, 1).contiguous()


def zero_rows_from(t: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Rows [end, rows) of t (rows, columns), unit column stride, become zeros in place; `end` is (1,)
    int64 on t's device and never read by the host. Costs the padding rows' bytes, not a pass over t."""
    rows, cols = t.shape
    if rows:
        block_rows, block_cols = ZERO_ROWS_TILE
        with device_ctx(t.device):
            _ZERO_ROWS[(triton.cdiv(rows, block_rows),)](
                t, end, rows, cols, t.stride(0), BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols
            )
    return t
