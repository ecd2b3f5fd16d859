# ruff: noqa: E741  (I and O are the legend's in/out feature sizes)
"""Gluon kernels of the grouped GEMM for Hopper (sm_90), warp-specialised (jit code only; host code in
`moekit.ops.runtime.gemm`).

Legend as in `moekit.ops.kernels.grouped_gemm`: M routed rows, N groups (experts), I in_features,
O out_features; a forward/dgrad tile is BLOCK_M rows by BLOCK_C columns of the output (COLS wide),
reduced over RED in steps of BLOCK_RED; a wgrad tile is (BLOCK_O, BLOCK_I) of dw and reduces over its
group's rows BLOCK_M at a time.

    grouped_mm_ws_kernel       c[r] = a[r] @ op(w[g]) (+ bias[g] (* bias_scale[r]))
                               a (M, RED), w (N, B_ROWS, B_COLS) -> c (M, COLS): grouped_mm_kernel's
                               forward (TRANS_B) and dgrad
                               (PINGPONG: compiled as grouped_mm_pingpong_kernel, 128 x 192 tiles,
                               each math warp group a whole tile in turn)
    wgrad_gathered_ws_kernel   dw[g] = dy[rows of g]^T @ x[idx[rows of g]]
                               dy (M, O) in expert order, x (T, I) token rows, idx (M,) -> dw (N, O, I)

The shared pieces of the warp-specialised row-tiled kernels (this module's and
`moekit.ops.kernels.grouped_gemm_fp8_hopper`'s): `release_slot` (a math warp group's arrival on a ring
slot's empty barrier) and `tile_epilogue` (a math warp group's rows of a tile: padding zeros, bias,
output dtype, TMA or masked pointer stores).

## grouped_mm_ws_kernel

Why: at the fused MLP's short reductions (fc2's forward reduces over F, fc1's dgrad over 2F: 4-16
steps of 64) the Triton kernel's fixed cost per tile (the accumulator's drain, the epilogue, the
restart of the wgmma chain: about two reduction steps, notes/grouped_gemm.md) is a third of a tile's
time, and Triton 3.6 does not warp-specialise the loop on Hopper. Here the loads run in a warp of
their own, ahead across tiles, and each of two math warp groups owns 64 rows of the 128 x 256 tile
with its own epilogue, so neither waits for the other's:

    load      (1 warp,   the tile's (BLOCK_M, BLOCK_RED) box of a and two boxes of the weight (the
               or 4)     tile's two column halves), one reduction step a ring slot, running ahead
    math 0/1  (4 warps   wgmma of its 64 rows into two (64, BLOCK_C / 2) fp32 accumulators, each
               each)     step's MMAs in flight while the next slot's are issued; then its rows'
                         epilogue (`tile_epilogue`: TMA stores through its staging tile, drained
                         during the next tile's main loop, or masked pointer stores at a group's
                         last rows)

The weight is read through its 2-D view, the groups one after the other: (N * COLS, RED) boxes
(BLOCK_C / 2, BLOCK_RED), K-major, permuted for wgmma (TRANS_B: w[g] stored (COLS, RED), the forward),
or (N * RED, COLS) boxes (BLOCK_RED, BLOCK_C / 2), MN-major, which wgmma takes as they are (w[g]
stored (RED, COLS), the dgrad). Rows of a K-major box past COLS are the next group's (or zeros past the
last) and feed only columns that are never stored; an MN-major box's rows must stay in the group: RED
a multiple of BLOCK_RED (the host checks). Columns past RED read as zeros (TMA fills them) in both.
Padding tiles (the rows offs[N]:M) load nothing, run no step and store zeros.

Both operands through TMA, fp32 accumulation of m64n128k16 wgmma chains in k order, the Triton kernel's
epilogue (`grouped_gemm.with_bias`) in its order: the products the Triton kernel's sm_90 tile computes
(128 x 256, 64-deep steps), so the same bits.

With PINGPONG each math warp group takes whole 128 x (BLOCK_C0 + BLOCK_C1) tiles in turn (CUTLASS's
ping-pong schedule): its main loop runs while the other group stores its tile, where the shared tile's
two groups store together and the tensor cores wait. Taking turns is a barrier a group (the other arrives
once its main loop has issued its last MMAs). 128 x 192 tiles (accumulators of 128 and 64 columns, 192
registers a thread) read 11 % more operand bytes an output element than 128 x 256 for that overlap.

## wgrad_gathered_ws_kernel

Why: the layer's fc1 weight gradient needs x's rows in expert order, the (M, H) copy the forward never
wrote. The Triton wgrad can read them through the row map (`wgrad_kernel`'s GATHER_X), but its pointer
loads of the wide operand (64 rows x 256 columns a step) run its main loop at about half the TMA
speed, slower than writing the copy first. Here a warp group of its own copies the rows by cp.async
(`moekit.ops.kernels.gather_hopper`) into a ring running ahead of the tensor cores, as the fused MLP's
GATHER variants do, so the copy is never written and the main loop runs at the TMA loop's pace.

Two partitions:

    load   (LOAD_WARPS: 4 or 8 warps) each step's dy boxes (TMA) and the step's x rows (cp.async),
                      into a ring of STAGES slots, running ahead across tiles
    mma    (8 warps)  two accumulators (the tile's halves along O or I) over the ring, wgmma with both
                      operands MN-major in shared memory (dy's box read transposed, x's rows as
                      they lie); at a tile's end the pointer stores of dw[g]'s tile

Rows past a group's end: x's copy nothing and read as zeros; dy's box reads the next group's rows
(finite values times zeros) through one descriptor whose extent ends at offs[N] (the padding rows
past it read as zeros, whatever they hold). A group without rows runs no step and stores zeros.

The products and their order are the Triton wgrad's at its sm_90 tile (128 x 256, 64-row steps,
fp32 accumulation, one wgmma chain per step in k order), so both give the same bits.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from moekit.ops.kernels.gather_hopper import gather_layout, gather_slot, routed_tokens, token_rows
from moekit.ops.kernels.grouped_gemm import wgrad_tile, with_bias
from moekit.ops.kernels.schedule import gluon_group_ids, tile_coords, tile_schedule


@gluon.jit
def release_slot(empty, it, STAGES: gl.constexpr):
    """This warp group's arrival on ring slot `it`'s empty barrier (which expects one from each math warp
    group), once all its warps are past the wait on their MMAs that read the slot."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(it % STAGES), count=1)


