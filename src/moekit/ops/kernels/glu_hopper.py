"""Gluon kernels of the fused grouped MLP for Hopper (sm_90), warp-specialised (jit code only; host
code in `moekit.ops.runtime.glu`).

Legend as in `moekit.ops.kernels.glu`: M routed rows, N experts, H hidden size, F ffn size;
BLOCK_M rows by BLOCK_C activation columns per accumulator, reduced in steps of BLOCK_RED.

    glu_forward_ws_kernel   fc1 with the gated activation in its epilogue, as glu_forward_kernel:
                            h = x @ w1[g]^T (+ b1[g])        x (M, H), w1 (N, 2F, H) -> h (M, 2F)
                            act = ACT(gate(h), up(h)) (* probs)                     -> act (M, F)
    glu_backward_ws_kernel  fc2's dgrad with the activation's backward, as glu_backward_kernel:
                            dA = dy @ w2[g]                  dy (M, H), w2 (N, H, F)
                            dh, act_p (M, 2F), (M, F); d probs partials

Why: Triton 3.6 does not warp-specialise these persistent loops on Hopper, so its kernels run each
tile's epilogue, and the restart of the pipeline between two main loops, with the tensor cores idle.
Here the loads and the epilogue run in partitions of their own beside the main loop.

The forward runs three partitions of one program at once:

    load      (1 warp)   TMA loads of x and of the gate and up weight rows into a ring of STAGES
                         shared-memory slots, running ahead across tile boundaries
              (4 warps)  with GATHER: the weights by TMA as above, x's rows gathered from the token
                         rows x[idx[r]] by cp.async (below)
    mma       (8 warps)  wgmma over the ring into two fp32 accumulators (gate, up); at a tile's end
                         adds the bias, rounds h to the output dtype and hands it over in shared
                         memory, then starts the next tile
    epilogue  (4 warps)  reads h back in column chunks, stores h, computes the activation (and
                         probs) from the rounded h and stores it, all by coalesced pointer stores

GATHER: the routed row r of a tile is row idx[r] of x (T, H), `moe_experts`' token of each sorted
row, so the (M, H) copy of x in expert order is never written. Hopper's TMA moves boxes, not rows
picked by an index (sm_100's tma.async_gather does), and one 1-row box per row would be 128 TMA
issues of 128 bytes per slot from one thread, each needing its row index as a scalar. Instead the
load partition takes its whole warp group: each of its 128 threads holds the 64-bit addresses of 8
of the tile's rows (read once a tile) and copies 16 bytes per row per slot by cp.async into the
slot's swizzled buffer, then arrives on the slot's barrier when its copies land (a counted
arrival: the barrier expects the TMA's arrival and one per thread); the mma partition fences the
generic-proxy writes before wgmma reads them. Rows outside the tile's expert are zeros (TMA reads
the neighbours' rows there); a row's products depend on its own x only and such rows are never
stored, so h and act are the bits of the TMA path over the gathered rows.

The tile schedule (`moekit.ops.kernels.schedule`) and the activation pair (ACT, ACT_GRAD from
`moekit.ops.kernels.activations`) are the Triton kernels' own jit functions, called from Gluon, so
both kernels give the same bits.

GLU layouts (k = glu_interleave_size, k = F for `[gate | up]`) and weight orientations. The weights
are read through a 2-D view of the tensor as stored, one expert after the other: (N * 2F, H) of w1
(N, 2F, H), or with W_TRANSPOSED (N * H, 2F) of the (N, H, 2F) tensor under a transposed w1 view
(transformers' gpt-oss), whose boxes land MN-major in shared memory, which wgmma takes as they are;
likewise (N * H, F) of w2 or (N * F, H) under its transposed view (K-major boxes, permuted). A
forward tile's two accumulators each take one run of BLOCK_C consecutive fc1 rows (a 2-D box, the
main loop is the same for every layout):
    split   (k = F or BLOCK_C | k) the gate rows of the tile's columns and their up rows
    PAIRED  (k | BLOCK_C, k < F)   the tile's 2 BLOCK_C gate and up rows in fc1's own order, starting
                                   at row 2 c0: h comes out in its stored order, and the epilogue
                                   pairs each gate with its up: for k < 16 a thread reads 2 x 8
                                   consecutive columns of h, whole blocks, and splits them in its
                                   registers; for 16 <= k a chunk's gates and ups are two slices
Rows of the last, partial tile past F feed only columns past F, which are never stored (up rows,
the next expert's, or zeros past the last). The backward's w2 boxes do not depend on k; its h and
dh chunks of 16 activation columns lie in one block (k = F or 16 | k) or, for k | 8, are 32
consecutive columns of h split (and dh joined) in registers. Blocks that neither divide nor are
divided by the tile (k = 3, 24, 192, ...) run the Triton kernels (`runtime.glu.hopper_layout_ok`).

The backward has two partitions: the load warp (with GATHER its warp group, d out's token rows read
by cp.async as the forward's x), and 8 warps that run a 128 x 256 main loop (two
accumulators over one dy box and two w2 boxes, the plain GEMM's tile: 128 x 128 tiles read a third
more from L2) and then the tile's epilogue themselves, each accumulator through one fp32 staging
tile in shared memory, with h loaded by pointer ahead of the math. The load warp fills the ring
with the next tile during that epilogue, so only the epilogue's own time is between two main loops.
Its dh and act_p are glu_backward_kernel's bits; d probs sums the same products over 256 columns
per partial (another fp32 order). An epilogue partition of its own (4 warps) cannot keep up with
the backward's main loop: its epilogue moves three times the forward's bytes per tile
(notes/grouped_mlp.md).
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

from moekit.ops.kernels.gather_hopper import gather_layout, gather_slot, gathered_rows
from moekit.ops.kernels.schedule import gluon_group_ids, tile_coords, tile_schedule


@gluon.jit
def _weight_runs(c0, GLU_BLOCK: gl.constexpr, PAIRED: gl.constexpr, BLOCK_C: gl.constexpr):
    """The first rows of fc1 (of one expert) behind the forward's two accumulators for activation
    columns c0:c0+BLOCK_C, each a run of BLOCK_C consecutive rows. Split (k = F or BLOCK_C | k): the
    columns' gate rows and their up rows. PAIRED (k | BLOCK_C, k < F): the columns' 2 BLOCK_C gate and
    up rows in fc1's own order, halves of the run that starts at 2 c0."""
    run0 = c0 + (c0 // GLU_BLOCK) * GLU_BLOCK
    if PAIRED:
        return run0, run0 + BLOCK_C
    return run0, run0 + GLU_BLOCK


@gluon.constexpr_function
def _paired_gate_column(col, block):
    """Where activation column `col` of a PAIRED tile has its gate among the tile's 2 BLOCK_C columns of
    h (GLU block `block`): its up is `block` further."""
    return (col // block) * 2 * block + col % block


@gluon.jit
def _deinterleave(hh, GLU_BLOCK: gl.constexpr, layout: gl.constexpr):
    """(gate, up) of hh (rows, 2C): C / k GLU blocks of k gates and k ups, as (rows, C) tensors in
    `layout`. The caller's layout of hh gives each thread whole blocks (k | its run of columns), so
    the reorder stays in every thread's registers (asserted)."""
    ROWS: gl.constexpr = hh.shape[0]
    COLS: gl.constexpr = hh.shape[1] // 2
    blocks = gl.reshape(hh, [ROWS, COLS // GLU_BLOCK, 2, GLU_BLOCK])
    pairs = gl.reshape(gl.permute(blocks, (0, 1, 3, 2)), [ROWS, COLS, 2])
    gate, up = gl.split(pairs)
    return gl.convert_layout(gate, layout, assert_trivial=True), gl.convert_layout(up, layout, assert_trivial=True)


@gluon.jit
def _interleave(gate, up, GLU_BLOCK: gl.constexpr, layout: gl.constexpr):
    """The inverse of `_deinterleave`: (rows, 2C) in `layout` from gate and up (rows, C)."""
    ROWS: gl.constexpr = gate.shape[0]
    COLS: gl.constexpr = gate.shape[1]
    pairs = gl.reshape(gl.join(gate, up), [ROWS, COLS // GLU_BLOCK, GLU_BLOCK, 2])
    hh = gl.reshape(gl.permute(pairs, (0, 1, 3, 2)), [ROWS, 2 * COLS])
    return gl.convert_layout(hh, layout, assert_trivial=True)


# The two worker partitions take the same parameters, as Gluon's warp-specialization tutorial asks
# of worker partitions; each uses its own part of them.
@gluon.jit
def _load_partition(
    x_ptr,
    w_ptr,
    h_ptr,
    act_ptr,
    bias_ptr,
    probs_ptr,
    offs_ptr,
    idx_ptr,
    M,
    F,
    H,
    N,
    stride_xm,
    stride_wr,
    stride_hm,
    stride_actm,
    stride_bias_g,
    a_bufs,
    bg_bufs,
    bu_bufs,
    ready,
    empty,
    hg_smem,
    hu_smem,
    epi_ready,
    epi_free,
    ACT: gl.constexpr,
    ACT_GRAD: gl.constexpr,
    GLU_BLOCK: gl.constexpr,
    W_TRANSPOSED: gl.constexpr,
    PAIRED: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    EPI_COLS: gl.constexpr,
    GATHER: gl.constexpr,
):
    """x's rows and the tile's two runs of weight rows (`_weight_runs`), BLOCK_RED reduction columns a
    slot, into the ring. The weights by TMA; x's rows by TMA too, or with GATHER by cp.async from
    x's token rows idx[r] (one 16-byte copy per thread per 8 columns, the row addresses formed once a
    tile), each thread's copies arriving on the slot's barrier when they land."""
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, gluon_group_ids(BLOCK_GROUPS), M, N, F, BLOCK_M, BLOCK_C
    )
    elem_bytes: gl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth // 8
    slot_layout: gl.constexpr = gather_layout(elem_bytes, BLOCK_RED, gl.num_warps())
    if not GATHER:
        x_desc = tma.make_tensor_descriptor(
            x_ptr, shape=[M, H], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_RED], layout=a_bufs.type.layout
        )
    # A slot's TMA bytes: the two weight boxes, and x's box unless its rows are gathered.
    X_BOX_ROWS: gl.constexpr = 0 if GATHER else BLOCK_M
    nbytes: gl.constexpr = (X_BOX_ROWS + 2 * BLOCK_C) * BLOCK_RED * elem_bytes
    if W_TRANSPOSED:  # the 2-D view (N * H, 2F) of the (N, H, 2F) tensor under w1: MN-major boxes
        w_desc = tma.make_tensor_descriptor(
            w_ptr,
            shape=[N * H, 2 * F],
            strides=[stride_wr, 1],
            block_shape=[BLOCK_RED, BLOCK_C],
            layout=bg_bufs.type.layout,
        )
    else:  # the 2-D view (N * 2F, H) of w1
        w_desc = tma.make_tensor_descriptor(
            w_ptr,
            shape=[N * 2 * F, H],
            strides=[stride_wr, 1],
            block_shape=[BLOCK_C, BLOCK_RED],
            layout=bg_bufs.type.layout,
        )
    red_steps = gl.cdiv(H, BLOCK_RED)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        g, row_lo, row_hi, row0, c0, _ = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, BLOCK_C, GROUP_M
        )
        if GATHER:
            # Zeros outside the tile's own rows, as the rows of padding tiles. A row's products depend
            # on its own x only, and the other rows of the tile (another expert's, or padding) are never
            # stored, so h and act are the bits of the TMA path over the gathered rows.
            x_rows, mask_rows = gathered_rows(
                x_ptr, idx_ptr, stride_xm, row0, row_lo, row_hi, g < N, BLOCK_M, slot_layout
            )
        else:
            # Padding tiles point past the last row (TMA reads zeros there).
            x_row0 = gl.where(g < N, row0, M)
        run0, run1 = _weight_runs(c0, GLU_BLOCK, PAIRED, BLOCK_C)
        for step in range(red_steps):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            red0 = step * BLOCK_RED
            if GATHER:
                gather_slot(a_bufs.index(slot), x_rows, mask_rows, red0, H, ready.index(slot), BLOCK_RED, slot_layout)
            else:
                tma.async_copy_global_to_shared(x_desc, [x_row0, red0], ready.index(slot), a_bufs.index(slot))
            if W_TRANSPOSED:
                tma.async_copy_global_to_shared(w_desc, [g * H + red0, run0], ready.index(slot), bg_bufs.index(slot))
                tma.async_copy_global_to_shared(w_desc, [g * H + red0, run1], ready.index(slot), bu_bufs.index(slot))
            else:
                w_row = g * 2 * F
                tma.async_copy_global_to_shared(w_desc, [w_row + run0, red0], ready.index(slot), bg_bufs.index(slot))
                tma.async_copy_global_to_shared(w_desc, [w_row + run1, red0], ready.index(slot), bu_bufs.index(slot))
            it += 1


@gluon.jit
def _epilogue_partition(
    x_ptr,
    w_ptr,
    h_ptr,
    act_ptr,
    bias_ptr,
    probs_ptr,
    offs_ptr,
    idx_ptr,
    M,
    F,
    H,
    N,
    stride_xm,
    stride_wr,
    stride_hm,
    stride_actm,
    stride_bias_g,
    a_bufs,
    bg_bufs,
    bu_bufs,
    ready,
    empty,
    hg_smem,
    hu_smem,
    epi_ready,
    epi_free,
    ACT: gl.constexpr,
    ACT_GRAD: gl.constexpr,
    GLU_BLOCK: gl.constexpr,
    W_TRANSPOSED: gl.constexpr,
    PAIRED: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    EPI_COLS: gl.constexpr,
    GATHER: gl.constexpr,
):
    """h and the activation of each tile from the rounded h the mma partition left in shared memory,
    EPI_COLS columns at a time, by 16-byte pointer stores."""
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, gluon_group_ids(BLOCK_GROUPS), M, N, F, BLOCK_M, BLOCK_C
    )
    VEC: gl.constexpr = 8
    layout: gl.constexpr = gl.BlockedLayout(
        [1, VEC], [32 * VEC // EPI_COLS, EPI_COLS // VEC], [gl.num_warps(), 1], [1, 0]
    )
    # PAIRED with k < EPI_COLS: a chunk's 2 EPI_COLS columns of h, each thread the gates and ups of
    # its VEC activation columns (k | VEC).
    pair_layout: gl.constexpr = gl.BlockedLayout(
        [1, 2 * VEC], [32 * VEC // EPI_COLS, EPI_COLS // VEC], [gl.num_warps(), 1], [1, 0]
    )
    out_ty = h_ptr.dtype.element_ty
    count = 0
    for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        g, row_lo, row_hi, row0, c0, _ = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, BLOCK_C, GROUP_M
        )
        # 64-bit tile bases and 32-bit offsets inside the tile: 64-bit pointers per element cost
        # the registers this partition does not have.
        offs_r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_m = row0 + offs_r
        mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
        if HAS_PROBS:
            p = gl.load(probs_ptr + offs_m, mask=mask_m & (g < N), other=0.0).to(gl.float32)
        h_tile = h_ptr + row0.to(gl.int64) * stride_hm
        act_tile = act_ptr + row0.to(gl.int64) * stride_actm
        h_rows = gl.expand_dims(offs_r * stride_hm, 1)
        act_rows = gl.expand_dims(offs_r * stride_actm, 1)
        if PAIRED and GLU_BLOCK < EPI_COLS:
            pair_r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, pair_layout))
            pair_mask_m = (row0 + pair_r >= row_lo) & (row0 + pair_r < row_hi)
            pair_rows = gl.expand_dims(pair_r * stride_hm, 1)
        mbarrier.wait(epi_ready, count & 1)
        for cc in gl.static_range(0, BLOCK_C, EPI_COLS):
            offs_c = c0 + cc + gl.arange(0, EPI_COLS, layout=gl.SliceLayout(0, layout))
            mask = gl.expand_dims(mask_m, 1) & gl.expand_dims(offs_c < F, 0)
            if PAIRED and GLU_BLOCK < EPI_COLS:
                # The chunk's gates and ups are h's 2 EPI_COLS columns from 2 (c0 + cc), stored as
                # they are and split in registers.
                pair_c = 2 * (c0 + cc) + gl.arange(0, 2 * EPI_COLS, layout=gl.SliceLayout(0, pair_layout))
                pair_mask = gl.expand_dims(pair_mask_m, 1) & gl.expand_dims(pair_c < 2 * F, 0)
                if 2 * cc < BLOCK_C:
                    hh = hg_smem.slice(2 * cc, 2 * EPI_COLS, dim=1).load(pair_layout)
                else:
                    hh = hu_smem.slice(2 * cc - BLOCK_C, 2 * EPI_COLS, dim=1).load(pair_layout)
                gl.store(h_tile + pair_rows + gl.expand_dims(pair_c, 0), hh, mask=pair_mask)
                h_g, h_u = _deinterleave(hh, GLU_BLOCK, layout)
            else:
                gate_c = gl.expand_dims(offs_c + (offs_c // GLU_BLOCK) * GLU_BLOCK, 0)
                if PAIRED:  # the chunk lies in one GLU block: k gates then k ups of the 2 BLOCK_C
                    if _paired_gate_column(cc, GLU_BLOCK) < BLOCK_C:
                        h_g = hg_smem.slice(_paired_gate_column(cc, GLU_BLOCK), EPI_COLS, dim=1).load(layout)
                        h_u = hg_smem.slice(_paired_gate_column(cc, GLU_BLOCK) + GLU_BLOCK, EPI_COLS, dim=1).load(
                            layout
                        )
                    else:
                        h_g = hu_smem.slice(_paired_gate_column(cc, GLU_BLOCK) - BLOCK_C, EPI_COLS, dim=1).load(layout)
                        h_u = hu_smem.slice(
                            _paired_gate_column(cc, GLU_BLOCK) - BLOCK_C + GLU_BLOCK, EPI_COLS, dim=1
                        ).load(layout)
                else:
                    h_g = hg_smem.slice(cc, EPI_COLS, dim=1).load(layout)
                    h_u = hu_smem.slice(cc, EPI_COLS, dim=1).load(layout)
                gl.store(h_tile + h_rows + gate_c, h_g, mask=mask)
                gl.store(h_tile + h_rows + gate_c + GLU_BLOCK, h_u, mask=mask)
            g32 = h_g.to(gl.float32)
            u32 = h_u.to(gl.float32)
            act = ACT(g32, u32)
            if HAS_PROBS:
                act = act * gl.expand_dims(p, 1)
            gl.store(act_tile + act_rows + gl.expand_dims(offs_c, 0), act.to(out_ty), mask=mask)
        # Every warp of this partition has read the staging buffers before they are handed back.
        gl.thread_barrier()
        mbarrier.arrive(epi_free, count=1)
        count += 1


@gluon.jit
def _mma_partition(
    offs_ptr,
    bias_ptr,
    M,
    F,
    H,
    N,
    stride_bias_g,
    a_bufs,
    bg_bufs,
    bu_bufs,
    ready,
    empty,
    hg_smem,
    hu_smem,
    epi_ready,
    epi_free,
    GLU_BLOCK: gl.constexpr,
    W_TRANSPOSED: gl.constexpr,
    PAIRED: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    GATHER: gl.constexpr,
):
    """The two accumulators of each tile over the ring; h (rounded, bias added, zeros on padding
    tiles) handed to the epilogue partition through hg_smem / hu_smem."""
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, gluon_group_ids(BLOCK_GROUPS), M, N, F, BLOCK_M, BLOCK_C
    )
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_C, 16]
    )
    out_ty = hg_smem.dtype
    red_steps = gl.cdiv(H, BLOCK_RED)
    it = 0
    count = 0
    for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        g, row_lo, row_hi, row0, c0, _ = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, BLOCK_C, GROUP_M
        )
        acc_g = gl.zeros([BLOCK_M, BLOCK_C], gl.float32, mma_layout)
        acc_u = gl.zeros([BLOCK_M, BLOCK_C], gl.float32, mma_layout)
        for step in range(red_steps):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            if GATHER:
                # x's tile came by cp.async (the generic proxy); wgmma reads it through the async proxy.
                fence_async_shared()
            if W_TRANSPOSED:  # (BLOCK_RED, BLOCK_C) boxes: MN-major B
                acc_g = warpgroup_mma(a_bufs.index(slot), bg_bufs.index(slot), acc_g, is_async=True)
                acc_u = warpgroup_mma(a_bufs.index(slot), bu_bufs.index(slot), acc_u, is_async=True)
            else:
                acc_g = warpgroup_mma(a_bufs.index(slot), bg_bufs.index(slot).permute((1, 0)), acc_g, is_async=True)
                acc_u = warpgroup_mma(a_bufs.index(slot), bu_bufs.index(slot).permute((1, 0)), acc_u, is_async=True)
            # The previous slot's two products are done once at most these two are in flight.
            acc_g, acc_u = warpgroup_mma_wait(num_outstanding=2, deps=(acc_g, acc_u))
            if step > 0:
                gl.thread_barrier()
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            it += 1
        acc_g, acc_u = warpgroup_mma_wait(num_outstanding=0, deps=(acc_g, acc_u))
        gl.thread_barrier()
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)

        real = g < N  # padding rows: exact zeros whatever x or the bias hold
        acc_g = gl.where(real, acc_g, 0.0)
        acc_u = gl.where(real, acc_u, 0.0)
        if HAS_BIAS:
            bias_base = bias_ptr + g.to(gl.int64) * stride_bias_g
            if PAIRED:  # the accumulators' columns are h's 2 c0 : 2 c0 + 2 BLOCK_C
                col = 2 * c0 + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, mma_layout))
                acc_g += gl.expand_dims(
                    gl.load(bias_base + col, mask=(col < 2 * F) & real, other=0.0).to(gl.float32), 0
                )
                col_u = col + BLOCK_C
                acc_u += gl.expand_dims(
                    gl.load(bias_base + col_u, mask=(col_u < 2 * F) & real, other=0.0).to(gl.float32), 0
                )
            else:
                offs_c = c0 + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, mma_layout))
                gate_c = offs_c + (offs_c // GLU_BLOCK) * GLU_BLOCK
                mask_c = (offs_c < F) & real
                acc_g += gl.expand_dims(gl.load(bias_base + gate_c, mask=mask_c, other=0.0).to(gl.float32), 0)
                acc_u += gl.expand_dims(
                    gl.load(bias_base + gate_c + GLU_BLOCK, mask=mask_c, other=0.0).to(gl.float32), 0
                )
        h_g = acc_g.to(out_ty)
        h_u = acc_u.to(out_ty)
        mbarrier.wait(epi_free, (count & 1) ^ 1)
        hg_smem.store(h_g)
        hu_smem.store(h_u)
        gl.thread_barrier()
        mbarrier.arrive(epi_ready, count=1)
        count += 1


@gluon.jit
def glu_forward_ws_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    act_ptr,
    bias_ptr,
    probs_ptr,
    offs_ptr,
    idx_ptr,
    M,
    F,
    H,
    N,
    stride_xm,
    stride_wr,
    stride_hm,
    stride_actm,
    stride_bias_g,
    ACT: gl.constexpr,
    ACT_GRAD: gl.constexpr,
    GLU_BLOCK: gl.constexpr,
    W_TRANSPOSED: gl.constexpr,
    PAIRED: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    EPI_COLS: gl.constexpr,
    EPI_REGS: gl.constexpr,
    GATHER: gl.constexpr,
    LOAD_WARPS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
):
    """fc1 + gated activation per expert: h (M, 2F) and act (M, F) in x's dtype; padding rows zero.

    x: (M, H) row stride stride_xm; w: (N, 2F, H), experts contiguous (stride 2F * stride_wr), rows
    stride_wr, unit last stride, or with W_TRANSPOSED the (N, H, 2F) tensor under a transposed view
    of it (experts H * stride_wr apart, rows stride_wr, needs BLOCK_RED | H); bias: (N, 2F); probs:
    (M,) any float dtype. Needs k = F or BLOCK_C | k (split), or k | BLOCK_C with PAIRED;
    TMA-aligned x and w (16-byte rows and base). num_warps = 8 (the mma partition).

    GATHER: x is (T, H) and routed row r reads x's row idx[r] (idx: (M,) int32 or int64, read for
    the rows before offs[N] only, values in [0, T)); the load partition is LOAD_WARPS = 4 warps
    (cp.async needs the threads). Otherwise idx is not read (any pointer) and LOAD_WARPS is 1 or 4 (one
    thread issues the TMA copies either way; 4 spread the tile schedule's group vectors over a warp
    group's lanes instead of one warp's).
    """
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_RED], dtype)
    # The weight boxes: (BLOCK_RED, BLOCK_C) of fc1's transposed storage, else (BLOCK_C, BLOCK_RED).
    B_ROWS: gl.constexpr = BLOCK_RED if W_TRANSPOSED else BLOCK_C
    B_COLS: gl.constexpr = BLOCK_C if W_TRANSPOSED else BLOCK_RED
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([B_ROWS, B_COLS], dtype)
    h_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_C], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_RED], a_layout)
    bg_bufs = gl.allocate_shared_memory(dtype, [STAGES, B_ROWS, B_COLS], b_layout)
    bu_bufs = gl.allocate_shared_memory(dtype, [STAGES, B_ROWS, B_COLS], b_layout)
    hg_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_C], h_layout)
    hu_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_C], h_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    epi_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    epi_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # A slot is ready when its TMA bytes have landed after the expect's arrival, and with GATHER
    # also every load thread's cp.async arrival.
    ready_count: gl.constexpr = 1 + LOAD_WARPS * 32 if GATHER else 1
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=ready_count)
        mbarrier.init(empty.index(i), count=1)
    mbarrier.init(epi_ready, count=1)
    mbarrier.init(epi_free, count=1)

    # The epilogue and load partitions take the same arguments, written out twice: a local tuple of
    # them does not compile (Triton 3.6 cannot hold the activation's JITFunction in a tuple value).
    gl.warp_specialize(
        [
            (
                _mma_partition,
                (
                    offs_ptr,
                    bias_ptr,
                    M,
                    F,
                    H,
                    N,
                    stride_bias_g,
                    a_bufs,
                    bg_bufs,
                    bu_bufs,
                    ready,
                    empty,
                    hg_smem,
                    hu_smem,
                    epi_ready,
                    epi_free,
                    GLU_BLOCK,
                    W_TRANSPOSED,
                    PAIRED,
                    HAS_BIAS,
                    BLOCK_M,
                    BLOCK_C,
                    BLOCK_RED,
                    GROUP_M,
                    BLOCK_GROUPS,
                    NUM_PROGRAMS,
                    STAGES,
                    GATHER,
                ),
            ),
            (
                _epilogue_partition,
                (
                    x_ptr,
                    w_ptr,
                    h_ptr,
                    act_ptr,
                    bias_ptr,
                    probs_ptr,
                    offs_ptr,
                    idx_ptr,
                    M,
                    F,
                    H,
                    N,
                    stride_xm,
                    stride_wr,
                    stride_hm,
                    stride_actm,
                    stride_bias_g,
                    a_bufs,
                    bg_bufs,
                    bu_bufs,
                    ready,
                    empty,
                    hg_smem,
                    hu_smem,
                    epi_ready,
                    epi_free,
                    ACT,
                    ACT_GRAD,
                    GLU_BLOCK,
                    W_TRANSPOSED,
                    PAIRED,
                    HAS_BIAS,
                    HAS_PROBS,
                    BLOCK_M,
                    BLOCK_C,
                    BLOCK_RED,
                    GROUP_M,
                    BLOCK_GROUPS,
                    NUM_PROGRAMS,
                    STAGES,
                    EPI_COLS,
                    GATHER,
                ),
            ),
            (
                _load_partition,
                (
                    x_ptr,
                    w_ptr,
                    h_ptr,
                    act_ptr,
                    bias_ptr,
                    probs_ptr,
                    offs_ptr,
                    idx_ptr,
                    M,
                    F,
                    H,
                    N,
                    stride_xm,
                    stride_wr,
                    stride_hm,
                    stride_actm,
                    stride_bias_g,
                    a_bufs,
                    bg_bufs,
                    bu_bufs,
                    ready,
                    empty,
                    hg_smem,
                    hu_smem,
                    epi_ready,
                    epi_free,
                    ACT,
                    ACT_GRAD,
                    GLU_BLOCK,
                    W_TRANSPOSED,
                    PAIRED,
                    HAS_BIAS,
                    HAS_PROBS,
                    BLOCK_M,
                    BLOCK_C,
                    BLOCK_RED,
                    GROUP_M,
                    BLOCK_GROUPS,
                    NUM_PROGRAMS,
                    STAGES,
                    EPI_COLS,
                    GATHER,
                ),
            ),
        ],
        [4, LOAD_WARPS],
        [EPI_REGS, LOAD_REGS],
    )


