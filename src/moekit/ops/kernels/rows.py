"""Triton kernels that move rows (jit code only; host code in `moekit.ops.runtime.rows`).

Legend: D features of a row; J source rows summed into each output row.

    gather_sum_rows_kernel  out[r] = sum over j of (weight[r, j] *) src[index[r, j]]: the one row
                            primitive of the package (gather J = 1, combine J = top-k)
    zero_rows_from_kernel   rows [end, rows) of a tensor become zeros, `end` read on the device
"""

import triton
import triton.language as tl


@triton.jit
def gather_sum_rows_kernel(
    src_ptr,
    index_ptr,
    weight_ptr,
    out_ptr,
    num_out_rows,
    num_features,
    rows_per_out,
    stride_src,
    stride_out,
    HAS_WEIGHT: tl.constexpr,
    COPY: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UNROLL_J: tl.constexpr = 1,
):
    """out[r, :] = sum over j of src[index[r, j], :] (times weight[r, j] with HAS_WEIGHT), j in
    ascending order, fp32 accumulator, one rounding at the store. One program owns a (BLOCK_ROWS,
    BLOCK_D) tile of out and is the only writer of it, so the summation order is fixed: no atomics,
    bit-identical results run to run. COPY (rows_per_out = 1, no weight): a plain row gather, the
    values stored as loaded (no fp32 round trip), so any dtype moves bit for bit (FP8 data and scales
    viewed as integers, NaN payloads included). index and weight: (num_out_rows, rows_per_out),
    contiguous. UNROLL_J > 1 unrolls the loop over j by that factor, so that as many source rows'
    loads can be in flight before their sums (the same sums in the same order: the same bits); 1 loads
    one source row after another."""
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_r = pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_r = offs_r < num_out_rows
    mask_d = offs_d < num_features
    mask_rd = mask_r[:, None] & mask_d[None, :]
    # int64 offsets: rows x stride passes 2^31 elements at real sizes (262144 rows x 7168 features).
    offs_r64 = offs_r.to(tl.int64)
    out_ptrs = out_ptr + offs_r64[:, None] * stride_out + offs_d[None, :]
    if COPY:
        src_rows = tl.load(index_ptr + offs_r64, mask=mask_r, other=0).to(tl.int64)
        vals = tl.load(src_ptr + src_rows[:, None] * stride_src + offs_d[None, :], mask=mask_rd)
        tl.store(out_ptrs, vals, mask=mask_rd)
        return
    acc = tl.zeros((BLOCK_ROWS, BLOCK_D), dtype=tl.float32)
    for j in tl.range(0, rows_per_out, loop_unroll_factor=UNROLL_J):
        src_rows = tl.load(index_ptr + offs_r64 * rows_per_out + j, mask=mask_r, other=0).to(tl.int64)
        vals = tl.load(src_ptr + src_rows[:, None] * stride_src + offs_d[None, :], mask=mask_rd, other=0.0)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + offs_r64 * rows_per_out + j, mask=mask_r, other=0.0).to(tl.float32)
            acc += vals.to(tl.float32) * w[:, None]
        else:
            acc += vals.to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_rd)


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
    """Rows [end, rows) of t (rows, cols) become zeros, where `end` (one int64) is read on the device:
    torch's grouped_mm leaves the padding rows past the last group offset unwritten, and with device
    splits the host does not know that offset (reading it would sync). Every program reads `end` and
    exits unless its block of rows reaches past it, so the traffic is the padding rows' bytes plus one
    int read per program."""
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