@gluon.jit
def store_rows(out, c_ptr, offs_m, offs_c, row_lo, row_hi, COLS, stride_cm):
    """Masked pointer stores of a tile's rows of its group and columns below COLS."""
    mask = gl.expand_dims((offs_m >= row_lo) & (offs_m < row_hi), 1) & gl.expand_dims(offs_c < COLS, 0)
    ptrs = c_ptr + gl.expand_dims(offs_m.to(gl.int64) * stride_cm, 1) + gl.expand_dims(offs_c, 0)
    gl.store(ptrs, out, mask=mask)


@gluon.jit
def tile_epilogue(
    acc,
    real,
    g,
    N,
    offs_m,
    c0,
    rows0,
    row_lo,
    row_hi,
    c_ptr,
    c_desc,
    c_smem,
    bias_ptr,
    scale_ptr,
    COLS,
    stride_cm,
    stride_bias_g,
    HAS_BIAS: gl.constexpr,
    HAS_SCALE: gl.constexpr,
    EPI_TMA: gl.constexpr,
    cols_layout: gl.constexpr,
    STAGED_ROWS: gl.constexpr = False,
):
    """One (ROWS, SUB) accumulator of columns c0: onwards: the Triton kernel's epilogue
    (`grouped_gemm.fwd_epilogue`) in its order (padding rows exact zeros whatever they hold, then the
    bias, none on padding tiles, then the output dtype), stored by TMA (rows all in the group: through
    the warp group's staging tile, asynchronously) or by masked pointer stores. STAGED_ROWS (with
    EPI_TMA): a tile's rows that end inside it (a group's last) also go through the staging tile, read
    back as 16-byte row pieces for the masked stores, where the accumulator's own layout stores pairs
    of elements scattered over 8 rows a warp: the same values, fewer and whole-sector stores."""
    ROWS: gl.constexpr = acc.shape[0]
    SUB: gl.constexpr = acc.shape[1]
    offs_c = c0 + gl.arange(0, SUB, layout=cols_layout)
    acc = gl.where(real, acc, 0.0)
    if HAS_BIAS:
        mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
        acc = with_bias(acc, bias_ptr, scale_ptr, g, N, offs_m, offs_c, mask_m, offs_c < COLS, stride_bias_g, HAS_SCALE)
    out = acc.to(c_ptr.dtype.element_ty)
    if EPI_TMA:
        whole = rows0 + ROWS <= row_hi
        if whole or STAGED_ROWS:
            # The previous store has read the staging tile (every warp waits past it).
            tma.store_wait(0)
            gl.thread_barrier()
            c_smem.store(out)
            if whole:
                fence_async_shared()
                gl.thread_barrier()
                tma.async_copy_shared_to_global(c_desc, [rows0, c0], c_smem)
            else:
                gl.thread_barrier()
                elem_bytes: gl.constexpr = c_ptr.dtype.element_ty.primitive_bitwidth // 8
                pieces: gl.constexpr = gather_layout(elem_bytes, SUB, gl.num_warps())
                rows = rows0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, pieces))
                cols = c0 + gl.arange(0, SUB, layout=gl.SliceLayout(0, pieces))
                store_rows(c_smem.load(pieces), c_ptr, rows, cols, row_lo, row_hi, COLS, stride_cm)
        else:
            store_rows(out, c_ptr, offs_m, offs_c, row_lo, row_hi, COLS, stride_cm)
    else:
        store_rows(out, c_ptr, offs_m, offs_c, row_lo, row_hi, COLS, stride_cm)


@gluon.jit
def output_desc(c_ptr, c_smem, M, COLS, stride_cm, EPI_TMA: gl.constexpr):
    """The (M, COLS) output's TMA descriptor whose boxes are a math warp group's staging tile c_smem (for
    `tile_epilogue`'s stores); without EPI_TMA c_ptr itself, which the epilogue never uses as one."""
    if EPI_TMA:
        return tma.make_tensor_descriptor(
            c_ptr, shape=[M, COLS], strides=[stride_cm, 1], block_shape=c_smem.shape, layout=c_smem.type.layout
        )
    else:
        return c_ptr


