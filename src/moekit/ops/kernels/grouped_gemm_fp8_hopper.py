# ruff: noqa: E741  (I and O are the wgrad legend's in/out feature sizes)
"""Gluon kernels of fp8_block's grouped GEMM (forward and dgrad) and grouped weight gradient for Hopper
(sm_90), warp-specialised, with every reduction step's promotion beside MMAs in flight (jit code only;
host code in `moekit.ops.runtime.quantized_gemm`, which launches them where they apply and the Triton
kernels `moekit.ops.kernels.grouped_gemm_fp8.grouped_mm_fp8_kernel` /
`moekit.ops.kernels.grouped_wgrad_fp8.grouped_wgrad_fp8_block_kernel` everywhere else).

Legend as in `moekit.ops.kernels.grouped_gemm_fp8`: M routed rows, N groups (experts); an output tile
is BLOCK_M rows by BLOCK_C columns, its reduction runs in steps of BLOCK_RED; COLS and RED are the
output width and the reduction length.

    c[r] = a_q[r] @ w_q[g]^T (+ bias[g] (* bias_scale[r]))   a_q (M, RED), w_q (N, COLS, RED) -> c (M, COLS)

(the forward: a = x, w = the weight; the dgrad: a = dy, w = the weight transposed), fp8_block's scales:
a has one fp32 scale per row per 128 reduction columns, w[g] one per 128 x 128 tile. A step is one
scale block (BLOCK_RED = 128) and each 128 columns of a tile lie in one weight block, so each step's
FP8 product p_k of those columns is scaled by one factor per row, s_k = sa[r, k] * sb[g, c / 128, k],
and promoted into an fp32 accumulator: acc = fma(p_k, s_k, acc), steps in order (DeepSeek-V3's recipe).

Why a kernel of its own: the product must be complete before it is scaled, and Triton 3.6 keeps at
most half of the steps' MMAs in flight beside a promotion (the Triton kernel's docstring). Here two
math warp groups share each tile, 64 rows each, and each drives its own wgmma:

    wait for the step's ring slot
    issue the MMA of its 64 rows x 128 columns into the product registers (use_acc=False: a fresh
        product; the registers of the previous one, promoted already, so no copies)
    wgmma.wait_group 0                         its own MMA only
    acc = fma(p, s, acc)                       while the tensor cores run the other warp group's MMA
    (a 256-column tile: the same for its second 128 columns, into the same product registers)
    release the slot (one arrival per warp group)

Each warp group waits for its own MMAs only and never for the other's, so the two drift into taking
turns: while one promotes, the other's MMA keeps the tensor cores busy (DeepGEMM's scheme on Hopper).
A promotion (64 FMAs a thread) is far shorter than the other group's MMA (64 x 128 x 128). The other
scheme, one warp group overlapping its own promotion with its next MMA (issue step k, `wait_group 1`,
promote step k-1), needs an MMA in flight across the loop's back edge whose registers the next
iteration reads after that wait; ptxas cannot follow it there and serializes every wgmma of the
kernel (C7514), with or without the first step peeled off the loop (notes/quantized_gemm.md).

The promotion is the Triton kernel's pinned `promote` (inline asm with side effects, so that it stays
after the wait that completes its product). Scales are loaded a step ahead of their use, and a tile's
first step's a tile ahead: before the previous tile's epilogue, so that no tile's first MMA waits for a
global load.

Partitions of one persistent program (the tile schedule is `moekit.ops.kernels.schedule`'s). The load
warp computes each tile's coordinates from the device offsets and hands them to the math warp groups
through a ring of tile records in shared memory (`_put_record` / `_take_record`, a ready and an empty
barrier each), written before the tile's first slot: the math warp groups then run no reduction over
the groups and keep no group vectors, once a tile, which at fine-grained experts (few steps a tile) is
a visible share of a tile's time (notes/quantized_gemm.md). The gated kernel's math warp groups still
compute their own (`tile_coords`).

    load      (1 warp)   TMA loads of the rows' (BLOCK_M, BLOCK_RED) box and the weight's
                         (BLOCK_C, BLOCK_RED) box (2-D view (N * COLS, RED); rows past COLS are the
                         next group's or zeros, and feed only columns that are never stored) into a
                         ring of STAGES slots, running ahead across tile boundaries
    math 0/1  (4 warps   the main loop above on rows 0:64 / 64:128 of each tile, then their
               each)     epilogue: bias, output dtype, and TMA stores of 64 x 128 blocks whose rows all
                         lie in the tile's group (asynchronous, through the warp group's staging tile:
                         they drain during the next tile's main loop), masked pointer stores of a
                         group's last, partial rows (and everywhere when the output's rows are not
                         16-byte aligned)

Padding tiles (the rows offs[N]:M) run no reduction and store zeros.

The same fp32 operations in the same order as the Triton kernel's fp8_block path: the products are the
same m64n128k32 wgmma chains (four k32 steps, the first with a zero accumulator), the promotion the same
fma per element (the Triton kernel's first promotion adds 0 * 0 to 0), the epilogue the same bias
expression and rounding. So the two give the same bits.

The wgrad (`grouped_wgrad_fp8_block_ws_kernel`; legend O, I as in `moekit.ops.kernels.grouped_wgrad_fp8`)

    dw[g] (O, I) = sum over group g's 128-row scale blocks k of p_k * s_dy[k, o] * s_x[k, i],
    p_k = dyt[:, block k] @ xt[:, block k]^T

is the same problem on the transposed operands (`segment_starts`' layout: K-major, as FP8 wgmma needs):
a = dyt (O, pitch), b = xt (I, pitch), a tile of dw (O, I) 128 x 256, a step 128 columns (one scale
block of the group's rows), the same partitions and main loop. The scale is an outer product: each
element's factor is s_dy[o] * s_x[i], then one fma (`grouped_wgrad_fp8.promote_outer`, pinned). The
step's scale rows travel with its operands: the load warp brings s_dy[slot, o0:o0 + 128] and s_x[slot,
i0:i0 + 256] into the ring slot by TMA (1.5 KiB), so a promotion reads them from shared memory (vector
loads at fixed offsets, no address or mask arithmetic, no global latency: with the scales gathered from
global memory by the math warps, each half's promotion waited on them after its MMA). The x scales of a
128-column half are 32 registers a thread in the accumulator's layout, so they are read where used
rather than a step ahead. A group's last, partial step reads its segment's zero tail (segments are
128 columns wide: `grouped_wgrad_fp8.SEGMENT_COLUMNS`), so one whole-extent descriptor of each operand
serves every step. The Triton wgrad's fp32 operations in its order (its extra promotions add 0), so
the same bits.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from moekit.ops.kernels.grouped_gemm import wgrad_tile, with_bias
from moekit.ops.kernels.grouped_gemm_fp8 import promote
from moekit.ops.kernels.grouped_gemm_hopper import output_desc, release_slot, store_halves
from moekit.ops.kernels.grouped_wgrad_fp8 import SEGMENT_COLUMNS, promote_outer, scale_slots, segment_starts
from moekit.ops.kernels.quantize import abs_for_amax, e4m3_tile, fp32_scales
from moekit.ops.kernels.schedule import gluon_group_ids, tile_coords, tile_schedule


@gluon.jit
def _shared_ring(
    dtype: gl.constexpr,
    out_ty: gl.constexpr,
    ROWS: gl.constexpr,
    COLS: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Both kernels' shared memory: a ring of STAGES slots of one reduction step (the (ROWS, BLOCK_RED)
    box of the operand whose rows are the tile's, the (COLS, BLOCK_RED) box of the other), each math warp
    group's own (ROWS / 2, min(COLS, BLOCK_RED)) staging tile for its TMA stores, and the slots' ready
    barriers (one arrival: the load warp's expect) and empty barriers (two: a slot is free once both warp
    groups' MMAs on it are done)."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_RED], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([COLS, BLOCK_RED], dtype)
    SUB: gl.constexpr = COLS if COLS < BLOCK_RED else BLOCK_RED
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS // 2, SUB], out_ty)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, ROWS, BLOCK_RED], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, COLS, BLOCK_RED], b_layout)
    c0_smem = gl.allocate_shared_memory(out_ty, [ROWS // 2, SUB], c_layout)
    c1_smem = gl.allocate_shared_memory(out_ty, [ROWS // 2, SUB], c_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return a_bufs, b_bufs, c0_smem, c1_smem, ready, empty


@gluon.jit
def _load_partition(
    a_ptr,
    b_ptr,
    offs_ptr,
    M,
    COLS,
    RED,
    N,
    stride_am,
    stride_br,
    a_bufs,
    b_bufs,
    ready,
    empty,
    records,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    GLU_BLOCK: gl.constexpr,
    RECORDS: gl.constexpr,
):
    """Each tile's A and B boxes, one reduction step a slot; none for padding tiles. With GLU_BLOCK > 0
    (the gated kernel: COLS = F activation columns, tiles of BLOCK_C / 2 of them) the B box is two boxes
    of BLOCK_C / 2 weight rows, the tile's gate rows and its up rows (`glu_weight_rows`)."""
    SCHED_C: gl.constexpr = BLOCK_C // 2 if GLU_BLOCK > 0 else BLOCK_C
    gl.static_assert(RECORDS == 0 or GLU_BLOCK == 0, "records' column tiles are BLOCK_C wide (`_take_record`)")
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, gluon_group_ids(BLOCK_GROUPS), M, N, COLS, BLOCK_M, SCHED_C
    )
    a_desc = tma.make_tensor_descriptor(
        a_ptr, shape=[M, RED], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_RED], layout=a_bufs.type.layout
    )
    W_ROWS = 2 * COLS if GLU_BLOCK > 0 else COLS  # weight rows a group
    b_desc = tma.make_tensor_descriptor(
        b_ptr,
        shape=[N * W_ROWS, RED],
        strides=[stride_br, 1],
        block_shape=[SCHED_C, BLOCK_RED],
        layout=b_bufs.type.layout,
    )
    nbytes: gl.constexpr = (BLOCK_M + BLOCK_C) * BLOCK_RED * a_ptr.dtype.element_ty.primitive_bitwidth // 8
    red_steps = gl.cdiv(RED, BLOCK_RED)
    it = 0
    j = 0
    for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        g, row_lo, row_hi, row0, c0, pid_c = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, SCHED_C, GROUP_M
        )
        b_row = g * W_ROWS + (glu_weight_rows(c0, GLU_BLOCK) if GLU_BLOCK > 0 else c0)
        if RECORDS > 0:
            _put_record(records, j, g, row_lo, row_hi, row0, pid_c, RECORDS)
            j += 1
        for step in range(red_steps * (g < N).to(gl.int32)):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            red0 = step * BLOCK_RED
            tma.async_copy_global_to_shared(a_desc, [row0, red0], ready.index(slot), a_bufs.index(slot))
            if GLU_BLOCK > 0:
                b_slot = b_bufs.index(slot)
                tma.async_copy_global_to_shared(
                    b_desc, [b_row, red0], ready.index(slot), b_slot.slice(0, SCHED_C, dim=0)
                )
                tma.async_copy_global_to_shared(
                    b_desc, [b_row + GLU_BLOCK, red0], ready.index(slot), b_slot.slice(SCHED_C, SCHED_C, dim=0)
                )
            else:
                tma.async_copy_global_to_shared(b_desc, [b_row, red0], ready.index(slot), b_bufs.index(slot))
            it += 1


