"""Triton kernel of the FP8 grouped GEMM, forward and dgrad (jit code only; host code in
`moekit.ops.runtime.quantized_gemm`, the formats in `moekit.ops.quantize`).

Legend: M routed rows, N groups (experts), I in_features, O out_features. One output tile is
(BLOCK_M rows, BLOCK_C columns), its reduction runs in steps of BLOCK_RED; COLS and RED are the
output width and the reduction length (O and I for the forward, I and O for the dgrad).

    forward  y[r]  = x_q[r] @ w_q[g]^T (+ bias[g] (* bias_scale[r]))   x_q (M, I), w_q (N, O, I) -> y (M, O)
    dgrad    dx[r] = dy_q[r] @ w_q[g]                                   dy_q (M, O), w_q (N, O, I) -> dx (M, I)

Operands are float8 E4M3 with float32 dequantization multipliers (`scale_inv`); products are
accumulated in fp32 and the result leaves in the output's dtype:
- BLOCK_SCALES (fp8_block): A has one scale per row per 128 reduction columns, B one per 128 x 128
  tile of w[g]. Scales change along the reduction, so they are applied in the main loop, one
  reduction step = one scale block (BLOCK_RED == SCALE_BLOCK), and a tile's columns lie in one
  weight block (BLOCK_C divides SCALE_BLOCK): acc += dot(a, b) * (sa * sb)[:, None], DeepSeek-V3's
  promotion of the FP8 products into an fp32 accumulator. The product must be complete before it is
  scaled; so that the tensor cores need not idle while it is, the loop takes two steps an iteration:

      p0 = dot(a0, b0)              Triton waits for it (wgmma.wait_group 0), which drains p1 too
      acc = promote(acc, prev)      the previous iteration's second product
      p1 = dot(a1, b1)              left in flight across the loop's back edge
      acc = promote(acc, p0)        beside p1's MMAs
      prev = p1

  This is the shape Triton 3.6's wgmma pipeliner keeps asynchronous: a dot whose result is used
  only by the loop's yield, and in the next iteration only after the loop's first wait 0 (p0's).
  With one step an iteration the product is read before any such wait, and Triton waits right
  after the dot. `promote` is pinned (inline asm with side effects) on the GPU: as plain arithmetic,
  LLVM moves prev's promotion below p1's MMA, prev and p1 are then live together, the back edge
  copies p1's in-flight accumulator registers, and ptxas serializes every wgmma of the kernel.
- otherwise (fp8_rowwise): A has one scale per row, B one per output column (the forward: one per
  output channel of w; the dgrad: the weight's columnwise form, one per input channel). Both are
  constant along the reduction: the FP8 products accumulate unscaled and the scales are applied
  once, in the epilogue.

The schedule, the operand loads and the epilogue are the bf16 kernel's (`moekit.ops.kernels.schedule`,
`moekit.ops.kernels.grouped_gemm.fwd_epilogue`): a persistent program walks the groups' tiles from
the device offsets (no host read of them), then the padding rows offs[N]:M, written as zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.ops.kernels.grouped_gemm import fwd_epilogue
from moekit.ops.kernels.schedule import gemm_tile, load_a, load_b, operand_descs, tile_schedule


@triton.jit
def promote(acc, prod, scale, PINNED: tl.constexpr):
    """acc + prod * scale[:, None]: an FP8 step's product promoted into the fp32 accumulator with its
    per-row scales (acc, prod (P, Q) fp32; scale (P,)). PINNED: as one `fma.rn.f32` inline-asm
    statement per element with side effects, so that LLVM keeps it where the kernel puts it relative
    to the wgmma statements (module docstring: the product's registers must be dead before the next
    asynchronous MMA writes its own); only on the GPU (the interpreter has no inline asm)."""
    if PINNED:
        return tl.inline_asm_elementwise(
            "fma.rn.f32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [prod, scale[:, None], acc],
            dtype=tl.float32,
            is_pure=False,
            pack=1,
        )
    else:
        return acc + prod * scale[:, None]


@triton.jit
def load_operands(
    a_desc,
    a_ptr,
    b_desc,
    b_ptr,
    red0,
    a_row0,
    row_lo,
    row_hi,
    g,
    N,
    c0,
    COLS,
    RED,
    stride_am,
    stride_bg,
    stride_br,
    TRANS_B: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_RED: tl.constexpr,
):
    """The A (BLOCK_M, BLOCK_RED) and B (BLOCK_RED, BLOCK_C) tiles of the reduction step at red0 (the
    schedule's `load_a` / `load_b`; reads past RED are zeros)."""
    a = load_a(a_desc, a_ptr, red0, a_row0, row_lo, row_hi, RED, stride_am, USE_TMA, False, BLOCK_M, BLOCK_RED)
    b = load_b(
        b_desc, b_ptr, g, N, red0, c0, COLS, RED, stride_bg, stride_br, TRANS_B, USE_TMA, False, BLOCK_C, BLOCK_RED
    )
    return a, b


@triton.jit
def grouped_mm_fp8_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
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
    stride_asm,
    stride_bsg,
    stride_bs_red,
    stride_bs_col,
    TRANS_B: tl.constexpr,
    BLOCK_SCALES: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_RED: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_GROUPS: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
    EPI_TMA: tl.constexpr,
    PINNED: tl.constexpr,
):
    """c (M, COLS) = dequant(a) (M, RED) @ op(dequant(w[g])) per group, padding rows zero.

    a: (M, RED) float8, row stride stride_am, unit column stride; a_scale: fp32, row r's scale of
       reduction block j at a_scale_ptr + r * stride_asm + j (BLOCK_SCALES; j = 0 otherwise).
    b: (N, B_ROWS, B_COLS) float8 weight data, strides (stride_bg, stride_br, 1); w[g] is (COLS, RED)
       if TRANS_B (forward) else (RED, COLS) (dgrad). b_scale: fp32; the scale of w[g]'s element
       (reduction index k, output column c) is at b_scale_ptr + g * stride_bsg + (k // SCALE_BLOCK)
       * stride_bs_red + (c // SCALE_BLOCK) * stride_bs_col with BLOCK_SCALES, else at b_scale_ptr +
       g * stride_bsg + c * stride_bs_col (one per output column).
    c: (M, COLS) in the output dtype, row stride stride_cm; bias (N, COLS) and its per-row scale as
       the bf16 kernel's.
    With BLOCK_SCALES a second step past RED (an odd step count) reads zeros (TMA's fill, the pointer
    path's mask) with scale 0. PINNED: `promote` as inline asm (GPU only).
    """
    tl.static_assert(not BLOCK_SCALES or BLOCK_RED == SCALE_BLOCK, "a reduction step is one scale block")
    tl.static_assert(not BLOCK_SCALES or SCALE_BLOCK % BLOCK_C == 0, "a tile's columns are in one scale block")
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
        # Scales of the tile's own rows and columns only: rows of other groups and columns past
        # COLS (never stored) read 0, and padding tiles read nothing.
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_c = c0 + tl.arange(0, BLOCK_C)
        mask_sa = (offs_m >= row_lo) & (offs_m < row_hi) & (g < N)
        mask_sb = (offs_c < COLS) & (g < N)
        sa_ptrs = a_scale_ptr + offs_m.to(tl.int64) * stride_asm
        sb_ptrs = b_scale_ptr + g.to(tl.int64) * stride_bsg + offs_c * stride_bs_col
        acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
        if BLOCK_SCALES:
            # The tile's columns lie in one weight scale block: one weight scale a step.
            sb_ptr = b_scale_ptr + g.to(tl.int64) * stride_bsg + (c0 // SCALE_BLOCK) * stride_bs_col
            prev = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
            s_prev = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for pair in range(tl.cdiv(red_steps, 2)):
                step0 = 2 * pair
                step1 = step0 + 1
                red0 = step0 * BLOCK_RED
                red1 = red0 + BLOCK_RED
                # A second step past RED (an odd step count) reads zeros with scale 0.
                a0, b0 = load_operands(
                    a_desc, a_ptr, b_desc, b_ptr, red0, a_row0, row_lo, row_hi, g, N, c0, COLS, RED, stride_am,
                    stride_bg, stride_br, TRANS_B, USE_TMA, BLOCK_M, BLOCK_C, BLOCK_RED,
                )  # fmt: skip
                a1, b1 = load_operands(
                    a_desc, a_ptr, b_desc, b_ptr, red1, a_row0, row_lo, row_hi, g, N, c0, COLS, RED, stride_am,
                    stride_bg, stride_br, TRANS_B, USE_TMA, BLOCK_M, BLOCK_C, BLOCK_RED,
                )  # fmt: skip
                s0 = tl.load(sa_ptrs + step0, mask=mask_sa, other=0.0) * tl.load(
                    sb_ptr + step0 * stride_bs_red, mask=g < N, other=0.0
                )
                in1 = step1 < red_steps
                s1 = tl.load(sa_ptrs + step1, mask=mask_sa & in1, other=0.0) * tl.load(
                    sb_ptr + step1 * stride_bs_red, mask=(g < N) & in1, other=0.0
                )
                p0 = tl.dot(a0, b0)
                acc = promote(acc, prev, s_prev, PINNED)
                p1 = tl.dot(a1, b1)
                acc = promote(acc, p0, s0, PINNED)
                prev = p1
                s_prev = s1
            acc = promote(acc, prev, s_prev, False)
        else:
            for step in range(red_steps):
                red0 = step * BLOCK_RED
                a, b = load_operands(
                    a_desc, a_ptr, b_desc, b_ptr, red0, a_row0, row_lo, row_hi, g, N, c0, COLS, RED, stride_am,
                    stride_bg, stride_br, TRANS_B, USE_TMA, BLOCK_M, BLOCK_C, BLOCK_RED,
                )  # fmt: skip
                acc = tl.dot(a, b, acc)
            sa = tl.load(sa_ptrs, mask=mask_sa, other=0.0)
            sb = tl.load(sb_ptrs, mask=mask_sb, other=0.0)
            acc = acc * (sa[:, None] * sb[None, :])
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