@gluon.jit
def store_halves(
    acc0,
    acc1,
    real,
    g,
    N,
    offs_m,
    c0,
    rows0,
    row_lo,
    row_hi,
    c_ptr,
    c_desc,
    c_smem,
    bias_ptr,
    scale_ptr,
    COLS,
    stride_cm,
    stride_bias_g,
    HALVES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_SCALE: gl.constexpr,
    EPI_TMA: gl.constexpr,
    cols_layout: gl.constexpr,
):
    """`tile_epilogue` of a math warp group's accumulators: acc0 at columns c0 onwards and, with HALVES
    == 2, acc1 at the next acc0.shape[1] columns where those start below COLS."""
    SUB: gl.constexpr = acc0.shape[1]
    tile_epilogue(
        acc0, real, g, N, offs_m, c0, rows0, row_lo, row_hi, c_ptr, c_desc, c_smem, bias_ptr, scale_ptr, COLS,
        stride_cm, stride_bias_g, HAS_BIAS, HAS_SCALE, EPI_TMA, cols_layout,
    )  # fmt: skip
    if HALVES == 2 and c0 + SUB < COLS:  # the second half holds columns below COLS
        tile_epilogue(
            acc1, real, g, N, offs_m, c0 + SUB, rows0, row_lo, row_hi, c_ptr, c_desc, c_smem, bias_ptr, scale_ptr,
            COLS, stride_cm, stride_bias_g, HAS_BIAS, HAS_SCALE, EPI_TMA, cols_layout,
        )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# grouped_mm_ws_kernel
# --------------------------------------------------------------------------------------------------


@gluon.jit
def _weight_desc(b_ptr, COLS, RED, N, stride_br, bufs, TRANS_B: gl.constexpr):
    """The weight's 2-D view as a TMA descriptor whose boxes are `bufs`' slots: (N * COLS, RED), K-major
    boxes (TRANS_B), or (N * RED, COLS), MN-major boxes."""
    box: gl.constexpr = [bufs.shape[1], bufs.shape[2]]
    if TRANS_B:
        return tma.make_tensor_descriptor(
            b_ptr, shape=[N * COLS, RED], strides=[stride_br, 1], block_shape=box, layout=bufs.type.layout
        )
    else:
        return tma.make_tensor_descriptor(
            b_ptr, shape=[N * RED, COLS], strides=[stride_br, 1], block_shape=box, layout=bufs.type.layout
        )


