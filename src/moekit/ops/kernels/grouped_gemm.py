# ruff: noqa: E741  (I and O are the legend's in/out feature sizes)
"""Triton kernels of the grouped GEMM (jit code only; host code in `moekit.ops.runtime.gemm`).

Legend: M routed rows, N groups (experts), I in_features, O out_features. Inside the forward/dgrad
kernel one output tile is (BLOCK_M rows, BLOCK_C columns) and its reduction runs in steps of
BLOCK_RED; COLS and RED are that kernel's output width and reduction length (O and I for the
forward, I and O for the dgrad). The wgrad kernel's tile is (BLOCK_O, BLOCK_I) and it reduces over
the group's rows in steps of BLOCK_M.

    forward  y[r]  = x[r] @ w[g]^T (+ bias[g] (* bias_scale[r]))   x (M, I), w (N, O, I) -> y (M, O)
    dgrad    dx[r] = dy[r] @ w[g]                                   dy (M, O), w (N, O, I) -> dx (M, I)
    wgrad    dw[g] = dy[rows of g]^T @ x[rows of g]                 dy (M, O), x (M, I) -> dw (N, O, I)
    row sum  db[g] = sum over rows r of g of dy[r] (* scale[r])     dy (M, O) -> db (N, O) fp32 partials

Rows of group g are `offs[g]:offs[g+1]` (`offs`: device int64, N+1 entries). No kernel is given a
host copy of `offs`: each derives its tile schedule from it on the device (no host syncs, CUDA-graph
capturable with other split sizes). notes/grouped_gemm.md has the design.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.ops.kernels.schedule import (
    gemm_tile,
    group_rows,
    load_a,
    load_b,
    operand_descs,
    split_halves,
    swizzle,
    tile_schedule,
)


@triton.jit
def with_bias(acc, bias_ptr, scale_ptr, g, N, offs_m, offs_c, mask_m, mask_c, stride_bias_g, HAS_SCALE: tl.constexpr):
    """acc + bias[g] (* scale[r]) in fp32, the forward epilogues' bias step (the Triton and the Gluon
    kernels', which pass offs_m / offs_c in their layouts). Padding tiles (g == N) get no bias: padding
    rows are written as exact zeros."""
    bias = tl.load(bias_ptr + g.to(tl.int64) * stride_bias_g + offs_c, mask=mask_c & (g < N), other=0.0).to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + offs_m, mask=mask_m & (g < N), other=0.0).to(tl.float32)
        return acc + scale[:, None] * bias[None, :]
    return acc + bias[None, :]


@triton.jit
def fwd_epilogue(
    acc,
    c_ptr,
    c_desc,
    bias_ptr,
    scale_ptr,
    g,
    N,
    row0,
    c0,
    row_lo,
    row_hi,
    COLS,
    stride_cm,
    stride_bias_g,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    EPI_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """acc (BLOCK_M, BLOCK_C) fp32 -> (+ bias[g] (* scale[r])) -> output dtype -> rows of the group.

    EPI_TMA: the tile leaves through asynchronous TMA stores, so the next tile's main loop
    overlaps the write-back. c_desc is the tile's own descriptor whose row extent ends at the
    group's end: rows of the next group are clipped by the hardware, not by a branch (a branch
    here breaks Triton's loop fusion).
    """
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_c = c0 + tl.arange(0, BLOCK_C)
    mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
    mask_c = offs_c < COLS
    if HAS_BIAS:
        acc = with_bias(acc, bias_ptr, scale_ptr, g, N, offs_m, offs_c, mask_m, mask_c, stride_bias_g, HAS_SCALE)
    out_ty = c_ptr.dtype.element_ty
    if EPI_TMA:
        acc0, acc1 = split_halves(acc, BLOCK_M, BLOCK_C)
        c_desc.store([row0, c0], acc0.to(out_ty))
        c_desc.store([row0, c0 + BLOCK_C // 2], acc1.to(out_ty))
    else:
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_c[None, :]
        tl.store(c_ptrs, acc.to(out_ty), mask=mask_m[:, None] & mask_c[None, :])


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def grouped_mm_kernel(
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
    B_ROWS,
    B_COLS,
    stride_am,
    stride_bg,
    stride_br,
    stride_cm,
    stride_bias_g,
    TRANS_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_RED: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    EPI_TMA: tl.constexpr,
):
    """Forward (TRANS_B) and dgrad: c (M, COLS) = a (M, RED) @ op(w[g]) per group, padding rows zero.

    a: (M, RED), row stride stride_am, unit column stride.
    b: (N, B_ROWS, B_COLS) weight, strides (stride_bg, stride_br, 1); w[g] is (COLS, RED) if TRANS_B
       (forward: w (N, O, I)) else (RED, COLS) (dgrad: the same w (N, O, I)).
    c: (M, COLS), row stride stride_cm.

    One persistent program per SM walks a flat tile space with a stride of the grid size: group
    after group, the (row-tile, column-tile) grid of each group, then a pseudo-group N over the
    padding rows offs[N]:M, whose tiles store zeros.
    """
    pid = tl.program_id(0)
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, tl.arange(0, BLOCK_GROUPS), M, N, COLS, BLOCK_M, BLOCK_C
    )
    red_steps = tl.cdiv(RED, BLOCK_RED)

    a_desc, b_desc = operand_descs(
        a_ptr,
        b_ptr,
        M,
        RED,
        N,
        B_ROWS,
        B_COLS,
        stride_am,
        stride_bg,
        stride_br,
        TRANS_B,
        USE_TMA,
        BLOCK_M,
        BLOCK_C,
        BLOCK_RED,
    )
    for tile_id in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        g, row_lo, row_hi, row0, c0, a_row0, c_desc = gemm_tile(
            tile_id,
            num_pid_c,
            row_start,
            row_end,
            tile_end,
            M,
            N,
            c_ptr,
            COLS,
            stride_cm,
            EPI_TMA,
            BLOCK_M,
            BLOCK_C,
            GROUP_M,
        )
        acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        for step in range(red_steps):
            red0 = step * BLOCK_RED
            a = load_a(a_desc, a_ptr, red0, a_row0, row_lo, row_hi, RED, stride_am, USE_TMA, UPCAST, BLOCK_M, BLOCK_RED)
            b = load_b(
                b_desc,
                b_ptr,
                g,
                N,
                red0,
                c0,
                COLS,
                RED,
                stride_bg,
                stride_br,
                TRANS_B,
                USE_TMA,
                UPCAST,
                BLOCK_C,
                BLOCK_RED,
            )
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        # Padding rows are written as exact zeros whatever they hold (NaN * 0 is NaN).
        acc = tl.where(g < N, acc, 0.0)
        fwd_epilogue(
            acc,
            c_ptr,
            c_desc,
            bias_ptr,
            scale_ptr,
            g,
            N,
            row0,
            c0,
            row_lo,
            row_hi,
            COLS,
            stride_cm,
            stride_bias_g,
            HAS_BIAS,
            HAS_SCALE,
            EPI_TMA,
            BLOCK_M,
            BLOCK_C,
        )


@triton.jit
def wgrad_tile(
    tile_id,
    tiles_per_group,
    num_pid_o,
    num_pid_i,
    offs_ptr,
    M,
    GROUP_O: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """wgrad tile -> (group, o0, i0, group's row start, group's row end)."""
    g = tile_id // tiles_per_group
    pid_o, pid_i = swizzle(tile_id % tiles_per_group, num_pid_o, num_pid_i, GROUP_O)
    row_lo = tl.load(offs_ptr + g).to(tl.int32)
    row_hi = tl.load(offs_ptr + g + 1).to(tl.int32)
    row_lo = tl.minimum(tl.maximum(row_lo, 0), M)
    row_hi = tl.minimum(tl.maximum(row_hi, row_lo), M)
    return g, pid_o * BLOCK_O, pid_i * BLOCK_I, row_lo, row_hi


@triton.jit
def _wgrad_rows(idx_ptr, offs_m, mask_m, GATHER: tl.constexpr):
    """The rows of an operand that the routed rows offs_m stand for: themselves, or with GATHER their
    entries of the row map idx (row 0 where masked: such loads are masked too)."""
    if GATHER:
        return tl.load(idx_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    else:
        return offs_m.to(tl.int64)


@triton.jit
def _wgrad_load(
    dy_desc,
    x_desc,
    dy_ptr,
    x_ptr,
    dy_idx_ptr,
    x_idx_ptr,
    r0,
    o0,
    i0,
    row_hi,
    O,
    I,
    stride_dym,
    stride_xm,
    USE_TMA: tl.constexpr,
    GATHER_DY: tl.constexpr,
    GATHER_X: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """One reduction step of wgrad operands: a = dy[r0:r0+BLOCK_M, o0:o0+BLOCK_O]^T (BLOCK_O, BLOCK_M),
    b = x[r0:r0+BLOCK_M, i0:i0+BLOCK_I] (BLOCK_M, BLOCK_I); with GATHER_DY (GATHER_X) routed row r of
    dy (x) is its row dy_idx[r] (x_idx[r]). Rows at or past row_hi must add nothing: the pointer loads
    (every gathered operand) mask them, with TMA the descriptors' row extents make them zeros (see
    wgrad_kernel)."""
    offs_m = r0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < row_hi
    if USE_TMA and not GATHER_DY:
        a = dy_desc.load([r0, o0]).T
    else:
        offs_o = o0 + tl.arange(0, BLOCK_O)
        rows_dy = _wgrad_rows(dy_idx_ptr, offs_m, mask_m, GATHER_DY)
        a = tl.load(
            dy_ptr + rows_dy[None, :] * stride_dym + offs_o[:, None],
            mask=mask_m[None, :] & (offs_o[:, None] < O),
            other=0.0,
        )
    if USE_TMA and not GATHER_X:
        b = x_desc.load([r0, i0])
    else:
        offs_i = i0 + tl.arange(0, BLOCK_I)
        rows_x = _wgrad_rows(x_idx_ptr, offs_m, mask_m, GATHER_X)
        b = tl.load(
            x_ptr + rows_x[:, None] * stride_xm + offs_i[None, :],
            mask=mask_m[:, None] & (offs_i[None, :] < I),
            other=0.0,
        )
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def wgrad_epilogue(
    acc,
    dw_ptr,
    dw_desc,
    g,
    o0,
    i0,
    O,
    I,
    stride_dwg,
    stride_dwo,
    EPI_TMA: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """dw[g, o0:o0+BLOCK_O, i0:i0+BLOCK_I] = acc. EPI_TMA: asynchronous TMA stores through a
    (N, O, I) descriptor, whose bounds clip the O and I tails (wgrad tiles are short in the
    reduction, so overlapping their write-back with the next tile matters)."""
    out_ty = dw_ptr.dtype.element_ty
    if EPI_TMA:
        acc0, acc1 = split_halves(acc, BLOCK_O, BLOCK_I)
        dw_desc.store([g, o0, i0], acc0.to(out_ty).reshape(1, BLOCK_O, BLOCK_I // 2))
        dw_desc.store([g, o0, i0 + BLOCK_I // 2], acc1.to(out_ty).reshape(1, BLOCK_O, BLOCK_I // 2))
    else:
        offs_o = o0 + tl.arange(0, BLOCK_O)
        offs_i = i0 + tl.arange(0, BLOCK_I)
        dw_ptrs = dw_ptr + g.to(tl.int64) * stride_dwg + offs_o.to(tl.int64)[:, None] * stride_dwo + offs_i[None, :]
        tl.store(dw_ptrs, acc.to(out_ty), mask=(offs_o[:, None] < O) & (offs_i[None, :] < I))


@triton.jit
def wgrad_steps(
    offs_ptr,
    pid,
    tiles_per_group,
    M,
    N,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
):
    """(steps, rows_used) of program `pid` of a flattened wgrad (every group owns `tiles_per_group`
    tiles, tile t goes to program t % NUM_PROGRAMS): the reduction steps of all its tiles, each tile
    max(1, its group's row steps of BLOCK_M) (an empty group's tile runs one discarded step so that
    its zeros are stored like any tile), and offs[N] clamped into [0, M] (rows past it are padding)."""
    offs_g = tl.arange(0, BLOCK_GROUPS)
    lo_v, hi_v = group_rows(offs_ptr, offs_g, M, N, False)
    steps_v = tl.maximum(tl.cdiv(hi_v - lo_v, BLOCK_M), 1)
    first_v = offs_g * tiles_per_group
    # number of tile ids t < X with t = pid (mod NUM_PROGRAMS); X >= 0 keeps it non-negative
    mine_v = (first_v + tiles_per_group - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS - (
        first_v - pid + NUM_PROGRAMS - 1
    ) // NUM_PROGRAMS
    mine_v = tl.where(offs_g < N, mine_v, 0)
    return tl.sum(mine_v * steps_v, 0), tl.max(tl.where(offs_g < N, hi_v, 0), 0)


@triton.jit
def wgrad_kernel(
    dy_ptr,
    x_ptr,
    dw_ptr,
    offs_ptr,
    dy_idx_ptr,
    x_idx_ptr,
    M,
    O,
    I,
    N,
    stride_dym,
    stride_xm,
    stride_dwg,
    stride_dwo,
    USE_TMA: tl.constexpr,
    GATHER_DY: tl.constexpr,
    GATHER_X: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP_O: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    EPI_TMA: tl.constexpr,
):
    """dw[g] (O, I) = dy[rows of g]^T @ x[rows of g] for every group in one launch.

    dy: (M, O) row stride stride_dym; x: (M, I) row stride stride_xm; dw: (N, O, I) with strides
    (stride_dwg, stride_dwo, 1). Tiles: BLOCK_O x BLOCK_I, reducing over rows BLOCK_M at a time.
    Every group owns the same (o, i) tile grid; its reduction runs over its own rows (none for an
    empty group, whose dw is zeros).

    GATHER_DY / GATHER_X: the operand's routed row r is its row dy_idx[r] / x_idx[r] (an (M,) int32 or
    int64 row map; the operand then has rows of its own, e.g. x's token rows, and its row extent is not
    M), read by pointer loads masked at the group's end; the row map is read only below offs[N]. The
    other operand keeps its TMA loads through one whole-tensor descriptor ending at offs[N]: the
    masked zeros of the gathered one cancel the rows it reads past a group's end. Otherwise dy_idx and
    x_idx are not read (any pointer).

    The last step of a group whose row count is not a multiple of BLOCK_M reaches past the group's
    end into the next group's rows or the padding rows (which may hold anything); they must add
    nothing. With TMA:
      FLATTEN: the group gets its own dy descriptor whose row extent ends at the group's end (TMA
        zero-fills), and x's descriptor ends at offs[N]: the rows past the group are zero dy rows
        times x rows of later groups, exact zeros as long as those are finite (an inf in x makes
        the loss NaN anyway), or zeros times zeros in the padding. One descriptor per group
        instead of two (faster on skewed splits: notes/grouped_gemm.md), built once per run of a program's
        consecutive tiles of the group; groups with a whole number of steps need none.
      nested loop: per-tile dy and x descriptors that both end at the group's end.

    FLATTEN: the reduction loops of a program's tiles have different lengths, which Triton's loop
    fusion cannot flatten, so the kernel writes the fused loop itself: one loop over all steps of
    all of the program's tiles, with the tile set-up in a `step == 0` branch and the store in a
    `step == last` branch. The pipeliner then prefetches the next tile's first operands while the
    current tile's epilogue runs.
    """
    pid = tl.program_id(0)
    num_pid_o = tl.cdiv(O, BLOCK_O)
    num_pid_i = tl.cdiv(I, BLOCK_I)
    tiles_per_group = num_pid_o * num_pid_i
    num_tiles = N * tiles_per_group
    if EPI_TMA:
        dw_desc = tl.make_tensor_descriptor(
            dw_ptr, shape=[N, O, I], strides=[stride_dwg, stride_dwo, 1], block_shape=[1, BLOCK_O, BLOCK_I // 2]
        )
    else:
        dw_desc = None
    if FLATTEN:
        total_steps, rows_used = wgrad_steps(offs_ptr, pid, tiles_per_group, M, N, NUM_PROGRAMS, BLOCK_M, BLOCK_GROUPS)

        tile_id = pid - NUM_PROGRAMS
        step = 0
        tile_steps = 1
        g = 0
        o0 = 0
        i0 = 0
        row_lo = 0
        row_hi = 0
        desc_g = -1
        if USE_TMA and not GATHER_DY:
            # Whole-tensor descriptors, built once: a group whose row count is a multiple of
            # BLOCK_M never reads past its end, so it needs no descriptor of its own, nor does any
            # group where x's rows are gathered (masked). Rows past offs[N] read as zeros.
            dy_full = tl.make_tensor_descriptor(
                dy_ptr, shape=[tl.maximum(rows_used, 1), O], strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_O]
            )
        else:
            dy_full = None
        if USE_TMA and not GATHER_X:
            # Rows past offs[N] (padding, may be NaN) read as zeros.
            x_desc = tl.make_tensor_descriptor(
                x_ptr, shape=[tl.maximum(rows_used, 1), I], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_I]
            )
        else:
            x_desc = None
        dy_desc = dy_full
        acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
        for _ in range(0, total_steps):
            if step == 0:
                tile_id += NUM_PROGRAMS
                g, o0, i0, row_lo, row_hi = wgrad_tile(
                    tile_id, tiles_per_group, num_pid_o, num_pid_i, offs_ptr, M, GROUP_O, BLOCK_O, BLOCK_I
                )
                tile_steps = tl.maximum(tl.cdiv(row_hi - row_lo, BLOCK_M), 1)
                if USE_TMA and not (GATHER_DY or GATHER_X):
                    if (row_hi - row_lo) % BLOCK_M == 0:
                        dy_desc = dy_full
                        desc_g = -1
                    elif g != desc_g:
                        # Building a descriptor costs a tensormap write and a proxy fence on the
                        # path to the tile's first loads: only ragged groups pay it, once per run
                        # of consecutive tiles of the group.
                        dy_desc = tl.make_tensor_descriptor(
                            dy_ptr,
                            shape=[tl.maximum(row_hi, 1), O],
                            strides=[stride_dym, 1],
                            block_shape=[BLOCK_M, BLOCK_O],
                        )
                        desc_g = g
            a, b = _wgrad_load(
                dy_desc,
                x_desc,
                dy_ptr,
                x_ptr,
                dy_idx_ptr,
                x_idx_ptr,
                row_lo + step * BLOCK_M,
                o0,
                i0,
                row_hi,
                O,
                I,
                stride_dym,
                stride_xm,
                USE_TMA,
                GATHER_DY,
                GATHER_X,
                UPCAST,
                BLOCK_O,
                BLOCK_I,
                BLOCK_M,
            )
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            last = step == tile_steps - 1
            if last:
                # An empty group's single step may have read rows of other groups: store zeros.
                acc = tl.where(row_hi > row_lo, acc, 0.0)
                wgrad_epilogue(acc, dw_ptr, dw_desc, g, o0, i0, O, I, stride_dwg, stride_dwo, EPI_TMA, BLOCK_O, BLOCK_I)
                acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
            # The step counter must not depend on the epilogue branch: the next tile's loads
            # (pipeline stage 0) would then wait for this tile's store (last stage).
            step = tl.where(last, 0, step + 1)
    else:
        for tile_id in tl.range(pid, num_tiles, NUM_PROGRAMS):
            g, o0, i0, row_lo, row_hi = wgrad_tile(
                tile_id, tiles_per_group, num_pid_o, num_pid_i, offs_ptr, M, GROUP_O, BLOCK_O, BLOCK_I
            )
            dy_desc = None
            x_desc = None
            if USE_TMA and not GATHER_DY:
                dy_desc = tl.make_tensor_descriptor(
                    dy_ptr, shape=[tl.maximum(row_hi, 1), O], strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_O]
                )
            if USE_TMA and not GATHER_X:
                x_desc = tl.make_tensor_descriptor(
                    x_ptr, shape=[tl.maximum(row_hi, 1), I], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_I]
                )
            acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
            for step in range(tl.cdiv(row_hi - row_lo, BLOCK_M)):
                a, b = _wgrad_load(
                    dy_desc,
                    x_desc,
                    dy_ptr,
                    x_ptr,
                    dy_idx_ptr,
                    x_idx_ptr,
                    row_lo + step * BLOCK_M,
                    o0,
                    i0,
                    row_hi,
                    O,
                    I,
                    stride_dym,
                    stride_xm,
                    USE_TMA,
                    GATHER_DY,
                    GATHER_X,
                    UPCAST,
                    BLOCK_O,
                    BLOCK_I,
                    BLOCK_M,
                )
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            wgrad_epilogue(acc, dw_ptr, dw_desc, g, o0, i0, O, I, stride_dwg, stride_dwo, EPI_TMA, BLOCK_O, BLOCK_I)


@triton.jit
def group_row_sum_kernel(
    src_ptr,
    scale_ptr,
    part_ptr,
    vec_ptr,
    dot_ptr,
    offs_ptr,
    index_ptr,
    M,
    COLS,
    N,
    stride_sm,
    stride_vec_g,
    HAS_SCALE: tl.constexpr,
    ROW_DOT: tl.constexpr,
    GATHER: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """part[s, g, c] = sum of src[r, c] (* scale[r]) over the s-th of SPLITS equal slices of group
    g's rows, in fp32. Grid (column tiles, N, SPLITS). With ROW_DOT also, for every row r of group g,
    dot[pid_c, r] = sum over the tile's columns c of src[r, c] * vec[g, c] (unscaled), fp32. With GATHER
    row r is src[index[r]] (index (M,): the routed rows read where they lie in the token rows, never
    gathered first); M counts the rows of the groups (index's), not src's.

    Fixed row order inside a program and a fixed sum over s afterwards: deterministic, no atomics.
    Padding rows (past offs[N]) belong to no group and are never read (nor their dot written).
    """
    pid_c = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_s = tl.program_id(2)
    row_lo = tl.load(offs_ptr + pid_g).to(tl.int32)
    row_hi = tl.load(offs_ptr + pid_g + 1).to(tl.int32)
    row_lo = tl.minimum(tl.maximum(row_lo, 0), M)
    row_hi = tl.minimum(tl.maximum(row_hi, row_lo), M)
    chunk = tl.cdiv(tl.cdiv(row_hi - row_lo, SPLITS), BLOCK_M) * BLOCK_M
    r_begin = row_lo + pid_s * chunk
    r_stop = tl.minimum(r_begin + chunk, row_hi)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < COLS
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    if ROW_DOT:
        vec = tl.load(vec_ptr + pid_g.to(tl.int64) * stride_vec_g + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    for r in range(r_begin, r_stop, BLOCK_M):
        offs_m = r + tl.arange(0, BLOCK_M)
        mask_m = offs_m < r_stop
        if GATHER:
            src_m = tl.load(index_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        else:
            src_m = offs_m.to(tl.int64)
        vals = tl.load(
            src_ptr + src_m[:, None] * stride_sm + offs_c[None, :],
            mask=mask_m[:, None] & mask_c[None, :],
            other=0.0,
        ).to(tl.float32)
        if ROW_DOT:
            tl.store(dot_ptr + pid_c.to(tl.int64) * M + offs_m, tl.sum(vals * vec[None, :], 1), mask=mask_m)
        if HAS_SCALE:
            vals = vals * tl.load(scale_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)[:, None]
        acc += vals
    total = tl.sum(acc, 0)
    out = part_ptr + (pid_s.to(tl.int64) * N + pid_g) * COLS + offs_c
    tl.store(out, total, mask=mask_c)
