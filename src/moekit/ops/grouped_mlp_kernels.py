"""Triton kernels of the fused grouped MLP (jit code only; launchers and autograd live in
`moekit.ops.grouped_mlp`).

Legend: M routed rows, N experts, H hidden size, F ffn size. One output tile is BLOCK_M rows by
BLOCK_C activation columns (columns of F); the reduction runs in steps of BLOCK_RED.

    glu_forward_kernel   fc1 with the gated activation in its epilogue:
                         h = x @ w1[g]^T (+ b1[g])              x (M, H), w1 (N, 2F, H) -> h (M, 2F)
                         act = act(gate(h), up(h)) (* probs)                           -> act (M, F)
    glu_backward_kernel  fc2's dgrad with the activation's backward in its epilogue:
                         dA = dy @ w2[g]                         dy (M, H), w2 (N, H, F), never stored
                         dh = d act(gate(h), up(h)) given dA (* probs)                 -> dh (M, 2F)
                         act_p = act(gate(h), up(h)) (* probs)   (fc2's wgrad operand)  -> (M, F)
                         d probs partials = sum over the tile's columns of act * dA     -> (F tiles, M) fp32

Gate and up columns of output column j (glu_interleave_size k; k = F is the `[gate | up]` layout):
gate j + (j // k) * k, up that + k. One program computes the matching gate and up tiles of its
columns with two accumulators over the same x tile, so the activation needs nothing from another
program. With TMA the weight rows of a tile are read through a 5-D view (N, F/k, 2, k, H) of w1:
a box of BLOCK_C // k blocks of k gate (or up) rows when k divides BLOCK_C, a run of BLOCK_C rows
inside one block otherwise.

Every tile runs the same reduction loop (what lets Triton fuse the persistent tile loop and the
reduction loop into one software pipeline, as in grouped_gemm_kernels.grouped_mm_kernel); padding
tiles (rows past offs[N]) read zeros and store zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.ops.grouped_gemm_kernels import load_a, load_b, locate_tile, split_halves, swizzle, tile_schedule

CLAMP_LIMIT = tl.constexpr(7.0)
CLAMP_ALPHA = tl.constexpr(1.702)


@triton.jit
def _glu_cols(c0, F, GLU_BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """(activation columns of the tile, their gate columns in h, their mask)."""
    offs_c = c0 + tl.arange(0, BLOCK_C)
    gate_c = offs_c + (offs_c // GLU_BLOCK) * GLU_BLOCK
    return offs_c, gate_c, offs_c < F


@triton.jit
def _act(g, u, ACTIVATION: tl.constexpr):
    """The gated activation in fp32: 0 = swiglu silu(g) * u; 1 = clamped_swiglu (gpt-oss)."""
    if ACTIVATION == 0:
        return g * tl.sigmoid(g) * u
    else:
        gc = tl.minimum(g, CLAMP_LIMIT)
        uc = tl.minimum(tl.maximum(u, -CLAMP_LIMIT), CLAMP_LIMIT)
        return gc * tl.sigmoid(CLAMP_ALPHA * gc) * (uc + 1.0)


@triton.jit
def _glu_desc(ptr, rows, F, stride_m, GLU_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
              GATE_AND_UP: tl.constexpr = False):
    """TMA descriptor over the 4-D view (rows, F/k, 2, k) of an (M, 2F) tensor (h or dh): a box holds
    BLOCK_C consecutive gate (index 0) or up (index 1) columns of one GLU block (GATE_AND_UP: both,
    one box (BLOCK_M, 1, 2, BLOCK_C)), clipped at the block's end (k = F: at F) and at `rows`. Needs
    BLOCK_C | k or k = F."""
    return tl.make_tensor_descriptor(
        ptr, shape=[rows, F // GLU_BLOCK, 2, GLU_BLOCK], strides=[stride_m, 2 * GLU_BLOCK, GLU_BLOCK, 1],
        block_shape=[BLOCK_M, 1, 2 if GATE_AND_UP else 1, BLOCK_C])


@triton.jit
def _load_glu_w(w_desc, w_ptr, g, N, red0, c0, gate_c, mask_c, H, stride_wg, stride_wr, UP: tl.constexpr,
                USE_TMA: tl.constexpr, UPCAST: tl.constexpr, GLU_BLOCK: tl.constexpr,
                BLOCK_C: tl.constexpr, BLOCK_RED: tl.constexpr):
    """(BLOCK_RED, BLOCK_C) of w1[g]^T: the gate rows (UP = 0) or up rows (UP = 1) of the tile's
    columns, reduction columns red0:red0+BLOCK_RED."""
    if USE_TMA:
        # w_desc: the 5-D view (N, F/k, 2, k, H); c0 % k is 0 when k divides BLOCK_C.
        b = w_desc.load([g, c0 // GLU_BLOCK, UP, c0 % GLU_BLOCK, red0]).reshape(BLOCK_C, BLOCK_RED).T
    else:
        offs_red = red0 + tl.arange(0, BLOCK_RED)
        rows = gate_c + UP * GLU_BLOCK
        b = tl.load(
            w_ptr + g.to(tl.int64) * stride_wg + rows.to(tl.int64)[None, :] * stride_wr + offs_red[:, None],
            mask=(offs_red[:, None] < H) & mask_c[None, :] & (g < N), other=0.0,
        )
    if UPCAST:
        b = b.to(tl.float32)
    return b


@triton.jit
def _store_act(act, act_ptr, row0, row_hi, c0, offs_m, offs_c, mask_m, mask_c, F, stride_actm,
               EPI_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    """act (BLOCK_M, BLOCK_C) -> act_out[row0:, c0:], rows below row_hi and columns below F only."""
    if EPI_TMA:
        act_desc = tl.make_tensor_descriptor(
            act_ptr, shape=[row_hi, F], strides=[stride_actm, 1], block_shape=[BLOCK_M, BLOCK_C])
        act_desc.store([row0, c0], act)
    else:
        tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * stride_actm + offs_c[None, :], act,
                 mask=mask_m[:, None] & mask_c[None, :])


@triton.jit
def glu_forward_kernel(
    x_ptr, w_ptr, h_ptr, act_ptr, bias_ptr, probs_ptr, offs_ptr,
    M, F, H, N,
    stride_xm, stride_wg, stride_wr, stride_hm, stride_actm, stride_bias_g,
    ACTIVATION: tl.constexpr, GLU_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PROBS: tl.constexpr,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_RED: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_GROUPS: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    BOX_BLOCKS: tl.constexpr, BOX_ROWS: tl.constexpr, EPI_TMA: tl.constexpr,
):
    """fc1 + gated activation per expert: h (M, 2F) and act (M, F) in x's dtype; padding rows zero.

    x: (M, H) row stride stride_xm; w: (N, 2F, H) strides (stride_wg, stride_wr, 1); bias: (N, 2F);
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
        offs_ptr, M, N, F, BLOCK_M, BLOCK_C, BLOCK_GROUPS)
    red_steps = tl.cdiv(H, BLOCK_RED)
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(
            x_ptr, shape=[M, H], strides=[stride_xm, 1], block_shape=[BLOCK_M, BLOCK_RED])
        w_desc = tl.make_tensor_descriptor(
            w_ptr, shape=[N, F // GLU_BLOCK, 2, GLU_BLOCK, H],
            strides=[stride_wg, 2 * GLU_BLOCK * stride_wr, GLU_BLOCK * stride_wr, stride_wr, 1],
            block_shape=[1, BOX_BLOCKS, 1, BOX_ROWS, BLOCK_RED])
    else:
        x_desc = None
        w_desc = None
    out_ty = h_ptr.dtype.element_ty
    for tile_id in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        g, first_tile, row_lo, row_hi = locate_tile(tile_id, tile_end, row_start, row_end)
        pid_m, pid_c = swizzle(tile_id - first_tile, tl.cdiv(row_hi - row_lo, BLOCK_M), num_pid_c, GROUP_M)
        row0 = row_lo + pid_m * BLOCK_M
        c0 = pid_c * BLOCK_C
        offs_c, gate_c, mask_c = _glu_cols(c0, F, GLU_BLOCK, BLOCK_C)
        x_row0 = tl.where(g < N, row0, M)  # padding tiles: TMA boxes past the end read zeros
        acc_g = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        for step in range(red_steps):
            red0 = step * BLOCK_RED
            a = load_a(x_desc, x_ptr, red0, x_row0, row_lo, row_hi, H, stride_xm, USE_TMA, UPCAST,
                       BLOCK_M, BLOCK_RED)
            b_g = _load_glu_w(w_desc, w_ptr, g, N, red0, c0, gate_c, mask_c, H, stride_wg, stride_wr, 0,
                              USE_TMA, UPCAST, GLU_BLOCK, BLOCK_C, BLOCK_RED)
            b_u = _load_glu_w(w_desc, w_ptr, g, N, red0, c0, gate_c, mask_c, H, stride_wg, stride_wr, 1,
                              USE_TMA, UPCAST, GLU_BLOCK, BLOCK_C, BLOCK_RED)
            acc_g = tl.dot(a, b_g, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, b_u, acc_u, input_precision=DOT_PRECISION)

        # Epilogue: bias, one rounding to h's dtype, the activation from the rounded h, probs.
        offs_m = row0 + tl.arange(0, BLOCK_M)
        mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
        real = g < N  # padding rows: exact zeros whatever x, bias or probs hold
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
        act = _act(h_g.to(tl.float32), h_u.to(tl.float32), ACTIVATION)
        if HAS_PROBS:
            p = tl.load(probs_ptr + offs_m, mask=mask_m & real, other=0.0).to(tl.float32)
            act = act * p[:, None]
        _store_act(act.to(out_ty), act_ptr, row0, row_hi, c0, offs_m, offs_c, mask_m, mask_c, F, stride_actm,
                   EPI_TMA, BLOCK_M, BLOCK_C)


@triton.jit
def glu_backward_kernel(
    dy_ptr, w_ptr, h_ptr, dh_ptr, act_ptr, probs_ptr, dprobs_ptr, offs_ptr,
    M, F, H, N,
    stride_dym, stride_wg, stride_wr, stride_hm, stride_dhm, stride_actm,
    ACTIVATION: tl.constexpr, GLU_BLOCK: tl.constexpr, HAS_PROBS: tl.constexpr,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_RED: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_GROUPS: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    EPI_TMA: tl.constexpr,
):
    """fc2's dgrad dA = dy @ w2[g] with the activation's backward in the epilogue.

    dy: (M, H) row stride stride_dym; w: fc2's (N, H, F) strides (stride_wg, stride_wr, 1);
    h: fc1's saved pre-activation (M, 2F). Writes dh (M, 2F) and act_p (M, F) in h's dtype and, with
    probs, dprobs (4 x F tiles, M) fp32: quarter tile c's partial of sum_j act[r, j] * dA[r, j]
    (reduced over the tiles by the host in a fixed order: no atomics). Padding rows get zeros.
    EPI_TMA (needs BLOCK_C | k or k = F): h tiles come in and dh / act_p tiles leave through TMA, a
    quarter's gate and up columns in one box each way.
    """
    pid = tl.program_id(0)
    num_pid_c, row_start, row_end, tile_end, num_tiles = tile_schedule(
        offs_ptr, M, N, F, BLOCK_M, BLOCK_C, BLOCK_GROUPS)
    red_steps = tl.cdiv(H, BLOCK_RED)
    if USE_TMA:
        dy_desc = tl.make_tensor_descriptor(
            dy_ptr, shape=[M, H], strides=[stride_dym, 1], block_shape=[BLOCK_M, BLOCK_RED])
        w_desc = tl.make_tensor_descriptor(
            w_ptr, shape=[N, H, F], strides=[stride_wg, stride_wr, 1], block_shape=[1, BLOCK_RED, BLOCK_C])
    else:
        dy_desc = None
        w_desc = None
    if EPI_TMA:
        # Rows past the tile's group are read (and their results dropped); rows past M read zeros.
        h_desc = _glu_desc(h_ptr, M, F, stride_hm, GLU_BLOCK, BLOCK_M, BLOCK_C // 4, GATE_AND_UP=True)
    else:
        h_desc = None
    for tile_id in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        g, first_tile, row_lo, row_hi = locate_tile(tile_id, tile_end, row_start, row_end)
        pid_m, pid_c = swizzle(tile_id - first_tile, tl.cdiv(row_hi - row_lo, BLOCK_M), num_pid_c, GROUP_M)
        row0 = row_lo + pid_m * BLOCK_M
        c0 = pid_c * BLOCK_C
        dy_row0 = tl.where(g < N, row0, M)
        acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        for step in range(red_steps):
            red0 = step * BLOCK_RED
            a = load_a(dy_desc, dy_ptr, red0, dy_row0, row_lo, row_hi, H, stride_dym, USE_TMA, UPCAST,
                       BLOCK_M, BLOCK_RED)
            b = load_b(w_desc, w_ptr, g, N, red0, c0, F, H, stride_wg, stride_wr, False, USE_TMA, UPCAST,
                       BLOCK_C, BLOCK_RED)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)

        # Epilogue: the activation's backward on the tile's gate and up columns of h, in four
        # column quarters: the fp32 temporaries of a whole tile (or a half: 96-120 bytes of spills
        # in the sm_90 compile, and slower, notes v5) do not fit in the registers; quarters compile
        # to 255 and no spills. A quarter's h comes in as one TMA box of its gate and up columns and
        # its dh leaves as one: the loads wait for their data, so half the round trips of one box
        # each (4-7% on the H200, notes v5).
        d_act = tl.where(g < N, acc, 0.0)
        QUARTER: tl.constexpr = BLOCK_C // 4
        if EPI_TMA:
            dh_desc = _glu_desc(dh_ptr, row_hi, F, stride_dhm, GLU_BLOCK, BLOCK_M, QUARTER, GATE_AND_UP=True)
            act_desc = tl.make_tensor_descriptor(
                act_ptr, shape=[row_hi, F], strides=[stride_actm, 1], block_shape=[BLOCK_M, QUARTER])
        else:
            dh_desc = None
            act_desc = None
        d_act0, d_act1 = split_halves(d_act, BLOCK_M, BLOCK_C)
        d_act00, d_act01 = split_halves(d_act0, BLOCK_M, BLOCK_C // 2)
        d_act10, d_act11 = split_halves(d_act1, BLOCK_M, BLOCK_C // 2)
        _glu_backward_epilogue(
            d_act00, 4 * pid_c, c0, g, N, row0, row_lo, row_hi, M, F, h_ptr, h_desc, dh_ptr, dh_desc,
            act_ptr, act_desc, probs_ptr, dprobs_ptr, stride_hm, stride_dhm, stride_actm,
            ACTIVATION, GLU_BLOCK, HAS_PROBS, EPI_TMA, BLOCK_M, QUARTER)
        _glu_backward_epilogue(
            d_act01, 4 * pid_c + 1, c0 + QUARTER, g, N, row0, row_lo, row_hi, M, F, h_ptr, h_desc, dh_ptr,
            dh_desc, act_ptr, act_desc, probs_ptr, dprobs_ptr, stride_hm, stride_dhm, stride_actm,
            ACTIVATION, GLU_BLOCK, HAS_PROBS, EPI_TMA, BLOCK_M, QUARTER)
        _glu_backward_epilogue(
            d_act10, 4 * pid_c + 2, c0 + 2 * QUARTER, g, N, row0, row_lo, row_hi, M, F, h_ptr, h_desc, dh_ptr,
            dh_desc, act_ptr, act_desc, probs_ptr, dprobs_ptr, stride_hm, stride_dhm, stride_actm,
            ACTIVATION, GLU_BLOCK, HAS_PROBS, EPI_TMA, BLOCK_M, QUARTER)
        _glu_backward_epilogue(
            d_act11, 4 * pid_c + 3, c0 + 3 * QUARTER, g, N, row0, row_lo, row_hi, M, F, h_ptr, h_desc, dh_ptr,
            dh_desc, act_ptr, act_desc, probs_ptr, dprobs_ptr, stride_hm, stride_dhm, stride_actm,
            ACTIVATION, GLU_BLOCK, HAS_PROBS, EPI_TMA, BLOCK_M, QUARTER)


@triton.jit
def _glu_backward_epilogue(
    d_act, part_row, c0, g, N, row0, row_lo, row_hi, M, F, h_ptr, h_desc, dh_ptr, dh_desc,
    act_ptr, act_desc, probs_ptr, dprobs_ptr, stride_hm, stride_dhm, stride_actm,
    ACTIVATION: tl.constexpr, GLU_BLOCK: tl.constexpr, HAS_PROBS: tl.constexpr, EPI_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """d_act (BLOCK_M, BLOCK_C) fp32 = dA of activation columns c0:c0+BLOCK_C -> dh's gate and up
    columns, act_p, and row `part_row` of the d probs partials."""
    offs_c, gate_c, mask_c = _glu_cols(c0, F, GLU_BLOCK, BLOCK_C)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
    real = g < N
    out_ty = dh_ptr.dtype.element_ty
    if EPI_TMA:
        # One box of the gate and up columns. Padding tiles read their rows of h, which the forward
        # wrote as zeros.
        h_gu = h_desc.load([row0, c0 // GLU_BLOCK, 0, c0 % GLU_BLOCK]).reshape(BLOCK_M, 2, BLOCK_C)
        hg, hu = tl.split(tl.permute(h_gu, (0, 2, 1)))
        hg = hg.to(tl.float32)
        hu = hu.to(tl.float32)
    else:
        mask = mask_m[:, None] & mask_c[None, :] & real
        h_rows = h_ptr + offs_m.to(tl.int64)[:, None] * stride_hm
        hg = tl.load(h_rows + gate_c[None, :], mask=mask, other=0.0).to(tl.float32)
        hu = tl.load(h_rows + (gate_c + GLU_BLOCK)[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        sig = tl.sigmoid(hg)
        silu = hg * sig
        act = silu * hu
    else:
        gc = tl.minimum(hg, CLAMP_LIMIT)
        uc = tl.minimum(tl.maximum(hu, -CLAMP_LIMIT), CLAMP_LIMIT)
        sig = tl.sigmoid(CLAMP_ALPHA * gc)
        act = gc * sig * (uc + 1.0)
    if HAS_PROBS:
        p = tl.load(probs_ptr + offs_m, mask=mask_m & real, other=0.0).to(tl.float32)
        tl.store(dprobs_ptr + part_row.to(tl.int64) * M + offs_m, tl.sum(act * d_act, 1), mask=mask_m)
        d_act = d_act * p[:, None]
        act = act * p[:, None]
    if ACTIVATION == 0:
        d_g = d_act * hu * sig * (1.0 + hg * (1.0 - sig))
        d_u = d_act * silu
    else:
        # The clamps pass the gradient at the limit itself, as torch.clamp does.
        d_g = tl.where(hg <= CLAMP_LIMIT, d_act * (uc + 1.0) * sig * (1.0 + CLAMP_ALPHA * gc * (1.0 - sig)), 0.0)
        d_u = tl.where((hu >= -CLAMP_LIMIT) & (hu <= CLAMP_LIMIT), d_act * gc * sig, 0.0)
    if EPI_TMA:
        d_gu = tl.permute(tl.join(d_g.to(out_ty), d_u.to(out_ty)), (0, 2, 1)).reshape(BLOCK_M, 1, 2, BLOCK_C)
        dh_desc.store([row0, c0 // GLU_BLOCK, 0, c0 % GLU_BLOCK], d_gu)
        act_desc.store([row0, c0], act.to(out_ty))
    else:
        store_mask = mask_m[:, None] & mask_c[None, :]
        dh_rows = dh_ptr + offs_m.to(tl.int64)[:, None] * stride_dhm
        tl.store(dh_rows + gate_c[None, :], d_g.to(out_ty), mask=store_mask)
        tl.store(dh_rows + (gate_c + GLU_BLOCK)[None, :], d_u.to(out_ty), mask=store_mask)
        tl.store(act_ptr + offs_m.to(tl.int64)[:, None] * stride_actm + offs_c[None, :], act.to(out_ty),
                 mask=store_mask)