@gluon.jit
def _mm_load_partition(
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
    b0_bufs,
    b1_bufs,
    ready,
    empty,
    TRANS_B: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Each tile's a box and its two weight boxes (the tile's first BLOCK_C0 columns into b0_bufs, the
    next BLOCK_C1 into b1_bufs; the slots' shapes say which), one reduction step a slot; none for padding
    tiles. The tiles in the order of `tile_schedule`'s space, this program's every NUM_PROGRAMS-th."""
    BLOCK_C0: gl.constexpr = b0_bufs.shape[1] if TRANS_B else b0_bufs.shape[2]
    BLOCK_C1: gl.constexpr = b1_bufs.shape[1] if TRANS_B else b1_bufs.shape[2]
    BLOCK_C: gl.constexpr = BLOCK_C0 + BLOCK_C1
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, gluon_group_ids(BLOCK_GROUPS), M, N, COLS, BLOCK_M, BLOCK_C
    )
    a_desc = tma.make_tensor_descriptor(
        a_ptr, shape=[M, RED], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_RED], layout=a_bufs.type.layout
    )
    b0_desc = _weight_desc(b_ptr, COLS, RED, N, stride_br, b0_bufs, TRANS_B)
    if BLOCK_C1 == BLOCK_C0:
        b1_desc = b0_desc
    else:
        b1_desc = _weight_desc(b_ptr, COLS, RED, N, stride_br, b1_bufs, TRANS_B)
    nbytes: gl.constexpr = (BLOCK_M + BLOCK_C) * BLOCK_RED * a_ptr.dtype.element_ty.primitive_bitwidth // 8
    red_steps = gl.cdiv(RED, BLOCK_RED)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        g, row_lo, row_hi, row0, c0, _ = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, BLOCK_C, GROUP_M
        )
        for step in range(red_steps * (g < N).to(gl.int32)):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            red0 = step * BLOCK_RED
            tma.async_copy_global_to_shared(a_desc, [row0, red0], ready.index(slot), a_bufs.index(slot))
            if TRANS_B:
                tma.async_copy_global_to_shared(b0_desc, [g * COLS + c0, red0], ready.index(slot), b0_bufs.index(slot))
                tma.async_copy_global_to_shared(
                    b1_desc, [g * COLS + c0 + BLOCK_C0, red0], ready.index(slot), b1_bufs.index(slot)
                )
            else:
                tma.async_copy_global_to_shared(b0_desc, [g * RED + red0, c0], ready.index(slot), b0_bufs.index(slot))
                tma.async_copy_global_to_shared(
                    b1_desc, [g * RED + red0, c0 + BLOCK_C0], ready.index(slot), b1_bufs.index(slot)
                )
            it += 1


@gluon.jit
def _mm_math_partition(
    c_ptr,
    bias_ptr,
    scale_ptr,
    offs_ptr,
    M,
    COLS,
    RED,
    N,
    stride_cm,
    stride_bias_g,
    a_bufs,
    b0_bufs,
    b1_bufs,
    c0_smem,
    c1_smem,
    ready,
    empty,
    turn,
    WG: gl.constexpr,
    PINGPONG: gl.constexpr,
    TRANS_B: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_SCALE: gl.constexpr,
    EPI_TMA: gl.constexpr,
    STAGED_ROWS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Math warp group WG: two accumulators, (ROWS, BLOCK_C0) and (ROWS, BLOCK_C1) (its staging tiles'
    shapes), over the ring, a step's MMAs in flight while the next slot's are issued; then their
    epilogue through the staging tiles (the same bytes: c1_smem is c0_smem or its reinterpretation).

    Shared tile (not PINGPONG): rows WG * BLOCK_M / 2 onwards of every tile of the program, the two
    groups side by side on each slot. Ping-pong: every second tile of the program (its j-th, j = WG,
    WG + 2, ...), all BLOCK_M rows, its main loop only on its turn (turn[WG], which the other group
    arrives on once its main loop has issued its last MMAs), so that its epilogue runs beside the
    other's main loop. A ping-pong tile's first ring slot follows from j alone: the load warp loads the
    tiles in order, every real tile RED / BLOCK_RED steps and the padding tiles (the last of the tile
    space) none, so it is red_steps * min(j, the program's real tiles). Taking turns also keeps a
    group's wait on a slot's ready barrier within one phase of the load warp (a parity names the last
    phase or the one before, never two back)."""
    ROWS: gl.constexpr = c0_smem.shape[0]
    BLOCK_C0: gl.constexpr = c0_smem.shape[1]
    BLOCK_C1: gl.constexpr = c1_smem.shape[1]
    BLOCK_C: gl.constexpr = BLOCK_C0 + BLOCK_C1
    FIRST_ROW: gl.constexpr = 0 if PINGPONG else WG * ROWS
    FIRST_TILE: gl.constexpr = WG * NUM_PROGRAMS if PINGPONG else 0
    TILE_STRIDE: gl.constexpr = 2 * NUM_PROGRAMS if PINGPONG else NUM_PROGRAMS
    offs_g = gluon_group_ids(BLOCK_GROUPS)
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(offs_ptr, offs_g, M, N, COLS, BLOCK_M, BLOCK_C)
    layout0: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_C0, 16]
    )
    layout1: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_C1, 16]
    )
    c0_desc = output_desc(c_ptr, c0_smem, M, COLS, stride_cm, EPI_TMA)
    if PINGPONG:
        c1_desc = output_desc(c_ptr, c1_smem, M, COLS, stride_cm, EPI_TMA)
        # tile_end is non-decreasing: its largest entry below N ends the real tiles.
        num_real = gl.max(gl.where(offs_g < N, tile_end, 0), axis=0)
        real_tiles = gl.cdiv(gl.maximum(num_real - gl.program_id(0), 0), NUM_PROGRAMS)
    else:
        c1_desc = c0_desc
    red_steps = gl.cdiv(RED, BLOCK_RED)
    it = 0
    k = 0
    for tile_id in range(gl.program_id(0) + FIRST_TILE, num_tiles, TILE_STRIDE):
        g, row_lo, row_hi, row0, c0, _ = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, BLOCK_C, GROUP_M
        )
        real = g < N
        rows0 = row0 + FIRST_ROW
        acc0 = gl.zeros([ROWS, BLOCK_C0], gl.float32, layout0)
        acc1 = gl.zeros([ROWS, BLOCK_C1], gl.float32, layout1)
        steps = red_steps * real.to(gl.int32)
        if PINGPONG:
            it = red_steps * gl.minimum(2 * k + WG, real_tiles)
            # Group 0's first turn is free (the barrier's phase before its first).
            mbarrier.wait(turn.index(WG), (k & 1) ^ (1 - WG))
        for step in range(steps):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            a_rows = a_bufs.index(slot).slice(FIRST_ROW, ROWS, dim=0)
            if TRANS_B:  # K-major boxes
                acc0 = warpgroup_mma(a_rows, b0_bufs.index(slot).permute((1, 0)), acc0, is_async=True)
                acc1 = warpgroup_mma(a_rows, b1_bufs.index(slot).permute((1, 0)), acc1, is_async=True)
            else:  # MN-major boxes
                acc0 = warpgroup_mma(a_rows, b0_bufs.index(slot), acc0, is_async=True)
                acc1 = warpgroup_mma(a_rows, b1_bufs.index(slot), acc1, is_async=True)
            # The previous slot's two products are done once at most these two are in flight.
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
            if step > 0:
                release_slot(empty, it - 1, STAGES)
            it += 1
        if PINGPONG:  # the main loop has issued its MMAs: the other group's turn
            gl.thread_barrier()
            mbarrier.arrive(turn.index(1 - WG), count=1)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        if steps > 0:
            release_slot(empty, it - 1, STAGES)
        offs_m0 = rows0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout0))
        tile_epilogue(
            acc0, real, g, N, offs_m0, c0, rows0, row_lo, row_hi, c_ptr, c0_desc, c0_smem, bias_ptr, scale_ptr, COLS,
            stride_cm, stride_bias_g, HAS_BIAS, HAS_SCALE, EPI_TMA, gl.SliceLayout(0, layout0), STAGED_ROWS,
        )  # fmt: skip
        if c0 + BLOCK_C0 < COLS:  # the second accumulator holds columns below COLS
            offs_m1 = rows0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout1))
            tile_epilogue(
                acc1, real, g, N, offs_m1, c0 + BLOCK_C0, rows0, row_lo, row_hi, c_ptr, c1_desc, c1_smem, bias_ptr,
                scale_ptr, COLS, stride_cm, stride_bias_g, HAS_BIAS, HAS_SCALE, EPI_TMA, gl.SliceLayout(0, layout1),
                STAGED_ROWS,
            )  # fmt: skip
        k += 1
    if EPI_TMA:
        tma.store_wait(0)


