"""Gluon kernel of grouped FP8 quantization for Hopper (sm_90): fp8_block's columnwise form (jit code
only; host code in `moekit.ops.runtime.quantize`, the formats in `moekit.grouped_tensor`).

Legend as in `moekit.ops.kernels.quantize`: M rows (N groups of them, then padding rows), X columns; a
slot is one block of 128 rows of one group, a strip its 128 columns [q * 128, + 128).

    quantize_slots_tma_kernel   `quantize_slots_kernel`'s problem for fp8_block (128 x 1 columnwise
                                blocks, with or without the 1 x 128 rowwise ones; (M, X) rows or the
                                FP8 wgrad's segments), its bytes: each strip read once from memory
                                into shared memory by TMA, then walked twice there

Why: a column's scale needs every row of its slot before any of its bytes, so a strip is read twice.
`quantize_slots_kernel` reads it twice from memory (the second walk from L2) in row chunks held in
registers, which bounds its bytes in flight an SM by registers. Here the strip (32 KiB of bf16) lands
in shared memory (CHUNK-row TMA boxes, all on one barrier) and both walks read it there; a persistent
program keeps STAGES strips in flight (the next ones load while it walks the current one), so the
bytes in flight are shared memory, not registers. The walks are loops over the chunks, not unrolled,
so a program needs few registers and many small programs share an SM (`QUANTIZE_SLOTS_TMA`: what
overlaps one program's walks is the others' loads and stores).

A program takes the work items (slot, strip) pid, pid + P, ... (slots fastest or strips fastest:
SLOTS_FASTEST). Each item's boxes are loaded whatever the slot holds (TMA fills rows past M with
zeros); rows outside the slot's group are masked out in the walks, so a slot that reaches into the next
group's rows, a padding slot (read as zeros, as the Triton kernel reads them) and an unused slot (its
column scales 1, nothing else written) need no branch around the ring; a whole slot of a real group
(every slot but a group's last) takes a copy of the walks without the per-element row masks. Before a
stage is loaded again every warp has finished reading it (a CTA barrier, then the proxy fence).

Walk 1, chunks of CHUNK rows in a row-major register layout (16 consecutive columns a thread): the
elementwise running maximum of |x| (columns; a NaN-propagating max, the NaN read as inf once a block),
and with ROWWISE each row's 1 x 128 block (the strip's row) quantized and stored at once. Walk 2: the
columnwise bytes, as (M, X) rows (the same layout, 16-byte stores) or, SEGMENTS, into the FP8 wgrad's
(X, pitch) layout, read from shared memory in a column-major register layout (16 consecutive rows of
one column a thread), so that each thread stores 16 consecutive bytes of a destination row. The scale
and E4M3 rules are `moekit.ops.kernels.quantize`'s own jit functions, called from Gluon: the bytes are
`quantize_slots_kernel`'s.
"""

from __future__ import annotations

import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from moekit.ops.kernels.grouped_wgrad_fp8 import segment_starts
from moekit.ops.kernels.quantize import e4m3_tile, fp32_scales
from moekit.ops.kernels.schedule import gluon_group_ids


@gluon.jit
def _work_item(w, strips, SLOTS_FASTEST: gl.constexpr, num_slots):
    """(slot, strip) of work item w."""
    if SLOTS_FASTEST:
        return w % num_slots, w // num_slots
    else:
        return w // strips, w % strips


@gluon.jit
def _slot_of(slot, offs_ptr, slot_offs_ptr, rows, num_groups, gi, SEGMENTS: gl.constexpr, SLOT_ROWS: gl.constexpr):
    """(live, count, j0, r0, seg0) of a slot: whether its group is a real one (not the padding rows),
    its group's row count (the padding rows' for group N), its first row within the group, its first
    row in x, and (SEGMENTS) its first column in the wgrad layout (0 otherwise)."""
    starts = gl.load(slot_offs_ptr + 1 + gi, mask=gi < num_groups, other=2**62)
    g = gl.sum((starts <= slot).to(gl.int32), axis=0)
    live = g < num_groups
    group_start = gl.load(offs_ptr + g)
    count = gl.load(offs_ptr + g + 1, mask=live, other=rows) - group_start
    j0 = (slot - gl.load(slot_offs_ptr + g)) * SLOT_ROWS
    seg0 = j0 * 0
    if SEGMENTS:
        starts_v, _ = segment_starts(offs_ptr, gi, rows, num_groups)
        seg0 = gl.sum(gl.where(gi == g, starts_v, 0), axis=0) + j0
    return live, count, j0, group_start + j0, seg0


