"""Triton kernels of the fused grouped MLP (jit code only; host code in `moekit.ops.runtime.glu`).

Legend: M routed rows, N experts, H hidden size, F ffn size. One output tile is BLOCK_M rows by
BLOCK_C activation columns (columns of F); the reduction runs in steps of BLOCK_RED.

    glu_forward_kernel   fc1 with the gated activation in its epilogue:
                         h = x @ w1[g]^T (+ b1[g])              x (M, H), w1 (N, 2F, H) -> h (M, 2F)
                         act = ACT(gate(h), up(h)) (* probs)                           -> act (M, F)
    glu_backward_kernel  fc2's dgrad with the activation's backward in its epilogue:
                         dA = dy @ w2[g]                         dy (M, H), w2 (N, H, F), never stored
                         dh = ACT_GRAD(gate(h), up(h), dA (* probs))                   -> dh (M, 2F)
                         act_p = ACT(gate(h), up(h)) (* probs)   (fc2's wgrad operand)  -> (M, F)
                         d probs partials = sum over the tile's columns of act * dA     -> (F tiles, M) fp32

Gate and up columns of output column j (glu_interleave_size k; k = F is the `[gate | up]` layout):
gate j + (j // k) * k, up that + k. One program computes the matching gate and up tiles of its
columns with two accumulators over the same x tile, so the activation needs nothing from another
program. With TMA the weight rows of a tile are read through a 5-D view (N, F/k, 2, k, H) of w1:
a box of BLOCK_C // k blocks of k gate (or up) rows when k divides BLOCK_C, a run of BLOCK_C rows
inside one block otherwise.

The gated activation is a constexpr pair of jit functions (ACT, ACT_GRAD) from
`moekit.ops.kernels.activations`.

Every tile runs the same reduction loop (what lets Triton fuse the persistent tile loop and the
reduction loop into one software pipeline, as in kernels.grouped_gemm.grouped_mm_kernel); padding
tiles (rows past offs[N]) read zeros and store zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.ops.kernels.schedule import load_a, load_b, operand_descs, split_halves, tile_coords, tile_schedule


@triton.jit
def _glu_cols(c0, F, GLU_BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """(activation columns of the tile, their gate columns in h, their mask)."""
    offs_c = c0 + tl.arange(0, BLOCK_C)
    gate_c = offs_c + (offs_c // GLU_BLOCK) * GLU_BLOCK
    return offs_c, gate_c, offs_c < F


@triton.jit
def _glu_desc(ptr, rows, F, stride_m, GLU_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """TMA descriptor over the 4-D view (rows, F/k, 2, k) of h (M, 2F): a box holds BLOCK_C
    consecutive gate (index 0) or up (index 1) columns of one GLU block, clipped at the block's end
    (k = F: at F) and at `rows`. Needs BLOCK_C | k or k = F."""
    return tl.make_tensor_descriptor(
        ptr,
        shape=[rows, F // GLU_BLOCK, 2, GLU_BLOCK],
        strides=[stride_m, 2 * GLU_BLOCK, GLU_BLOCK, 1],
        block_shape=[BLOCK_M, 1, 1, BLOCK_C],
    )


@triton.jit
def _load_glu_w(
    w_desc,
    w_ptr,
    g,
    N,
    red0,
    c0,
    gate_c,
    mask_c,
    H,
    stride_wg,
    stride_wr,
    stride_wh,
    UP: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    W_TRANSPOSED: tl.constexpr,
    GLU_BLOCK: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_RED: tl.constexpr,
):
    """(BLOCK_RED, BLOCK_C) of w1[g]^T: the gate rows (UP = 0) or up rows (UP = 1) of the tile's
    columns, reduction columns red0:red0+BLOCK_RED."""
    if USE_TMA:
        # c0 % k is 0 when k divides BLOCK_C.
        if W_TRANSPOSED:  # w_desc: the 5-D view (N, H, F/k, 2, k) of the (N, H, 2F) tensor under w1
            b = w_desc.load([g, red0, c0 // GLU_BLOCK, UP, c0 % GLU_BLOCK]).reshape(BLOCK_RED, BLOCK_C)
        else:  # w_desc: the 5-D view (N, F/k, 2, k, H)
            b = w_desc.load([g, c0 // GLU_BLOCK, UP, c0 % GLU_BLOCK, red0]).reshape(BLOCK_C, BLOCK_RED).T
    else:
        offs_red = red0 + tl.arange(0, BLOCK_RED)
        rows = gate_c + UP * GLU_BLOCK
        b = tl.load(
            w_ptr
            + g.to(tl.int64) * stride_wg
            + rows.to(tl.int64)[None, :] * stride_wr
            + offs_red.to(tl.int64)[:, None] * stride_wh,
            mask=(offs_red[:, None] < H) & mask_c[None, :] & (g < N),
            other=0.0,
        )
    if UPCAST:
        b = b.to(tl.float32)
    return b


@triton.jit
def _store_act(
    act,
    act_ptr,
    row0,
    row_hi,
    c0,
    offs_m,
    offs_c,
    mask_m,
    mask_c,
    F,
    stride_actm,
    EPI_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """act (BLOCK_M, BLOCK_C) -> act_out[row0:, c0:], rows below row_hi and columns below F only."""
    if EPI_TMA:
        act_desc = tl.make_tensor_descriptor(
            act_ptr, shape=[row_hi, F], strides=[stride_actm, 1], block_shape=[BLOCK_M, BLOCK_C]
        )
        act_desc.store([row0, c0], act)
    else:
        tl.store(
            act_ptr + offs_m.to(tl.int64)[:, None] * stride_actm + offs_c[None, :],
            act,
            mask=mask_m[:, None] & mask_c[None, :],
        )


@triton.jit
def glu_forward_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    act_ptr,
    bias_ptr,
    probs_ptr,
    offs_ptr,
    M,
    F,
    H,
    N,
    stride_xm,
    stride_wg,
    stride_wr,
    stride_wh,
    stride_hm,
    stride_actm,
    stride_bias_g,
    ACT: tl.constexpr,
    ACT_GRAD: tl.constexpr,
    GLU_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    W_TRANSPOSED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_RED: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    BOX_BLOCKS: tl.constexpr,
    BOX_ROWS: tl.constexpr,
    EPI_TMA: tl.constexpr,
):
    """fc1 + gated activation per expert: h (M, 2F) and act (M, F) in x's dtype; padding rows zero.

    x: (M, H) row stride stride_xm; w: (N, 2F, H) strides (stride_wg, stride_wr, stride_wh), one of
    stride_wr (W_TRANSPOSED: a view of an (N, H, 2F) tensor) or stride_wh 1; bias: (N, 2F);
    probs: (M,) any float dtype. BOX_BLOCKS x BOX_ROWS = BLOCK_C: the weight box of one tile in the
    5-D view (BLOCK_C // k blocks of k rows when k divides BLOCK_C, else 1 x BLOCK_C, which needs
    BLOCK_C to divide k or k = F). EPI_TMA (needs BLOCK_C | k or k = F): h and act leave through
    TMA stores bounded at the group's last row; else masked pointer stores (whose 2-D pointer
    tensors cost many registers: the small-k layouts' path). The activation is computed from h as
    stored (rounded to the output dtype), so the backward, which recomputes it from the saved h,
    sees the forward's values.
    """
    pid = tl.program_id(0)
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, tl.arange(0, BLOCK_GROUPS), M, N, F, BLOCK_M, BLOCK_C
    )
    red_steps = tl.cdiv(H, BLOCK_RED)
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(
            x_ptr, shape=[M, H], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_RED]
        )
        if W_TRANSPOSED:
            w_desc = tl.make_tensor_descriptor(
                w_ptr,
                shape=[N, H, F // GLU_BLOCK, 2, GLU_BLOCK],
                strides=[stride_wg, stride_wh, 2 * GLU_BLOCK, GLU_BLOCK, 1],
                block_shape=[1, BLOCK_RED, BOX_BLOCKS, 1, BOX_ROWS],
            )
        else:
            w_desc = tl.make_tensor_descriptor(
                w_ptr,
                shape=[N, F // GLU_BLOCK, 2, GLU_BLOCK, H],
                strides=[stride_wg, 2 * GLU_BLOCK * stride_wr, GLU_BLOCK * stride_wr, stride_wr, 1],
                block_shape=[1, BOX_BLOCKS, 1, BOX_ROWS, BLOCK_RED],
            )
    else:
        x_desc = None
        w_desc = None
    out_ty = h_ptr.dtype.element_ty
    for tile_id in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        g, row_lo, row_hi, row0, c0, pid_c = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, BLOCK_C, GROUP_M
        )
        offs_c, gate_c, mask_c = _glu_cols(c0, F, GLU_BLOCK, BLOCK_C)
        x_row0 = tl.where(g < N, row0, M)  # padding tiles: TMA boxes past the end read zeros
        acc_g = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        for step in range(red_steps):
            red0 = step * BLOCK_RED
            a = load_a(x_desc, x_ptr, red0, x_row0, row_lo, row_hi, H, stride_xm, USE_TMA, UPCAST, BLOCK_M, BLOCK_RED)
            b_g = _load_glu_w(
                w_desc,
                w_ptr,
                g,
                N,
                red0,
                c0,
                gate_c,
                mask_c,
                H,
                stride_wg,
                stride_wr,
                stride_wh,
                0,
                USE_TMA,
                UPCAST,
                W_TRANSPOSED,
                GLU_BLOCK,
                BLOCK_C,
                BLOCK_RED,
            )
            b_u = _load_glu_w(
                w_desc,
                w_ptr,
                g,
                N,
                red0,
                c0,
                gate_c,
                mask_c,
                H,
                stride_wg,
                stride_wr,
                stride_wh,
                1,
                USE_TMA,
                UPCAST,
                W_TRANSPOSED,
                GLU_BLOCK,
                BLOCK_C,
                BLOCK_RED,
            )
            acc_g = tl.dot(a, b_g, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, b_u, acc_u, input_precision=DOT_PRECISION)

        # Epilogue: bias, one rounding to h's dtype, the activation from the rounded h, probs.
        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
        real = g < N  # padding rows: exact zeros whatever x, bias or probs hold
        if HAS_PROBS:
            # Loaded first, so its latency passes during h's stores (after them it was exposed;
            # before the main loop it slowed the loop down: notes/grouped_mlp.md).
            p = tl.load(probs_ptr + offs_m, mask=mask_m & real, other=0.0).to(tl.float32)
        acc_g = tl.where(real, acc_g, 0.0)
        acc_u = tl.where(real, acc_u, 0.0)
        if HAS_BIAS:
            bias_base = bias_ptr + g.to(tl.int64) * stride_bias_g
            acc_g += tl.load(bias_base + gate_c, mask=mask_c & real, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bias_base + gate_c + GLU_BLOCK, mask=mask_c & real, other=0.0).to(tl.float32)[None, :]
        h_g = acc_g.to(out_ty)
        h_u = acc_u.to(out_ty)
        if EPI_TMA:
            h_desc = _glu_desc(h_ptr, row_hi, F, stride_hm, GLU_BLOCK, BLOCK_M, BLOCK_C)
            h_desc.store([row0, c0 // GLU_BLOCK, 0, c0 % GLU_BLOCK], h_g.reshape(BLOCK_M, 1, 1, BLOCK_C))
            h_desc.store([row0, c0 // GLU_BLOCK, 1, c0 % GLU_BLOCK], h_u.reshape(BLOCK_M, 1, 1, BLOCK_C))
        else:
            mask = mask_m[:, None] & mask_c[None, :]
            h_rows = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm
            tl.store(h_rows + gate_c[None, :], h_g, mask=mask)
            tl.store(h_rows + (gate_c + GLU_BLOCK)[None, :], h_u, mask=mask)
        act = ACT(h_g.to(tl.float32), h_u.to(tl.float32))
        if HAS_PROBS:
            act = act * p[:, None]
        _store_act(
            act.to(out_ty),
            act_ptr,
            row0,
            row_hi,
            c0,
            offs_m,
            offs_c,
            mask_m,
            mask_c,
            F,
            stride_actm,
            EPI_TMA,
            BLOCK_M,
            BLOCK_C,
        )


@triton.jit
def glu_backward_kernel(
    dy_ptr,
    w_ptr,
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
    stride_dym,
    stride_wg,
    stride_wr,
    stride_hm,
    stride_dhm,
    stride_actm,
    ACT: tl.constexpr,
    ACT_GRAD: tl.constexpr,
    GLU_BLOCK: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST: tl.constexpr,
    W_TRANSPOSED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_RED: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """fc2's dgrad dA = dy @ w2[g] with the activation's backward in the epilogue.

    dy: (M, H) row stride stride_dym; w: fc2's (N, H, F) strides (stride_wg, stride_wr, 1), or with
    W_TRANSPOSED the (N, F, H) tensor under a transposed view of it, strides (stride_wg, stride_wr, 1);
    h: fc1's saved pre-activation (M, 2F). Writes dh (M, 2F) and act_p (M, F) in h's dtype and, with
    probs, dprobs (F tiles, M) fp32: tile c's partial of sum_j act[r, j] * dA[r, j] (reduced over the
    tiles by the host in a fixed order: no atomics). Padding rows get zeros.
    """
    pid = tl.program_id(0)
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, tl.arange(0, BLOCK_GROUPS), M, N, F, BLOCK_M, BLOCK_C
    )
    red_steps = tl.cdiv(H, BLOCK_RED)
    # w is (N, F, H) with W_TRANSPOSED, else (N, H, F).
    dy_desc, w_desc = operand_descs(
        dy_ptr,
        w_ptr,
        M,
        H,
        N,
        F if W_TRANSPOSED else H,
        H if W_TRANSPOSED else F,
        stride_dym,
        stride_wg,
        stride_wr,
        W_TRANSPOSED,
        USE_TMA,
        BLOCK_M,
        BLOCK_C,
        BLOCK_RED,
    )
    QUARTER: tl.constexpr = BLOCK_C // 4
    for tile_id in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        g, row_lo, row_hi, row0, c0, pid_c = tile_coords(
            tile_id, num_pid_c, row_start, row_end, tile_end, BLOCK_M, BLOCK_C, GROUP_M
        )
        dy_row0 = tl.where(g < N, row0, M)
        # The tile's probs are loaded before the main loop, whose time hides the load's latency
        # (in the epilogue it was exposed: notes/grouped_mlp.md). The row offsets are
        # made again for the d probs store below rather than kept live through the loop.
        if HAS_PROBS:
            offs_pm = row0 + tl.arange(0, BLOCK_M)
            p = tl.load(probs_ptr + offs_pm, mask=(offs_pm >= row_lo) & (offs_pm < row_hi) & (g < N), other=0.0).to(
                tl.float32
            )
        else:
            p = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        for step in range(red_steps):
            red0 = step * BLOCK_RED
            a = load_a(
                dy_desc, dy_ptr, red0, dy_row0, row_lo, row_hi, H, stride_dym, USE_TMA, UPCAST, BLOCK_M, BLOCK_RED
            )
            b = load_b(
                w_desc,
                w_ptr,
                g,
                N,
                red0,
                c0,
                F,
                H,
                stride_wg,
                stride_wr,
                W_TRANSPOSED,
                USE_TMA,
                UPCAST,
                BLOCK_C,
                BLOCK_RED,
            )
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

        # Epilogue: the activation's backward in four column quarters (the fp32 temporaries of a
        # whole tile, or of a half, do not fit in the registers: spills, and slower).
        # A quarter's h is loaded by pointer before the previous quarter's math, so that its
        # latency overlaps that math; dh and act_p leave by masked pointer stores, which nothing
        # waits on. TMA boxes each way made every quarter wait for its load and for its stores to
        # drain: slower (notes/grouped_mlp.md). d probs is summed over the tile's quarters
        # in registers, one partial row per tile.
        d_act = tl.where(g < N, acc, 0.0)
        d_act0, d_act1 = split_halves(d_act, BLOCK_M, BLOCK_C)
        d_act00, d_act01 = split_halves(d_act0, BLOCK_M, BLOCK_C // 2)
        d_act10, d_act11 = split_halves(d_act1, BLOCK_M, BLOCK_C // 2)
        hg, hu = _load_h(h_ptr, c0, g, N, row0, row_lo, row_hi, F, stride_hm, GLU_BLOCK, BLOCK_M, QUARTER)
        hg_next, hu_next = _load_h(
            h_ptr, c0 + QUARTER, g, N, row0, row_lo, row_hi, F, stride_hm, GLU_BLOCK, BLOCK_M, QUARTER
        )
        d_probs = _glu_backward_quarter(
            d_act00,
            hg,
            hu,
            c0,
            row0,
            row_lo,
            row_hi,
            F,
            dh_ptr,
            act_ptr,
            p,
            stride_dhm,
            stride_actm,
            ACT,
            ACT_GRAD,
            GLU_BLOCK,
            HAS_PROBS,
            BLOCK_M,
            QUARTER,
        )
        hg, hu = _load_h(h_ptr, c0 + 2 * QUARTER, g, N, row0, row_lo, row_hi, F, stride_hm, GLU_BLOCK, BLOCK_M, QUARTER)
        d_probs += _glu_backward_quarter(
            d_act01,
            hg_next,
            hu_next,
            c0 + QUARTER,
            row0,
            row_lo,
            row_hi,
            F,
            dh_ptr,
            act_ptr,
            p,
            stride_dhm,
            stride_actm,
            ACT,
            ACT_GRAD,
            GLU_BLOCK,
            HAS_PROBS,
            BLOCK_M,
            QUARTER,
        )
        hg_next, hu_next = _load_h(
            h_ptr, c0 + 3 * QUARTER, g, N, row0, row_lo, row_hi, F, stride_hm, GLU_BLOCK, BLOCK_M, QUARTER
        )
        d_probs += _glu_backward_quarter(
            d_act10,
            hg,
            hu,
            c0 + 2 * QUARTER,
            row0,
            row_lo,
            row_hi,
            F,
            dh_ptr,
            act_ptr,
            p,
            stride_dhm,
            stride_actm,
            ACT,
            ACT_GRAD,
            GLU_BLOCK,
            HAS_PROBS,
            BLOCK_M,
            QUARTER,
        )
        d_probs += _glu_backward_quarter(
            d_act11,
            hg_next,
            hu_next,
            c0 + 3 * QUARTER,
            row0,
            row_lo,
            row_hi,
            F,
            dh_ptr,
            act_ptr,
            p,
            stride_dhm,
            stride_actm,
            ACT,
            ACT_GRAD,
            GLU_BLOCK,
            HAS_PROBS,
            BLOCK_M,
            QUARTER,
        )
        if HAS_PROBS:
            offs_m = row0 + tl.arange(0, BLOCK_M)
            tl.store(dprobs_ptr + pid_c.to(tl.int64) * M + offs_m, d_probs, mask=(offs_m >= row_lo) & (offs_m < row_hi))


@triton.jit
def _load_h(
    h_ptr,
    c0,
    g,
    N,
    row0,
    row_lo,
    row_hi,
    F,
    stride_hm,
    GLU_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """(gate, up) columns of h for activation columns c0:c0+BLOCK_C, (BLOCK_M, BLOCK_C) each in h's
    dtype; zeros outside the tile's group, past F and on padding tiles."""
    _, gate_c, mask_c = _glu_cols(c0, F, GLU_BLOCK, BLOCK_C)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    mask = ((offs_m >= row_lo) & (offs_m < row_hi))[:, None] & mask_c[None, :] & (g < N)
    h_rows = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm
    return (
        tl.load(h_rows + gate_c[None, :], mask=mask, other=0.0),
        tl.load(h_rows + (gate_c + GLU_BLOCK)[None, :], mask=mask, other=0.0),
    )


