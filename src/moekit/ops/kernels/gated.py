"""The gated activation on its own, over rows of fc1's output (jit code only; host code in
`moekit.ops.runtime.gated`): the composed MLP's activation where fc1 is not fused with it (the quantized
paths, whose fc1 is an FP8 GEMM).

Legend: M rows, F ffn size (the activation's output features).

    gated_forward_kernel    out[r, c] = ACT(gate(h)[r, c], up(h)[r, c]) (* probs[r])
    gated_backward_kernel   dh = ACT_GRAD(gate, up, d_out (* probs)) in h's order, and with NEED_DPROBS
                            d probs[r] = sum over c of ACT(gate, up)[r, c] * d_out[r, c]
    gated_quantize_kernel   the quantized MLP's forward between its GEMMs in one pass over h: the rowwise
                            quantizations of out (fc2's operand) and of h's held form (what the
                            backward keeps), as `quantize_tiles_kernel` would write them from out and
                            from h, neither written in h's dtype
    held_columns_kernel     the quantized MLP's backward, fc2's wgrad operand: out of h held in FP8,
                            quantized columnwise into the FP8 wgrad's segments as `quantize_slots_kernel`
                            would write them from out, out never written in h's dtype

Gate and up of activation column c sit at h's columns (c // GLU_BLOCK) * 2 * GLU_BLOCK + c % GLU_BLOCK
and GLU_BLOCK further (GLU_BLOCK = F: the `[gate | up]` order; `moekit.ops.glu`). Both compute in fp32
from h as stored, one rounding at the store, the activation's jit pair (`moekit.ops.kernels.activations`)
as every fused kernel calls it.

With SCALED, h is held in FP8 (the quantized MLP's backward): its E4M3 bytes and rowwise scales
(`scale_ptr`, a row of `stride_scale` scales; SCALE_COLS columns a scale, 0 for one a row; SCALE_E8M0
for mxfp8's E8M0 bytes), read in the load: data * scale in fp32, rounded once to the output's dtype
(by `bf16_rne` where ROUND_BF16: a bfloat16 output under the interpreter), as the dequantize kernel
writes it; then, where HELD_GATE_LIMIT / HELD_UP_LIMIT are above 0, the values within 3/2 of a clamp
clamped to it (`moekit.ops.glu.from_held`). The same values as dequantizing h first, without the
(M, 2F) tensor in between.
"""

import triton
import triton.language as tl

from moekit.ops.kernels.activations import KEEP_NAN
from moekit.ops.kernels.grouped_wgrad_fp8 import SEGMENT_COLUMNS
from moekit.ops.kernels.quantize import (
    abs_bits,
    abs_for_amax,
    bf16_rne,
    column_scales,
    e4m3_value,
    e8m0_value,
    program_order,
    rowwise_blocks,
    segment_store,
    segment_tail,
)


