"""Triton kernels of the grouped linear's host-side glue (jit code only; launchers in grouped_linear.py).

`zero_rows_from_kernel` zeroes the padding rows of a (M, X) output, rows [end, M) where `end` is the
last group offset as the device holds it. torch's grouped_mm leaves those rows unwritten, and with
device splits the host does not know `end` (reading it would sync). Every program reads `end` and
exits unless its block of rows reaches past it, so the traffic is the padding rows' bytes plus one
int read per program: proportional to the padding, not a pass over the whole output.
"""

import triton
import triton.language as tl


@triton.jit
def zero_rows_from_kernel(
    t_ptr,
    end_ptr,
    rows,
    cols,
    stride_row,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    pid_row = tl.program_id(0)
    end = tl.load(end_ptr)
    row_start = pid_row * BLOCK_ROWS
    if row_start + BLOCK_ROWS > end:
        offs_row = row_start + tl.arange(0, BLOCK_ROWS)
        mask_row = (offs_row >= end) & (offs_row < rows)
        # int64 addresses: rows * stride_row may pass 2^31 elements on real sizes.
        row_ptrs = t_ptr + offs_row.to(tl.int64)[:, None] * stride_row
        zeros = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=t_ptr.dtype.element_ty)
        for col_start in range(0, cols, BLOCK_COLS):
            offs_col = col_start + tl.arange(0, BLOCK_COLS)
            mask = mask_row[:, None] & (offs_col < cols)[None, :]
            tl.store(row_ptrs + offs_col[None, :], zeros, mask=mask)
