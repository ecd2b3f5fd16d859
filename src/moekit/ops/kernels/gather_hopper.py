"""Gluon helpers of Hopper kernels whose rows come through a row map (jit code only): a tile's routed
row r is row idx[r] of a source tensor (`moe_experts`' token of each sorted row), copied into a ring
slot by cp.async instead of TMA.

Why cp.async: Hopper's TMA moves boxes, not rows picked by an index (sm_100's tma.async_gather does),
and one 1-row box per row would be a TMA issue of a few hundred bytes per row from one thread, each
needing its row index as a scalar. Instead a load partition of a whole warp group forms the rows'
64-bit addresses in its threads and copies 16 bytes per thread per copy into the slot's swizzled
buffer, then arrives on the slot's barrier when its copies land (counted arrivals: the barrier
expects one per thread and call besides the TMA's). The consumer fences the generic-proxy writes
before wgmma reads them. Rows outside the tile's group copy nothing and read as zeros.

Users: `glu_hopper` (the fused MLP's forward and backward) and `grouped_gemm_hopper` (the wgrad).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy


@gluon.constexpr_function
def gather_layout(elem_bytes, block_red, num_warps):
    """The layout of a gathered slot: BLOCK_RED columns of a row as 16-byte pieces across a warp's lanes,
    rows across the warps."""
    vec = 16 // elem_bytes
    return gl.BlockedLayout([1, vec], [32 * vec // block_red, block_red // vec], [num_warps, 1], [1, 0])


@gluon.jit
def routed_tokens(idx_ptr, row0, row_lo, row_hi, real, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """(tokens (BLOCK_M,) int32, row mask (BLOCK_M,)) of the routed rows row0 + i, in the row layout of
    `layout`: idx[row] (the source row, below 2**31) for the rows in [row_lo, row_hi) when `real`, 0 for
    the others, whose idx entries are not read (never past offs[N])."""
    offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    mask_m = (offs_m >= row_lo) & (offs_m < row_hi) & real
    token = gl.load(idx_ptr + offs_m, mask=mask_m, other=0)
    return token.to(gl.int32), mask_m


@gluon.jit
def token_rows(src_ptr, stride_src, token, mask_m):
    """(row addresses (BLOCK_M, 1), row mask (BLOCK_M, 1)) of `routed_tokens`' rows of src."""
    return gl.expand_dims(src_ptr + token.to(gl.int64) * stride_src, 1), gl.expand_dims(mask_m, 1)


@gluon.jit
def gathered_rows(
    src_ptr, idx_ptr, stride_src, row0, row_lo, row_hi, real, BLOCK_M: gl.constexpr, layout: gl.constexpr
):
    """(row addresses (BLOCK_M, 1), row mask (BLOCK_M, 1)) of a tile's routed rows row0 + i, each the
    source row idx[row] (the token of a sorted row): `routed_tokens` then `token_rows`. Only the tile's
    own expert's rows; the others copy nothing and read as zeros."""
    token, mask_m = routed_tokens(idx_ptr, row0, row_lo, row_hi, real, BLOCK_M, layout)
    return token_rows(src_ptr, stride_src, token, mask_m)


@gluon.jit
def gather_slot(buf, rows, mask_rows, red0, width, bar, BLOCK_RED: gl.constexpr, layout: gl.constexpr):
    """Copy the reduction columns red0 : red0 + BLOCK_RED of the tile's gathered rows into a ring slot by
    cp.async (one 16-byte copy per thread per 8 columns of 16-bit data), then arrive on the slot's
    barrier when they land (counted arrivals: the barrier expects one per thread of the partition)."""
    elem_bytes: gl.constexpr = buf.dtype.primitive_bitwidth // 8
    VEC: gl.constexpr = 16 // elem_bytes
    red_c = gl.expand_dims(red0 + gl.arange(0, BLOCK_RED, layout=gl.SliceLayout(0, layout)), 0)
    # The column mask in whole 16-byte pieces (8 | width as TMA's 16-byte rows need): one predicate per
    # copy whatever the width's divisibility, so each copy stays 16 bytes wide.
    mask_c = red_c // VEC < width // VEC
    async_copy.async_copy_global_to_shared(buf, rows + red_c, mask=mask_rows & mask_c)
    async_copy.mbarrier_arrive(bar, increment_count=False)