def _mm_kernel_name(specialization) -> str:
    """The compiled name of `grouped_mm_ws_kernel` (what profilers show): grouped_mm_pingpong_kernel
    under the ping-pong schedule."""
    return "grouped_mm_pingpong_kernel" if specialization.constants["PINGPONG"] else "grouped_mm_ws_kernel"


@gluon.jit(repr=_mm_kernel_name)
def grouped_mm_ws_kernel(
    a_ptr,
    b_ptr,
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
    TRANS_B: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_SCALE: gl.constexpr,
    EPI_TMA: gl.constexpr,
    PINGPONG: gl.constexpr,
    STAGED_ROWS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C0: gl.constexpr,
    BLOCK_C1: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    MATH_REGS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    LOAD_WARPS: gl.constexpr,
):
    """c (M, COLS) = a (M, RED) @ op(w[g]) (+ bias[g] (* bias_scale[r])) per group, padding rows zero:
    `grouped_mm_kernel`'s forward (TRANS_B: w[g] stored (COLS, RED)) and dgrad (w[g] stored (RED, COLS)),
    on BLOCK_M x (BLOCK_C0 + BLOCK_C1) tiles, the shared tile's two math warp groups 64 rows each
    (BLOCK_C0 = BLOCK_C1) or, with PINGPONG, each group whole tiles in turn (`_mm_math_partition`).

    a: (M, RED) bf16/fp16, row stride stride_am, unit column stride. b: the weight, groups one after the
    other with rows stride_br apart (the 2-D view (N * COLS, RED) with TRANS_B, else (N * RED, COLS) and
    RED a multiple of BLOCK_RED), unit last stride. c: (M, COLS) in a's dtype, row stride stride_cm
    (EPI_TMA: TMA stores of a warp group's row blocks inside a group, needs a 16-byte aligned row stride
    and base). bias (N, COLS) row stride stride_bias_g and its per-row scale (M,) as the Triton kernel's.
    offs: (N + 1,) int64 device offsets. TMA-aligned a and b (16-byte row strides and bases), a
    non-empty reduction, the view's rows below 2**31. BLOCK_M = 128 (wgmma m64 row blocks); BLOCK_C0 and
    BLOCK_C1 powers of two (an accumulator's width); num_warps = 4 (math warp group 0; group 1 and the
    load partition are workers with MATH_REGS and LOAD_REGS registers a thread). LOAD_WARPS: the load
    partition's warps, 1 or 4 (one elected thread issues each TMA copy either way; 4 spread the tile
    schedule's group vectors, BLOCK_GROUPS long, over a warp group's lanes, where one warp's registers
    spill them at 512).
    """
    gl.static_assert(BLOCK_M == 128, "wgmma row blocks of 64: two a warp group (PINGPONG) or one")
    gl.static_assert(PINGPONG or BLOCK_C0 == BLOCK_C1, "the shared tile's halves are equal")
    gl.static_assert(BLOCK_C1 <= BLOCK_C0, "the second accumulator stores through the first's staging tile")
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_M if PINGPONG else BLOCK_M // 2
    B0_SHAPE: gl.constexpr = [BLOCK_C0, BLOCK_RED] if TRANS_B else [BLOCK_RED, BLOCK_C0]
    B1_SHAPE: gl.constexpr = [BLOCK_C1, BLOCK_RED] if TRANS_B else [BLOCK_RED, BLOCK_C1]
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_RED], dtype)
    b0_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(B0_SHAPE, dtype)
    b1_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(B1_SHAPE, dtype)
    c0_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_C0], dtype)
    c1_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_C1], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_RED], a_layout)
    b0_bufs = gl.allocate_shared_memory(dtype, [STAGES] + B0_SHAPE, b0_layout)
    b1_bufs = gl.allocate_shared_memory(dtype, [STAGES] + B1_SHAPE, b1_layout)
    # Staging tiles, c<group><accumulator>: each group stores both its accumulators through one tile of
    # its own (the ping-pong's narrower second accumulator through the same bytes, reinterpreted, once
    # the first's store has read them; `_reinterpret` is Gluon's aliasing view in Triton 3.6), so the ring
    # keeps its fourth slot beside them.
    c00_smem = gl.allocate_shared_memory(dtype, [ROWS, BLOCK_C0], c0_layout)
    c10_smem = gl.allocate_shared_memory(dtype, [ROWS, BLOCK_C0], c0_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # A slot is ready on the load warp's expect and its bytes; free once its readers' MMAs on it are done
    # (both groups' on the shared tile, one group's in ping-pong).
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1 if PINGPONG else 2)
    if PINGPONG:
        c01_smem = c00_smem._reinterpret(dtype, [ROWS, BLOCK_C1], c1_layout)
        c11_smem = c10_smem._reinterpret(dtype, [ROWS, BLOCK_C1], c1_layout)
        # turn[w] completes a phase when the other group hands the main loop to group w.
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
    else:
        c01_smem = c00_smem
        c11_smem = c10_smem
        turn = ready  # never waited on or arrived at without PINGPONG
    # The two math partitions' argument tuples differ only in their staging tiles and index, yet are
    # written out: a tuple built in the kernel would not keep its constexprs.
    gl.warp_specialize(
        [
            (
                _mm_math_partition,
                (
                    c_ptr,
                    bias_ptr,
                    scale_ptr,
                    offs_ptr,
                    M,
                    COLS,
                    RED,
                    N,
                    stride_cm,
                    stride_bias_g,
                    a_bufs,
                    b0_bufs,
                    b1_bufs,
                    c00_smem,
                    c01_smem,
                    ready,
                    empty,
                    turn,
                    0,
                    PINGPONG,
                    TRANS_B,
                    HAS_BIAS,
                    HAS_SCALE,
                    EPI_TMA,
                    STAGED_ROWS,
                    BLOCK_M,
                    BLOCK_RED,
                    GROUP_M,
                    BLOCK_GROUPS,
                    NUM_PROGRAMS,
                    STAGES,
                ),
            ),
            (
                _mm_math_partition,
                (
                    c_ptr,
                    bias_ptr,
                    scale_ptr,
                    offs_ptr,
                    M,
                    COLS,
                    RED,
                    N,
                    stride_cm,
                    stride_bias_g,
                    a_bufs,
                    b0_bufs,
                    b1_bufs,
                    c10_smem,
                    c11_smem,
                    ready,
                    empty,
                    turn,
                    1,
                    PINGPONG,
                    TRANS_B,
                    HAS_BIAS,
                    HAS_SCALE,
                    EPI_TMA,
                    STAGED_ROWS,
                    BLOCK_M,
                    BLOCK_RED,
                    GROUP_M,
                    BLOCK_GROUPS,
                    NUM_PROGRAMS,
                    STAGES,
                ),
            ),
            (
                _mm_load_partition,
                (
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
                    b0_bufs,
                    b1_bufs,
                    ready,
                    empty,
                    TRANS_B,
                    BLOCK_M,
                    BLOCK_RED,
                    GROUP_M,
                    BLOCK_GROUPS,
                    NUM_PROGRAMS,
                    STAGES,
                ),
            ),
        ],
        [4, LOAD_WARPS],
        [MATH_REGS, LOAD_REGS],
    )


