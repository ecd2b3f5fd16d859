"""Triton kernels of `moekit.ops.moe_experts`: row movement between token order and expert order.

Legend: R output rows, J source rows summed into each output row, D features.
"""

import triton
import triton.language as tl


@triton.jit
def _sum_rows_kernel(
    src_ptr,
    index_ptr,
    out_ptr,
    num_out_rows,
    num_features,
    rows_per_out,
    stride_src,
    stride_out,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[r, :] = sum over j of src[index[r, j], :], j in ascending order, fp32 accumulator, one
    rounding at the store. One program owns a (BLOCK_R, BLOCK_D) tile of out and is the only writer
    of it, so the summation order is fixed: no atomics, bit-identical results run to run.
    With rows_per_out = 1 this is a plain row gather (exact in any dtype)."""
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_r = offs_r < num_out_rows
    mask_d = offs_d < num_features
    mask_rd = mask_r[:, None] & mask_d[None, :]
    # int64 offsets: rows x stride passes 2^31 elements at real sizes (262144 rows x 7168 features).
    offs_r64 = offs_r.to(tl.int64)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for j in range(0, rows_per_out):
        src_rows = tl.load(index_ptr + offs_r64 * rows_per_out + j, mask=mask_r, other=0).to(tl.int64)
        vals = tl.load(src_ptr + src_rows[:, None] * stride_src + offs_d[None, :], mask=mask_rd, other=0.0)
        acc += vals.to(tl.float32)
    tl.store(out_ptr + offs_r64[:, None] * stride_out + offs_d[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask_rd)
