# ruff: noqa: E741  (I and O are the legend's in/out feature sizes)
"""Triton grouped GEMM kernels: the three products of a grouped linear, for Hopper first.

legend: M routed rows, G groups (experts), I in_features, O out_features,
        K reduction dim of one kernel, N output columns of one kernel.

    forward  y[r]  = x[r] @ w[g]^T (+ bias[g] (* bias_scale[r]))   x: (M, I), w: (G, O, I) -> y: (M, O)
    dgrad    dx[r] = dy[r] @ w[g]                                   dy: (M, O), w: (G, O, I) -> dx: (M, I)
    wgrad    dw[g] = dy[rows of g]^T @ x[rows of g]                 dy: (M, O), x: (M, I) -> dw: (G, O, I)
             dbias[g] = sum of dy over rows of g                    -> dbias: (G, O)

Rows of group g are ``offs[g]:offs[g+1]`` where ``offs`` is a device int64 tensor of G+1 entries.
The host never reads ``offs``: every kernel derives its tile schedule from it on the device, so the
launches are free of host syncs and can be captured in a CUDA graph and replayed with other split
sizes (as long as the buffers keep their shapes).

Design (see notes/grouped_gemm.md for the measurements behind it):

* One persistent kernel per product. Programs (one per SM) walk a flat tile space with a stride of
  the grid size. For forward/dgrad the tile space is, group after group, the (m-tile, n-tile) grid
  of each group, followed by a pseudo-group G that covers the padding rows ``offs[G]:M``; its tiles
  run no K loop and store zeros. For wgrad every group owns the same (o-tile, i-tile) grid and the
  K loop runs over the group's rows (zero iterations for an empty group, so its dw is zeros).
* Tile -> (group, tile in group): every program keeps the per-group tile-end prefix sum in
  registers (one vector of BLOCK_G entries, computed once) and finds its group with one fused
  reduction per tile: no Python loop over experts, no host-side schedule, no scalar search loop.
* Operands come in through TMA tensor descriptors built on the device (``tl.make_tensor_descriptor``)
  when every base and stride is 16-byte aligned (USE_TMA); otherwise, and on pre-Hopper GPUs, through
  masked pointer loads. Zero-filled TMA boxes make the K tail and the N tail exact. For wgrad a
  group whose row count is not a multiple of BLOCK_K gets a dy descriptor whose row extent ends at
  the group's end, so rows of the next group (or padding rows, which may hold anything) add zeros.
* Epilogue: fp32 accumulator -> (+ bias[g] * bias_scale[r]) -> one rounding to the output dtype ->
  masked store of the rows that belong to the tile's group. A tile that straddles a group boundary
  computes garbage rows for the neighbour group and simply does not store them.
* Extension points for the later fused steps: ``_load_ab`` is the only place operands are read
  (FP8 block scales would be loaded next to the operands there and applied per K step);
  ``_fwd_epilogue`` is the only place the accumulator is turned into output (SwiGLU over the
  interleaved gate/up columns of one tile, router-prob scaling and probs-scaled bias go there;
  dSwiGLU/dprobs go into the dgrad epilogue, which is the same function with other constexprs).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.0; the interpreter class tells whether kernels run on the CPU.
    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction
except ImportError:  # pragma: no cover - very old triton
    _InterpretedFunction = ()

__all__ = [
    "grouped_gemm_forward",
    "grouped_gemm_dgrad",
    "grouped_gemm_wgrad",
    "triton_unavailable_reason",
]

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# Device-side helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _min_tuple(a0, a1, a2, a3, b0, b1, b2, b3):
    # Combine of the tile-locating reduction: (#groups ending at or before the tile, the largest
    # such end = the group's first tile, smallest start / end among the groups not yet ended =
    # the tile's group's row range, because starts and ends are non-decreasing).
    return a0 + b0, tl.maximum(a1, b1), tl.minimum(a2, b2), tl.minimum(a3, b3)


@triton.jit
def _group_rows(offs_ptr, M, G, BLOCK_G: tl.constexpr, PAD_GROUP: tl.constexpr):
    """Row range [start, end) of every group, as vectors of BLOCK_G int32 (entries past the last
    group are empty ranges at M). With PAD_GROUP, entry G is the padding pseudo-group offs[G]:M.
    Values are clamped into [0, M] and made non-decreasing, so a bad offs tensor can make results
    wrong but can never send a load or store outside its buffer."""
    offs_g = tl.arange(0, BLOCK_G)
    start = tl.load(offs_ptr + offs_g, mask=offs_g <= G, other=0).to(tl.int32)
    end = tl.load(offs_ptr + offs_g + 1, mask=offs_g < G, other=0).to(tl.int32)
    start = tl.minimum(tl.maximum(start, 0), M)
    end = tl.minimum(tl.maximum(end, start), M)
    if PAD_GROUP:
        end = tl.where(offs_g == G, M, end)
    n_groups = G + 1 if PAD_GROUP else G
    start = tl.where(offs_g < n_groups, start, M)
    end = tl.where(offs_g < n_groups, end, M)
    return start, end


@triton.jit
def _locate_tile(tile_id, tile_end, row_start, row_end):
    """(group, first tile id of that group, group's row start, group's row end) of a flat tile id.
    tile_end: inclusive prefix sum of tiles per group (non-decreasing)."""
    done = tile_end <= tile_id
    n_done, first_tile, r0, r1 = tl.reduce(
        (
            done.to(tl.int32),
            tl.where(done, tile_end, 0),
            tl.where(done, 2147483647, row_start),
            tl.where(done, 2147483647, row_end),
        ),
        0,
        _min_tuple,
    )
    return n_done, first_tile, r0, r1


@triton.jit
def _swizzle(t, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Local tile index -> (pid_m, pid_n), GROUP_M m-tiles at a time, so that the programs running
    at one moment share a few A row-blocks and B column-blocks in L2."""
    num_in_band = GROUP_M * num_pid_n
    band = t // num_in_band
    first_m = band * GROUP_M
    band_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (t % num_in_band) % band_m
    pid_n = (t % num_in_band) // band_m
    return pid_m, pid_n