# --------------------------------------------------------------------------------------------------
# wgrad_gathered_ws_kernel
# --------------------------------------------------------------------------------------------------


@gluon.jit
def _tile_grid(O, I, BLOCK_O: gl.constexpr, BLOCK_I: gl.constexpr):
    """(o tiles, i tiles, tiles a group) of dw's (O, I) grid, which every group owns whole."""
    num_pid_o = gl.cdiv(O, BLOCK_O)
    num_pid_i = gl.cdiv(I, BLOCK_I)
    return num_pid_o, num_pid_i, num_pid_o * num_pid_i


@gluon.constexpr_function
def _wgrad_split(split_o):
    """(SO, SI): how a gathered wgrad tile's two accumulators split it: along O (SPLIT_O: two dy boxes, one
    x slot) or along I (two x slots, one dy box)."""
    return (2, 1) if split_o else (1, 2)


@gluon.jit
def _wgrad_load_partition(
    dy_ptr,
    x_ptr,
    offs_ptr,
    idx_ptr,
    M,
    O,
    I,
    N,
    stride_dym,
    stride_xm,
    dy_bufs,
    x_bufs,
    ready,
    empty,
    BLOCK_O: gl.constexpr,
    BLOCK_I: gl.constexpr,
    BLOCK_M: gl.constexpr,
    GROUP_O: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT_O: gl.constexpr,
):
    """Each step's dy boxes by TMA and its x rows (the row map's entries of the step's routed rows) by
    cp.async, each thread's copies arriving on the slot's barrier."""
    num_pid_o, num_pid_i, tiles_per_group = _tile_grid(O, I, BLOCK_O, BLOCK_I)
    SO: gl.constexpr = _wgrad_split(SPLIT_O)[0]
    SI: gl.constexpr = _wgrad_split(SPLIT_O)[1]
    PART_O: gl.constexpr = BLOCK_O // SO
    PART_I: gl.constexpr = BLOCK_I // SI
    elem_bytes: gl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth // 8
    slot_layout: gl.constexpr = gather_layout(elem_bytes, PART_I, gl.num_warps())
    # Rows past offs[N] (padding, may hold anything) read as zeros.
    rows_used = gl.minimum(gl.maximum(gl.load(offs_ptr + N).to(gl.int32), 1), gl.maximum(M, 1))
    dy_desc = tma.make_tensor_descriptor(
        dy_ptr, shape=[rows_used, O], strides=[stride_dym, 1], block_shape=[BLOCK_M, PART_O], layout=dy_bufs.type.layout
    )
    nbytes: gl.constexpr = BLOCK_M * BLOCK_O * elem_bytes
    it = 0
    for tile_id in range(gl.program_id(0), N * tiles_per_group, NUM_PROGRAMS):
        g, o0, i0, row_lo, row_hi = wgrad_tile(
            tile_id, tiles_per_group, num_pid_o, num_pid_i, offs_ptr, M, GROUP_O, BLOCK_O, BLOCK_I
        )
        token, mask_m = routed_tokens(idx_ptr, row_lo, row_lo, row_hi, g < N, BLOCK_M, slot_layout)
        for step in range(gl.cdiv(row_hi - row_lo, BLOCK_M)):
            r0 = row_lo + step * BLOCK_M
            # The next step's row map entries, loading while this step waits for its slot and issues its
            # copies: a step's rows change every step (the reduction runs over them), and a load of the
            # map on the copies' path would cost the partition its latency every step.
            token_next, mask_next = routed_tokens(idx_ptr, r0 + BLOCK_M, row_lo, row_hi, g < N, BLOCK_M, slot_layout)
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            for h in gl.static_range(SO):
                tma.async_copy_global_to_shared(
                    dy_desc, [r0, o0 + h * PART_O], ready.index(slot), dy_bufs.index(slot * SO + h)
                )
            rows, mask_rows = token_rows(x_ptr, stride_xm, token, mask_m)
            for h in gl.static_range(SI):
                gather_slot(
                    x_bufs.index(slot * SI + h), rows, mask_rows, i0 + h * PART_I, I, ready.index(slot), PART_I,
                    slot_layout,
                )  # fmt: skip
            token = token_next
            mask_m = mask_next
            it += 1