# --------------------------------------------------------------------------------------------------
# The backward: a load warp beside 8 warps that run the main loop and the epilogue
# --------------------------------------------------------------------------------------------------


@gluon.jit
def _bwd_load_partition(
    dy_ptr,
    w_ptr,
    offs_ptr,
    idx_ptr,
    M,
    F,
    H,
    N,
    stride_dym,
    stride_wr,
    a_bufs,
    b0_bufs,
    b1_bufs,
    ready,
    empty,
    W_TRANSPOSED: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    GATHER: gl.constexpr,
):
    """dy's rows and the two (BLOCK_RED, BLOCK_C) boxes of w2[g] of each tile, one reduction step a
    slot, into the ring; it runs ahead across tiles, so the next tile's first slots fill while the
    other partition runs this tile's epilogue. dy's rows by TMA, or with GATHER by cp.async from d
    out's token rows idx[r], as the forward's x."""
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, gluon_group_ids(BLOCK_GROUPS), M, N, F, BLOCK_M, 2 * BLOCK_C
    )
    elem_bytes: gl.constexpr = dy_ptr.dtype.element_ty.primitive_bitwidth // 8
    slot_layout: gl.constexpr = gather_layout(elem_bytes, BLOCK_RED, gl.num_warps())
    if not GATHER:
        dy_desc = tma.make_tensor_descriptor(
            dy_ptr, shape=[M, H], strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_RED], layout=a_bufs.type.layout
        )
    if W_TRANSPOSED:  # the 2-D view (N * F, H) of the (N, F, H) tensor under w2
        w_desc = tma.make_tensor_descriptor(
            w_ptr,
            shape=[N * F, H],
            strides=[stride_wr, 1],
            block_shape=[BLOCK_C, BLOCK_RED],
            layout=b0_bufs.type.layout,
        )
    else:  # the 2-D view (N * H, F) of w2
        w_desc = tma.make_tensor_descriptor(
            w_ptr,
            shape=[N * H, F],
            strides=[stride_wr, 1],
            block_shape=[BLOCK_RED, BLOCK_C],
            layout=b0_bufs.type.layout,
        )
    # A slot's TMA bytes: the two weight boxes, and dy's box unless its rows are gathered.
    DY_BOX_ROWS: gl.constexpr = 0 if GATHER else BLOCK_M
    nbytes: gl.constexpr = (DY_BOX_ROWS + 2 * BLOCK_C) * BLOCK_RED * elem_bytes
    red_steps = gl.cdiv(H, BLOCK_RED)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        g, row_lo, row_hi, row0, c0, _ = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, 2 * BLOCK_C, GROUP_M
        )
        if GATHER:
            # Zeros outside the tile's own rows: their dA, dh, act_p and d probs are never stored, so
            # the stored rows are the bits of the TMA path over the gathered rows.
            dy_rows, mask_rows = gathered_rows(
                dy_ptr, idx_ptr, stride_dym, row0, row_lo, row_hi, g < N, BLOCK_M, slot_layout
            )
        else:
            # Padding tiles point past the last row (TMA reads zeros there), so their dA is zero.
            dy_row0 = gl.where(g < N, row0, M)
        for step in range(red_steps):
            slot = it % STAGES
            mbarrier.wait(empty.index(slot), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            red0 = step * BLOCK_RED
            if GATHER:
                gather_slot(a_bufs.index(slot), dy_rows, mask_rows, red0, H, ready.index(slot), BLOCK_RED, slot_layout)
            else:
                tma.async_copy_global_to_shared(dy_desc, [dy_row0, red0], ready.index(slot), a_bufs.index(slot))
            if W_TRANSPOSED:
                # Rows past F are the next expert's (zeros past the last): they feed only columns
                # past F, of which nothing is stored.
                w_row = g * F + c0
                tma.async_copy_global_to_shared(w_desc, [w_row, red0], ready.index(slot), b0_bufs.index(slot))
                tma.async_copy_global_to_shared(w_desc, [w_row + BLOCK_C, red0], ready.index(slot), b1_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(w_desc, [g * H + red0, c0], ready.index(slot), b0_bufs.index(slot))
                # Past F (the last tile's second half) the box reads zeros, and nothing of it is stored.
                tma.async_copy_global_to_shared(
                    w_desc, [g * H + red0, c0 + BLOCK_C], ready.index(slot), b1_bufs.index(slot)
                )
            it += 1


@gluon.constexpr_function
def _bwd_pairs(block, epi_cols):
    """Whether the backward reads and writes a chunk's h and dh as 2 EPI_COLS consecutive columns
    split in registers: GLU blocks narrower than a chunk that divide a thread's 8 columns."""
    return block < epi_cols and 8 % block == 0


@gluon.jit
def _bwd_shift(c, half_shift, GLU_BLOCK: gl.constexpr, BLOCK_C: gl.constexpr):
    """The gate column of activation column j of a chunk that starts at c is j + this shift: the
    tile half's (`half_shift`) where a half lies in one GLU block (k = F or BLOCK_C | k), else the
    chunk's own (EPI_COLS | k, or k = F)."""
    if GLU_BLOCK >= BLOCK_C:
        return half_shift
    return (c // GLU_BLOCK) * GLU_BLOCK


@gluon.jit
def _bwd_load_h(
    h_ptr,
    row0,
    offs_r,
    mask_rows,
    c,
    half_shift,
    F,
    stride_hm,
    GLU_BLOCK: gl.constexpr,
    BLOCK_C: gl.constexpr,
    EPI_COLS: gl.constexpr,
    layout: gl.constexpr,
    pair_layout: gl.constexpr,
):
    """(gate, up) of h for activation columns c:c+EPI_COLS of the tile's rows, in h's dtype and
    `layout`; zeros where mask_rows is false and past F. `_bwd_pairs` and `_bwd_shift` say where."""
    rows = h_ptr + row0.to(gl.int64) * stride_hm
    if _bwd_pairs(GLU_BLOCK, EPI_COLS):
        pair_c = 2 * c + gl.arange(0, 2 * EPI_COLS, layout=gl.SliceLayout(0, pair_layout))
        pair_r = gl.convert_layout(offs_r, gl.SliceLayout(1, pair_layout), assert_trivial=True)
        pair_mask_r = gl.convert_layout(mask_rows, gl.SliceLayout(1, pair_layout), assert_trivial=True)
        mask = gl.expand_dims(pair_mask_r, 1) & gl.expand_dims(pair_c < 2 * F, 0)
        hh = gl.load(rows + gl.expand_dims(pair_r * stride_hm, 1) + gl.expand_dims(pair_c, 0), mask=mask, other=0.0)
        return _deinterleave(hh, GLU_BLOCK, layout)
    offs_c = c + gl.arange(0, EPI_COLS, layout=gl.SliceLayout(0, layout))
    gate_c = gl.expand_dims(offs_c + _bwd_shift(c, half_shift, GLU_BLOCK, BLOCK_C), 0)
    mask = gl.expand_dims(mask_rows, 1) & gl.expand_dims(offs_c < F, 0)
    rows = rows + gl.expand_dims(offs_r * stride_hm, 1)
    return gl.load(rows + gate_c, mask=mask, other=0.0), gl.load(rows + gate_c + GLU_BLOCK, mask=mask, other=0.0)


@gluon.jit
def _bwd_chunk(
    d_act,
    hg,
    hu,
    p,
    dh_ptr,
    act_ptr,
    row0,
    offs_r,
    mask_m,
    c,
    half_shift,
    F,
    stride_dhm,
    stride_actm,
    ACT: gl.constexpr,
    ACT_GRAD: gl.constexpr,
    GLU_BLOCK: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    BLOCK_C: gl.constexpr,
    EPI_COLS: gl.constexpr,
    layout: gl.constexpr,
    pair_layout: gl.constexpr,
):
    """The activation's backward of EPI_COLS columns with the operations of glu_backward_kernel, in
    its order: dh (in h's order, as `_bwd_load_h` reads it) and act_p stored; returns the rows' sum_j
    act * dA (zeros without probs)."""
    offs_c = c + gl.arange(0, EPI_COLS, layout=gl.SliceLayout(0, layout))
    mask = gl.expand_dims(mask_m, 1) & gl.expand_dims(offs_c < F, 0)
    out_ty = dh_ptr.dtype.element_ty
    hg = hg.to(gl.float32)
    hu = hu.to(gl.float32)
    act = ACT(hg, hu)
    if HAS_PROBS:
        d_probs = gl.sum(act * d_act, 1)
        d_act = d_act * gl.expand_dims(p, 1)
        act = act * gl.expand_dims(p, 1)
    else:
        d_probs = gl.zeros([d_act.shape[0]], gl.float32, gl.SliceLayout(1, layout))
    d_g, d_u = ACT_GRAD(hg, hu, d_act)
    dh_tile = dh_ptr + row0.to(gl.int64) * stride_dhm
    if _bwd_pairs(GLU_BLOCK, EPI_COLS):
        pair_c = 2 * c + gl.arange(0, 2 * EPI_COLS, layout=gl.SliceLayout(0, pair_layout))
        pair_r = gl.convert_layout(offs_r, gl.SliceLayout(1, pair_layout), assert_trivial=True)
        pair_mask_m = gl.convert_layout(mask_m, gl.SliceLayout(1, pair_layout), assert_trivial=True)
        pair_mask = gl.expand_dims(pair_mask_m, 1) & gl.expand_dims(pair_c < 2 * F, 0)
        dh_pairs = _interleave(d_g.to(out_ty), d_u.to(out_ty), GLU_BLOCK, pair_layout)
        gl.store(dh_tile + gl.expand_dims(pair_r * stride_dhm, 1) + gl.expand_dims(pair_c, 0), dh_pairs, mask=pair_mask)
    else:
        gate_c = gl.expand_dims(offs_c + _bwd_shift(c, half_shift, GLU_BLOCK, BLOCK_C), 0)
        dh_rows = dh_tile + gl.expand_dims(offs_r * stride_dhm, 1)
        gl.store(dh_rows + gate_c, d_g.to(out_ty), mask=mask)
        gl.store(dh_rows + gate_c + GLU_BLOCK, d_u.to(out_ty), mask=mask)
    act_rows = act_ptr + row0.to(gl.int64) * stride_actm + gl.expand_dims(offs_r * stride_actm, 1)
    gl.store(act_rows + gl.expand_dims(offs_c, 0), act.to(out_ty), mask=mask)
    return d_probs


@gluon.jit
def _bwd_mma_partition(
    h_ptr,
    dh_ptr,
    act_ptr,
    probs_ptr,
    dprobs_ptr,
    offs_ptr,
    M,
    F,
    H,
    N,
    stride_hm,
    stride_dhm,
    stride_actm,
    a_bufs,
    b0_bufs,
    b1_bufs,
    ready,
    empty,
    da_smem,
    ACT: gl.constexpr,
    ACT_GRAD: gl.constexpr,
    GLU_BLOCK: gl.constexpr,
    W_TRANSPOSED: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    EPI_COLS: gl.constexpr,
    GATHER: gl.constexpr,
):
    """dA of each tile in two fp32 accumulators of BLOCK_C columns over the ring, then the epilogue:
    each accumulator goes through da_smem and is read back EPI_COLS columns at a time in a
    coalesced layout; h's first two chunks are loaded before the main loop and the others two
    chunks ahead of the math."""
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, gluon_group_ids(BLOCK_GROUPS), M, N, F, BLOCK_M, 2 * BLOCK_C
    )
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BLOCK_C, 16]
    )
    VEC: gl.constexpr = 8
    layout: gl.constexpr = gl.BlockedLayout(
        [1, VEC], [32 * VEC // EPI_COLS, EPI_COLS // VEC], [gl.num_warps(), 1], [1, 0]
    )
    # k < EPI_COLS: a chunk's 2 EPI_COLS columns of h (and dh), each thread the gates and ups of its
    # VEC activation columns (k | VEC).
    pair_layout: gl.constexpr = gl.BlockedLayout(
        [1, 2 * VEC], [32 * VEC // EPI_COLS, EPI_COLS // VEC], [gl.num_warps(), 1], [1, 0]
    )
    CHUNKS: gl.constexpr = BLOCK_C // EPI_COLS
    red_steps = gl.cdiv(H, BLOCK_RED)
    it = 0
    for tile_id in range(gl.program_id(0), num_tiles, NUM_PROGRAMS):
        g, row_lo, row_hi, row0, c0, _ = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, 2 * BLOCK_C, GROUP_M
        )
        real = g < N
        offs_r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        offs_m = row0 + offs_r
        mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
        mask_h = mask_m & real  # padding rows: h reads as zeros, so dh and act_p are zeros
        # Loads issued before the main loop, whose time hides their latency.
        if HAS_PROBS:
            p = gl.load(probs_ptr + offs_m, mask=mask_h, other=0.0).to(gl.float32)
        else:
            p = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, layout))
        # Where each half of the tile's columns lies in one GLU block (k = F or BLOCK_C | k).
        shift0 = (c0 // GLU_BLOCK) * GLU_BLOCK
        shift1 = ((c0 + BLOCK_C) // GLU_BLOCK) * GLU_BLOCK
        hg0, hu0 = _bwd_load_h(
            h_ptr, row0, offs_r, mask_h, c0, shift0, F, stride_hm, GLU_BLOCK, BLOCK_C, EPI_COLS, layout, pair_layout
        )
        hg1, hu1 = _bwd_load_h(
            h_ptr,
            row0,
            offs_r,
            mask_h,
            c0 + EPI_COLS,
            shift0,
            F,
            stride_hm,
            GLU_BLOCK,
            BLOCK_C,
            EPI_COLS,
            layout,
            pair_layout,
        )
        acc0 = gl.zeros([BLOCK_M, BLOCK_C], gl.float32, mma_layout)
        acc1 = gl.zeros([BLOCK_M, BLOCK_C], gl.float32, mma_layout)
        for step in range(red_steps):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            if GATHER:
                # dy's tile came by cp.async (the generic proxy); wgmma reads it through the async proxy.
                fence_async_shared()
            if W_TRANSPOSED:  # (BLOCK_C, BLOCK_RED) boxes of the (N, F, H) storage: K-major B
                acc0 = warpgroup_mma(a_bufs.index(slot), b0_bufs.index(slot).permute((1, 0)), acc0, is_async=True)
                acc1 = warpgroup_mma(a_bufs.index(slot), b1_bufs.index(slot).permute((1, 0)), acc1, is_async=True)
            else:
                acc0 = warpgroup_mma(a_bufs.index(slot), b0_bufs.index(slot), acc0, is_async=True)
                acc1 = warpgroup_mma(a_bufs.index(slot), b1_bufs.index(slot), acc1, is_async=True)
            # The previous slot's two products are done once at most these two are in flight.
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
            if step > 0:
                gl.thread_barrier()
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)
            it += 1
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        gl.thread_barrier()
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), count=1)

        d_probs = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, layout))
        for k in gl.static_range(2 * CHUNKS):
            if k == 0:
                da_smem.store(acc0)
                gl.thread_barrier()
            if k == CHUNKS:
                # Every warp has read acc0's columns before acc1 takes the buffer.
                gl.thread_barrier()
                da_smem.store(acc1)
                gl.thread_barrier()
            c = c0 + k * EPI_COLS
            if k + 2 < 2 * CHUNKS:
                hg2, hu2 = _bwd_load_h(
                    h_ptr,
                    row0,
                    offs_r,
                    mask_h,
                    c + 2 * EPI_COLS,
                    shift0 if k + 2 < CHUNKS else shift1,
                    F,
                    stride_hm,
                    GLU_BLOCK,
                    BLOCK_C,
                    EPI_COLS,
                    layout,
                    pair_layout,
                )
            d_act = da_smem.slice((k % CHUNKS) * EPI_COLS, EPI_COLS, dim=1).load(layout)
            d_probs += _bwd_chunk(
                d_act,
                hg0,
                hu0,
                p,
                dh_ptr,
                act_ptr,
                row0,
                offs_r,
                mask_m,
                c,
                shift0 if k < CHUNKS else shift1,
                F,
                stride_dhm,
                stride_actm,
                ACT,
                ACT_GRAD,
                GLU_BLOCK,
                HAS_PROBS,
                BLOCK_C,
                EPI_COLS,
                layout,
                pair_layout,
            )
            if k + 1 < 2 * CHUNKS:
                hg0 = hg1
                hu0 = hu1
            if k + 2 < 2 * CHUNKS:
                hg1 = hg2
                hu1 = hu2
        # The next tile's first store into da_smem comes after every warp's last read of it.
        gl.thread_barrier()
        if HAS_PROBS:
            pid_c = c0 // (2 * BLOCK_C)
            gl.store(dprobs_ptr + pid_c.to(gl.int64) * M + offs_m, d_probs, mask=mask_m)