@triton.jit
def _load_ab(
    a_desc, b_desc, a_ptr, b_ptr, g, G, k0, row0, n0, row_lo, row_hi, N, K,
    stride_am, stride_bg, stride_br,
    B_IS_NK: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One K step of operands for forward/dgrad: a (BLOCK_M, BLOCK_K) from the routed rows,
    b (BLOCK_K, BLOCK_N) from w[g] (stored (N, K) when B_IS_NK, (K, N) otherwise)."""
    if USE_TMA:
        a = a_desc.load([row0, k0])
        if B_IS_NK:
            b = b_desc.load([g, n0, k0]).reshape(BLOCK_N, BLOCK_K).T
        else:
            b = b_desc.load([g, k0, n0]).reshape(BLOCK_K, BLOCK_N)
    else:
        offs_m = row0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
        mask_n = (offs_n < N) & (g < G)
        mask_k = offs_k < K
        a = tl.load(
            a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )
        b_base = b_ptr + g.to(tl.int64) * stride_bg
        if B_IS_NK:
            b = tl.load(
                b_base + offs_n.to(tl.int64)[None, :] * stride_br + offs_k[:, None],
                mask=mask_k[:, None] & mask_n[None, :], other=0.0,
            )
        else:
            b = tl.load(
                b_base + offs_k.to(tl.int64)[:, None] * stride_br + offs_n[None, :],
                mask=mask_k[:, None] & mask_n[None, :], other=0.0,
            )
    if UPCAST:
        # The Triton 3.6 interpreter multiplies bf16 dot operands as raw integers.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def _split_halves(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(BLOCK_M, BLOCK_N) -> two (BLOCK_M, BLOCK_N // 2) column halves: the epilogue stores half a
    tile at a time, which halves its shared-memory staging buffer."""
    acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    return tl.split(acc)


@triton.jit
def _fwd_epilogue(
    acc, c_ptr, c_desc, bias_ptr, scale_ptr, g, G, M, row0, n0, row_lo, row_hi, N,
    stride_cm, stride_bias_g,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EPI_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """acc (BLOCK_M, BLOCK_N) fp32 -> (+ bias[g] (* scale[r])) -> output dtype -> rows of the group.

    EPI_TMA: the tile leaves through asynchronous TMA stores, so the next tile's main loop
    overlaps the write-back. c_desc is the tile's own descriptor whose row extent ends at the
    group's end: rows of the next group are clipped by the hardware, not by a branch (a branch
    here breaks Triton's loop fusion).
    """
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = (offs_m >= row_lo) & (offs_m < row_hi)
    mask_n = offs_n < N
    if HAS_BIAS:
        # Padding tiles (g == G) get no bias: padding rows are written as exact zeros.
        bias = tl.load(
            bias_ptr + g.to(tl.int64) * stride_bias_g + offs_n,
            mask=mask_n & (g < G), other=0.0,
        ).to(tl.float32)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
            acc = acc + scale[:, None] * bias[None, :]
        else:
            acc = acc + bias[None, :]
    out_ty = c_ptr.dtype.element_ty
    if EPI_TMA:
        acc0, acc1 = _split_halves(acc, BLOCK_M, BLOCK_N)
        c_desc.store([row0, n0], acc0.to(out_ty))
        c_desc.store([row0, n0 + BLOCK_N // 2], acc1.to(out_ty))
    else:
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(out_ty), mask=mask_m[:, None] & mask_n[None, :])


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, scale_ptr, offs_ptr,
    M, N, K, G, B_ROWS, B_COLS,
    stride_am, stride_bg, stride_br, stride_cm, stride_bias_g,
    B_IS_NK: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_G: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr, EPI_TMA: tl.constexpr,
):
    """Forward (B_IS_NK) and dgrad: c (M, N) = a (M, K) @ op(w[g]) per group, padding rows zero.

    a: (M, K), row stride stride_am, unit column stride.
    b: (G, B_ROWS, B_COLS) weight, strides (stride_bg, stride_br, 1); w[g] is (N, K) if B_IS_NK
       (forward: w (G, O, I)) else (K, N) (dgrad: the same w (G, O, I)).
    c: (M, N), row stride stride_cm.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    row_start, row_end = _group_rows(offs_ptr, M, G, BLOCK_G, True)
    tiles = tl.cdiv(row_end - row_start, BLOCK_M) * num_pid_n
    tile_end = tl.cumsum(tiles, 0)
    num_tiles = tl.sum(tiles, 0)
    k_steps = tl.cdiv(K, BLOCK_K)

    if USE_TMA:
        a_desc = tl.make_tensor_descriptor(
            a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
        if B_IS_NK:
            b_desc = tl.make_tensor_descriptor(
                b_ptr, shape=[G, B_ROWS, B_COLS], strides=[stride_bg, stride_br, 1],
                block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(
                b_ptr, shape=[G, B_ROWS, B_COLS], strides=[stride_bg, stride_br, 1],
                block_shape=[1, BLOCK_K, BLOCK_N])
    else:
        a_desc = None
        b_desc = None
    for tile_id in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        g, first_tile, row_lo, row_hi = _locate_tile(tile_id, tile_end, row_start, row_end)
        pid_m, pid_n = _swizzle(tile_id - first_tile, tl.cdiv(row_hi - row_lo, BLOCK_M), num_pid_n, GROUP_M)
        row0 = row_lo + pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        # Every tile runs the same K loop (a tile-invariant trip count is what lets Triton fuse
        # the tile loop and the K loop into one software pipeline). Padding tiles (g == G) point
        # their TMA boxes past the end of a and b, so they read zeros and no memory.
        a_row0 = tl.where(g < G, row0, M)
        if EPI_TMA:
            c_desc = tl.make_tensor_descriptor(
                c_ptr, shape=[row_hi, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N // 2])
        else:
            c_desc = None
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_steps):
            a, b = _load_ab(
                a_desc, b_desc, a_ptr, b_ptr, g, G, ki * BLOCK_K, a_row0, n0, row_lo, row_hi, N, K,
                stride_am, stride_bg, stride_br,
                B_IS_NK, USE_TMA, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K,
            )
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        # Padding rows are written as exact zeros whatever they hold (NaN * 0 is NaN).
        acc = tl.where(g < G, acc, 0.0)
        _fwd_epilogue(
            acc, c_ptr, c_desc, bias_ptr, scale_ptr, g, G, M, row0, n0, row_lo, row_hi, N,
            stride_cm, stride_bias_g, HAS_BIAS, HAS_SCALE, EPI_TMA, BLOCK_M, BLOCK_N,
        )


@triton.jit
def _wgrad_tile(tile_id, tiles_per_group, num_pid_m, num_pid_n, offs_ptr, M,
                GROUP_M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """wgrad tile -> (group, o0, i0, group's row start, group's row end)."""
    g = tile_id // tiles_per_group
    pid_m, pid_n = _swizzle(tile_id % tiles_per_group, num_pid_m, num_pid_n, GROUP_M)
    row_lo = tl.load(offs_ptr + g).to(tl.int32)
    row_hi = tl.load(offs_ptr + g + 1).to(tl.int32)
    row_lo = tl.minimum(tl.maximum(row_lo, 0), M)
    row_hi = tl.minimum(tl.maximum(row_hi, row_lo), M)
    return g, pid_m * BLOCK_M, pid_n * BLOCK_N, row_lo, row_hi


@triton.jit
def _wgrad_load(dy_desc, x_desc, dy_ptr, x_ptr, r0, o0, i0, row_hi, O, I, stride_dym, stride_xm,
                USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K step of wgrad operands: a = dy[r0:r0+BK, o0:o0+BM]^T (BM, BK), b = x[r0:.., i0:..] (BK, BN).
    Rows at or past row_hi must add nothing: the pointer path masks them, with TMA the descriptors'
    row extents make them zeros (see _grouped_wgrad_kernel)."""
    if USE_TMA:
        a = dy_desc.load([r0, o0]).T
        b = x_desc.load([r0, i0])
    else:
        offs_k = r0 + tl.arange(0, BLOCK_K)
        offs_m = o0 + tl.arange(0, BLOCK_M)
        offs_n = i0 + tl.arange(0, BLOCK_N)
        mask_k = offs_k < row_hi
        a = tl.load(
            dy_ptr + offs_k.to(tl.int64)[None, :] * stride_dym + offs_m[:, None],
            mask=mask_k[None, :] & (offs_m[:, None] < O), other=0.0,
        )
        b = tl.load(
            x_ptr + offs_k.to(tl.int64)[:, None] * stride_xm + offs_n[None, :],
            mask=mask_k[:, None] & (offs_n[None, :] < I), other=0.0,
        )
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return a, b


@triton.jit
def _wgrad_epilogue(acc, dw_ptr, dw_desc, g, o0, i0, O, I, stride_dwg, stride_dwo,
                    EPI_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw[g, o0:o0+BM, i0:i0+BN] = acc. EPI_TMA: asynchronous TMA stores through a (G, O, I)
    descriptor, whose bounds clip the O and I tails (wgrad tiles are short in K, so overlapping
    their write-back with the next tile matters)."""
    out_ty = dw_ptr.dtype.element_ty
    if EPI_TMA:
        acc0, acc1 = _split_halves(acc, BLOCK_M, BLOCK_N)
        dw_desc.store([g, o0, i0], acc0.to(out_ty).reshape(1, BLOCK_M, BLOCK_N // 2))
        dw_desc.store([g, o0, i0 + BLOCK_N // 2], acc1.to(out_ty).reshape(1, BLOCK_M, BLOCK_N // 2))
    else:
        offs_m = o0 + tl.arange(0, BLOCK_M)
        offs_n = i0 + tl.arange(0, BLOCK_N)
        dw_ptrs = (dw_ptr + g.to(tl.int64) * stride_dwg
                   + offs_m.to(tl.int64)[:, None] * stride_dwo + offs_n[None, :])
        tl.store(dw_ptrs, acc.to(out_ty), mask=(offs_m[:, None] < O) & (offs_n[None, :] < I))


@triton.jit
def _grouped_wgrad_kernel(
    dy_ptr, x_ptr, dw_ptr, offs_ptr,
    M, O, I, G,
    stride_dym, stride_xm, stride_dwg, stride_dwo,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, BLOCK_G: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    EPI_TMA: tl.constexpr,
):
    """dw[g] (O, I) = dy[rows of g]^T @ x[rows of g] for every group in one launch.

    dy: (M, O) row stride stride_dym; x: (M, I) row stride stride_xm; dw: (G, O, I) with strides
    (stride_dwg, stride_dwo, 1). Tiles: BLOCK_M over O, BLOCK_N over I, BLOCK_K over rows.
    Every group owns the same (o, i) tile grid; its K loop runs over its own rows.

    The last K step of a group whose row count is not a multiple of BLOCK_K reaches past the
    group's end into the next group's rows or the padding rows (which may hold anything); they
    must add nothing. With TMA:
      FLATTEN: the group gets its own dy descriptor whose row extent ends at the group's end (TMA
        zero-fills), and x's descriptor ends at offs[G]: the rows past the group are zero dy rows
        times x rows of later groups, exact zeros as long as those are finite (an inf in x makes
        the loss NaN anyway), or zeros times zeros in the padding. One descriptor per group
        instead of two (measured: +2-6% on skewed splits), built once per run of a program's
        consecutive tiles of the group; groups with a whole number of K steps need none.
      nested loop: per-tile dy and x descriptors that both end at the group's end.

    FLATTEN: the K loops of a program's tiles have different lengths, which Triton's loop fusion
    cannot flatten, so the kernel writes the fused loop itself: one loop over all K steps of all
    of the program's tiles, with the tile set-up in a `ki == 0` branch and the store in a
    `ki == last` branch. The pipeliner then prefetches the next tile's first operands while the
    current tile's epilogue runs.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(O, BLOCK_M)
    num_pid_n = tl.cdiv(I, BLOCK_N)
    tiles_per_group = num_pid_m * num_pid_n
    num_tiles = G * tiles_per_group
    if EPI_TMA:
        dw_desc = tl.make_tensor_descriptor(
            dw_ptr, shape=[G, O, I], strides=[stride_dwg, stride_dwo, 1],
            block_shape=[1, BLOCK_M, BLOCK_N // 2])
    else:
        dw_desc = None
    if FLATTEN:
        offs_g = tl.arange(0, BLOCK_G)
        lo_v, hi_v = _group_rows(offs_ptr, M, G, BLOCK_G, False)
        steps_v = tl.maximum(tl.cdiv(hi_v - lo_v, BLOCK_K), 1)
        # K steps this program will run: each of its tiles takes max(1, steps of its group); an
        # empty group's tile runs one (discarded) step so that its zeros are stored like any tile.
        first_v = offs_g * tiles_per_group
        # number of tile ids t < X with t = pid (mod NUM_PROGRAMS); X >= 0 keeps it non-negative
        mine_v = ((first_v + tiles_per_group - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS
                  - (first_v - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS)
        mine_v = tl.where(offs_g < G, mine_v, 0)
        total_steps = tl.sum(mine_v * steps_v, 0)

        tile_id = pid - NUM_PROGRAMS
        ki = 0
        k_len = 1
        g = 0
        o0 = 0
        i0 = 0
        row_lo = 0
        row_hi = 0
        desc_g = -1
        if USE_TMA:
            # Whole-tensor descriptors, built once: a group whose row count is a multiple of
            # BLOCK_K never reads past its end, so it needs no descriptor of its own.
            dy_full = tl.make_tensor_descriptor(
                dy_ptr, shape=[M, O], strides=[stride_dym, 1], block_shape=[BLOCK_K, BLOCK_M])
            # Rows past offs[G] (padding, may be NaN) read as zeros.
            rows_used = tl.max(tl.where(offs_g < G, hi_v, 0), 0)
            x_desc = tl.make_tensor_descriptor(
                x_ptr, shape=[tl.maximum(rows_used, 1), I], strides=[stride_xm, 1],
                block_shape=[BLOCK_K, BLOCK_N])
            dy_desc = dy_full
        else:
            dy_desc = None
            x_desc = None
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _step in range(0, total_steps):
            if ki == 0:
                tile_id += NUM_PROGRAMS
                g, o0, i0, row_lo, row_hi = _wgrad_tile(
                    tile_id, tiles_per_group, num_pid_m, num_pid_n, offs_ptr, M, GROUP_M, BLOCK_M, BLOCK_N)
                k_len = tl.maximum(tl.cdiv(row_hi - row_lo, BLOCK_K), 1)
                if USE_TMA:
                    if (row_hi - row_lo) % BLOCK_K == 0:
                        dy_desc = dy_full
                        desc_g = -1
                    elif g != desc_g:
                        # Building a descriptor costs a tensormap write and a proxy fence on the
                        # path to the tile's first loads: only ragged groups pay it, once per run
                        # of consecutive tiles of the group.
                        dy_desc = tl.make_tensor_descriptor(
                            dy_ptr, shape=[tl.maximum(row_hi, 1), O], strides=[stride_dym, 1],
                            block_shape=[BLOCK_K, BLOCK_M])
                        desc_g = g
            a, b = _wgrad_load(dy_desc, x_desc, dy_ptr, x_ptr, row_lo + ki * BLOCK_K, o0, i0, row_hi, O, I,
                               stride_dym, stride_xm, USE_TMA, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            last = ki == k_len - 1
            if last:
                # An empty group's single step may have read rows of other groups: store zeros.
                acc = tl.where(row_hi > row_lo, acc, 0.0)
                _wgrad_epilogue(acc, dw_ptr, dw_desc, g, o0, i0, O, I, stride_dwg, stride_dwo,
                                EPI_TMA, BLOCK_M, BLOCK_N)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            # The step counter must not depend on the epilogue branch: the next tile's loads
            # (pipeline stage 0) would then wait for this tile's store (last stage).
            ki = tl.where(last, 0, ki + 1)
    else:
        for tile_id in tl.range(pid, num_tiles, NUM_PROGRAMS):
            g, o0, i0, row_lo, row_hi = _wgrad_tile(
                tile_id, tiles_per_group, num_pid_m, num_pid_n, offs_ptr, M, GROUP_M, BLOCK_M, BLOCK_N)
            if USE_TMA:
                dy_desc = tl.make_tensor_descriptor(
                    dy_ptr, shape=[tl.maximum(row_hi, 1), O], strides=[stride_dym, 1],
                    block_shape=[BLOCK_K, BLOCK_M])
                x_desc = tl.make_tensor_descriptor(
                    x_ptr, shape=[tl.maximum(row_hi, 1), I], strides=[stride_xm, 1],
                    block_shape=[BLOCK_K, BLOCK_N])
            else:
                dy_desc = None
                x_desc = None
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(tl.cdiv(row_hi - row_lo, BLOCK_K)):
                a, b = _wgrad_load(dy_desc, x_desc, dy_ptr, x_ptr, row_lo + ki * BLOCK_K, o0, i0, row_hi, O, I,
                                   stride_dym, stride_xm, USE_TMA, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            _wgrad_epilogue(acc, dw_ptr, dw_desc, g, o0, i0, O, I, stride_dwg, stride_dwo, EPI_TMA, BLOCK_M, BLOCK_N)


@triton.jit
def _group_colsum_kernel(
    dy_ptr, part_ptr, offs_ptr, M, O, G, stride_dym,
    SPLITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_O: tl.constexpr, UPCAST: tl.constexpr,
):
    """part[s, g, o] = sum of dy[r, o] over the s-th of SPLITS equal slices of group g's rows.

    Fixed row order inside a program and a fixed sum over s afterwards: deterministic, no atomics.
    """
    pid_o = tl.program_id(0)
    pid_g = tl.program_id(1)
    pid_s = tl.program_id(2)
    row_lo = tl.load(offs_ptr + pid_g).to(tl.int32)
    row_hi = tl.load(offs_ptr + pid_g + 1).to(tl.int32)
    row_lo = tl.minimum(tl.maximum(row_lo, 0), M)
    row_hi = tl.minimum(tl.maximum(row_hi, row_lo), M)
    chunk = tl.cdiv(tl.cdiv(row_hi - row_lo, SPLITS), BLOCK_R) * BLOCK_R
    r_begin = row_lo + pid_s * chunk
    r_stop = tl.minimum(r_begin + chunk, row_hi)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < O
    acc = tl.zeros((BLOCK_R, BLOCK_O), dtype=tl.float32)
    for r in range(r_begin, r_stop, BLOCK_R):
        offs_r = r + tl.arange(0, BLOCK_R)
        vals = tl.load(
            dy_ptr + offs_r.to(tl.int64)[:, None] * stride_dym + offs_o[None, :],
            mask=(offs_r[:, None] < r_stop) & mask_o[None, :], other=0.0,
        )
        acc += vals.to(tl.float32)
    total = tl.sum(acc, 0)
    out = part_ptr + (pid_s.to(tl.int64) * G + pid_g) * O + offs_o
    tl.store(out, total, mask=mask_o)


# --------------------------------------------------------------------------------------------
# Host side: availability, configs, autotuning cache, launchers
# --------------------------------------------------------------------------------------------

_INTERPRET = isinstance(_grouped_mm_kernel, _InterpretedFunction) if _InterpretedFunction else False


def triton_unavailable_reason(device, dtype) -> str | None:
    """Why the triton backend cannot run for tensors of ``dtype`` on ``device``; None if it can.

    CUDA: compute capability 8.0 or newer (Hopper, sm_90, gets the TMA path; Ampere/Ada run the
    pointer-load path of the same kernels, correct but not tuned). CPU: only when the environment
    variable TRITON_INTERPRET=1 was set before triton was imported (slow; for tests).
    """
    device = torch.device(device)
    if dtype not in _SUPPORTED_DTYPES:
        return f"triton grouped GEMM supports float32, bfloat16 and float16, not {dtype}"
    if device.type == "cpu":
        if _INTERPRET:
            return None
        return ("triton kernels need a CUDA device; on CPU they run only under the Triton "
                "interpreter (set TRITON_INTERPRET=1 before triton is imported)")
    if device.type != "cuda":
        return f"triton grouped GEMM runs on CUDA devices (or CPU under TRITON_INTERPRET=1), not {device.type}"
    if _INTERPRET:
        return None
    if not torch.cuda.is_available():
        return "CUDA is not available"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return f"triton grouped GEMM needs compute capability 8.0 or newer, device has {major}.{minor}"
    return None


def _check_device(t: torch.Tensor) -> None:
    reason = triton_unavailable_reason(t.device, t.dtype)
    if reason is not None:
        raise ValueError(reason)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs 16-byte aligned bases and 16-byte multiples for every non-unit stride."""
    for t in tensors:
        es = t.element_size()
        if t.data_ptr() % 16:
            return False
        if any((s * es) % 16 for s in t.stride()[:-1]):
            return False
        if t.numel() == 0:
            return False
    return True


def _torch_alloc(size: int, alignment: int, stream):
    # Scratch for device-side TMA descriptors (128 bytes per program). torch's caching allocator
    # keeps this stream-ordered and inside the graph pool during CUDA-graph capture.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side descriptors need triton's global-scratch allocator. It is a ContextVar, so it is
    unset in fresh threads (autograd's backward threads among them): set it on each launch unless
    the user installed their own."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_alloc)


class _Cfg(tuple):
    """(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_stages, num_warps, flatten, epi_tma)"""

    __slots__ = ()

    def __new__(cls, bm, bn, bk, gm, stages, warps, flatten, epi_tma=False):
        return super().__new__(cls, (bm, bn, bk, gm, stages, warps, flatten, epi_tma))

    bm = property(lambda s: s[0])
    bn = property(lambda s: s[1])
    bk = property(lambda s: s[2])
    gm = property(lambda s: s[3])
    stages = property(lambda s: s[4])
    warps = property(lambda s: s[5])
    flatten = property(lambda s: s[6])
    epi_tma = property(lambda s: s[7])


def _candidates(op: str, dtype: torch.dtype, use_tma: bool, cap: tuple[int, int], n: int) -> list[_Cfg]:
    """Small tuning space per problem class; the first entry is the untuned default."""
    if _INTERPRET:
        return [_Cfg(32, 32, 16, 4, 1, 4, False)]
    if dtype == torch.float32:
        return [_Cfg(64, 64, 32, 8, 3, 4, False)]
    if cap[0] >= 9 and use_tma:
        # Variants of the 128x256x64 / 8-warp tile that won on the H200 (notes/grouped_gemm.md):
        # (flatten, epi_tma, stages). 128x128 only for narrow outputs.
        if op == "wgrad":
            # One config: the 4-stage and whole-tile-store variants measured within noise of it
            # with interleaved timing (notes), and a single candidate means no autotuning sync.
            return [_Cfg(128, 256, 64, 8, 3, 8, True, True)]
        big = [
            _Cfg(128, 256, 64, 8, 3, 8, True, False),
            _Cfg(128, 256, 64, 8, 3, 8, True, True),
            _Cfg(128, 256, 64, 8, 3, 8, False, False),
        ]
        return big if n > 128 else [_Cfg(128, 128, 64, 8, 4, 8, True, False), big[0]]
    # Pointer path (unaligned operands, or Ampere/Ada): conservative shapes that fit 100 KB smem.
    return [_Cfg(128, 128, 32, 8, 3, 8, False), _Cfg(128, 64, 32, 8, 4, 4, False)]


_TUNED: dict[tuple, _Cfg] = {}


_AUTOTUNE = {"enabled": True}


def set_autotune(enabled: bool) -> None:
    """Turn the per-problem-class config search on (default) or off (first candidate config).

    The search benchmarks a few configs on the first call of each problem class, which synchronizes
    with the host once; turn it off for runs that must not sync even on their first step."""
    _AUTOTUNE["enabled"] = bool(enabled)


def _pick(key: tuple, cands: list[_Cfg], launch, device: torch.device) -> _Cfg:
    """Best config of ``cands`` for ``key``, benchmarked once per process and cached.

    Never benchmarks while a CUDA graph is being captured (it would synchronize): then the cached
    choice or the default is used. Warm up once outside capture to get the tuned config.
    """
    hit = _TUNED.get(key)
    if hit is not None:
        return hit
    if len(cands) == 1 or not _AUTOTUNE["enabled"] or device.type != "cuda" or _INTERPRET:
        return cands[0]
    if torch.cuda.is_current_stream_capturing():
        return cands[0]
    best, best_t = cands[0], float("inf")
    for cfg in cands:
        try:
            t = triton.testing.do_bench(lambda c=cfg: launch(c), warmup=5, rep=20, return_mode="median")
        except Exception:  # a config that does not compile or fit is skipped
            continue
        if t < best_t:
            best, best_t = cfg, t
    _TUNED[key] = best
    return best


def _resolve_tma(use_tma: bool | None, has_k: bool, *operands: torch.Tensor) -> tuple[bool, tuple[int, int]]:
    """(whether the operands go through TMA descriptors, the compute capability to pick configs
    for). use_tma given (tests, tuning) is kept as is, with Hopper's configs; otherwise TMA needs
    sm_90 (or the interpreter), a non-empty reduction and 16-byte aligned operands."""
    if use_tma is not None:
        return use_tma, (9, 0)
    device = operands[0].device
    cap = (9, 0) if (_INTERPRET or device.type != "cuda") else _capability(device.index)
    return (cap[0] >= 9 or _INTERPRET) and has_k and _tma_ok(*operands), cap


def _empty(shape, device, dtype) -> torch.Tensor:
    """Every output is allocated here, uninitialised: the kernels write every element. (Tests
    replace this with a NaN-filled allocation to prove it.)"""
    return torch.empty(shape, device=device, dtype=dtype)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands: full fp32 products unless the user allowed TF32 for matmuls, like torch.
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"


def _block_g(n: int) -> int:
    # The per-group vectors are tiny next to a tile; one size for up to 255 groups means one
    # compiled kernel for every model instead of one per expert count.
    return max(256, triton.next_power_of_2(n))


def _bucket(m: int) -> int:
    return 1 << max(int(m) - 1, 0).bit_length()


def _grid_size(device: torch.device, bound: int) -> int:
    sms = 4 if (_INTERPRET or device.type != "cuda") else _num_sms(device.index if device.index is not None
                                                                 else torch.cuda.current_device())
    return max(1, min(sms, bound))


def _check_offs(offs: torch.Tensor, groups: int, device: torch.device) -> torch.Tensor:
    if offs.dim() != 1 or offs.shape[0] != groups + 1:
        raise ValueError(f"offs must have shape ({groups + 1},), got {tuple(offs.shape)}")
    if offs.device != device:
        raise ValueError(f"offs is on {offs.device}, inputs on {device}")
    if offs.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"offs must be int64 or int32, got {offs.dtype}")
    return offs


def _device_ctx(device: torch.device):
    if device.type == "cuda" and not _INTERPRET:
        return torch.cuda.device(device)
    import contextlib

    return contextlib.nullcontext()


def _run_mm(a, w, offs, out, bias, scale, b_is_nk, cfg: _Cfg, use_tma: bool):
    M, K = a.shape
    G, b_rows, b_cols = w.shape
    N = out.shape[1]
    bound = (triton.cdiv(M, cfg.bm) + G + 1) * triton.cdiv(N, cfg.bn)
    nprog = _grid_size(a.device, bound)
    # TMA stores need a 16-byte aligned row stride of the (contiguous, fresh) output.
    epi_tma = bool(cfg.epi_tma and use_tma and (N * out.element_size()) % 16 == 0)
    if use_tma or epi_tma:
        _ensure_allocator()
    _grouped_mm_kernel[(nprog,)](
        a, w, out,
        bias if bias is not None else out, scale if scale is not None else out, offs,
        M, N, K, G, b_rows, b_cols,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        bias.stride(0) if bias is not None else 0,
        B_IS_NK=b_is_nk, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
        USE_TMA=use_tma, UPCAST=_INTERPRET, DOT_PRECISION=_dot_precision(a.dtype),
        BLOCK_M=cfg.bm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, GROUP_M=cfg.gm,
        BLOCK_G=_block_g(G + 2), NUM_PROGRAMS=nprog, FLATTEN=cfg.flatten, EPI_TMA=epi_tma,
        num_stages=cfg.stages, num_warps=cfg.warps,
    )


def _mm(op, a, w, offs, bias=None, scale=None, *, cfg=None, use_tma=None):
    """Shared launcher of forward (op="fwd": out (M, O)) and dgrad (op="dgrad": out (M, I))."""
    _check_device(a)
    if w.dim() != 3 or w.stride(2) != 1:
        raise ValueError("w must be a 3D (G, O, I) tensor whose last dim has stride 1")
    if a.dim() != 2:
        raise ValueError(f"expected a 2D input, got shape {tuple(a.shape)}")
    if w.dtype != a.dtype or w.device != a.device:
        raise ValueError(f"w is {w.dtype} on {w.device}, input is {a.dtype} on {a.device}")
    if a.stride(1) != 1:
        a = a.contiguous()
    G, O, I = w.shape
    b_is_nk = op == "fwd"
    K, N = (I, O) if b_is_nk else (O, I)
    if a.shape[1] != K:
        raise ValueError(f"input has {a.shape[1]} columns, w {tuple(w.shape)} needs {K}")
    offs = _check_offs(offs, G, a.device)
    M = a.shape[0]
    out = _empty((M, N), a.device, a.dtype)
    if M == 0 or N == 0:
        return out
    if G == 0:
        return out.zero_()
    use_tma, cap = _resolve_tma(use_tma, K > 0, a, w)
    with _device_ctx(a.device):
        if cfg is None:
            cands = _candidates(op, a.dtype, use_tma, cap, N)
            key = (op, a.dtype, N, K, G, _bucket(M), use_tma, bias is not None, scale is not None)
            cfg = _pick(key, cands,
                        lambda c: _run_mm(a, w, offs, out, bias, scale, b_is_nk, c, use_tma), a.device)
        _run_mm(a, w, offs, out, bias, scale, b_is_nk, cfg, use_tma)
    return out


def grouped_gemm_forward(x_MI, w_GOI, offs_G1, bias_GO=None, bias_scale_M=None, **_kw):
    """Grouped forward: y (M, O) with y[r] = x[r] @ w[g]^T (+ bias[g] (* bias_scale[r])).

    x_MI: (M, I) fp32/bf16/fp16, unit column stride preferred (copied otherwise).
    w_GOI: (G, O, I), same dtype, any strides with stride(2) == 1.
    offs_G1: (G+1,) int64 device tensor, offs[0] = 0, non-decreasing, offs[G] <= M.
    bias_GO: optional (G, O) (unit column stride); bias_scale_M: optional (M,) per-row factor of the
    bias (router probabilities), any float dtype. Rows r >= offs[G] are written as 0.
    Returns a fresh (M, O) tensor of x's dtype; accumulation and epilogue math in fp32.
    M and every feature size must stay below 2**31 (TMA coordinates are int32).
    """
    if bias_GO is None and bias_scale_M is not None:
        raise ValueError("bias_scale_M given without bias_GO")
    if bias_GO is not None:
        G, O, _ = w_GOI.shape
        if tuple(bias_GO.shape) != (G, O):
            raise ValueError(f"bias must have shape ({G}, {O}), got {tuple(bias_GO.shape)}")
        if bias_GO.device != x_MI.device:
            raise ValueError(f"bias is on {bias_GO.device}, x on {x_MI.device}")
        if bias_GO.stride(-1) != 1:
            bias_GO = bias_GO.contiguous()
    if bias_scale_M is not None:
        if bias_scale_M.dim() != 1 or bias_scale_M.shape[0] != x_MI.shape[0]:
            raise ValueError(f"bias_scale must have shape ({x_MI.shape[0]},), got {tuple(bias_scale_M.shape)}")
        if bias_scale_M.device != x_MI.device:
            raise ValueError(f"bias_scale is on {bias_scale_M.device}, x on {x_MI.device}")
        bias_scale_M = bias_scale_M.contiguous()
    return _mm("fwd", x_MI, w_GOI, offs_G1, bias_GO, bias_scale_M, **_kw)


def grouped_gemm_dgrad(dy_MO, w_GOI, offs_G1, **_kw):
    """Grouped dgrad: dx (M, I) with dx[r] = dy[r] @ w[g]; rows r >= offs[G] are 0.

    dy_MO: (M, O); w_GOI: (G, O, I) with stride(2) == 1; offs_G1 as in grouped_gemm_forward.
    """
    return _mm("dgrad", dy_MO, w_GOI, offs_G1, **_kw)


def _run_wgrad(dy, x, offs, dw, cfg: _Cfg, use_tma: bool):
    M, O = dy.shape
    I = x.shape[1]
    G = dw.shape[0]
    bound = G * triton.cdiv(O, cfg.bm) * triton.cdiv(I, cfg.bn)
    nprog = _grid_size(dy.device, bound)
    epi_tma = bool(cfg.epi_tma and use_tma and (I * dw.element_size()) % 16 == 0)
    if use_tma or epi_tma:
        _ensure_allocator()
    _grouped_wgrad_kernel[(nprog,)](
        dy, x, dw, offs, M, O, I, G,
        dy.stride(0), x.stride(0), dw.stride(0), dw.stride(1),
        USE_TMA=use_tma, UPCAST=_INTERPRET, DOT_PRECISION=_dot_precision(dy.dtype),
        BLOCK_M=cfg.bm, BLOCK_N=cfg.bn, BLOCK_K=cfg.bk, GROUP_M=cfg.gm,
        BLOCK_G=_block_g(G + 1), NUM_PROGRAMS=nprog, FLATTEN=cfg.flatten, EPI_TMA=epi_tma,
        num_stages=cfg.stages, num_warps=cfg.warps,
    )


def _dbias(dy: torch.Tensor, offs: torch.Tensor, G: int) -> torch.Tensor:
    M, O = dy.shape
    splits, block_o = 8, 128
    if _INTERPRET:
        splits, block_o = 2, 32
    part = torch.empty((splits, G, O), device=dy.device, dtype=torch.float32)
    grid = (triton.cdiv(O, block_o), G, splits)
    _group_colsum_kernel[grid](dy, part, offs, M, O, G, dy.stride(0),
                               SPLITS=splits, BLOCK_R=32, BLOCK_O=block_o, UPCAST=_INTERPRET,
                               num_warps=4)
    # A fixed-shape torch sum has a fixed reduction order: deterministic.
    return part.sum(0).to(dy.dtype)


def grouped_gemm_wgrad(dy_MO, x_MI, offs_G1, *, with_dbias=False, num_groups=None, **_kw):
    """Grouped wgrad in one launch: dw (G, O, I) with dw[g] = dy[rows of g]^T @ x[rows of g].

    dy_MO: (M, O), x_MI: (M, I), same dtype; offs_G1: (G+1,) int64 device tensor.
    Groups with no rows get zeros. with_dbias=True also returns dbias (G, O) = per-group sum of dy
    rows, computed deterministically (fixed-order partial sums, no atomics); else None.
    Rows r >= offs[G] take part in nothing.
    """
    _check_device(dy_MO)
    if dy_MO.dim() != 2 or x_MI.dim() != 2 or dy_MO.shape[0] != x_MI.shape[0]:
        raise ValueError(f"dy {tuple(dy_MO.shape)} and x {tuple(x_MI.shape)} must be (M, O) and (M, I)")
    if dy_MO.dtype != x_MI.dtype or dy_MO.device != x_MI.device:
        raise ValueError(f"dy is {dy_MO.dtype} on {dy_MO.device}, x is {x_MI.dtype} on {x_MI.device}")
    dy = dy_MO if dy_MO.stride(1) == 1 else dy_MO.contiguous()
    x = x_MI if x_MI.stride(1) == 1 else x_MI.contiguous()
    G = offs_G1.shape[0] - 1 if num_groups is None else num_groups
    offs = _check_offs(offs_G1, G, dy.device)
    M, O = dy.shape
    I = x.shape[1]
    dw = _empty((G, O, I), dy.device, dy.dtype)
    cfg = _kw.get("cfg")
    use_tma = _kw.get("use_tma")
    if G > 0 and O > 0 and I > 0:
        use_tma, cap = _resolve_tma(use_tma, M > 0, dy, x)
        with _device_ctx(dy.device):
            if cfg is None:
                cands = _candidates("wgrad", dy.dtype, use_tma, cap, I)
                key = ("wgrad", dy.dtype, O, I, G, _bucket(M), use_tma)
                cfg = _pick(key, cands, lambda c: _run_wgrad(dy, x, offs, dw, c, use_tma), dy.device)
            _run_wgrad(dy, x, offs, dw, cfg, use_tma)
    dbias = None
    if with_dbias:
        if G == 0 or O == 0:
            dbias = torch.zeros((G, O), device=dy.device, dtype=dy.dtype)
        else:
            with _device_ctx(dy.device):
                dbias = _dbias(dy, offs, G)
    return dw, dbias