@gluon.constexpr_function
def _dw_store_layout(trans_out, acc_layout, num_warps):
    """The layout a dw tile is stored from: the accumulator's own (pairs of elements along dw's rows), or
    for a transposed store 8 consecutive accumulator rows a thread (16 bytes along the transposed rows)."""
    return gl.BlockedLayout([8, 1], [16, 2], [1, num_warps], [0, 1]) if trans_out else acc_layout


@gluon.jit
def _store_half(acc, dw_ptr, g, o0, i0, O, I, TRANS_OUT: gl.constexpr):
    """dw[g, o0 : o0 + rows, i0 : i0 + cols] = acc (rounded to dw's dtype), masked to O and I; with
    TRANS_OUT dw[g] is (I, O) and takes acc's transpose, through a layout whose threads hold 8
    consecutive o each (16-byte stores along dw's rows; in the accumulator's layout a thread's
    neighbours along o are other threads)."""
    layout: gl.constexpr = _dw_store_layout(TRANS_OUT, acc.type.layout, gl.num_warps())
    val = gl.convert_layout(acc.to(dw_ptr.dtype.element_ty), layout)
    base = dw_ptr + g.to(gl.int64) * O * I
    offs_o = o0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    offs_i = i0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    mask = gl.expand_dims(offs_o < O, 1) & gl.expand_dims(offs_i < I, 0)
    if TRANS_OUT:
        ptrs = base + gl.expand_dims(offs_o, 1) + gl.expand_dims(offs_i.to(gl.int64) * O, 0)
    else:
        ptrs = base + gl.expand_dims(offs_o.to(gl.int64) * I, 1) + gl.expand_dims(offs_i, 0)
    gl.store(ptrs, val, mask=mask)


@gluon.jit
def _wgrad_mma_partition(
    dw_ptr,
    offs_ptr,
    M,
    O,
    I,
    N,
    dy_bufs,
    x_bufs,
    ready,
    empty,
    BLOCK_O: gl.constexpr,
    BLOCK_I: gl.constexpr,
    BLOCK_M: gl.constexpr,
    GROUP_O: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    SPLIT_O: gl.constexpr,
    TRANS_OUT: gl.constexpr,
):
    """The tile's two (BLOCK_O / SO, BLOCK_I / SI) accumulators over the ring, one step's MMAs kept in
    flight while the next slot's are issued; then the tile's stores."""
    num_pid_o, num_pid_i, tiles_per_group = _tile_grid(O, I, BLOCK_O, BLOCK_I)
    SO: gl.constexpr = _wgrad_split(SPLIT_O)[0]
    SI: gl.constexpr = _wgrad_split(SPLIT_O)[1]
    PART_O: gl.constexpr = BLOCK_O // SO
    PART_I: gl.constexpr = BLOCK_I // SI
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, PART_I, 16]
    )
    it = 0
    for tile_id in range(gl.program_id(0), N * tiles_per_group, NUM_PROGRAMS):
        g, o0, i0, row_lo, row_hi = wgrad_tile(
            tile_id, tiles_per_group, num_pid_o, num_pid_i, offs_ptr, M, GROUP_O, BLOCK_O, BLOCK_I
        )
        steps = gl.cdiv(row_hi - row_lo, BLOCK_M)
        acc0 = gl.zeros([PART_O, PART_I], gl.float32, mma_layout)
        acc1 = gl.zeros([PART_O, PART_I], gl.float32, mma_layout)
        for step in range(steps):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            # x's rows came by cp.async (the generic proxy); wgmma reads them through the async proxy.
            fence_async_shared()
            # dy's (BLOCK_M, PART_O) boxes as the MN-major A, x's rows as they lie.
            acc0 = warpgroup_mma(dy_bufs.index(slot * SO).permute((1, 0)), x_bufs.index(slot * SI), acc0, is_async=True)
            acc1 = warpgroup_mma(
                dy_bufs.index(slot * SO + SO - 1).permute((1, 0)), x_bufs.index(slot * SI + SI - 1), acc1, is_async=True
            )
            # The previous slot's two products are done once at most these two are in flight.
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
            if step > 0:
                gl.thread_barrier()
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            it += 1
        if steps > 0:
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
            gl.thread_barrier()
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
        _store_half(acc0, dw_ptr, g, o0, i0, O, I, TRANS_OUT)
        _store_half(acc1, dw_ptr, g, o0 + (SO - 1) * PART_O, i0 + (SI - 1) * PART_I, O, I, TRANS_OUT)


