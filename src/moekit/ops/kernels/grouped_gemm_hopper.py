# ruff: noqa: E741  (I and O are the legend's in/out feature sizes)
"""Gluon kernels of the grouped GEMM for Hopper (sm_90), warp-specialised (jit code only; host code in
`moekit.ops.runtime.gemm`).

Legend as in `moekit.ops.kernels.grouped_gemm`: M routed rows, N groups (experts), I in_features,
O out_features; a wgrad tile is (BLOCK_O, BLOCK_I) of dw and reduces over its group's rows BLOCK_M at
a time.

    wgrad_gathered_ws_kernel   dw[g] = dy[rows of g]^T @ x[idx[rows of g]]
                               dy (M, O) in expert order, x (T, I) token rows, idx (M,) -> dw (N, O, I)

Why: the layer's fc1 weight gradient needs x's rows in expert order, the (M, H) copy the forward never
wrote. The Triton wgrad can read them through the row map (`wgrad_kernel`'s GATHER_X), but its pointer
loads of the wide operand (64 rows x 256 columns a step) run its main loop at about half the TMA
speed, slower than writing the copy first. Here a warp group of its own copies the rows by cp.async
(`moekit.ops.kernels.gather_hopper`) into a ring running ahead of the tensor cores, as the fused MLP's
GATHER variants do, so the copy is never written and the main loop runs at the TMA loop's pace.

Two partitions:

    load   (4 warps)  each step's dy box (BLOCK_M rows x BLOCK_O columns, TMA) and the step's x rows,
                      two halves of BLOCK_I / 2 columns (cp.async), into a ring of STAGES slots,
                      running ahead across tiles
    mma    (8 warps)  two accumulators (the two halves of BLOCK_I) over the ring, wgmma with both
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
from moekit.ops.kernels.grouped_gemm import wgrad_tile


@gluon.jit
def _tile_grid(O, I, BLOCK_O: gl.constexpr, BLOCK_I: gl.constexpr):
    """(o tiles, i tiles, tiles a group) of dw's (O, I) grid, which every group owns whole."""
    num_pid_o = gl.cdiv(O, BLOCK_O)
    num_pid_i = gl.cdiv(I, BLOCK_I)
    return num_pid_o, num_pid_i, num_pid_o * num_pid_i


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
    a_bufs,
    b0_bufs,
    b1_bufs,
    ready,
    empty,
    BLOCK_O: gl.constexpr,
    BLOCK_I: gl.constexpr,
    BLOCK_M: gl.constexpr,
    GROUP_O: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Each step's dy box by TMA and its x rows (the row map's entries of the step's routed rows) by
    cp.async, two halves of HALF_I columns, each thread's copies arriving on the slot's barrier."""
    num_pid_o, num_pid_i, tiles_per_group = _tile_grid(O, I, BLOCK_O, BLOCK_I)
    HALF_I: gl.constexpr = BLOCK_I // 2
    elem_bytes: gl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth // 8
    slot_layout: gl.constexpr = gather_layout(elem_bytes, HALF_I, gl.num_warps())
    # Rows past offs[N] (padding, may hold anything) read as zeros.
    rows_used = gl.minimum(gl.maximum(gl.load(offs_ptr + N).to(gl.int32), 1), gl.maximum(M, 1))
    dy_desc = tma.make_tensor_descriptor(
        dy_ptr, shape=[rows_used, O], strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_O], layout=a_bufs.type.layout
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
            tma.async_copy_global_to_shared(dy_desc, [r0, o0], ready.index(slot), a_bufs.index(slot))
            rows, mask_rows = token_rows(x_ptr, stride_xm, token, mask_m)
            gather_slot(b0_bufs.index(slot), rows, mask_rows, i0, I, ready.index(slot), HALF_I, slot_layout)
            gather_slot(b1_bufs.index(slot), rows, mask_rows, i0 + HALF_I, I, ready.index(slot), HALF_I, slot_layout)
            token = token_next
            mask_m = mask_next
            it += 1


@gluon.jit
def _store_half(acc, dw_ptr, g, offs_o, i0, O, I, cols_layout: gl.constexpr):
    """dw[g, offs_o, i0 : i0 + width] = acc (rounded to dw's dtype), masked to O and I."""
    offs_i = i0 + gl.arange(0, acc.shape[1], layout=cols_layout)
    base = dw_ptr + g.to(gl.int64) * O * I
    ptrs = base + gl.expand_dims(offs_o.to(gl.int64) * I, 1) + gl.expand_dims(offs_i, 0)
    mask = gl.expand_dims(offs_o < O, 1) & gl.expand_dims(offs_i < I, 0)
    gl.store(ptrs, acc.to(dw_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _wgrad_mma_partition(
    dw_ptr,
    offs_ptr,
    M,
    O,
    I,
    N,
    a_bufs,
    b0_bufs,
    b1_bufs,
    ready,
    empty,
    BLOCK_O: gl.constexpr,
    BLOCK_I: gl.constexpr,
    BLOCK_M: gl.constexpr,
    GROUP_O: gl.constexpr,
    NUM_PROGRAMS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """The tile's two (BLOCK_O, BLOCK_I / 2) accumulators over the ring, one step's MMAs kept in flight
    while the next slot's are issued; then the tile's stores."""
    num_pid_o, num_pid_i, tiles_per_group = _tile_grid(O, I, BLOCK_O, BLOCK_I)
    HALF_I: gl.constexpr = BLOCK_I // 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, HALF_I, 16]
    )
    it = 0
    for tile_id in range(gl.program_id(0), N * tiles_per_group, NUM_PROGRAMS):
        g, o0, i0, row_lo, row_hi = wgrad_tile(
            tile_id, tiles_per_group, num_pid_o, num_pid_i, offs_ptr, M, GROUP_O, BLOCK_O, BLOCK_I
        )
        steps = gl.cdiv(row_hi - row_lo, BLOCK_M)
        acc0 = gl.zeros([BLOCK_O, HALF_I], gl.float32, mma_layout)
        acc1 = gl.zeros([BLOCK_O, HALF_I], gl.float32, mma_layout)
        for step in range(steps):
            slot = it % STAGES
            mbarrier.wait(ready.index(slot), (it // STAGES) & 1)
            # x's rows came by cp.async (the generic proxy); wgmma reads them through the async proxy.
            fence_async_shared()
            a = a_bufs.index(slot).permute((1, 0))  # dy's (BLOCK_M, BLOCK_O) box as the MN-major A
            acc0 = warpgroup_mma(a, b0_bufs.index(slot), acc0, is_async=True)
            acc1 = warpgroup_mma(a, b1_bufs.index(slot), acc1, is_async=True)
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
        offs_o = o0 + gl.arange(0, BLOCK_O, layout=gl.SliceLayout(1, mma_layout))
        cols_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        _store_half(acc0, dw_ptr, g, offs_o, i0, O, I, cols_layout)
        _store_half(acc1, dw_ptr, g, offs_o, i0 + HALF_I, O, I, cols_layout)


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
):
    """dw[g] (O, I) = dy[rows of g]^T @ x[idx[rows of g]] for every group in one launch.

    dy: (M, O) in expert order, row stride stride_dym, unit column stride, TMA-aligned (16-byte base and
    row stride). x: (T, I) token rows, row stride stride_xm a multiple of 16 elements on a 16-byte
    aligned base, I a multiple of 8 (16-byte copies). idx: (M,) int32 or int64, read below offs[N]
    only, values in [0, T). dw: a contiguous (N, O, I) in dy's dtype. offs: (N + 1,) int64 device
    offsets. unused_ptr: the slot of the Triton wgrad's dy row map (not read), so both kernels take one
    argument list. num_warps = 8 (the mma partition; BLOCK_O = 128, two warp groups of 64 rows), the
    load partition LOAD_WARPS = 4 warps with LOAD_REGS registers a thread.
    """
    gl.static_assert(BLOCK_O == 128, "two warp groups of 64 dw rows")
    dtype: gl.constexpr = dy_ptr.dtype.element_ty
    HALF_I: gl.constexpr = BLOCK_I // 2
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_O], dtype)
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF_I], dtype)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_O], a_layout)
    b0_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HALF_I], b_layout)
    b1_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HALF_I], b_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # A slot is ready when dy's TMA bytes have landed after the expect's arrival and every load
    # thread's two cp.async arrivals (one a half).
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1 + 2 * LOAD_WARPS * 32)
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
                    a_bufs,
                    b0_bufs,
                    b1_bufs,
                    ready,
                    empty,
                    BLOCK_O,
                    BLOCK_I,
                    BLOCK_M,
                    GROUP_O,
                    NUM_PROGRAMS,
                    STAGES,
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
                    a_bufs,
                    b0_bufs,
                    b1_bufs,
                    ready,
                    empty,
                    BLOCK_O,
                    BLOCK_I,
                    BLOCK_M,
                    GROUP_O,
                    NUM_PROGRAMS,
                    STAGES,
                ),
            ),
        ],
        [LOAD_WARPS],
        [LOAD_REGS],
    )