@gluon.jit
def _record_ring(RECORDS: gl.constexpr):
    """A ring of RECORDS tile records (8 int32 each: g, row_lo, row_hi, row0, pid_c) in shared memory with a
    ready barrier (the load warp's arrival) and an empty barrier (both math warp groups') each."""
    layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    recs = gl.allocate_shared_memory(gl.int32, [RECORDS, 1, 8], layout)
    rec_ready = gl.allocate_shared_memory(gl.int64, [RECORDS, 1], mbarrier.MBarrierLayout())
    rec_empty = gl.allocate_shared_memory(gl.int64, [RECORDS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(RECORDS):
        mbarrier.init(rec_ready.index(i), count=1)
        mbarrier.init(rec_empty.index(i), count=2)
    return recs, rec_ready, rec_empty


@gluon.jit
def _put_record(records, j, g, row_lo, row_hi, row0, pid_c, RECORDS: gl.constexpr):
    """The load warp: tile j's coordinates (`tile_coords`' column tile pid_c, not its first column) into
    record j % RECORDS once both math warp groups have read the record j - RECORDS that held it."""
    recs, rec_ready, rec_empty = records
    r = j % RECORDS
    mbarrier.wait(rec_empty.index(r), ((j // RECORDS) & 1) ^ 1)
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    k = gl.arange(0, 8, layout=layout)
    v = gl.where(k == 0, g, gl.where(k == 1, row_lo, gl.where(k == 2, row_hi, gl.where(k == 3, row0, pid_c))))
    recs.index(r).reshape([8]).store(v)
    gl.thread_barrier()
    mbarrier.arrive(rec_ready.index(r), count=1)


@gluon.jit
def _take_record(records, j, pred, RECORDS: gl.constexpr, BLOCK_C: gl.constexpr):
    """A math warp group: tile j's (g, row_lo, row_hi, row0, c0) from record j % RECORDS, then its arrival on
    the record's empty barrier; where pred is false (no tile j for this program), neither the wait nor the
    arrival, and the values are not to be used. c0 = pid_c * BLOCK_C here, not stored: so the compiler
    knows c0 a multiple of BLOCK_C, as where it computes `tile_coords` (a first column read from shared
    memory would be any integer, and the epilogue's masked pointer stores of a group's last rows would
    store single elements instead of pairs)."""
    recs, rec_ready, rec_empty = records
    r = j % RECORDS
    mbarrier.wait(rec_ready.index(r), (j // RECORDS) & 1, pred=pred)
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [gl.num_warps()], [0])
    v = recs.index(r).reshape([8]).load(layout)
    k = gl.arange(0, 8, layout=layout)
    g = gl.sum(gl.where(k == 0, v, 0), axis=0)
    row_lo = gl.sum(gl.where(k == 1, v, 0), axis=0)
    row_hi = gl.sum(gl.where(k == 2, v, 0), axis=0)
    row0 = gl.sum(gl.where(k == 3, v, 0), axis=0)
    c0 = gl.sum(gl.where(k == 4, v, 0), axis=0) * BLOCK_C
    gl.thread_barrier()
    mbarrier.arrive(rec_empty.index(r), count=1, pred=pred)
    return g, row_lo, row_hi, row0, c0


@gluon.jit
def glu_weight_rows(c0, GLU_BLOCK: gl.constexpr):
    """fc1's weight row (h's column) of the gate of activation column c0; its up is GLU_BLOCK further
    (`moekit.ops.glu`: GLU blocks of GLU_BLOCK gates then GLU_BLOCK ups, GLU_BLOCK = F for [gate | up])."""
    return (c0 // GLU_BLOCK) * (2 * GLU_BLOCK) + c0 % GLU_BLOCK


@gluon.jit
def _step_scales(
    sa_ptrs, sb_ptr, sb_hi_ptr, step, red_steps, mask_sa, real, hi_ok, stride_bs_red, HALVES: gl.constexpr
):
    """The factors of step `step` for the tile's (up to) two 128-column halves, sa[rows, step] * sb[g, column
    block, step] each (the Triton kernel's product, in its order; sb_ptr / sb_hi_ptr: the halves' weight
    scale blocks at step 0; the second equals the first where HALVES == 1, unused); 0 for rows outside
    the tile's group, on padding tiles (not real), for a second half past COLS (not hi_ok) and past the
    last step."""
    sa, sb0, sb1 = _step_factors(
        sa_ptrs, sb_ptr, sb_hi_ptr, step, red_steps, mask_sa, real, hi_ok, stride_bs_red, HALVES
    )
    return _scale_products(sa, sb0, sb1, HALVES)


@gluon.jit
def _step_factors(
    sa_ptrs, sb_ptr, sb_hi_ptr, step, red_steps, mask_sa, real, hi_ok, stride_bs_red, HALVES: gl.constexpr
):
    """`_step_scales`' loads: (sa[rows, step], sb[g, first block, step], sb[g, second block, step]), 0 where
    `_step_scales` says (the third equals the second where HALVES == 1)."""
    inside = step < red_steps
    sa = gl.load(sa_ptrs + step, mask=mask_sa & inside, other=0.0)
    sb0 = gl.load(sb_ptr + step * stride_bs_red, mask=real & inside, other=0.0)
    if HALVES == 2:
        sb1 = gl.load(sb_hi_ptr + step * stride_bs_red, mask=hi_ok & inside, other=0.0)
    else:
        sb1 = sb0
    return sa, sb0, sb1


@gluon.jit
def _scale_products(sa, sb0, sb1, HALVES: gl.constexpr):
    """`_step_scales`' products of `_step_factors`' loads."""
    s0 = sa * sb0
    if HALVES == 2:
        s1 = sa * sb1
    else:
        s1 = s0
    return s0, s1


@gluon.jit
def _tile_rows(
    g,
    row_lo,
    row_hi,
    row0,
    c0,
    pred,
    N,
    COLS,
    a_scale_ptr,
    b_scale_ptr,
    stride_asm,
    stride_bsg,
    stride_bs_col,
    HALF: gl.constexpr,
    ROWS: gl.constexpr,
    SUB: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    rows_layout: gl.constexpr,
):
    """This warp group's view of the tile a record describes: (real, its first row rows0, its rows offs_m,
    their step-0 row scales' pointers, the mask of those in the tile's group, the first half's weight
    scale block at step 0, whether a second half lies below COLS). Scales of the tile's own rows only
    (other groups' rows read 0; they are never stored); each accumulator's columns lie in one weight
    scale block: one weight scale a step each. Nothing is real where pred is false (no such tile)."""
    real = (g < N) & pred
    rows0 = row0 + HALF * ROWS
    offs_m = rows0 + gl.arange(0, ROWS, layout=rows_layout)
    mask_sa = (offs_m >= row_lo) & (offs_m < row_hi) & real
    sb_ptr = b_scale_ptr + g.to(gl.int64) * stride_bsg + (c0 // BLOCK_RED) * stride_bs_col
    hi_ok = real & (c0 + SUB < COLS)
    return real, rows0, offs_m, a_scale_ptr + offs_m.to(gl.int64) * stride_asm, mask_sa, sb_ptr, hi_ok


@gluon.jit
def _tile_factors(rows, red_steps, stride_bs_col, stride_bs_red, HALVES: gl.constexpr):
    """`_step_factors` of step 0 of the tile whose `_tile_rows` view is `rows` (zeros where that tile is
    not real: a padding tile, or none)."""
    real, _, _, sa_ptrs, mask_sa, sb_ptr, hi_ok = rows
    return _step_factors(
        sa_ptrs, sb_ptr, sb_ptr + stride_bs_col, 0, red_steps, mask_sa, real, hi_ok, stride_bs_red, HALVES
    )


@gluon.jit
def _main_loop(
    a_bufs,
    b_bufs,
    ready,
    empty,
    it,
    sa_ptrs,
    sb_ptr,
    sb_hi_ptr,
    mask_sa,
    real,
    hi_ok,
    red_steps,
    stride_bs_red,
    scale0,
    scale1,
    HALF: gl.constexpr,
    ROWS: gl.constexpr,
    SUB: gl.constexpr,
    HALVES: gl.constexpr,
    STAGES: gl.constexpr,
    mma_layout: gl.constexpr,
):
    """One warp group's reduction of one tile over the ring (the module docstring's loop), from ring
    position `it`: (acc0, acc1, it after the tile), acc1 the second 128-column half's accumulator (acc0
    again where HALVES == 1). sa_ptrs: the warp group's rows' scales at step 0; sb_ptr / sb_hi_ptr: the
    halves' weight scale blocks at step 0 (`_step_scales`); scale0 / scale1: step 0's factors, which the
    caller loads (the forward a tile ahead)."""
    prod = gl.zeros([ROWS, SUB], gl.float32, mma_layout)
    acc0 = gl.zeros([ROWS, SUB], gl.float32, mma_layout)
    if HALVES == 2:
        acc1 = gl.zeros([ROWS, SUB], gl.float32, mma_layout)
    else:
        acc1 = acc0
    for step in range(red_steps * real.to(gl.int32)):
        slot = it % STAGES
        mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
        a_rows = a_bufs.index(slot).slice(HALF * ROWS, ROWS, dim=0)
        # A fresh product (the registers of the last one, promoted already), this warp group's rows.
        prod = warpgroup_mma(
            a_rows, b_bufs.index(slot).slice(0, SUB, dim=0).permute((1, 0)), prod, use_acc=False, is_async=True
        )
        # The next step's scales, a step ahead of their use (their latency behind the MMAs).
        next0, next1 = _step_scales(
            sa_ptrs, sb_ptr, sb_hi_ptr, step + 1, red_steps, mask_sa, real, hi_ok, stride_bs_red, HALVES
        )
        prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
        if HALVES == 1:
            release_slot(empty, it, STAGES)
        # Beside the other warp group's MMA.
        acc0 = promote(acc0, prod, scale0, True)
        if HALVES == 2:
            if hi_ok:  # the second half holds columns below COLS
                prod = warpgroup_mma(
                    a_rows,
                    b_bufs.index(slot).slice(SUB, SUB, dim=0).permute((1, 0)),
                    prod,
                    use_acc=False,
                    is_async=True,
                )
                prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
                acc1 = promote(acc1, prod, scale1, True)
            release_slot(empty, it, STAGES)
            scale1 = next1
        scale0 = next0
        it += 1
    return acc0, acc1, it


@gluon.jit
def _math_partition(
    operands,
    c_smem,
    HALF: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_SCALE: gl.constexpr,
    EPI_TMA: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp group: rows HALF * BLOCK_M / 2 onwards of every tile (BLOCK_M / 2 of them), the main
    loop of the module docstring over the ring, then those rows' epilogue. A tile of 2 x 128 columns
    (two weight scale blocks) is two accumulators of 128 columns, each step two MMAs into the one
    product register set, each promoted with its block's scale before the next is issued. operands:
    the kernel's runtime arguments both math warp groups read, with the ring
    (`grouped_mm_fp8_block_ws_kernel`); c_smem: this warp group's staging tile."""
    a_scale_ptr, b_scale_ptr, c_ptr, bias_ptr, scale_ptr, offs_ptr, M, COLS, RED, N = operands[:10]
    stride_cm, stride_bias_g, stride_asm, stride_bsg, stride_bs_red, stride_bs_col = operands[10:16]
    a_bufs, b_bufs, ready, empty, records = operands[16:]
    _, _, _, _, num_tiles = tile_schedule(offs_ptr, gluon_group_ids(BLOCK_GROUPS), M, N, COLS, BLOCK_M, BLOCK_C)
    ROWS: gl.constexpr = BLOCK_M // 2
    SUB: gl.constexpr = BLOCK_C if BLOCK_C < BLOCK_RED else BLOCK_RED  # columns of one weight scale block
    HALVES: gl.constexpr = BLOCK_C // SUB
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, SUB, 32]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    c_desc = output_desc(c_ptr, c_smem, M, COLS, stride_cm, EPI_TMA)
    red_steps = gl.cdiv(RED, BLOCK_RED)
    it = 0
    # This program's tiles, j-th at tile id program_id + j * NUM_PROGRAMS: the first's record and step 0's
    # scales before the loop, every next one's during the tile before it (before its epilogue), so that a
    # tile's first MMA never waits for a global load.
    n_mine = gl.cdiv(num_tiles - gl.program_id(0), NUM_PROGRAMS)
    g, row_lo, row_hi, row0, c0 = _take_record(records, 0, n_mine > 0, STAGES, BLOCK_C)
    sa, sb0, sb1 = _tile_factors(
        _tile_rows(
            g, row_lo, row_hi, row0, c0, n_mine > 0, N, COLS, a_scale_ptr, b_scale_ptr, stride_asm, stride_bsg,
            stride_bs_col, HALF, ROWS, SUB, BLOCK_RED, rows_layout,
        ),
        red_steps, stride_bs_col, stride_bs_red, HALVES,
    )  # fmt: skip
    for j in range(n_mine):
        # The tile's rows and pointers again, not carried from the factors' loads above: carried, its
        # 64-element vectors would stay live through the previous tile's epilogue.
        real, rows0, offs_m, sa_ptrs, mask_sa, sb_ptr, hi_ok = _tile_rows(
            g, row_lo, row_hi, row0, c0, True, N, COLS, a_scale_ptr, b_scale_ptr, stride_asm, stride_bsg,
            stride_bs_col, HALF, ROWS, SUB, BLOCK_RED, rows_layout,
        )  # fmt: skip
        scale0, scale1 = _scale_products(sa, sb0, sb1, HALVES)
        acc0, acc1, it = _main_loop(
            a_bufs, b_bufs, ready, empty, it, sa_ptrs, sb_ptr, sb_ptr + stride_bs_col, mask_sa, real, hi_ok,
            red_steps, stride_bs_red, scale0, scale1, HALF, ROWS, SUB, HALVES, STAGES, mma_layout,
        )  # fmt: skip
        # The next tile's record and step 0's scales, their loads in flight during this tile's epilogue.
        has_next = j + 1 < n_mine
        g_n, row_lo_n, row_hi_n, row0_n, c0_n = _take_record(records, j + 1, has_next, STAGES, BLOCK_C)
        sa, sb0, sb1 = _tile_factors(
            _tile_rows(
                g_n, row_lo_n, row_hi_n, row0_n, c0_n, has_next, N, COLS, a_scale_ptr, b_scale_ptr, stride_asm,
                stride_bsg, stride_bs_col, HALF, ROWS, SUB, BLOCK_RED, rows_layout,
            ),
            red_steps, stride_bs_col, stride_bs_red, HALVES,
        )  # fmt: skip
        store_halves(
            acc0, acc1, real, g, N, offs_m, c0, rows0, row_lo, row_hi, c_ptr, c_desc, c_smem, bias_ptr, scale_ptr, COLS,
            stride_cm, stride_bias_g, HALVES, HAS_BIAS, HAS_SCALE, EPI_TMA, cols_layout,
        )  # fmt: skip
        g, row_lo, row_hi, row0, c0 = g_n, row_lo_n, row_hi_n, row0_n, c0_n
    if EPI_TMA:
        tma.store_wait(0)


@gluon.jit
def grouped_mm_fp8_block_ws_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    bias_ptr,
    scale_ptr,
    offs_ptr,
    M,
    COLS,
    RED,
    N,
    stride_am,
    stride_br,
    stride_cm,
    stride_bias_g,
    stride_asm,
    stride_bsg,
    stride_bs_red,
    stride_bs_col,
    HAS_BIAS: gl.constexpr,
    HAS_SCALE: gl.constexpr,
    EPI_TMA: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    MATH_REGS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
):
    """c (M, COLS) = dequant(a) (M, RED) @ dequant(w[g])^T per group with fp8_block's scales, padding
    rows zero: `grouped_mm_fp8_kernel`'s fp8_block path (TRANS_B, BLOCK_SCALES, SCALE_BLOCK = BLOCK_RED
    = 128) with TMA loads.

    a: (M, RED) float8 E4M3, row stride stride_am, unit column stride; a_scale: fp32, row r's scale of
    reduction block j at a_scale_ptr + r * stride_asm + j. b: (N, COLS, RED) float8, contiguous (row
    stride stride_br, groups COLS rows apart: read through its 2-D view); b_scale: fp32, the scale of
    w[g]'s block (c // 128, j) at b_scale_ptr + g * stride_bsg + j * stride_bs_red + (c // 128) *
    stride_bs_col. c: (M, COLS) in the output dtype, row stride stride_cm (EPI_TMA: TMA stores of the
    64-row blocks inside a group, needs a 16-byte aligned row stride and base); bias (N, COLS) row stride stride_bias_g
    and its per-row scale (M,) as the Triton kernel's. offs: (N + 1,) int64 device offsets. Needs
    BLOCK_RED = 128 (a step is a scale block), BLOCK_M = 128 (two warp groups of 64 rows), BLOCK_C a
    divisor of 128 or 256 (two weight scale blocks), TMA-aligned a and b (16-byte row strides and bases),
    N * COLS < 2**31. num_warps = 4 (math warp group 0; group 1 and the load warp are workers with
    MATH_REGS and LOAD_REGS registers a thread).
    """
    gl.static_assert(
        BLOCK_RED % BLOCK_C == 0 or BLOCK_C == 2 * BLOCK_RED, "a tile is in one weight scale block, or two whole ones"
    )
    gl.static_assert(BLOCK_M == 128, "two math warp groups of 64 rows")
    a_bufs, b_bufs, c0_smem, c1_smem, ready, empty = _shared_ring(
        a_ptr.dtype.element_ty, c_ptr.dtype.element_ty, BLOCK_M, BLOCK_C, BLOCK_RED, STAGES
    )
    records = _record_ring(STAGES)
    operands = (
        a_scale_ptr, b_scale_ptr, c_ptr, bias_ptr, scale_ptr, offs_ptr, M, COLS, RED, N, stride_cm, stride_bias_g,
        stride_asm, stride_bsg, stride_bs_red, stride_bs_col, a_bufs, b_bufs, ready, empty, records,
    )  # fmt: skip
    # The runtime arguments travel as one tuple; each partition's constexprs are written out in its own
    # tuple (a tuple built in the kernel would not keep them constexpr), so the two math partitions'
    # entries differ only in their staging tile and index.
    gl.warp_specialize(
        [
            (_math_partition, (operands, c0_smem, 0, HAS_BIAS, HAS_SCALE, EPI_TMA, BLOCK_M, BLOCK_C, BLOCK_RED,
                               GROUP_M, BLOCK_GROUPS, NUM_PROGRAMS, STAGES)),
            (_math_partition, (operands, c1_smem, 1, HAS_BIAS, HAS_SCALE, EPI_TMA, BLOCK_M, BLOCK_C, BLOCK_RED,
                               GROUP_M, BLOCK_GROUPS, NUM_PROGRAMS, STAGES)),
            (_load_partition, (a_ptr, b_ptr, offs_ptr, M, COLS, RED, N, stride_am, stride_br, a_bufs, b_bufs, ready,
                               empty, records, BLOCK_M, BLOCK_C, BLOCK_RED, GROUP_M, BLOCK_GROUPS, NUM_PROGRAMS,
                               STAGES, 0, STAGES)),
        ],
        [4, 1],
        [MATH_REGS, LOAD_REGS],
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# fc1 with the gated activation and both rowwise quantizations in its epilogue
# --------------------------------------------------------------------------------------------------


@gluon.jit
def _quantized_block(
    v, offs_m, rows0, mask_m, data_ptr, scale_ptr, stride_data, stride_scale, col0, row_lo, row_hi, c_smem
):
    """fp8_block's rowwise form of v (ROWS, 128) fp32, the columns col0 + [0, 128) of its tensor (col0 a
    multiple of 128: one 1 x 128 block a row): the scale_inv at scale[r, col0 / 128] and the E4M3 bytes,
    for the rows of [row_lo, row_hi) (v's rows: offs_m = rows0 + [0, ROWS); mask_m those in range).
    `group_quantize`'s bytes (the block maxima with NaN read as inf, `fp32_scales`, `e4m3_tile`). The
    NaN fix-up of `e4m3_tile` runs only where one of the warp group's rows has a non-finite maximum (one
    reduction over its rows): elsewhere no product is NaN and the hardware's bytes are torch's. Each branch
    writes its own bytes into the staging tile, so that the compiler does not join the two branches' bytes
    one register a byte (`store_e4m3` says why). The bytes leave through the warp group's staging tile
    c_smem: written in the accumulator's layout, read back 16 consecutive bytes a thread and stored as
    16-byte vectors (stored straight from the accumulator's layout they are single bytes, eight rows
    apart in each warp's store)."""
    ROWS: gl.constexpr = v.shape[0]
    SUB: gl.constexpr = v.shape[1]
    amax = gl.max(abs_for_amax(v), axis=1)
    scale, scale_inv = fp32_scales(amax)
    gl.store(scale_ptr + offs_m.to(gl.int64) * stride_scale + col0 // 128, scale_inv, mask=mask_m)
    s = gl.expand_dims(scale, 1)
    any_nan = gl.max(amax, axis=0) == float("inf")
    store_layout: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // SUB, SUB // 16], [gl.num_warps(), 1], [1, 0])
    gl.thread_barrier()  # every warp is past its reads of the staging tile's last use
    if any_nan:
        c_smem.store(e4m3_tile(v, s, True, True))
    else:
        c_smem.store(e4m3_tile(v, s, False, True))
    gl.thread_barrier()
    qb = c_smem.load(store_layout)
    rows = rows0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, store_layout))
    # col0 is a multiple of 128 (the docstring's contract): 16-byte runs from 16-byte aligned columns.
    cols = gl.max_contiguous(gl.multiple_of(col0 + gl.arange(0, SUB, layout=gl.SliceLayout(0, store_layout)), 16), 16)
    ptrs = data_ptr + gl.expand_dims(rows.to(gl.int64) * stride_data, 1) + gl.expand_dims(cols, 0)
    gl.store(ptrs, qb, mask=gl.expand_dims((rows >= row_lo) & (rows < row_hi), 1))


@gluon.jit
def _glu_epilogue(
    acc_g,
    acc_u,
    real,
    g,
    N,
    offs_m,
    rows0,
    c0,
    gate_col,
    row_lo,
    row_hi,
    bias_ptr,
    probs_ptr,
    a_data_ptr,
    a_scale_ptr,
    h_data_ptr,
    h_scale_ptr,
    F,
    stride_bias_g,
    stride_a_scale,
    stride_h_scale,
    c_smem,
    h_ty: gl.constexpr,
    ACT: gl.constexpr,
    GLU_BLOCK: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    cols_layout: gl.constexpr,
):
    """One warp group's rows of a gated tile: the gate and up accumulators of activation columns c0 +
    [0, 128) (h's columns gate_col + [0, 128) and GLU_BLOCK further) made into h's values as the plain
    epilogue makes them (padding tiles zeros, the bias, h's dtype), then `gated_quantize_kernel`'s
    outputs from those values: h's rowwise form (two blocks; h is its own held form: no clamps) and
    a = ACT(gate, up) (* probs) rounded to h's dtype, quantized rowwise. Stored for the rows of the
    tile's group (on padding tiles the padding rows: zeros, scale 1). h itself is never written."""
    SUB: gl.constexpr = acc_g.shape[1]
    offs_j = gl.arange(0, SUB, layout=cols_layout)
    mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
    rows = (offs_m, rows0, mask_m)
    tile = (row_lo, row_hi, c_smem)
    acc_g = gl.where(real, acc_g, 0.0)
    acc_u = gl.where(real, acc_u, 0.0)
    if HAS_BIAS:
        all_c = offs_j < SUB
        acc_g = with_bias(
            acc_g, bias_ptr, bias_ptr, g, N, offs_m, gate_col + offs_j, mask_m, all_c, stride_bias_g, False
        )
        acc_u = with_bias(
            acc_u, bias_ptr, bias_ptr, g, N, offs_m, gate_col + GLU_BLOCK + offs_j, mask_m, all_c, stride_bias_g, False
        )
    gate = acc_g.to(h_ty).to(gl.float32)
    up = acc_u.to(h_ty).to(gl.float32)
    _quantized_block(gate, *rows, h_data_ptr, h_scale_ptr, 2 * F, stride_h_scale, gate_col, *tile)
    _quantized_block(up, *rows, h_data_ptr, h_scale_ptr, 2 * F, stride_h_scale, gate_col + GLU_BLOCK, *tile)
    out = ACT(gate, up)
    live = mask_m & real
    if HAS_PROBS:
        out = out * gl.expand_dims(gl.load(probs_ptr + offs_m.to(gl.int64), mask=live, other=0.0).to(gl.float32), 1)
    out = gl.where(gl.expand_dims(live, 1), out.to(h_ty).to(gl.float32), 0.0)
    _quantized_block(out, *rows, a_data_ptr, a_scale_ptr, F, stride_a_scale, c0, *tile)


@gluon.jit
def _glu_math_partition(
    operands,
    c_smem,
    HALF: gl.constexpr,
    h_ty: gl.constexpr,
    ACT: gl.constexpr,
    GLU_BLOCK: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp group of the gated kernel: `_main_loop` over tiles of BLOCK_C / 2 activation columns (the
    ring's gate half and up half of the weight rows, one weight scale block each), then `_glu_epilogue`.
    operands: the kernel's runtime arguments both math warp groups read, with the ring
    (`grouped_glu_fp8_block_ws_kernel`); c_smem: this warp group's staging tile."""
    x_scale_ptr, w_scale_ptr, bias_ptr, probs_ptr, offs_ptr, a_data_ptr, a_scale_ptr, h_data_ptr = operands[:8]
    h_scale_ptr, M, F, H, N, stride_bias_g, stride_xsm, stride_wsg, stride_ws_red = operands[8:17]
    stride_ws_col, stride_a_scale, stride_h_scale, a_bufs, b_bufs, ready, empty = operands[17:]
    SUB: gl.constexpr = BLOCK_C // 2
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, gluon_group_ids(BLOCK_GROUPS), M, N, F, BLOCK_M, SUB
    )
    ROWS: gl.constexpr = BLOCK_M // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, SUB, 32]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    red_steps = gl.cdiv(H, BLOCK_RED)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        g, row_lo, row_hi, row0, c0, _ = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, SUB, GROUP_M
        )
        real = g < N
        rows0 = row0 + HALF * ROWS
        offs_m = rows0 + gl.arange(0, ROWS, layout=rows_layout)
        mask_sa = (offs_m >= row_lo) & (offs_m < row_hi) & real
        gate_col = glu_weight_rows(c0, GLU_BLOCK)
        sb_ptr = w_scale_ptr + g.to(gl.int64) * stride_wsg + (gate_col // BLOCK_RED) * stride_ws_col
        sa_ptrs = x_scale_ptr + offs_m.to(gl.int64) * stride_xsm
        sb_up_ptr = sb_ptr + (GLU_BLOCK // BLOCK_RED) * stride_ws_col
        scale_g, scale_u = _step_scales(sa_ptrs, sb_ptr, sb_up_ptr, 0, red_steps, mask_sa, real, real, stride_ws_red, 2)
        acc_g, acc_u, it = _main_loop(
            a_bufs, b_bufs, ready, empty, it, sa_ptrs, sb_ptr, sb_up_ptr, mask_sa, real, real, red_steps,
            stride_ws_red, scale_g, scale_u, HALF, ROWS, SUB, 2, STAGES, mma_layout,
        )  # fmt: skip
        _glu_epilogue(
            acc_g, acc_u, real, g, N, offs_m, rows0, c0, gate_col, row_lo, row_hi, bias_ptr, probs_ptr, a_data_ptr,
            a_scale_ptr, h_data_ptr, h_scale_ptr, F, stride_bias_g, stride_a_scale, stride_h_scale, c_smem, h_ty, ACT,
            GLU_BLOCK, HAS_BIAS, HAS_PROBS, cols_layout,
        )  # fmt: skip


@gluon.jit
def grouped_glu_fp8_block_ws_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    probs_ptr,
    offs_ptr,
    a_data_ptr,
    a_scale_ptr,
    h_data_ptr,
    h_scale_ptr,
    M,
    F,
    H,
    N,
    stride_xm,
    stride_wr,
    stride_bias_g,
    stride_xsm,
    stride_wsg,
    stride_ws_red,
    stride_ws_col,
    stride_a_scale,
    stride_h_scale,
    h_ty: gl.constexpr,
    ACT: gl.constexpr,
    GLU_BLOCK: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    MATH_REGS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
):
    """fc1 of the quantized MLP with the gated activation and both rowwise quantizations in its epilogue:
    h = dequant(x) @ dequant(w1[g])^T (+ b1[g]) as `grouped_mm_fp8_block_ws_kernel` computes it (its main
    loop: the same fp32 values), then, h never written, `gated_quantize_kernel`'s outputs from h's values:
    a = ACT(gate(h), up(h)) (* probs) in h's dtype quantized rowwise into a_data (M, F) / a_scale (M,
    F / 128), and h (its own held form) quantized rowwise into h_data (M, 2F) / h_scale (M, 2F / 128). The
    same bytes as that GEMM followed by `gated_quantize_kernel`; rows past offs[N] zeros with scale 1.

    x: (M, H) float8 with fp8_block scales (x_scale[r, j] at r * stride_xsm + j); w: (N, 2F, H) float8,
    contiguous (row stride stride_wr), gates and ups in GLU blocks of GLU_BLOCK rows (a multiple of 128;
    F for [gate | up]), scales of w[g]'s block (row // 128, j) at g * stride_wsg + j * stride_ws_red +
    (row // 128) * stride_ws_col. bias (N, 2F) in h_ty (row stride stride_bias_g); probs (M,). a_data /
    h_data as bytes (uint8 views), row-major; the scales fp32, row strides stride_a_scale /
    stride_h_scale. A tile is 128 rows by 128 activation columns, whose 128 gate rows and 128 up rows of
    the weight (each one weight scale block) are the ring's 256-row box: the two accumulators of
    `_math_partition`'s 256-column tile are the gate and the up of the same columns. Configuration as
    `grouped_mm_fp8_block_ws_kernel`'s with BLOCK_C = 256; each math warp group's staging tile carries its
    FP8 bytes into 16-byte stores."""
    gl.static_assert(BLOCK_C == 2 * BLOCK_RED, "a tile's gate rows and up rows are one weight scale block each")
    gl.static_assert(BLOCK_M == 128, "two math warp groups of 64 rows")
    gl.static_assert(GLU_BLOCK % BLOCK_RED == 0, "GLU blocks of whole weight scale blocks")
    a_bufs, b_bufs, c0_smem, c1_smem, ready, empty = _shared_ring(
        x_ptr.dtype.element_ty, gl.uint8, BLOCK_M, BLOCK_C, BLOCK_RED, STAGES
    )
    operands = (
        x_scale_ptr, w_scale_ptr, bias_ptr, probs_ptr, offs_ptr, a_data_ptr, a_scale_ptr, h_data_ptr, h_scale_ptr, M,
        F, H, N, stride_bias_g, stride_xsm, stride_wsg, stride_ws_red, stride_ws_col, stride_a_scale, stride_h_scale,
        a_bufs, b_bufs, ready, empty,
    )  # fmt: skip
    # The runtime arguments travel as one tuple; each partition's constexprs are written out in its own
    # tuple (a tuple built in the kernel would not keep them constexpr).
    gl.warp_specialize(
        [
            (
                _glu_math_partition,
                (
                    operands, c0_smem, 0, h_ty, ACT, GLU_BLOCK, HAS_BIAS, HAS_PROBS, BLOCK_M, BLOCK_C, BLOCK_RED,
                    GROUP_M, BLOCK_GROUPS, NUM_PROGRAMS, STAGES,
                ),
            ),
            (
                _glu_math_partition,
                (
                    operands, c1_smem, 1, h_ty, ACT, GLU_BLOCK, HAS_BIAS, HAS_PROBS, BLOCK_M, BLOCK_C, BLOCK_RED,
                    GROUP_M, BLOCK_GROUPS, NUM_PROGRAMS, STAGES,
                ),
            ),
            (
                _load_partition,
                (
                    x_ptr, w_ptr, offs_ptr, M, F, H, N, stride_xm, stride_wr, a_bufs, b_bufs, ready, empty, 0,
                    BLOCK_M, BLOCK_C, BLOCK_RED, GROUP_M, BLOCK_GROUPS, NUM_PROGRAMS, STAGES, GLU_BLOCK, 0,
                ),
            ),
        ],
        [4, 1],
        [MATH_REGS, LOAD_REGS],
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# fp8_block's wgrad: the same main loop over the transposed operands, an outer-product scale a step
# --------------------------------------------------------------------------------------------------


@gluon.jit
def _wgrad_tile(
    tile_id,
    tiles_per_group,
    num_pid_o,
    num_pid_i,
    offs_ptr,
    M,
    offs_g,
    starts_v,
    slots_v,
    GROUP_O: gl.constexpr,
    BO: gl.constexpr,
    BI: gl.constexpr,
):
    """(g, o0, i0, rows, col_lo, slot_lo) of a wgrad tile: `wgrad_tile`'s group and tile origin, the
    group's row count, its first column in the transposed operands (`segment_starts`) and its first
    columnwise scale slot."""
    g, o0, i0, row_lo, row_hi = wgrad_tile(tile_id, tiles_per_group, num_pid_o, num_pid_i, offs_ptr, M, GROUP_O, BO, BI)
    col_lo = gl.sum(gl.where(offs_g == g, starts_v, 0), 0)
    slot_lo = gl.sum(gl.where(offs_g == g, slots_v, 0), 0)
    return g, o0, i0, row_hi - row_lo, col_lo, slot_lo


@gluon.jit
def _wgrad_segments(offs_ptr, M, N, BLOCK_GROUPS: gl.constexpr, SCALE_BLOCK: gl.constexpr):
    """(offs_g, starts_v, slots_v, cols_used): each group's first column in the transposed operands, its
    first columnwise scale slot (the earlier groups' ceil(rows / SCALE_BLOCK) summed) and the columns in
    use (at least 1), as `grouped_wgrad_fp8_block_kernel` computes them."""
    offs_g = gluon_group_ids(BLOCK_GROUPS)
    starts_v, cols_used = segment_starts(offs_ptr, offs_g, M, N)
    slots_v = scale_slots(offs_ptr, offs_g, M, N, SCALE_BLOCK)
    return offs_g, starts_v, slots_v, gl.maximum(cols_used, 1)


@gluon.jit
def _wgrad_load_partition(
    dyt_ptr,
    xt_ptr,
    dy_scale_ptr,
    x_scale_ptr,
    offs_ptr,
    M,
    O,
    I,
    N,
    S,
    stride_dyt,
    stride_xt,
    stride_dys,
    stride_xs,
    a_bufs,
    b_bufs,
    sdy_bufs,
    sx_bufs,
    ready,
    empty,
    BLOCK_O: gl.constexpr,
    BLOCK_I: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_O: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Each tile's dyt (BLOCK_O, BLOCK_RED) and xt (BLOCK_I, BLOCK_RED) boxes and the step's scale rows,
    s_dy[slot, o0:o0 + BLOCK_O] and s_x[slot, i0:i0 + BLOCK_I] (zeros past O and I), one 128-row step of
    the group a slot. A group's last, partial step reads its segment's zero tail in both operands
    (BLOCK_RED divides SEGMENT_COLUMNS), so the whole-extent descriptors serve every step."""
    gl.static_assert(SEGMENT_COLUMNS % BLOCK_RED == 0, "a reduction step stays in its group's segment")
    offs_g, starts_v, slots_v, cols_used = _wgrad_segments(offs_ptr, M, N, BLOCK_GROUPS, BLOCK_RED)
    num_pid_o = gl.cdiv(O, BLOCK_O)
    num_pid_i = gl.cdiv(I, BLOCK_I)
    tiles_per_group = num_pid_o * num_pid_i
    dy_desc = tma.make_tensor_descriptor(
        dyt_ptr,
        shape=[O, cols_used],
        strides=[stride_dyt, 1],
        block_shape=[BLOCK_O, BLOCK_RED],
        layout=a_bufs.type.layout,
    )
    x_desc = tma.make_tensor_descriptor(
        xt_ptr,
        shape=[I, cols_used],
        strides=[stride_xt, 1],
        block_shape=[BLOCK_I, BLOCK_RED],
        layout=b_bufs.type.layout,
    )
    sdy_desc = tma.make_tensor_descriptor(
        dy_scale_ptr, shape=[S, O], strides=[stride_dys, 1], block_shape=[1, BLOCK_O], layout=sdy_bufs.type.layout
    )
    sx_desc = tma.make_tensor_descriptor(
        x_scale_ptr, shape=[S, I], strides=[stride_xs, 1], block_shape=[1, BLOCK_I], layout=sx_bufs.type.layout
    )
    nbytes: gl.constexpr = (BLOCK_O + BLOCK_I) * (BLOCK_RED * dyt_ptr.dtype.element_ty.primitive_bitwidth // 8 + 4)
    it = 0
    for tile_id in range(gl.program_id(0), N * tiles_per_group, NUM_PROGRAMS):
        g, o0, i0, rows, col_lo, slot_lo = _wgrad_tile(
            tile_id, tiles_per_group, num_pid_o, num_pid_i, offs_ptr, M, offs_g, starts_v, slots_v, GROUP_O, BLOCK_O,
            BLOCK_I,
        )  # fmt: skip
        for step in range(gl.cdiv(rows, BLOCK_RED)):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            red0 = col_lo + step * BLOCK_RED
            tma.async_copy_global_to_shared(dy_desc, [o0, red0], ready.index(slot), a_bufs.index(slot))
            tma.async_copy_global_to_shared(x_desc, [i0, red0], ready.index(slot), b_bufs.index(slot))
            tma.async_copy_global_to_shared(sdy_desc, [slot_lo + step, o0], ready.index(slot), sdy_bufs.index(slot))
            tma.async_copy_global_to_shared(sx_desc, [slot_lo + step, i0], ready.index(slot), sx_bufs.index(slot))
            it += 1


@gluon.jit
def _ring_scales(bufs, slot, start, length: gl.constexpr, layout: gl.constexpr):
    """`length` scales from `start` of ring slot `slot`'s scale row (a (1, width) TMA box), in `layout`."""
    width: gl.constexpr = bufs.shape[2]
    return bufs.index(slot).reshape([width]).slice(start, length).load(layout)


@gluon.jit
def _wgrad_math_partition(
    operands,
    c_smem,
    HALF: gl.constexpr,
    EPI_TMA: gl.constexpr,
    BLOCK_O: gl.constexpr,
    BLOCK_I: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_O: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp group: dw rows (o) HALF * BLOCK_O / 2 onwards of every tile, the forward's main loop over
    the ring with each step's product promoted by the outer product of its scales (`promote_outer`,
    pinned: s_dy[o] * s_x[i], then one fma), then the epilogue of dw as an (N * O, I) matrix (rows of
    the tile's group only). Two 128-column halves of BLOCK_I = 256: two accumulators, each step two MMAs
    into the one product register set, each promoted before the next is issued. operands: the kernel's
    runtime arguments both math warp groups read, with the ring and its scale rows
    (`grouped_wgrad_fp8_block_ws_kernel`); c_smem: this warp group's staging tile."""
    dw_ptr, offs_ptr, M, O, I, N, a_bufs, b_bufs, sdy_bufs, sx_bufs, ready, empty = operands
    offs_g, starts_v, slots_v, cols_used = _wgrad_segments(offs_ptr, M, N, BLOCK_GROUPS, BLOCK_RED)
    num_pid_o = gl.cdiv(O, BLOCK_O)
    num_pid_i = gl.cdiv(I, BLOCK_I)
    tiles_per_group = num_pid_o * num_pid_i
    ROWS: gl.constexpr = BLOCK_O // 2
    SUB: gl.constexpr = BLOCK_I if BLOCK_I < BLOCK_RED else BLOCK_RED
    HALVES: gl.constexpr = BLOCK_I // SUB
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, SUB, 32]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
    if EPI_TMA:
        c_desc = tma.make_tensor_descriptor(
            dw_ptr, shape=[N * O, I], strides=[I, 1], block_shape=[ROWS, SUB], layout=c_smem.type.layout
        )
    else:
        c_desc = dw_ptr  # unused without EPI_TMA
    it = 0
    for tile_id in range(gl.program_id(0), N * tiles_per_group, NUM_PROGRAMS):
        g, o0, i0, rows, _, _ = _wgrad_tile(
            tile_id, tiles_per_group, num_pid_o, num_pid_i, offs_ptr, M, offs_g, starts_v, slots_v, GROUP_O, BLOCK_O,
            BLOCK_I,
        )  # fmt: skip
        steps = gl.cdiv(rows, BLOCK_RED)
        offs_o = o0 + HALF * ROWS + gl.arange(0, ROWS, layout=rows_layout)
        hi_ok = i0 + SUB < I
        prod = gl.zeros([ROWS, SUB], gl.float32, mma_layout)
        acc0 = gl.zeros([ROWS, SUB], gl.float32, mma_layout)
        if HALVES == 2:
            acc1 = gl.zeros([ROWS, SUB], gl.float32, mma_layout)
        for _ in range(steps):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            a_rows = a_bufs.index(slot).slice(HALF * ROWS, ROWS, dim=0)
            prod = warpgroup_mma(
                a_rows, b_bufs.index(slot).slice(0, SUB, dim=0).permute((1, 0)), prod, use_acc=False, is_async=True
            )
            # The step's scales from the slot, where used (dy's 2 registers a thread, x's 32 a half: a
            # step ahead they would not fit beside the accumulators), behind this warp group's own MMA.
            s_dy = _ring_scales(sdy_bufs, slot, HALF * ROWS, ROWS, rows_layout)
            s_x = _ring_scales(sx_bufs, slot, 0, SUB, cols_layout)
            prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
            if HALVES == 1:
                release_slot(empty, it, STAGES)
            # Beside the other warp group's MMA.
            acc0 = promote_outer(acc0, prod, s_dy, s_x, True)
            if HALVES == 2:
                if hi_ok:  # the second half holds columns below I
                    prod = warpgroup_mma(
                        a_rows,
                        b_bufs.index(slot).slice(SUB, SUB, dim=0).permute((1, 0)),
                        prod,
                        use_acc=False,
                        is_async=True,
                    )
                    s_x = _ring_scales(sx_bufs, slot, SUB, SUB, cols_layout)
                    prod = warpgroup_mma_wait(num_outstanding=0, deps=(prod,))
                    acc1 = promote_outer(acc1, prod, s_dy, s_x, True)
                release_slot(empty, it, STAGES)
            it += 1

        if HALVES == 1:
            acc1 = acc0  # store_halves reads only acc0
        # dw[g] as rows g * O + o of an (N * O, I) matrix: TMA stores of the 64-row blocks inside O.
        offs_m = g * O + offs_o
        rows0 = g * O + o0 + HALF * ROWS
        store_halves(
            acc0, acc1, True, g, N, offs_m, i0, rows0, g * O, g * O + O, dw_ptr, c_desc, c_smem, dw_ptr, dw_ptr, I, I,
            0, HALVES, False, False, EPI_TMA, cols_layout,
        )  # fmt: skip
    if EPI_TMA:
        tma.store_wait(0)


@gluon.jit
def grouped_wgrad_fp8_block_ws_kernel(
    dyt_ptr,
    xt_ptr,
    dy_scale_ptr,
    x_scale_ptr,
    dw_ptr,
    offs_ptr,
    M,
    O,
    I,
    N,
    S,
    stride_dyt,
    stride_xt,
    stride_dys,
    stride_xs,
    EPI_TMA: gl.constexpr,
    BLOCK_O: gl.constexpr,
    BLOCK_I: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_O: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    MATH_REGS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
):
    """dw[g] (O, I) = sum over group g's 128-row scale blocks k of (dyt[:, block k] @ xt[:, block k]^T) *
    s_dy[slot, :, None] * s_x[slot, None, :], slot = group g's first scale slot + k:
    `grouped_wgrad_fp8_block_kernel` (SCALE_BLOCK = BLOCK_M = 128) with the forward's warp-specialised
    main loop.

    dyt (O, pitch) / xt (I, pitch) float8: `segment_starts`' layout, row strides stride_dyt / stride_xt
    (bytes, multiples of 16), 16-byte aligned bases. dy_scale (S, O) / x_scale (S, I) float32, row strides
    stride_dys / stride_xs, unit column stride (fp8_block's columnwise scales, blocks restarting at each
    group's first row). dw: a contiguous (N, O, I) in the output dtype (EPI_TMA: TMA stores, which need
    I * element size a multiple of 16), N * O < 2**31. offs: (N + 1,) int64 device offsets. A group
    without rows runs no step and stores zeros. Needs BLOCK_RED = 128 (a step is a scale block), BLOCK_O
    = 128 (two math warp groups of 64 rows), BLOCK_I a divisor of 128 or 256. num_warps = 4 (math warp
    group 0; group 1 and the load warp are workers with MATH_REGS and LOAD_REGS registers a thread).
    """
    gl.static_assert(BLOCK_RED == 128, "a reduction step is one 128-row scale block")
    gl.static_assert(BLOCK_RED % BLOCK_I == 0 or BLOCK_I == 2 * BLOCK_RED, "BLOCK_I divides 128, or is 256")
    gl.static_assert(BLOCK_O == 128, "two math warp groups of 64 rows")
    a_bufs, b_bufs, c0_smem, c1_smem, ready, empty = _shared_ring(
        dyt_ptr.dtype.element_ty, dw_ptr.dtype.element_ty, BLOCK_O, BLOCK_I, BLOCK_RED, STAGES
    )
    # Each slot's scale rows, (1, BLOCK_O) of s_dy and (1, BLOCK_I) of s_x, beside its operands.
    scale_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    sdy_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_O], scale_layout)
    sx_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_I], scale_layout)
    operands = (dw_ptr, offs_ptr, M, O, I, N, a_bufs, b_bufs, sdy_bufs, sx_bufs, ready, empty)
    # The runtime arguments travel as one tuple; each partition's constexprs are written out in its own
    # tuple (a tuple built in the kernel would not keep them constexpr).
    gl.warp_specialize(
        [
            (
                _wgrad_math_partition,
                (operands, c0_smem, 0, EPI_TMA, BLOCK_O, BLOCK_I, BLOCK_RED, GROUP_O, BLOCK_GROUPS, NUM_PROGRAMS,
                 STAGES),
            ),
            (
                _wgrad_math_partition,
                (operands, c1_smem, 1, EPI_TMA, BLOCK_O, BLOCK_I, BLOCK_RED, GROUP_O, BLOCK_GROUPS, NUM_PROGRAMS,
                 STAGES),
            ),
            (
                _wgrad_load_partition,
                (
                    dyt_ptr, xt_ptr, dy_scale_ptr, x_scale_ptr, offs_ptr, M, O, I, N, S, stride_dyt, stride_xt,
                    stride_dys, stride_xs, a_bufs, b_bufs, sdy_bufs, sx_bufs, ready, empty, BLOCK_O, BLOCK_I,
                    BLOCK_RED, GROUP_O, BLOCK_GROUPS, NUM_PROGRAMS, STAGES,
                ),
            ),
        ],
        [4, 1],
        [MATH_REGS, LOAD_REGS],
    )  # fmt: skip