@gluon.jit
def wgrad_gathered_ws_kernel(
    dy_ptr,
    x_ptr,
    dw_ptr,
    offs_ptr,
    unused_ptr,
    idx_ptr,
    M,
    O,
    I,
    N,
    stride_dym,
    stride_xm,
    BLOCK_O: gl.constexpr,
    BLOCK_I: gl.constexpr,
    BLOCK_M: gl.constexpr,
    GROUP_O: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    LOAD_WARPS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
    SPLIT_O: gl.constexpr,
    TRANS_OUT: gl.constexpr = False,
):
    """dw[g] (O, I) = dy[rows of g]^T @ x[idx[rows of g]] for every group in one launch; with TRANS_OUT
    its transpose, dw[g] (I, O) = x[idx[rows of g]]^T @ dy[rows of g] (a wgrad whose gathered operand is
    the output-gradient side: the caller passes the operands swapped).

    dy: (M, O) in expert order, row stride stride_dym, unit column stride, TMA-aligned (16-byte base and
    row stride). x: (T, I) token rows, row stride stride_xm a multiple of 16 elements on a 16-byte
    aligned base, I a multiple of 8 (16-byte copies). idx: (M,) int32 or int64, read below offs[N]
    only, values in [0, T). dw: a contiguous (N, O, I) in dy's dtype ((N, I, O) with TRANS_OUT). offs:
    (N + 1,) int64 device offsets. unused_ptr: the slot of the Triton wgrad's dy row map (not read),
    so both kernels take one argument list. num_warps = 8 (the mma partition: two warp groups of 64
    rows of each accumulator), the load partition LOAD_WARPS = 4 or 8 warps (one or two warp groups of
    copies) with LOAD_REGS registers a thread. The tile's two accumulators split it along O (SPLIT_O:
    BLOCK_O = 256, two dy boxes and one x slot of BLOCK_I columns a step) or along I (BLOCK_O = 128:
    one dy box, two x slots of BLOCK_I / 2 columns).
    """
    SO: gl.constexpr = _wgrad_split(SPLIT_O)[0]
    SI: gl.constexpr = _wgrad_split(SPLIT_O)[1]
    gl.static_assert(BLOCK_O // SO == 128, "two warp groups of 64 dw rows an accumulator")
    dtype: gl.constexpr = dy_ptr.dtype.element_ty
    dy_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_O // SO], dtype)
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_I // SI], dtype)
    dy_bufs = gl.allocate_shared_memory(dtype, [STAGES * SO, BLOCK_M, BLOCK_O // SO], dy_layout)
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES * SI, BLOCK_M, BLOCK_I // SI], x_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # A slot is ready when dy's TMA bytes have landed after the expect's arrival and every load
    # thread's cp.async arrivals (one an x slot).
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1 + SI * LOAD_WARPS * 32)
        mbarrier.init(empty.index(i), count=1)
    # (The argument tuples are written out: a tuple built in the kernel would not keep its constexprs.)
    gl.warp_specialize(
        [
            (
                _wgrad_mma_partition,
                (
                    dw_ptr,
                    offs_ptr,
                    M,
                    O,
                    I,
                    N,
                    dy_bufs,
                    x_bufs,
                    ready,
                    empty,
                    BLOCK_O,
                    BLOCK_I,
                    BLOCK_M,
                    GROUP_O,
                    NUM_PROGRAMS,
                    STAGES,
                    SPLIT_O,
                    TRANS_OUT,
                ),
            ),
            (
                _wgrad_load_partition,
                (
                    dy_ptr,
                    x_ptr,
                    offs_ptr,
                    idx_ptr,
                    M,
                    O,
                    I,
                    N,
                    stride_dym,
                    stride_xm,
                    dy_bufs,
                    x_bufs,
                    ready,
                    empty,
                    BLOCK_O,
                    BLOCK_I,
                    BLOCK_M,
                    GROUP_O,
                    NUM_PROGRAMS,
                    STAGES,
                    SPLIT_O,
                ),
            ),
        ],
        [LOAD_WARPS],
        [LOAD_REGS],
    )