@triton.jit
def _glu_backward_quarter(
    d_act,
    hg,
    hu,
    c0,
    row0,
    row_lo,
    row_hi,
    F,
    dh_ptr,
    act_ptr,
    p,
    stride_dhm,
    stride_actm,
    ACT: tl.constexpr,
    ACT_GRAD: tl.constexpr,
    GLU_BLOCK: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """d_act (BLOCK_M, BLOCK_C) fp32 = dA of activation columns c0:c0+BLOCK_C, with their h columns
    (hg, hu) and the rows' probs p (BLOCK_M,) fp32 -> dh's gate and up columns and act_p stored;
    returns the rows' sum_j act * dA (zeros without probs)."""
    offs_c, gate_c, mask_c = _glu_cols(c0, F, GLU_BLOCK, BLOCK_C)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
    out_ty = dh_ptr.dtype.element_ty
    hg = hg.to(tl.float32)
    hu = hu.to(tl.float32)
    act = ACT(hg, hu)
    if HAS_PROBS:
        d_probs = tl.sum(act * d_act, 1)
        d_act = d_act * p[:, None]
        act = act * p[:, None]
    else:
        d_probs = tl.zeros((BLOCK_M,), dtype=tl.float32)
    d_g, d_u = ACT_GRAD(hg, hu, d_act)
    mask = mask_m[:, None] & mask_c[None, :]
    dh_rows = dh_ptr + offs_m.to(tl.int64)[:, None] * stride_dhm
    tl.store(dh_rows + gate_c[None, :], d_g.to(out_ty), mask=mask)
    tl.store(dh_rows + (gate_c + GLU_BLOCK)[None, :], d_u.to(out_ty), mask=mask)
    tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * stride_actm + offs_c[None, :], act.to(out_ty), mask=mask)
    return d_probs
