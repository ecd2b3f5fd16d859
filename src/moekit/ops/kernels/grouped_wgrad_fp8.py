# ruff: noqa: E741  (I and O are the legend's in/out feature sizes)
"""Triton kernels of the FP8 grouped weight gradient (jit code only; host code in
`moekit.ops.runtime.quantized_gemm`, the formats in `moekit.ops.quantize`).

Legend: M routed rows, N groups (experts), I in_features, O out_features, X a generic width.

    wgrad   dw[g] (O, I) = sum over rows r of g of dy[r, o] * x[r, i]
          = (dyt_q[:, rows of g] @ xt_q[:, rows of g]^T) * s_dy[g, o] * s_x[g, i]

fp8_rowwise's columnwise quantization of dy (M, O) and x (M, I) has one float32 dequantization
multiplier per (group, column), constant along the wgrad's reduction (the group's rows): the FP8
products accumulate unscaled in fp32 and the two scales are applied once, in the epilogue
(`grouped_wgrad_fp8_kernel`). fp8_block's has one per column of each 128-row block of a group
(blocks restart at every group's first row): a 128-row step from the group's start is one block of
both operands, promoted into the fp32 accumulator with its scales in the main loop, the forward's
overlapped loop (`grouped_wgrad_fp8_block_kernel`, `moekit.ops.kernels.grouped_gemm_fp8`).

Hopper's FP8 wgmma takes both operands from shared memory only "K-major", contiguous along the
reduction; the reduction here runs down the rows of (M, X) data. So the kernel takes both operands
transposed, (X, pitch) with the rows contiguous (`transpose_rows_kernel`, one read and one write of
the FP8 data each, or written so by the columnwise quantization itself: `moekit.ops.kernels.quantize`'s
SEGMENTS stores), and reads them as the FP8 forward reads its operands: A = dyt[o0:, c0:]
(BLOCK_O, BLOCK_M), B = xt[i0:, c0:] (BLOCK_I, BLOCK_M) through a transposed view, no transpose in
registers. A group may start at any row, and a TMA box must start 16-byte aligned along the contiguous
dimension: so each group's rows start a segment at a multiple of SEGMENT_COLUMNS (128) columns of the
transposed operand, zeros filling the segment's tail (`segment_starts`). 128 rather than TMA's 16: a
writer of 128 rows of a group (the quantizer's slots) then stores whole 128-byte lines of every
destination row at any split (a segment starting mid-line makes the writers of neighbouring slots
share lines, each storing part of them), and a reduction step of up to 128 rows never leaves its
group's segment, whose tail is zeros in both operands: no step needs a descriptor that stops at its
group's last row. The cost: up to 127 zero columns a group.

The schedule is the bf16 wgrad's (`moekit.ops.kernels.grouped_gemm.wgrad_kernel`): every group owns
the same (o, i) tile grid and the group offsets are read on the device only; fp8_rowwise's persistent
program runs all its tiles' reduction steps in one software-pipelined loop (the FLATTEN form),
fp8_block's one reduction loop per tile (its products must not be read in an epilogue branch inside
the pipelined loop: `grouped_wgrad_fp8_block_kernel`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.ops.kernels.grouped_gemm import wgrad_epilogue, wgrad_steps, wgrad_tile
from moekit.ops.kernels.schedule import group_rows

SEGMENT_COLUMNS = tl.constexpr(128)  # equal to moekit.ops.runtime.quantize_torch.SEGMENT_COLUMNS (tested)


@triton.jit
def segment_starts(offs_ptr, offs_g, M, N):
    """(starts, total) of the transposed operands' group segments: group g's rows occupy columns
    [starts[g], starts[g] + rows of g) of a transposed (X, pitch) operand, starts[g] the sum of the
    earlier groups' row counts each rounded up to SEGMENT_COLUMNS (the module's docstring says why);
    the columns between a group's last row and the next segment hold zeros. `offs_g` as `group_rows`'
    (entries past N are empty); total = the columns in use."""
    lo_v, hi_v = group_rows(offs_ptr, offs_g, M, N, False)
    width_v = tl.cdiv(hi_v - lo_v, SEGMENT_COLUMNS) * SEGMENT_COLUMNS
    ends_v = tl.cumsum(width_v, 0)
    return ends_v - width_v, tl.sum(width_v, 0)


@triton.jit
def scale_slots(offs_ptr, offs_g, M, N, SCALE_BLOCK: tl.constexpr):
    """Each group's first slot of fp8_block's columnwise scales: the sum over the earlier groups h of
    ceil(rows of h / SCALE_BLOCK) (`moekit.ops.quantize`'s slot offsets, from the device offsets);
    `offs_g` as `group_rows`'."""
    lo_v, hi_v = group_rows(offs_ptr, offs_g, M, N, False)
    blocks_v = tl.cdiv(hi_v - lo_v, SCALE_BLOCK)
    return tl.cumsum(blocks_v, 0) - blocks_v


@triton.jit
def transpose_rows_kernel(
    src_ptr,
    dst_ptr,
    offs_ptr,
    M,
    X,
    N,
    stride_src,
    pitch_words,
    BLOCK_M: tl.constexpr,
    BLOCK_X: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """Program (column tile, tile of destination columns): an (M, X) byte matrix (row stride
    `stride_src`) into (X, 4 * pitch_words) bytes, addressed as int32 words, in `segment_starts`'
    layout: dst[x, starts[g] + j] = src[offs[g] + j, x] for the j < rows of group g, zeros in the
    rest of each segment (up to its next multiple of SEGMENT_COLUMNS). Rows past offs[N] (padding, may
    hold anything) are never read; columns past the last segment are not written. A word holds 4
    consecutive columns, all of one segment (segments start at multiples of SEGMENT_COLUMNS): a thread
    packs its 4 bytes of (q, x) from 4 rows in registers and the transpose through shared memory moves
    words, as `moekit.ops.kernels.quantize.transpose_weight_kernel` does for weights. BLOCK_GROUPS > N. Bytes
    only: no arithmetic on values."""
    xb = tl.program_id(0)
    mb = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_GROUPS)
    starts_v, total = segment_starts(offs_ptr, offs_g, M, N)
    if mb * BLOCK_M < total:
        lo_v, hi_v = group_rows(offs_ptr, offs_g, M, N, False)
        q = mb * (BLOCK_M // 4) + tl.arange(0, BLOCK_M // 4)
        c = q * 4
        # The segment of each word: the last group starting at or before it (later empty groups
        # start at the same column and own no columns; the first one wins by the compare below).
        seg_end = starts_v + tl.cdiv(hi_v - lo_v, SEGMENT_COLUMNS) * SEGMENT_COLUMNS
        inside = (starts_v[None, :] <= c[:, None]) & (c[:, None] < seg_end[None, :])
        src_row = tl.sum(tl.where(inside, lo_v[None, :] - starts_v[None, :], 0), 1) + c
        row_end = tl.sum(tl.where(inside, hi_v[None, :], 0), 1)
        x = xb * BLOCK_X + tl.arange(0, BLOCK_X)
        mask_x = x < X
        row0 = src_ptr + src_row.to(tl.int64)[:, None] * stride_src + x[None, :]
        words = tl.load(row0, mask=(src_row < row_end)[:, None] & mask_x[None, :], other=0).to(tl.int32)
        for k in tl.static_range(1, 4):
            mask_k = (src_row + k < row_end)[:, None] & mask_x[None, :]
            words |= tl.load(row0 + k * stride_src, mask=mask_k, other=0).to(tl.int32) << (8 * k)
        mask_t = mask_x[:, None] & (c < total)[None, :]
        tl.store(dst_ptr + x.to(tl.int64)[:, None] * pitch_words + q[None, :], tl.trans(words), mask=mask_t)


@triton.jit
def scaled(
    acc,
    dy_scale_ptr,
    x_scale_ptr,
    g,
    o0,
    i0,
    O,
    I,
    stride_dys,
    stride_xs,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """acc (BLOCK_O, BLOCK_I) of group g's tile at (o0, i0) times s_dy[g, o] * s_x[g, i] (tails read 0:
    never stored)."""
    offs_o = o0 + tl.arange(0, BLOCK_O)
    offs_i = i0 + tl.arange(0, BLOCK_I)
    s_dy = tl.load(dy_scale_ptr + g.to(tl.int64) * stride_dys + offs_o, mask=offs_o < O, other=0.0)
    s_x = tl.load(x_scale_ptr + g.to(tl.int64) * stride_xs + offs_i, mask=offs_i < I, other=0.0)
    return acc * (s_dy[:, None] * s_x[None, :])


@triton.jit
def grouped_wgrad_fp8_kernel(
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
    stride_dyt,
    stride_xt,
    stride_dys,
    stride_xs,
    stride_dwg,
    stride_dwo,
    USE_TMA: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP_O: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    EPI_TMA: tl.constexpr,
):
    """dw[g] (O, I) = (dyt[:, segment g] @ xt[:, segment g]^T) * s_dy[g, :, None] * s_x[g, None, :].

    dyt: (O, pitch) float8, dy's columnwise data transposed into `segment_starts`' layout (group g's
    rows at columns starts[g]:, zeros to the segment's end), row stride stride_dyt (bytes, a multiple
    of 16); xt: (I, pitch) likewise for x. dy_scale (N, O) and x_scale (N, I) float32, row strides
    stride_dys / stride_xs, unit column stride. dw: (N, O, I) in the output dtype, strides
    (stride_dwg, stride_dwo, 1). Tiles BLOCK_O x BLOCK_I (BLOCK_M a multiple of 16), reducing over
    the group's columns BLOCK_M at a time (fp32 accumulation); every TMA box starts at starts[g] +
    step * BLOCK_M, 16-byte aligned.

    Columns that must add nothing, as the bf16 wgrad's rows: the last step of a group whose row count
    is not a multiple of BLOCK_M reaches past its last row, but not past its segment (BLOCK_M divides
    SEGMENT_COLUMNS), whose tail is zeros in both operands: one whole-extent descriptor of each serves
    every step. Padding rows (past offs[N], which may hold anything, NaN included) are never in a
    segment. The pointer path also masks both at the group's last row. A group without rows runs one
    discarded step and stores zeros (whatever its scales hold).
    """
    tl.static_assert(SEGMENT_COLUMNS % BLOCK_M == 0, "a reduction step stays in its group's segment")
    pid = tl.program_id(0)
    num_pid_o = tl.cdiv(O, BLOCK_O)
    num_pid_i = tl.cdiv(I, BLOCK_I)
    tiles_per_group = num_pid_o * num_pid_i
    if EPI_TMA:
        dw_desc = tl.make_tensor_descriptor(
            dw_ptr, shape=[N, O, I], strides=[stride_dwg, stride_dwo, 1], block_shape=[1, BLOCK_O, BLOCK_I // 2]
        )
    else:
        dw_desc = dw_ptr  # placeholder, unused without EPI_TMA
    total_steps, _ = wgrad_steps(offs_ptr, pid, tiles_per_group, M, N, NUM_PROGRAMS, BLOCK_M, BLOCK_GROUPS)
    offs_g = tl.arange(0, BLOCK_GROUPS)
    starts_v, cols_used = segment_starts(offs_ptr, offs_g, M, N)
    cols_used = tl.maximum(cols_used, 1)

    tile_id = pid - NUM_PROGRAMS
    step = 0
    tile_steps = 1
    g = 0
    o0 = 0
    i0 = 0
    row_lo = 0
    row_hi = 0
    col_lo = 0
    col_hi = 0
    if USE_TMA:
        dy_desc = tl.make_tensor_descriptor(
            dyt_ptr, shape=[O, cols_used], strides=[stride_dyt, 1], block_shape=[BLOCK_O, BLOCK_M]
        )
        x_desc = tl.make_tensor_descriptor(
            xt_ptr, shape=[I, cols_used], strides=[stride_xt, 1], block_shape=[BLOCK_I, BLOCK_M]
        )
    else:
        dy_desc = dyt_ptr  # placeholders, unused without USE_TMA
        x_desc = xt_ptr
    acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
    for _ in range(0, total_steps):
        if step == 0:
            tile_id += NUM_PROGRAMS
            g, o0, i0, row_lo, row_hi = wgrad_tile(
                tile_id, tiles_per_group, num_pid_o, num_pid_i, offs_ptr, M, GROUP_O, BLOCK_O, BLOCK_I
            )
            tile_steps = tl.maximum(tl.cdiv(row_hi - row_lo, BLOCK_M), 1)
            col_lo = tl.sum(tl.where(offs_g == g, starts_v, 0), 0)
            col_hi = col_lo + (row_hi - row_lo)
        r0 = col_lo + step * BLOCK_M
        if USE_TMA:
            a = dy_desc.load([o0, r0])
            b = x_desc.load([i0, r0]).T
        else:
            offs_m = r0 + tl.arange(0, BLOCK_M)
            offs_o = o0 + tl.arange(0, BLOCK_O)
            offs_i = i0 + tl.arange(0, BLOCK_I)
            mask_m = offs_m < col_hi
            a = tl.load(
                dyt_ptr + offs_o.to(tl.int64)[:, None] * stride_dyt + offs_m[None, :],
                mask=(offs_o < O)[:, None] & mask_m[None, :],
                other=0.0,
            )
            b = tl.load(
                xt_ptr + offs_i.to(tl.int64)[None, :] * stride_xt + offs_m[:, None],
                mask=mask_m[:, None] & (offs_i < I)[None, :],
                other=0.0,
            )
        acc = tl.dot(a, b, acc)
        last = step == tile_steps - 1
        if last:
            acc = scaled(acc, dy_scale_ptr, x_scale_ptr, g, o0, i0, O, I, stride_dys, stride_xs, BLOCK_O, BLOCK_I)
            # A group without rows stores zeros: its one step read other groups' rows.
            acc = tl.where(row_hi > row_lo, acc, 0.0)
            wgrad_epilogue(acc, dw_ptr, dw_desc, g, o0, i0, O, I, stride_dwg, stride_dwo, EPI_TMA, BLOCK_O, BLOCK_I)
            acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
        # The step counter must not depend on the epilogue branch (the next tile's loads would wait
        # for this tile's store).
        step = tl.where(last, 0, step + 1)


@triton.jit
def wgrad_block_operands(
    dy_desc,
    x_desc,
    dyt_ptr,
    xt_ptr,
    r0,
    col_hi,
    o0,
    i0,
    O,
    I,
    stride_dyt,
    stride_xt,
    USE_TMA: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(A, B) of one reduction step at column r0 of the transposed operands: A = dyt[o0:, r0:]
    (BLOCK_O, BLOCK_M), B = xt[i0:, r0:]^T (BLOCK_M, BLOCK_I), a transposed view with TMA (the
    descriptors' extents zero-fill); the pointer path reads zeros at columns >= col_hi and past O / I."""
    if USE_TMA:
        a = dy_desc.load([o0, r0])
        b = x_desc.load([i0, r0]).T
    else:
        offs_m = r0 + tl.arange(0, BLOCK_M)
        offs_o = o0 + tl.arange(0, BLOCK_O)
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask_m = offs_m < col_hi
        a = tl.load(
            dyt_ptr + offs_o.to(tl.int64)[:, None] * stride_dyt + offs_m[None, :],
            mask=(offs_o < O)[:, None] & mask_m[None, :],
            other=0.0,
        )
        b = tl.load(
            xt_ptr + offs_i.to(tl.int64)[None, :] * stride_xt + offs_m[:, None],
            mask=mask_m[:, None] & (offs_i < I)[None, :],
            other=0.0,
        )
    return a, b


@triton.jit
def block_scales(sdy_ptrs, sx_ptrs, slot, stride_dys, stride_xs, mask_o, mask_i):
    """(s_dy, s_x): scale row `slot` of dy's (BLOCK_O,) and x's (BLOCK_I,) tile columns (sdy_ptrs /
    sx_ptrs: the tile's columns of scale row 0); masked entries read 0."""
    s_dy = tl.load(sdy_ptrs + slot.to(tl.int64) * stride_dys, mask=mask_o, other=0.0)
    s_x = tl.load(sx_ptrs + slot.to(tl.int64) * stride_xs, mask=mask_i, other=0.0)
    return s_dy, s_x


@triton.jit
def promote_outer(acc, prod, s_dy, s_x, PINNED: tl.constexpr):
    """acc + prod * s_dy[:, None] * s_x[None, :]: one step's FP8 product (BLOCK_O, BLOCK_I) promoted into
    the fp32 accumulator with its block's scales. PINNED: one inline-asm statement with side effects
    per element, as `grouped_gemm_fp8.promote` (GPU only)."""
    if PINNED:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 t; mul.f32 t, $2, $3; fma.rn.f32 $0, $1, t, $4; }",
            "=r,r,r,r,r",
            [prod, s_dy[:, None], s_x[None, :], acc],
            dtype=tl.float32,
            is_pure=False,
            pack=1,
        )
    else:
        return acc + prod * (s_dy[:, None] * s_x[None, :])


@triton.jit
def grouped_wgrad_fp8_block_kernel(
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
    stride_dyt,
    stride_xt,
    stride_dys,
    stride_xs,
    stride_dwg,
    stride_dwo,
    SCALE_BLOCK: tl.constexpr,
    USE_TMA: tl.constexpr,
    PINNED: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP_O: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    EPI_TMA: tl.constexpr,
):
    """dw[g] (O, I) = sum over group g's scale blocks k of (dyt[:, block k] @ xt[:, block k]^T) *
    s_dy[slot, :, None] * s_x[slot, None, :], slot = group g's first scale slot + k (fp8_block).

    dyt / xt: as `grouped_wgrad_fp8_kernel`'s (`segment_starts`' layout, row strides in bytes, multiples
    of 16). dy_scale (S, O) / x_scale (S, I) float32, row strides stride_dys / stride_xs, unit column
    stride: fp8_block's columnwise scales, one per column of each block of SCALE_BLOCK rows of a group,
    blocks restarting at every group's first row, group g's blocks from slot sum over h < g of
    ceil(rows of h / SCALE_BLOCK) (`moekit.ops.quantize`'s slot offsets, recomputed here from offs). dw:
    (N, O, I) in the output dtype, strides (stride_dwg, stride_dwo, 1).

    Tiles BLOCK_O x BLOCK_I, a reduction step BLOCK_M rows (SCALE_BLOCK a multiple of it: a step lies in
    one scale block, whose scales it applies: DeepSeek-V3's promotion of each step's FP8 product into
    the fp32 accumulator). The main loop is `grouped_mm_fp8_kernel`'s: two steps an iteration, the
    second step's MMA in flight while the first step's product is promoted (see there), so a tile runs
    ceil(rows / (2 BLOCK_M)) iterations, none for a group without rows (its tiles store zeros). A
    persistent program walks tiles t = pid, pid + NUM_PROGRAMS, ... (the bf16 wgrad's tile order,
    `wgrad_tile`), one nested loop per tile.

    Columns that must add nothing: a step holding the group's last row reads the segment's zero tail
    past it in both operands (BLOCK_M divides SEGMENT_COLUMNS; the pointer path also masks both at the
    last row), so one whole-extent descriptor of each serves every step; a pair's second step wholly
    past the group's rows reads the next segment's bytes (or TMA's zeros past the columns in use) and
    has scale 0: it adds 0 while those bytes are finite (a non-finite input has made the loss NaN
    anyway). Padding rows (past offs[N]) are never in a segment.
    """
    tl.static_assert(SCALE_BLOCK % BLOCK_M == 0, "a reduction step lies in one scale block")
    tl.static_assert(SEGMENT_COLUMNS % BLOCK_M == 0, "a reduction step stays in its group's segment")
    pid = tl.program_id(0)
    num_pid_o = tl.cdiv(O, BLOCK_O)
    num_pid_i = tl.cdiv(I, BLOCK_I)
    tiles_per_group = num_pid_o * num_pid_i
    if EPI_TMA:
        dw_desc = tl.make_tensor_descriptor(
            dw_ptr, shape=[N, O, I], strides=[stride_dwg, stride_dwo, 1], block_shape=[1, BLOCK_O, BLOCK_I // 2]
        )
    else:
        dw_desc = dw_ptr  # placeholder, unused without EPI_TMA
    offs_g = tl.arange(0, BLOCK_GROUPS)
    starts_v, cols_used = segment_starts(offs_ptr, offs_g, M, N)
    cols_used = tl.maximum(cols_used, 1)
    slots_v = scale_slots(offs_ptr, offs_g, M, N, SCALE_BLOCK)
    if USE_TMA:
        dy_desc = tl.make_tensor_descriptor(
            dyt_ptr, shape=[O, cols_used], strides=[stride_dyt, 1], block_shape=[BLOCK_O, BLOCK_M]
        )
        x_desc = tl.make_tensor_descriptor(
            xt_ptr, shape=[I, cols_used], strides=[stride_xt, 1], block_shape=[BLOCK_I, BLOCK_M]
        )
    else:
        dy_desc = dyt_ptr  # placeholders, unused without USE_TMA
        x_desc = xt_ptr
    for tile_id in range(pid, N * tiles_per_group, NUM_PROGRAMS):
        g, o0, i0, row_lo, row_hi = wgrad_tile(
            tile_id, tiles_per_group, num_pid_o, num_pid_i, offs_ptr, M, GROUP_O, BLOCK_O, BLOCK_I
        )
        rows = row_hi - row_lo
        col_lo = tl.sum(tl.where(offs_g == g, starts_v, 0), 0)
        col_hi = col_lo + rows
        slot_lo = tl.sum(tl.where(offs_g == g, slots_v, 0), 0)
        offs_o = o0 + tl.arange(0, BLOCK_O)
        offs_i = i0 + tl.arange(0, BLOCK_I)
        mask_o = offs_o < O
        mask_i = offs_i < I
        sdy_ptrs = dy_scale_ptr + offs_o
        sx_ptrs = x_scale_ptr + offs_i
        acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
        prev = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
        slot_prev = slot_lo
        in_prev = False
        for pair in range(tl.cdiv(rows, 2 * BLOCK_M)):
            k0 = pair * (2 * BLOCK_M)
            k1 = k0 + BLOCK_M
            a0, b0 = wgrad_block_operands(
                dy_desc, x_desc, dyt_ptr, xt_ptr, col_lo + k0, col_hi, o0, i0, O, I, stride_dyt, stride_xt,
                USE_TMA, BLOCK_O, BLOCK_I, BLOCK_M,
            )  # fmt: skip
            a1, b1 = wgrad_block_operands(
                dy_desc, x_desc, dyt_ptr, xt_ptr, col_lo + k1, col_hi, o0, i0, O, I, stride_dyt, stride_xt,
                USE_TMA, BLOCK_O, BLOCK_I, BLOCK_M,
            )  # fmt: skip
            # The previous step's scales are read before this step's MMA, so that their latency hides
            # behind it rather than in the promotion that no MMA overlaps.
            sdy_prev, sx_prev = block_scales(
                sdy_ptrs, sx_ptrs, slot_prev, stride_dys, stride_xs, mask_o & in_prev, mask_i
            )
            p0 = tl.dot(a0, b0)
            acc = promote_outer(acc, prev, sdy_prev, sx_prev, PINNED)
            p1 = tl.dot(a1, b1)
            sdy0, sx0 = block_scales(
                sdy_ptrs, sx_ptrs, slot_lo + k0 // SCALE_BLOCK, stride_dys, stride_xs, mask_o, mask_i
            )
            acc = promote_outer(acc, p0, sdy0, sx0, PINNED)
            prev = p1
            slot_prev = slot_lo + k1 // SCALE_BLOCK
            in_prev = k1 < rows
        sdy_prev, sx_prev = block_scales(sdy_ptrs, sx_ptrs, slot_prev, stride_dys, stride_xs, mask_o & in_prev, mask_i)
        acc = promote_outer(acc, prev, sdy_prev, sx_prev, False)
        wgrad_epilogue(acc, dw_ptr, dw_desc, g, o0, i0, O, I, stride_dwg, stride_dwo, EPI_TMA, BLOCK_O, BLOCK_I)