@gluon.jit
def _issue(
    ring,
    w,
    stage,
    work,
    SLOTS_FASTEST: gl.constexpr,
    SLOT_ROWS: gl.constexpr,
    BLOCK_C: gl.constexpr,
    CHUNK: gl.constexpr,
    NBYTES: gl.constexpr,
):
    """Load work item w's strip into ring stage `stage` (nothing past the last item): one box of CHUNK
    rows a buffer, all on the stage's barrier. ring: (x's descriptor, buffers, ready barriers); work:
    (items, strips, slots, offs_ptr, slot_offs_ptr, rows, groups, the group vector)."""
    desc, bufs, ready = ring
    n_work, strips, num_slots, offs_ptr, slot_offs_ptr, rows, num_groups, gi = work
    if w < n_work:
        slot, q = _work_item(w, strips, SLOTS_FASTEST, num_slots)
        _, _, _, r0, _ = _slot_of(slot, offs_ptr, slot_offs_ptr, rows, num_groups, gi, False, SLOT_ROWS)
        mbarrier.expect(ready.index(stage), NBYTES)
        NCH: gl.constexpr = SLOT_ROWS // CHUNK
        for kk in gl.static_range(NCH):
            tma.async_copy_global_to_shared(
                desc, [(r0 + kk * CHUNK).to(gl.int32), q * BLOCK_C], ready.index(stage), bufs.index(stage * NCH + kk)
            )


@gluon.jit
def _nan_max(a, b):
    return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _amax_of(a, axis: gl.constexpr):
    """The maximum along `axis` of |x| values, a NaN propagated and then read as inf (the block maxima
    of `moekit.ops.kernels.quantize.abs_for_amax`, one instruction an element instead of three)."""
    m = gl.reduce(a, axis, _nan_max)
    return gl.where(m != m, float("inf"), m)


