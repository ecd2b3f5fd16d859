"""Gluon kernel of grouped FP8 quantization for Hopper (sm_90): fp8_block's columnwise form, and mxfp8's
in the (M, X) layout (jit code only; host code in `moekit.ops.runtime.quantize`, the formats in
`moekit.grouped_tensor`).

Legend as in `moekit.ops.kernels.quantize`: M rows (N groups of them, then padding rows), X columns; a
slot is one block of rows of one group (128 for fp8_block, 32 for mxfp8), a strip its 128 columns [q *
128, + 128).

    quantize_slots_tma_kernel   `quantize_slots_kernel`'s problem for fp8_block (128 x 1 columnwise
                                blocks, with or without the 1 x 128 rowwise ones; (M, X) rows or the
                                FP8 wgrad's segments) and for mxfp8 (32 x 1 and 1 x 32 blocks, E8M0
                                scales; (M, X) rows), its bytes: each strip read once from memory
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
SLOTS_FASTEST). A slot's rows (first row, rows left in its group, real group or not, segment start)
come from a table the host fills just before (`slot_records_kernel`): one independent load a slot,
issued an item ahead, where finding the slot's group from the device offsets is a chain of dependent
loads and cross-warp reductions that every warp of the program would wait on. Each item's boxes are
loaded whatever the slot holds (TMA fills rows past M with zeros); rows outside the slot's group are
masked out in the walks, so a slot that reaches into the next group's rows, a padding slot (read as
zeros, as the Triton kernel reads them) and an unused slot (its column scales 1, nothing else written)
need no branch around the ring; a whole slot of a real group (every slot but a group's last) takes a
copy of the walks without the per-element row masks. Before a
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
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from moekit.ops.kernels.grouped_wgrad_fp8 import SEGMENT_COLUMNS
from moekit.ops.kernels.quantize import e8m0_scales, fp32_scales, store_e4m3


@gluon.jit
def _work_item(w, strips, SLOTS_FASTEST: gl.constexpr, num_slots):
    """(slot, strip) of work item w."""
    if SLOTS_FASTEST:
        return w % num_slots, w // num_slots
    else:
        return w // strips, w % strips


@gluon.jit
def _record(rec_ptr, slot, valid):
    """(r0, n, live, seg0) of a slot from `slot_records_kernel`'s table (zeros where not `valid`): four
    independent loads, so that they can be issued an item before they are used."""
    rec = rec_ptr + slot.to(gl.int64) * 4
    r0 = gl.load(rec, mask=valid, other=0)
    n = gl.load(rec + 1, mask=valid, other=0)
    live = gl.load(rec + 2, mask=valid, other=0)
    seg0 = gl.load(rec + 3, mask=valid, other=0)
    return r0, n, live, seg0


@gluon.jit
def _issue(
    ring,
    w,
    r0,
    stage,
    work,
    SLOTS_FASTEST: gl.constexpr,
    SLOT_ROWS: gl.constexpr,
    BLOCK_C: gl.constexpr,
    CHUNK: gl.constexpr,
    NBYTES: gl.constexpr,
    GATHER: gl.constexpr,
):
    """Load work item w's strip (r0: its slot's first row; its strip: `_work_item`'s) into ring stage
    `stage` (nothing past the last item): one box of CHUNK rows a buffer, all on the stage's barrier.
    ring: (source, buffers, ready barriers), the source x's descriptor; work: (items, strips, slots).

    GATHER: row r of the problem is x's row index[r], and TMA boxes cannot gather rows: the source is
    (x_ptr, index_ptr, rows, cols, stride_x) and every thread copies 16 bytes at a time with cp.async
    (zeros past the rows and the columns, as TMA fills), one commit group a call, empty past the last
    item, so that each call counts one group and the wait before a stage's walks is a wait for all but
    the STAGES - 1 newest groups (`_wait_stage`)."""
    source, bufs, ready = ring
    n_work, strips, num_slots = work
    NCH: gl.constexpr = SLOT_ROWS // CHUNK
    if GATHER:
        x_ptr, index_ptr, rows, cols, stride_x = source
        if w < n_work:
            _, q = _work_item(w, strips, SLOTS_FASTEST, num_slots)
            # 8 two-byte elements (16 bytes) a thread, 16 threads a row's 128 columns.
            LG: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [gl.num_warps(), 1], [1, 0])
            i = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, LG))
            c = q * BLOCK_C + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, LG))
            # Every chunk's row indices first (their loads in flight together: one round trip, not one a
            # chunk), then the copies.
            srcs = ()
            for kk in gl.static_range(NCH):
                r = r0 + kk * CHUNK + i
                srcs = srcs + (gl.load(index_ptr + r, mask=r < rows, other=0),)  # type: ignore[assignment]
            for kk in gl.static_range(NCH):
                r = r0 + kk * CHUNK + i
                ptrs = x_ptr + srcs[kk].to(gl.int64)[:, None] * stride_x + c[None, :]
                mask = (r < rows)[:, None] & (c < cols)[None, :]
                async_copy.async_copy_global_to_shared(bufs.index(stage * NCH + kk), ptrs, mask=mask)
        async_copy.commit_group()
    else:
        if w < n_work:
            _, q = _work_item(w, strips, SLOTS_FASTEST, num_slots)
            mbarrier.expect(ready.index(stage), NBYTES)
            for kk in gl.static_range(NCH):
                tma.async_copy_global_to_shared(
                    source, [r0 + kk * CHUNK, q * BLOCK_C], ready.index(stage), bufs.index(stage * NCH + kk)
                )


@gluon.jit
def _wait_stage(ready, stage, it, STAGES: gl.constexpr, GATHER: gl.constexpr):
    """Wait until ring stage `stage` (iteration it's) has landed: its barrier's phase for TMA; with
    GATHER, this thread's copies of all but the newest STAGES - 1 groups, then every thread's (a CTA
    barrier: the stage was copied by all of them)."""
    if GATHER:
        async_copy.wait_group(STAGES - 1)
        gl.thread_barrier()
    else:
        mbarrier.wait(ready.index(stage), (it // STAGES) & 1)


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
    MX: gl.constexpr,
    CHUNK: gl.constexpr,
    SLOT_ROWS: gl.constexpr,
    BLOCK_C: gl.constexpr,
    HW_E4M3: gl.constexpr,
):
    """Both walks over one strip in shared memory. MX: mxfp8's blocks (a strip's row holds four 1 x 32
    blocks, each with its E8M0 byte; a slot is 32 rows; column scales E8M0 bytes), else fp8_block's (a
    strip's row is one 1 x 128 block; fp32 scale_inv). MASKED: rows past the group's end (or a padding slot's)
    are read as zeros and not stored; without it every row of the strip is the group's (a whole slot,
    no select an element). The maxima fold |x| with a NaN-propagating max and read a NaN maximum as inf
    once a block (`_amax_of`). item: the work item's (n, r0, seg0, slot, q, live) (`_record`,
    `_work_item`); sizes: (cols, stride_x, stride_row_scale, pitch); outputs: the four output pointers."""
    n, r0, seg0, slot, q, live = item
    cols, stride_x, stride_row_scale, pitch = sizes
    row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr = outputs
    NW: gl.constexpr = gl.num_warps()
    # Row-major chunks: 8 threads x 16 columns a row; column-major (SEGMENTS' walk 2): 16 rows a thread.
    L: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NW, 1], [1, 0])
    LT: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [1, NW], [0, 1])
    i = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, L))
    c = q * BLOCK_C + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, L))
    cmask = c < cols
    # The running maxima in the input's dtype: |x| and their maximum are exact there, and half the
    # registers of float32 for 16-bit input (what decides the programs an SM).
    amax_ic = gl.zeros([CHUNK, BLOCK_C], bufs.dtype, L)
    for kk in range(SLOT_ROWS // CHUNK):
        k = kk * CHUNK
        rmask = k + i < n
        x_in = bufs.index(base + kk).load(L)
        if MASKED:
            x_in = gl.where((rmask & live)[:, None], x_in, gl.zeros_like(x_in))
        amax_ic = _nan_max(amax_ic, gl.abs(x_in)).to(bufs.dtype)
        x = x_in.to(gl.float32)
        a = gl.abs(x)
        if ROWWISE:
            r64 = (r0 + k + i).to(gl.int64)
            elem = r64[:, None] * stride_x + c[None, :]
            row_mask = rmask[:, None] & cmask[None, :]
            if MX:
                # (CHUNK, 4, 32): a thread's 16 columns lie in one block, a block's 32 in two threads.
                NB: gl.constexpr = BLOCK_C // 32
                a3 = gl.reshape(a, [CHUNK, NB, 32])
                amax_b = _amax_of(a3, 2)
                byte, mult_b = e8m0_scales(amax_b)
                bl: gl.constexpr = amax_b.type.layout
                cb = q * NB + gl.arange(0, NB, layout=gl.SliceLayout(0, bl))
                rb = (r0 + k + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, bl))).to(gl.int64)
                rbmask = (k + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, bl))) < n
                scale_mask = rbmask[:, None] & (cb < stride_row_scale)[None, :]
                gl.store(row_scale_ptr + rb[:, None] * stride_row_scale + cb[None, :], byte, mask=scale_mask)
                mult3, _ = gl.broadcast(gl.expand_dims(mult_b, 2), a3)
                mult = gl.convert_layout(gl.reshape(mult3, [CHUNK, BLOCK_C]), L)
                row_nan = gl.max(gl.max(amax_b, axis=1), axis=0) == float("inf")
                store_e4m3(row_data_ptr + elem, x, mult, row_mask, row_mask, row_nan, HW_E4M3, False)
            else:
                amax_r = _amax_of(a, 1)
                scale, scale_inv = fp32_scales(amax_r)
                gl.store(row_scale_ptr + r64 * stride_row_scale + q, scale_inv, mask=rmask)
                row_nan = gl.max(amax_r, axis=0) == float("inf")
                store_e4m3(row_data_ptr + elem, x, scale[:, None], row_mask, row_mask, row_nan, HW_E4M3, False)
    amax_c = _amax_of(amax_ic.to(gl.float32), 0)
    if MX:
        byte_c, mult = e8m0_scales(amax_c)
        gl.store(col_scale_ptr + slot.to(gl.int64) * cols + c, byte_c, mask=cmask)
    else:
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
            keep = (k + iT < n)[:, None]
            if MASKED:
                x = gl.where(keep & live, x, 0.0)
            # Rows past the group's last row are zeros up to the segment's end (a slot is a segment's
            # width: the slot holding the group's last row reaches it), nothing past it: zero bytes,
            # not the bytes of 0 x scale (a column whose scale is NaN would write NaN bytes there).
            smask = live & (k + iT < gl.cdiv(n, SEGMENT_COLUMNS) * SEGMENT_COLUMNS)
            dst = (seg0 + k) // 16 * 16 + iT
            ptrs = col_data_ptr + cT.to(gl.int64)[None, :] * pitch + dst[:, None]
            store_e4m3(ptrs, x, multT[None, :], keep, smask[:, None] & (cT < cols)[None, :], any_nan, HW_E4M3, False)
    else:
        for kk in range(SLOT_ROWS // CHUNK):
            k = kk * CHUNK
            rmask = k + i < n
            x = bufs.index(base + kk).load(L).to(gl.float32)
            if MASKED:
                x = gl.where((rmask & live)[:, None], x, 0.0)
            elem = (r0 + k + i).to(gl.int64)[:, None] * stride_x + c[None, :]
            mask = rmask[:, None] & cmask[None, :]
            store_e4m3(col_data_ptr + elem, x, mult[None, :], mask, mask, any_nan, HW_E4M3, False)


@gluon.jit
def _first_row(rec_ptr, w, work, SLOTS_FASTEST: gl.constexpr):
    """Work item w's slot's first row in x (`slot_records_kernel`'s r0; 0 past the last item)."""
    n_work, strips, num_slots = work
    slot, _ = _work_item(w, strips, SLOTS_FASTEST, num_slots)
    return gl.load(rec_ptr + slot.to(gl.int64) * 4, mask=w < n_work, other=0)


@gluon.jit
def quantize_slots_tma_kernel(
    x_ptr,
    index_ptr,
    rec_ptr,
    noop_ptr,
    row_data_ptr,
    row_scale_ptr,
    col_data_ptr,
    col_scale_ptr,
    rows,
    cols,
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
    HW_E4M3: gl.constexpr,
    GATHER: gl.constexpr = False,
    MX: gl.constexpr = False,
):
    """fp8_block's columnwise form (and its rowwise form with ROWWISE) of x (rows, cols), bf16 or fp16,
    16-byte aligned base and row stride; the outputs and bytes of `quantize_slots_kernel` with TILE_K =
    SLOT_ROWS = BLOCK_C = 128 (num_slots: its slot programs, ceil(M / 128) + N), each slot's rows read
    from `slot_records_kernel`'s table (rec_ptr, SLOT_ROWS 128, the same SEGMENTS). MX: mxfp8's instead,
    the (M, X) layout only: TILE_K = SLOT_ROWS = 32, BLOCK_C = 128 (four row blocks a strip's row),
    E8M0 scales, num_slots ceil(M / 32) + N and the table's slots of 32 rows. A persistent launch:
    the programs take the num_slots x ceil(cols / 128) work items in turn. Each iteration issues the
    loads of its next item's record and of the first row of the item it loads next before it walks
    its own strip, so their latency hides behind the walks. GATHER: row r of the problem (rows of them)
    is x's row index[r], loaded by cp.async instead of TMA (`_issue`); everything else the same."""
    SLOT_ROWS: gl.constexpr = 32 if MX else 128
    BLOCK_C: gl.constexpr = 128
    gl.static_assert(SLOT_ROWS % CHUNK == 0 and CHUNK % 16 == 0, "chunks of 16-row multiples")
    gl.static_assert(
        not SEGMENTS or SLOT_ROWS == SEGMENT_COLUMNS, "a slot's walk 2 fills its segment's columns to the end"
    )
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
        if GATHER:
            source = (x_ptr, index_ptr, rows, cols, stride_x)
        else:
            source = tma.make_tensor_descriptor(
                x_ptr, shape=[rows, cols], strides=[stride_x, 1], block_shape=[CHUNK, BLOCK_C], layout=smem_layout
            )
        strips = gl.cdiv(cols, BLOCK_C)
        n_work = num_slots * strips
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        ring = (source, bufs, ready)
        work = (n_work, strips, num_slots)
        for s in gl.static_range(STAGES):
            w0 = pid + s * nprog
            _issue(
                ring,
                w0,
                _first_row(rec_ptr, w0, work, SLOTS_FASTEST),
                s,
                work,
                SLOTS_FASTEST,
                SLOT_ROWS,
                BLOCK_C,
                CHUNK,
                NBYTES,
                GATHER,
            )
        sizes = (cols, stride_x, stride_row_scale, pitch)
        outputs = (row_data_ptr, row_scale_ptr, col_data_ptr, col_scale_ptr)
        slot, _ = _work_item(pid, strips, SLOTS_FASTEST, num_slots)
        r0, n, live, seg0 = _record(rec_ptr, slot, pid < n_work)
        it = 0
        for w in range(pid, n_work, nprog):
            stage = it % STAGES
            slot, q = _work_item(w, strips, SLOTS_FASTEST, num_slots)
            next_slot, _ = _work_item(w + nprog, strips, SLOTS_FASTEST, num_slots)
            next_record = _record(rec_ptr, next_slot, w + nprog < n_work)
            load_r0 = _first_row(rec_ptr, w + STAGES * nprog, work, SLOTS_FASTEST)
            _wait_stage(ready, stage, it, STAGES, GATHER)
            item = (n, r0, seg0, slot, q, live != 0)
            base = stage * (SLOT_ROWS // CHUNK)
            if live != 0 and n >= SLOT_ROWS:  # a whole slot of a real group: no row masks
                _walks(
                    bufs, base, item, sizes, outputs, False, ROWWISE, SEGMENTS, MX, CHUNK, SLOT_ROWS, BLOCK_C, HW_E4M3
                )
            else:
                _walks(
                    bufs, base, item, sizes, outputs, True, ROWWISE, SEGMENTS, MX, CHUNK, SLOT_ROWS, BLOCK_C, HW_E4M3
                )
            # Every warp is done with this stage before it is loaded again.
            gl.thread_barrier()
            fence_async_shared()
            _issue(
                ring, w + STAGES * nprog, load_r0, stage, work, SLOTS_FASTEST, SLOT_ROWS, BLOCK_C, CHUNK, NBYTES, GATHER
            )
            r0, n, live, seg0 = next_record
            it += 1
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(s))