@gluon.jit
def glu_backward_ws_kernel(
    dy_ptr,
    w_ptr,
    h_ptr,
    dh_ptr,
    act_ptr,
    probs_ptr,
    dprobs_ptr,
    offs_ptr,
    idx_ptr,
    M,
    F,
    H,
    N,
    stride_dym,
    stride_wr,
    stride_hm,
    stride_dhm,
    stride_actm,
    ACT: gl.constexpr,
    ACT_GRAD: gl.constexpr,
    GLU_BLOCK: gl.constexpr,
    W_TRANSPOSED: gl.constexpr,
    HAS_PROBS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_C: gl.constexpr,
    BLOCK_RED: gl.constexpr,
    GROUP_M: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
    EPI_COLS: gl.constexpr,
    GATHER: gl.constexpr,
    LOAD_WARPS: gl.constexpr,
    LOAD_REGS: gl.constexpr,
):
    """fc2's dgrad dA = dy @ w2[g] with the activation's backward, as glu_backward_kernel: dh (M, 2F)
    and act_p (M, F) in h's dtype (the same bits), with probs the d probs partials
    (cdiv(F, 2 BLOCK_C), M) fp32 (another summation order than glu_backward_kernel's). A tile is
    BLOCK_M rows by 2 BLOCK_C activation columns. dy: (M, H) row stride stride_dym; w: fc2's
    (N, H, F), experts contiguous (stride H * stride_wr), unit last stride, needs BLOCK_RED | H (the
    2-D view (N * H, F) of w2 must not reach into the next expert); or with W_TRANSPOSED the
    (N, F, H) tensor under a transposed view of it (experts F * stride_wr apart). Needs k = F,
    BLOCK_C | k, EPI_COLS | k below BLOCK_C, or k | 8. num_warps = 8 (the mma partition).

    GATHER: dy is d out (T, H) and routed row r reads its row idx[r] (idx: (M,) int32 or int64, read
    for the rows before offs[N] only, values in [0, T)), as the forward's GATHER; the load partition is
    LOAD_WARPS = 4 warps. Otherwise idx is not read (any pointer) and LOAD_WARPS is 1 or 4, as the
    forward's."""
    dtype: gl.constexpr = dy_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_RED], dtype)
    # The weight boxes: (BLOCK_C, BLOCK_RED) of fc2's transposed storage, else (BLOCK_RED, BLOCK_C).
    B_ROWS: gl.constexpr = BLOCK_C if W_TRANSPOSED else BLOCK_RED
    B_COLS: gl.constexpr = BLOCK_RED if W_TRANSPOSED else BLOCK_C
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([B_ROWS, B_COLS], dtype)
    da_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_C], gl.float32)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_RED], a_layout)
    b0_bufs = gl.allocate_shared_memory(dtype, [STAGES, B_ROWS, B_COLS], b_layout)
    b1_bufs = gl.allocate_shared_memory(dtype, [STAGES, B_ROWS, B_COLS], b_layout)
    da_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_C], da_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # With GATHER a slot is also waiting for every load thread's cp.async arrival.
    ready_count: gl.constexpr = 1 + LOAD_WARPS * 32 if GATHER else 1
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=ready_count)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize(
        [
            (
                _bwd_mma_partition,
                (
                    h_ptr,
                    dh_ptr,
                    act_ptr,
                    probs_ptr,
                    dprobs_ptr,
                    offs_ptr,
                    M,
                    F,
                    H,
                    N,
                    stride_hm,
                    stride_dhm,
                    stride_actm,
                    a_bufs,
                    b0_bufs,
                    b1_bufs,
                    ready,
                    empty,
                    da_smem,
                    ACT,
                    ACT_GRAD,
                    GLU_BLOCK,
                    W_TRANSPOSED,
                    HAS_PROBS,
                    BLOCK_M,
                    BLOCK_C,
                    BLOCK_RED,
                    GROUP_M,
                    BLOCK_GROUPS,
                    NUM_PROGRAMS,
                    STAGES,
                    EPI_COLS,
                    GATHER,
                ),
            ),
            (
                _bwd_load_partition,
                (
                    dy_ptr,
                    w_ptr,
                    offs_ptr,
                    idx_ptr,
                    M,
                    F,
                    H,
                    N,
                    stride_dym,
                    stride_wr,
                    a_bufs,
                    b0_bufs,
                    b1_bufs,
                    ready,
                    empty,
                    W_TRANSPOSED,
                    BLOCK_M,
                    BLOCK_C,
                    BLOCK_RED,
                    GROUP_M,
                    BLOCK_GROUPS,
                    NUM_PROGRAMS,
                    STAGES,
                    GATHER,
                ),
            ),
        ],
        [LOAD_WARPS],
        [LOAD_REGS],
    )