@gluon.jit
def _walks(
    bufs,
    base,
    item,
    sizes,
    outputs,
    MASKED: gl.constexpr,
    ROWWISE: gl.constexpr,
    SEGMENTS: gl.constexpr,
    CHUNK: gl.constexpr,
    SLOT_ROWS: gl.constexpr,
    BLOCK_C: gl.constexpr,
    HW_E4M3: gl.constexpr,
):
    """Both walks over one strip in shared memory. MASKED: rows past the group's end (or a padding slot's)
    are read as zeros and not stored; without it every row of the strip is the group's (a whole slot,
    no select an element). The maxima fold |x| with a NaN-propagating max and read a NaN maximum as inf
    once a block (`_amax_of`). item: the work item's (count, j0, r0, seg0, slot, q, live) (`_slot_of`,
    `_work_item`); sizes: (cols, stride_x, stride_row_scale, pitch); outputs: the four output pointers."""
    count, j0, r0, seg0, slot, q, live = item
    cols, stride_x, stride_row_scale, pitch = sizes
    row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr = outputs
    NW: gl.constexpr = gl.num_warps()
    # Row-major chunks: 8 threads x 16 columns a row; column-major (SEGMENTS' walk 2): 16 rows a thread.
    L: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])
    LT: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [1, NW], [0, 1])
    i = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, L))
    c = q * BLOCK_C + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, L))
    cmask = c < cols
    amax_ic = gl.zeros([CHUNK, BLOCK_C], gl.float32, L)
    for kk in range(SLOT_ROWS // CHUNK):
        k = kk * CHUNK
        rmask = j0 + k + i < count
        x = bufs.index(base + kk).load(L).to(gl.float32)
        if MASKED:
            x = gl.where((rmask & live)[:, None], x, 0.0)
        a = gl.abs(x)
        amax_ic = _nan_max(amax_ic, a)
        if ROWWISE:
            r64 = (r0 + k + i).to(gl.int64)
            amax_r = _amax_of(a, 1)
            scale, scale_inv = fp32_scales(amax_r)
            gl.store(row_scale_ptr + r64 * stride_row_scale + q, scale_inv, mask=rmask)
            qb = e4m3_tile(x, scale[:, None], gl.max(amax_r, axis=0) == float("inf"), HW_E4M3)
            elem = r64[:, None] * stride_x + c[None, :]
            gl.store(row_data_ptr + elem, qb, mask=rmask[:, None] & cmask[None, :])
    amax_c = _amax_of(amax_ic, 0)
    mult, scale_inv_c = fp32_scales(amax_c)
    gl.store(col_scale_ptr + slot.to(gl.int64) * cols + c, scale_inv_c, mask=cmask)
    any_nan = gl.max(amax_c, axis=0) == float("inf")
    if SEGMENTS:
        iT = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LT))
        cT = q * BLOCK_C + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, LT))
        multT = gl.convert_layout(mult, gl.SliceLayout(0, LT))
        for kk in range(SLOT_ROWS // CHUNK):
            k = kk * CHUNK
            x = bufs.index(base + kk).load(LT).to(gl.float32)
            if MASKED:
                x = gl.where(((j0 + k + iT < count) & live)[:, None], x, 0.0)
            qb = e4m3_tile(x, multT[None, :], any_nan, HW_E4M3)
            # Rows past the group's last row are zeros up to the segment's end, nothing past it.
            smask = live & (j0 + k + iT < gl.cdiv(count, 16) * 16)
            dst = (seg0 + k) // 16 * 16 + iT
            ptrs = col_data_ptr + cT.to(gl.int64)[None, :] * pitch + dst[:, None]
            gl.store(ptrs, qb, mask=smask[:, None] & (cT < cols)[None, :])
    else:
        for kk in range(SLOT_ROWS // CHUNK):
            k = kk * CHUNK
            rmask = j0 + k + i < count
            x = bufs.index(base + kk).load(L).to(gl.float32)
            if MASKED:
                x = gl.where((rmask & live)[:, None], x, 0.0)
            qb = e4m3_tile(x, mult[None, :], any_nan, HW_E4M3)
            elem = (r0 + k + i).to(gl.int64)[:, None] * stride_x + c[None, :]
            gl.store(col_data_ptr + elem, qb, mask=rmask[:, None] & cmask[None, :])


@gluon.jit
def quantize_slots_tma_kernel(
    x_ptr,
    offs_ptr,
    slot_offs_ptr,
    noop_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    rows,
    cols,
    num_groups,
    stride_x,
    stride_row_scale,
    pitch,
    num_slots,
    ROWWISE: gl.constexpr,
    SEGMENTS: gl.constexpr,
    CHUNK: gl.constexpr,
    STAGES: gl.constexpr,
    SLOTS_FASTEST: gl.constexpr,
    HAS_NOOP: gl.constexpr,
    BLOCK_GROUPS: gl.constexpr,
    HW_E4M3: gl.constexpr,
):
    """fp8_block's columnwise form (and its rowwise form with ROWWISE) of x (rows, cols), bf16 or fp16,
    16-byte aligned base and row stride; the arguments, outputs and bytes of `quantize_slots_kernel`
    with TILE_K = SLOT_ROWS = BLOCK_C = 128 (num_slots: its slot programs, ceil(M / 128) + N). A
    persistent launch: the programs take the num_slots x ceil(cols / 128) work items in turn."""
    SLOT_ROWS: gl.constexpr = 128
    BLOCK_C: gl.constexpr = 128
    gl.static_assert(SLOT_ROWS % CHUNK == 0 and CHUNK % 16 == 0, "chunks of 16-row multiples")
    run = True
    if HAS_NOOP:
        run = gl.load(noop_ptr) != 1.0
    if run:
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        NBYTES: gl.constexpr = SLOT_ROWS * BLOCK_C * dtype.primitive_bitwidth // 8
        NCH: gl.constexpr = SLOT_ROWS // CHUNK
        smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([CHUNK, BLOCK_C], dtype)
        bufs = gl.allocate_shared_memory(dtype, [STAGES * NCH, CHUNK, BLOCK_C], smem_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
        desc = tma.make_tensor_descriptor(
            x_ptr, shape=[rows, cols], strides=[stride_x, 1], block_shape=[CHUNK, BLOCK_C], layout=smem_layout
        )
        gi = gluon_group_ids(BLOCK_GROUPS)
        strips = gl.cdiv(cols, BLOCK_C)
        n_work = num_slots * strips
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        ring = (desc, bufs, ready)
        work = (n_work, strips, num_slots, offs_ptr, slot_offs_ptr, rows, num_groups, gi)
        for s in gl.static_range(STAGES):
            _issue(ring, pid + s * nprog, s, work, SLOTS_FASTEST, SLOT_ROWS, BLOCK_C, CHUNK, NBYTES)
        sizes = (cols, stride_x, stride_row_scale, pitch)
        outputs = (row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr)
        it = 0
        for w in range(pid, n_work, nprog):
            stage = it % STAGES
            slot, q = _work_item(w, strips, SLOTS_FASTEST, num_slots)
            live, count, j0, r0, seg0 = _slot_of(
                slot, offs_ptr, slot_offs_ptr, rows, num_groups, gi, SEGMENTS, SLOT_ROWS
            )
            mbarrier.wait(ready.index(stage), (it // STAGES) & 1)
            item = (count, j0, r0, seg0, slot, q, live)
            base = stage * (SLOT_ROWS // CHUNK)
            if live and j0 + SLOT_ROWS <= count:  # a whole slot of a real group: no row masks
                _walks(bufs, base, item, sizes, outputs, False, ROWWISE, SEGMENTS, CHUNK, SLOT_ROWS, BLOCK_C, HW_E4M3)
            else:
                _walks(bufs, base, item, sizes, outputs, True, ROWWISE, SEGMENTS, CHUNK, SLOT_ROWS, BLOCK_C, HW_E4M3)
            # Every warp is done with this stage before it is loaded again.
            gl.thread_barrier()
            fence_async_shared()
            _issue(ring, w + STAGES * nprog, stage, work, SLOTS_FASTEST, SLOT_ROWS, BLOCK_C, CHUNK, NBYTES)
            it += 1
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