@triton.jit
def _gate_up_columns(offs_c, GLU_BLOCK: tl.constexpr):
    gate = (offs_c // GLU_BLOCK) * (2 * GLU_BLOCK) + offs_c % GLU_BLOCK
    return gate, gate + GLU_BLOCK


@triton.jit
def _fp8_values(bytes_, FP8_CVT: tl.constexpr):
    """E4M3 bytes as fp32: by the hardware's conversion (FP8_CVT), or by `e4m3_value`'s integer decoding
    (exact, as the interpreter needs)."""
    if FP8_CVT:
        return bytes_.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_value(bytes_)


@triton.jit
def _gate_up_fp8(h_rows, gate_c, up_c, mask, FP8_CVT: tl.constexpr):
    """The E4M3 values of a tile's gates and ups (h held in FP8), fp32; both loads issued first."""
    g_bytes = tl.load(h_rows + gate_c[None, :], mask=mask, other=0)
    u_bytes = tl.load(h_rows + up_c[None, :], mask=mask, other=0)
    return _fp8_values(g_bytes, FP8_CVT), _fp8_values(u_bytes, FP8_CVT)


@triton.jit
def _dequantized(
    g,
    u,
    g_scale,
    u_scale,
    round_ty: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HELD_GATE_LIMIT: tl.constexpr,
    HELD_UP_LIMIT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """(gate, up) of h held in FP8: the E4M3 values g, u times their scales (E8M0 bytes or float32, any
    shape that broadcasts), rounded once to round_ty, the values within 3/2 of a clamp clamped to it
    (module docstring)."""
    if SCALE_E8M0:
        g = g * e8m0_value(g_scale)
        u = u * e8m0_value(u_scale)
    else:
        g = g * g_scale
        u = u * u_scale
    if ROUND_BF16:
        g, u = bf16_rne(g), bf16_rne(u)
    g, u = g.to(round_ty).to(tl.float32), u.to(round_ty).to(tl.float32)
    if HELD_GATE_LIMIT > 0:
        g = tl.where(g > 1.5 * HELD_GATE_LIMIT, g, tl.minimum(g, HELD_GATE_LIMIT, propagate_nan=KEEP_NAN))
    if HELD_UP_LIMIT > 0:
        u_low = tl.maximum(u, -HELD_UP_LIMIT, propagate_nan=KEEP_NAN)
        u_clamped = tl.minimum(u_low, HELD_UP_LIMIT, propagate_nan=KEEP_NAN)
        u = tl.where(tl.abs(u) > 1.5 * HELD_UP_LIMIT, u, u_clamped)
    return g, u


@triton.jit
def _run_scales(scale_rows, first, cols, ffn, row_mask, other, SCALE_COLS: tl.constexpr, ROW_SCALES: tl.constexpr):
    """The scales of a tile's run of h columns `cols` (gates or ups, `first` the run's first), (rows, 1)
    or (rows, BLOCK_C): the block of `first` (ROW_SCALES 1: the run's only one), or with ROW_SCALES 2
    also the next block, each column taking the one it lies in. The next block is loaded only where
    the row has one (the ups' last run may end in the row's last block)."""
    block = first // SCALE_COLS
    s = tl.load(scale_rows + block, mask=row_mask, other=other)
    if ROW_SCALES == 2:
        has_next = (block + 1) * SCALE_COLS < 2 * ffn
        s_next = tl.load(scale_rows + block + 1, mask=row_mask & has_next, other=other)
        s = tl.where((cols < (block + 1) * SCALE_COLS)[None, :], s, s_next)
    return s


@triton.jit
def _load_gate_up(
    h_rows,
    scale_rows,
    c0,
    ffn,
    gate_c,
    up_c,
    mask,
    row_mask,
    round_ty: tl.constexpr,
    GLU_BLOCK: tl.constexpr,
    SCALED: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HELD_GATE_LIMIT: tl.constexpr,
    HELD_UP_LIMIT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    FP8_CVT: tl.constexpr,
    ROW_SCALES: tl.constexpr,
):
    """(gate, up) of a tile of activation columns c0 + [0, BLOCK_C) (gate_c, up_c their h columns) in
    fp32: h's values, or with SCALED its FP8 bytes dequantized (module docstring).

    A row's scales are loaded once for the tile (row_mask (rows, 1) says which rows): its one scale
    (SCALE_COLS 0), or those of the one or two blocks (ROW_SCALES, the host's `tile_scale_span`) its
    gates lie in, and its ups (`_run_scales`). Why not each element's: a pointer an element, and a load
    whose addresses repeat along the columns, which the compiler lays out column after column, so that
    the FP8 bytes would move into that layout one at a time through shared memory. F = ffn columns."""
    if SCALED:
        g, u = _gate_up_fp8(h_rows, gate_c, up_c, mask, FP8_CVT)
        other = 127 if SCALE_E8M0 else 1.0
        if SCALE_COLS == 0:  # one scale a row
            g_scale = tl.load(scale_rows, mask=row_mask, other=other)
            u_scale = g_scale
        else:
            gate0, up0 = _gate_up_columns(c0, GLU_BLOCK)
            g_scale = _run_scales(scale_rows, gate0, gate_c, ffn, row_mask, other, SCALE_COLS, ROW_SCALES)
            u_scale = _run_scales(scale_rows, up0, up_c, ffn, row_mask, other, SCALE_COLS, ROW_SCALES)
        g, u = _dequantized(
            g, u, g_scale, u_scale, round_ty, SCALE_E8M0, HELD_GATE_LIMIT, HELD_UP_LIMIT, ROUND_BF16
        )  # fmt: skip
    else:
        g = tl.load(h_rows + gate_c[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_rows + up_c[None, :], mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def gated_forward_kernel(
    h_ptr,
    scale_ptr,
    probs_ptr,
    out_ptr,
    rows,
    ffn,
    stride_h,
    stride_scale,
    stride_out,
    GLU_BLOCK: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    ACT: tl.constexpr,
    SCALED: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HELD_GATE_LIMIT: tl.constexpr,
    HELD_UP_LIMIT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    FP8_CVT: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """One (BLOCK_ROWS, BLOCK_C) tile of out (rows, F) per program, its only writer."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_r = (pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)  # rows x stride pass 2^31
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_r = offs_r < rows
    mask = mask_r[:, None] & (offs_c < ffn)[None, :]
    gate_c, up_c = _gate_up_columns(offs_c, GLU_BLOCK)
    h_rows = h_ptr + offs_r[:, None] * stride_h
    scale_rows = scale_ptr + offs_r[:, None] * stride_scale
    round_ty = out_ptr.dtype.element_ty
    g, u = _load_gate_up(
        h_rows, scale_rows, pid_c * BLOCK_C, ffn, gate_c, up_c, mask, mask_r[:, None], round_ty, GLU_BLOCK,
        SCALED, SCALE_COLS, SCALE_E8M0, HELD_GATE_LIMIT, HELD_UP_LIMIT, ROUND_BF16, FP8_CVT, ROW_SCALES,
    )  # fmt: skip
    out = ACT(g, u)
    if HAS_PROBS:
        out = out * tl.load(probs_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_r[:, None] * stride_out + offs_c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gated_backward_kernel(
    h_ptr,
    scale_ptr,
    probs_ptr,
    d_out_ptr,
    dh_ptr,
    d_probs_ptr,
    rows,
    ffn,
    stride_h,
    stride_scale,
    stride_d_out,
    stride_dh,
    GLU_BLOCK: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    NEED_DPROBS: tl.constexpr,
    ACT: tl.constexpr,
    ACT_GRAD: tl.constexpr,
    SCALED: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HELD_GATE_LIMIT: tl.constexpr,
    HELD_UP_LIMIT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    FP8_CVT: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """BLOCK_ROWS whole rows per program: it walks the F columns in BLOCK_C steps, so each row's d probs
    is one program's fp32 sum in a fixed order (no atomics, the same bits run to run)."""
    pid_r = tl.program_id(0)
    offs_r = (pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    mask_r = offs_r < rows
    h_rows = h_ptr + offs_r[:, None] * stride_h
    scale_rows = scale_ptr + offs_r[:, None] * stride_scale
    dh_rows = dh_ptr + offs_r[:, None] * stride_dh
    d_out_rows = d_out_ptr + offs_r[:, None] * stride_d_out
    if HAS_PROBS:
        p = tl.load(probs_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    d_probs = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for c0 in range(0, ffn, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        mask = mask_r[:, None] & (offs_c < ffn)[None, :]
        gate_c, up_c = _gate_up_columns(offs_c, GLU_BLOCK)
        g, u = _load_gate_up(
            h_rows, scale_rows, c0, ffn, gate_c, up_c, mask, mask_r[:, None], dh_ptr.dtype.element_ty, GLU_BLOCK,
            SCALED, SCALE_COLS, SCALE_E8M0, HELD_GATE_LIMIT, HELD_UP_LIMIT, ROUND_BF16, FP8_CVT, ROW_SCALES,
        )  # fmt: skip
        d = tl.load(d_out_rows + offs_c[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_PROBS:
            if NEED_DPROBS:
                d_probs += tl.sum(ACT(g, u) * d, axis=1)
            d = d * p[:, None]
        d_g, d_u = ACT_GRAD(g, u, d)
        tl.store(dh_rows + gate_c[None, :], d_g.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dh_rows + up_c[None, :], d_u.to(dh_ptr.dtype.element_ty), mask=mask)
    if NEED_DPROBS:
        tl.store(d_probs_ptr + offs_r, d_probs, mask=mask_r)


@triton.jit
def _held_values(v, is_gate, limit_ty: tl.constexpr, HELD_GATE_LIMIT: tl.constexpr, HELD_UP_LIMIT: tl.constexpr):
    """h's held form (`moekit.ops.glu.to_held`) of fp32 values v of h (is_gate: which are gates): past a
    clamp, twice the limit with the value's sign; the limits rounded to h's dtype first, as the torch
    form compares and writes them in h's dtype."""
    if HELD_GATE_LIMIT > 0:
        g_lim = tl.full((), HELD_GATE_LIMIT, tl.float32).to(limit_ty).to(tl.float32)
        g_two = tl.full((), 2 * HELD_GATE_LIMIT, tl.float32).to(limit_ty).to(tl.float32)
        v = tl.where(is_gate & (v > g_lim), g_two, v)
    if HELD_UP_LIMIT > 0:
        u_lim = tl.full((), HELD_UP_LIMIT, tl.float32).to(limit_ty).to(tl.float32)
        u_two = tl.full((), 2 * HELD_UP_LIMIT, tl.float32).to(limit_ty).to(tl.float32)
        v = tl.where(~is_gate & (tl.abs(v) > u_lim), tl.where(v > 0, u_two, -u_two), v)
    return v


@triton.jit
def _quantize_run(v, hcol0, valid, r64, rmask, data_ptr, scale_ptr, stride_data, stride_scale,
                  MX: tl.constexpr, TILE_K: tl.constexpr, HW_E4M3: tl.constexpr):  # fmt: skip
    """Store the rowwise bytes and scales of v (rows, RUN) fp32, the columns hcol0 + [0, RUN) of its
    tensor (hcol0 a multiple of TILE_K) of which the first `valid` exist: whole 1 x TILE_K blocks, a
    last partial one only where the row ends (zeros past it, as the quantize kernels read them); no
    block past `valid` is written (it may be another run's)."""
    RUN: tl.constexpr = v.shape[1]
    NB: tl.constexpr = RUN // TILE_K
    cmask = tl.arange(0, RUN) < valid
    cb = hcol0 // TILE_K + tl.arange(0, NB)
    cbmask = tl.arange(0, NB) * TILE_K < valid
    # hcol0 // TILE_K * TILE_K is hcol0 itself, written so that the compiler sees a multiple of TILE_K
    # (a run's start is a GLU index expression, whose divisibility it cannot follow): 16-byte stores
    # rather than one byte at a time.
    cols = hcol0 // TILE_K * TILE_K + tl.arange(0, RUN)
    data = data_ptr + r64[:, None] * stride_data + cols[None, :]
    rowwise_blocks(v, abs_bits(v), r64, rmask, cb, cbmask, scale_ptr, stride_scale, data,
                   rmask[:, None] & cmask[None, :], MX, TILE_K, HW_E4M3, tl.float32)  # fmt: skip


@triton.jit
def gated_quantize_kernel(
    h_ptr,
    probs_ptr,
    offs_ptr,
    a_data_ptr,
    a_scale_ptr,
    h_data_ptr,
    h_scale_ptr,
    rows,
    ffn,
    num_groups,
    stride_h,
    stride_a_scale,
    stride_h_scale,
    GLU_BLOCK: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    ACT: tl.constexpr,
    MX: tl.constexpr,
    TILE_K: tl.constexpr,
    HELD_GATE_LIMIT: tl.constexpr,
    HELD_UP_LIMIT: tl.constexpr,
    RUNS: tl.constexpr,
    HW_E4M3: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BAND: tl.constexpr,
):
    """One (BLOCK_ROWS, BLOCK_C) tile of out's columns a program: out = ACT(gate, up) (* probs) rounded
    once to h's dtype (`gated_forward_kernel`'s values), then quantized in 1 x TILE_K blocks (E8M0 with
    MX, else fp32 scale_inv) into a_data (rows, F) and a_scale (rows, cdiv(F, TILE_K)); and h's held form
    quantized the same way into h_data (rows, 2F) and h_scale (rows, cdiv(2F, TILE_K)). Rows from
    offs[num_groups] on are padding: read as zeros (data 0, scale 1), as group_quantize reads them.

    The tile's h columns form whole scale blocks in one of two ways (the host picks, RUNS):
    - RUNS: the gates of the tile's columns are one run of h's columns starting at a multiple of TILE_K,
      and so are the ups (GLU_BLOCK a multiple of TILE_K and of BLOCK_C, or F itself with F a multiple of
      TILE_K): each run is quantized as it is.
    - otherwise (TILE_K a multiple of 2 * GLU_BLOCK, BLOCK_C of GLU_BLOCK): the tile's columns are the h
      columns [2 c0, 2 c0 + 2 BLOCK_C), gates and ups interleaved: read as one tile in h's order, split
      into gates and ups for the activation, and quantized as it is.

    BAND 0: a 2-D launch, row tiles fastest; else a 1-D launch in bands of BAND row tiles, a band's whole
    width of column tiles next to each other (`program_order`: stretches of h's rows read together)."""
    if BAND == 0:
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
    else:
        pid_r, pid_c = program_order(tl.cdiv(ffn, BLOCK_C), BAND)
    offs_r = (pid_r * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    rmask = offs_r < rows
    live = rmask & (offs_r < tl.load(offs_ptr + num_groups))
    c0 = pid_c * BLOCK_C
    valid = ffn - c0
    cols = tl.arange(0, BLOCK_C)
    mask = live[:, None] & (cols < valid)[None, :]
    h_rows = h_ptr + offs_r[:, None] * stride_h
    h_ty = h_ptr.dtype.element_ty
    if RUNS:
        # Through each column's gate and up index (as gated_forward_kernel): on the H200 faster than the
        # same runs addressed as gate0 + arange (benchmarks/README.md, the gated quantize A/B).
        gate0 = (c0 // GLU_BLOCK) * 2 * GLU_BLOCK + c0 % GLU_BLOCK
        gate_c, up_c = _gate_up_columns(c0 + cols, GLU_BLOCK)
        g = tl.load(h_rows + gate_c[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_rows + up_c[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        # The tile's pairs are h's columns [2 c0, 2 c0 + 2 BLOCK_C): read once, split into gates and ups.
        hcols = tl.arange(0, 2 * BLOCK_C)
        v = tl.load(h_rows + 2 * c0 + hcols[None, :], mask=live[:, None] & (hcols < 2 * valid)[None, :], other=0.0).to(
            tl.float32
        )
        pairs = tl.permute(tl.reshape(v, (BLOCK_ROWS, BLOCK_C // GLU_BLOCK, 2, GLU_BLOCK)), (0, 1, 3, 2))
        g3, u3 = tl.split(pairs)
        g = tl.reshape(g3, (BLOCK_ROWS, BLOCK_C))
        u = tl.reshape(u3, (BLOCK_ROWS, BLOCK_C))
    out = ACT(g, u)
    if HAS_PROBS:
        out = out * tl.load(probs_ptr + offs_r, mask=live, other=0.0).to(tl.float32)[:, None]
    out = tl.where(mask, out.to(h_ty).to(tl.float32), 0.0)
    _quantize_run(out, c0, valid, offs_r, rmask, a_data_ptr, a_scale_ptr, ffn, stride_a_scale, MX, TILE_K, HW_E4M3)
    if RUNS:
        is_gate = tl.full((BLOCK_ROWS, BLOCK_C), True, tl.int1)
        g = _held_values(g, is_gate, h_ty, HELD_GATE_LIMIT, HELD_UP_LIMIT)
        u = _held_values(u, ~is_gate, h_ty, HELD_GATE_LIMIT, HELD_UP_LIMIT)
        args = (h_data_ptr, h_scale_ptr, 2 * ffn, stride_h_scale)
        _quantize_run(g, gate0, valid, offs_r, rmask, *args, MX, TILE_K, HW_E4M3)
        _quantize_run(u, gate0 + GLU_BLOCK, valid, offs_r, rmask, *args, MX, TILE_K, HW_E4M3)
    else:
        is_gate = ((hcols // GLU_BLOCK) % 2 == 0)[None, :]
        v = _held_values(v, is_gate, h_ty, HELD_GATE_LIMIT, HELD_UP_LIMIT)
        _quantize_run(
            v, 2 * c0, 2 * valid, offs_r, rmask, h_data_ptr, h_scale_ptr, 2 * ffn, stride_h_scale, MX, TILE_K, HW_E4M3
        )


@triton.jit
def held_columns_kernel(
    h_ptr,
    scale_ptr,
    probs_ptr,
    rec_ptr,
    col_data_ptr,
    col_scale_ptr,
    ffn,
    stride_h,
    stride_scale,
    pitch,
    GLU_BLOCK: tl.constexpr,
    HAS_PROBS: tl.constexpr,
    ACT: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
    SCALED: tl.constexpr,
    SCALE_COLS: tl.constexpr,
    SCALE_E8M0: tl.constexpr,
    HELD_GATE_LIMIT: tl.constexpr,
    HELD_UP_LIMIT: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    FP8_CVT: tl.constexpr,
    ROW_SCALES: tl.constexpr,
    MX: tl.constexpr,
    SLOT_ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    HW_E4M3: tl.constexpr,
):
    """Program (slot, q): out = ACT(gate, up) (* probs) of the held h (SCALED: its FP8 bytes and rowwise
    scales, dequantized in the load as `gated_forward_kernel` reads them), rounded once to OUT_DTYPE, on
    one slot's rows (SLOT_ROWS, the format's block of rows of one group) and columns [q * BLOCK_C, +
    BLOCK_C), quantized columnwise: a SLOT_ROWS x 1 scale a column at col_scale[slot, col] (E8M0 bytes
    with MX, else float32 scale_inv), the bytes into the FP8 wgrad's segments (X = F, pitch). The bytes
    of `quantize_slots_kernel` (SEGMENTS, one walk) over `gated_forward_kernel`'s out: the same values,
    maxima, scales and encoding, with rows past the group (and padding rows) as zeros and unused slots'
    scales 1. Why one kernel: out (M, F) in h's dtype is then neither written nor read again.

    ROW_SCALES: as `_load_gate_up` (the host narrows BLOCK_C until a tile's runs span at most two scale
    blocks).

    The slot's rows come from `slot_records_kernel`'s table (rec_ptr: first row, rows left in its group,
    real group or not, first column in the segments), one load, rather than from the offsets through a
    chain of dependent loads and cross-warp reductions on every program's critical path. The stores
    need the slot's place in its segment only modulo a segment (a segment starts on a multiple of
    SEGMENT_COLUMNS): j0 = seg0 % SEGMENT_COLUMNS and the group's rows counted from there."""
    slot, qc = tl.program_id(0), tl.program_id(1)
    rec = rec_ptr + slot.to(tl.int64) * 4
    r0, n, live, seg0 = tl.load(rec), tl.load(rec + 1), tl.load(rec + 2) != 0, tl.load(rec + 3)
    # A slot starts a multiple of SLOT_ROWS into its segment: written so that the compiler sees it, and
    # the stores' masks keep 16-byte runs.
    j0 = seg0 % SEGMENT_COLUMNS // SLOT_ROWS * SLOT_ROWS
    count = n + j0
    i = tl.arange(0, SLOT_ROWS)
    keep = i < n
    r64 = r0.to(tl.int64) + i
    c = qc * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < ffn
    mask = (keep & live)[:, None] & cmask[None, :]
    gate_c, up_c = _gate_up_columns(c, GLU_BLOCK)
    h_rows, scale_rows = h_ptr + r64[:, None] * stride_h, scale_ptr + r64[:, None] * stride_scale
    g_v, u_v = _load_gate_up(
        h_rows, scale_rows, qc * BLOCK_C, ffn, gate_c, up_c, mask, (keep & live)[:, None], OUT_DTYPE, GLU_BLOCK,
        SCALED, SCALE_COLS, SCALE_E8M0, HELD_GATE_LIMIT, HELD_UP_LIMIT, ROUND_BF16, FP8_CVT, ROW_SCALES,
    )  # fmt: skip
    out = ACT(g_v, u_v)
    if HAS_PROBS:
        out = out * tl.load(probs_ptr + r64, mask=keep & live, other=0.0).to(tl.float32)[:, None]
    out = tl.where(mask, out.to(OUT_DTYPE).to(tl.float32), 0.0)
    col_scales = col_scale_ptr + slot.to(tl.int64) * ffn + c
    mult, any_nan = column_scales(tl.max(abs_for_amax(out), axis=0), col_scales, cmask, MX)
    segment_store(col_data_ptr, out, mult[None, :], any_nan, keep, c, cmask, j0, count, seg0, live, pitch, SLOT_ROWS,
                  HW_E4M3)  # fmt: skip
    segment_tail(col_data_ptr, c, cmask, j0, count, seg0, live, pitch, SLOT_ROWS, SLOT_ROWS)
