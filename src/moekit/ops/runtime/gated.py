"""Host side of the gated activation on its own (`moekit.ops.kernels.gated`), planned and launched by the
recipe of `moekit.ops.runtime.launch`: the composed MLP's activation where fc1 is not fused with it.

Legend: M rows, F ffn size.

`held_gated_forward` / `held_gated_backward` take h held in FP8 (the quantized MLP's backward): its
rowwise quantization's data and scales, dequantized in the kernels' loads (`HeldH`).

`gated_quantize_into`: the quantized MLP's forward between its GEMMs, one launch: the activation's
rowwise quantization (fc2's operand) and h's held form's (what the backward keeps) from one read of h,
where the recipe's blocks allow (`gated_quantize_unavailable_reason`).

`held_columns_into`: the quantized MLP's backward: the activation of the held h quantized columnwise into
fc2's FP8 wgrad segments (mxfp8 and fp8_block) by one kernel after the slots' table, the activation never
written; where the quantized MLP uses it, `held_columns_unavailable_reason` (off on sm90: slower there).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from moekit.grouped_tensor import recipe_named
from moekit.ops.kernels.gated import (
    gated_backward_kernel,
    gated_forward_kernel,
    gated_quantize_kernel,
    held_columns_kernel,
)
from moekit.ops.runtime.configs import (
    GATED_NARROWEST_ONE_BLOCK,
    GATED_QUANTIZE_TILES,
    GATED_TILES,
    HELD_COLUMNS,
    HELD_COLUMNS_FUSED,
)
from moekit.ops.runtime.glu import jit_pair
from moekit.ops.runtime.launch import (
    INTERPRET,
    TL_DTYPES,
    Launcher,
    LaunchPlan,
    arch_of,
    device_ctx,
    plan_launch,
    tensor_key,
)
from moekit.ops.runtime.quantize import hw_e4m3, slot_records_plan
from moekit.ops.runtime.quantize_torch import segment_pitch

_FORWARD = Launcher(gated_forward_kernel)
_BACKWARD = Launcher(gated_backward_kernel)
_QUANTIZE = Launcher(gated_quantize_kernel)
_HELD_COLUMNS = Launcher(held_columns_kernel)


class HeldH(NamedTuple):
    """How h is read: plain (`PLAIN`), or as the rowwise quantization of a `recipe` (FP8 data with scales
    of `scale_cols` columns, 0 for one a row, E8M0 bytes or float32) in `dtype`, whose values within
    3/2 of the activation's clamps (gate_limit, up_limit; 0: none) are clamped to them
    (`moekit.ops.glu.from_held`)."""

    scaled: bool
    scale_cols: int
    e8m0: bool
    gate_limit: float
    up_limit: float
    dtype: torch.dtype | None

    @staticmethod
    def of(recipe: str, dtype: torch.dtype, gate_limit: float, up_limit: float) -> HeldH:
        info = recipe_named(recipe)
        return HeldH(True, info.block_cols or 0, info.scale_dtype != torch.float32, gate_limit, up_limit, dtype)

    def constexprs(self) -> dict:
        return dict(
            SCALED=self.scaled,
            SCALE_COLS=self.scale_cols,
            SCALE_E8M0=self.e8m0,
            HELD_GATE_LIMIT=self.gate_limit,
            HELD_UP_LIMIT=self.up_limit,
            ROUND_BF16=self.scaled and INTERPRET and self.dtype == torch.bfloat16,
            FP8_CVT=self.scaled and not INTERPRET,
        )


PLAIN = HeldH(False, 0, False, 0.0, 0.0, None)


def _gated_tile(device: torch.device, ffn: int, glu_block: int, held: HeldH) -> tuple[int, int, int, int]:
    """(BLOCK_ROWS, BLOCK_C, warps, ROW_SCALES) of the gated forward and backward kernels: the table's
    tile; for h held in FP8 with blocks of scales, `narrowed` to them, so that a row's scales are
    loaded once a tile."""
    block_rows, block_c, warps = GATED_TILES[arch_of(device)][held.scaled]
    if not held.scaled or held.scale_cols == 0:
        return block_rows, block_c, warps, 1
    narrowest = GATED_NARROWEST_ONE_BLOCK[arch_of(device)]
    block_rows, block_c, span = narrowed(block_rows, block_c, ffn, glu_block, held.scale_cols, narrowest)
    return block_rows, block_c, warps, span


def narrowed(
    block_rows: int, block_c: int, ffn: int, glu_block: int, scale_cols: int, narrowest: int
) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_C, span): the tile's columns halved and its rows doubled (the same elements)
    until every tile's gates lie in one of h's scale blocks of scale_cols columns and so do its ups
    (`tile_scale_span` 1), down to `narrowest` columns (`configs.GATED_NARROWEST_ONE_BLOCK`); where that
    does not get there, on until no run spans more than two blocks (a one-column tile spans one). The
    span is the kernels' ROW_SCALES."""
    span = tile_scale_span(ffn, glu_block, block_c, scale_cols)
    while (span > 1 and block_c > narrowest) or span > 2:
        block_rows, block_c = block_rows * 2, block_c // 2
        span = tile_scale_span(ffn, glu_block, block_c, scale_cols)
    return block_rows, block_c, span


def _plan_forward(
    h_M2F: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    held: HeldH,
) -> LaunchPlan:
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    block_rows, block_c, warps, scales_a_row = _gated_tile(h_M2F.device, ffn, glu_block, held)
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(ffn, block_c))
    ints = (rows, ffn, h_M2F.stride(0), h_scale.stride(0), ffn)
    constexprs = dict(
        GLU_BLOCK=glu_block,
        HAS_PROBS=probs_M is not None,
        ACT=jit_pair(activation)["ACT"],
        **held.constexprs(),
        ROW_SCALES=scales_a_row,
        BLOCK_ROWS=block_rows,
        BLOCK_C=block_c,
        num_warps=warps,
    )
    return LaunchPlan(_FORWARD, grid, ints, constexprs)


def gated_forward(h_M2F: torch.Tensor, probs_M: torch.Tensor | None, glu_block: int, activation: str) -> torch.Tensor:
    """out (M, F) in h's dtype = ACT(gate(h), up(h)) (* probs per row), fp32 math, one rounding.

    h_M2F (M, 2F) with unit column stride, gates and ups in GLU blocks of `glu_block` (F: `[gate | up]`);
    probs_M (M,) contiguous or None; activation a registered name (its jit pair)."""
    return _forward(h_M2F, h_M2F, probs_M, glu_block, activation, PLAIN, h_M2F.dtype)


def held_gated_forward(
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    held: HeldH,
) -> torch.Tensor:
    """`gated_forward` of h held in FP8: h_data (M, 2F) float8 and h_scale its rowwise scales (contiguous,
    as `moekit.grouped_tensor` shapes them), dequantized in the load as `held` says; out (M, F) in
    held.dtype. The same values as `gated_forward` of the dequantized h after `from_held`."""
    assert held.dtype is not None  # HeldH.of
    return _forward(_u8(h_data), _u8(h_scale), probs_M, glu_block, activation, held, held.dtype)


def _u8(t: torch.Tensor) -> torch.Tensor:
    """A one-byte float tensor (float8 data, E8M0 scales) as the bytes the kernels decode themselves."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _forward(
    h_M2F: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_block: int,
    activation: str,
    held: HeldH,
    dtype: torch.dtype,
) -> torch.Tensor:
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    out = h_M2F.new_empty(rows, ffn, dtype=dtype)
    if out.numel() == 0:
        return out
    key = (tensor_key(h_M2F), tensor_key(h_scale), tensor_key(probs_M), glu_block, activation, held)
    plan = plan_launch("gated_fwd", key, lambda: _plan_forward(h_M2F, h_scale, probs_M, glu_block, activation, held))
    with device_ctx(h_M2F.device):
        plan(h_M2F, h_scale, probs_M if probs_M is not None else out, out)
    return out


def _plan_backward(
    h_M2F: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_block: int,
    activation: str,
    need_d_probs: bool,
    held: HeldH,
) -> LaunchPlan:
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    block_rows, block_c, warps, scales_a_row = _gated_tile(h_M2F.device, ffn, glu_block, held)
    ints = (rows, ffn, h_M2F.stride(0), h_scale.stride(0), d_out_MF.stride(0), 2 * ffn)
    constexprs = dict(
        GLU_BLOCK=glu_block,
        HAS_PROBS=probs_M is not None,
        NEED_DPROBS=need_d_probs,
        **jit_pair(activation),
        **held.constexprs(),
        ROW_SCALES=scales_a_row,
        BLOCK_ROWS=block_rows,
        BLOCK_C=block_c,
        num_warps=warps,
    )
    return LaunchPlan(_BACKWARD, (triton.cdiv(rows, block_rows),), ints, constexprs)


def gated_backward(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_block: int,
    activation: str,
    need_d_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dh (M, 2F) in h's dtype and order, d probs (M,) fp32 or None) of `gated_forward`: dh =
    ACT_GRAD(gate, up, d_out (* probs)); d probs[r] = sum over c of ACT(gate, up)[r, c] * d_out[r, c]
    (where probs and need_d_probs), one program's fixed-order fp32 sum per row. d_out_MF (M, F) with unit
    column stride; the rest as `gated_forward`."""
    return _backward(h_M2F, h_M2F, probs_M, d_out_MF, glu_block, activation, need_d_probs, PLAIN, h_M2F.dtype)


def held_gated_backward(
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_block: int,
    activation: str,
    need_d_probs: bool,
    held: HeldH,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`gated_backward` of h held in FP8 (`held_gated_forward`'s arguments); dh in held.dtype."""
    assert held.dtype is not None  # HeldH.of
    return _backward(
        _u8(h_data), _u8(h_scale), probs_M, d_out_MF, glu_block, activation, need_d_probs, held, held.dtype
    )


def _backward(
    h_M2F: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_block: int,
    activation: str,
    need_d_probs: bool,
    held: HeldH,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    dh = h_M2F.new_empty(rows, 2 * ffn, dtype=dtype)
    need_d_probs = need_d_probs and probs_M is not None
    d_probs = torch.zeros(rows, device=h_M2F.device, dtype=torch.float32) if need_d_probs else None
    if rows == 0 or ffn == 0:
        return dh, d_probs
    key = (
        tensor_key(h_M2F),
        tensor_key(h_scale),
        tensor_key(probs_M),
        tensor_key(d_out_MF),
        glu_block,
        activation,
        need_d_probs,
        held,
    )
    plan = plan_launch(
        "gated_bwd",
        key,
        lambda: _plan_backward(h_M2F, h_scale, probs_M, d_out_MF, glu_block, activation, need_d_probs, held),
    )
    with device_ctx(h_M2F.device):
        plan(
            h_M2F,
            h_scale,
            probs_M if probs_M is not None else dh,
            d_out_MF,
            dh,
            d_probs if d_probs is not None else dh,
        )
    return dh, d_probs


def gated_quantize_unavailable_reason(recipe: str, ffn: int, glu_block: int) -> str | None:
    """Why `gated_quantize_into` cannot write this recipe's rowwise forms of the activation and of h
    (F = ffn columns, gates and ups in GLU blocks of glu_block); None if it can. Its programs hold whole
    scale blocks of h: the gates of a tile of columns are one run of whole blocks, and so are the ups
    (glu_block a multiple of the block), or a block holds whole gate/up pairs (the block a multiple of
    2 * glu_block)."""
    tile_k = recipe_named(recipe).block_cols
    if tile_k is None:
        return f"{recipe}'s scales span whole rows: a program of column tiles cannot make them"
    if glu_block % tile_k and tile_k % (2 * glu_block):
        return (
            f"h's {tile_k}-column scale blocks of {recipe} cut across its GLU blocks of {glu_block} "
            f"(F = {ffn}): neither a multiple of the other's pair"
        )
    return None


def _quantize_plan(h_M2F: torch.Tensor, probs_M: torch.Tensor | None, glu_block: int, activation: str, recipe: str,
                   gate_limit: float, up_limit: float, a_scale: torch.Tensor,
                   h_scale: torch.Tensor, num_groups: int) -> LaunchPlan:  # fmt: skip
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    info = recipe_named(recipe)
    tile_k = info.block_cols
    assert tile_k is not None  # gated_quantize_unavailable_reason
    # Whole scale blocks of the activation's columns a tile (so of its pairs' h columns, interleaved),
    # and with runs a tile inside one GLU block (all of F in the [gate | up] order).
    runs = glu_block % tile_k == 0
    block_rows, widest, warps, band = GATED_QUANTIZE_TILES[arch_of(h_M2F.device)][runs]
    block_c = max(widest, tile_k)
    while runs and glu_block != ffn and glu_block % block_c:
        block_c //= 2
    row_tiles, column_tiles = triton.cdiv(rows, block_rows), triton.cdiv(ffn, block_c)
    grid = (row_tiles, column_tiles) if band == 0 else (row_tiles * column_tiles,)
    ints = (rows, ffn, num_groups, h_M2F.stride(0), a_scale.stride(0), h_scale.stride(0))
    constexprs = dict(
        GLU_BLOCK=glu_block,
        HAS_PROBS=probs_M is not None,
        ACT=jit_pair(activation)["ACT"],
        MX=info.scale_dtype != torch.float32,
        TILE_K=tile_k,
        HELD_GATE_LIMIT=gate_limit,
        HELD_UP_LIMIT=up_limit,
        RUNS=runs,
        HW_E4M3=hw_e4m3(h_M2F.device),
        BLOCK_ROWS=block_rows,
        BLOCK_C=block_c,
        BAND=band,
        num_warps=warps,
    )
    return LaunchPlan(_QUANTIZE, grid, ints, constexprs)


def gated_quantize_into(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    offs: torch.Tensor,
    glu_block: int,
    activation: str,
    recipe: str,
    gate_limit: float,
    up_limit: float,
    a_data: torch.Tensor,
    a_scale: torch.Tensor,
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
) -> None:
    """Write `group_quantize`'s rowwise form of a = ACT(gate(h), up(h)) (* probs) (F columns, in h's
    dtype as `gated_forward` gives it) into a_data / a_scale, and of h's held form (`moekit.ops.glu.to_held`
    with the clamps gate_limit / up_limit, 0 for none) into h_data / h_scale, in one launch; offs (N + 1,)
    the groups' device offsets (rows past offs[N] are padding: zeros). h_M2F (M, 2F) with unit column
    stride; the storage contiguous, shaped as `group_quantize` allocates it; the layout one that
    `gated_quantize_unavailable_reason` accepts."""
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    if rows == 0 or ffn == 0:
        return
    num_groups = offs.shape[0] - 1
    # Every tensor launched is in the key (a plan's binary is specialized on each one's dtype and alignment).
    key: tuple = (
        tensor_key(h_M2F),
        tensor_key(probs_M),
        glu_block,
        activation,
        recipe,
        gate_limit,
        up_limit,
        num_groups,
    )
    key += tuple(map(tensor_key, (offs, a_data, a_scale, h_data, h_scale)))
    plan = plan_launch(
        "gated_quantize",
        key,
        lambda: _quantize_plan(
            h_M2F, probs_M, glu_block, activation, recipe, gate_limit, up_limit, a_scale, h_scale, num_groups
        ),
    )
    with device_ctx(h_M2F.device):
        probs = probs_M if probs_M is not None else h_M2F
        plan(h_M2F, probs, offs, _u8(a_data), _u8(a_scale), _u8(h_data), _u8(h_scale))


def tile_scale_span(ffn: int, glu_block: int, block_c: int, scale_cols: int) -> int:
    """The most of h's rowwise scale blocks (scale_cols columns each) that the gates of one tile of
    block_c activation columns (from a multiple of block_c, cut at F = ffn) lie in, or its ups (gates
    and ups in GLU blocks of glu_block: `moekit.ops.glu`); 0 for one scale a row (scale_cols <= 0).
    1: a program loads a row's gate and up scales once a tile; 2: the two blocks' scales of each, and
    picks by column (the kernels' ROW_SCALES). Checked column by column, once a plan."""
    if scale_cols <= 0:
        return 0
    span = 1
    for c0 in range(0, ffn, block_c):
        cols = range(c0, min(ffn, c0 + block_c))
        gates = {((c // glu_block) * 2 * glu_block + c % glu_block) // scale_cols for c in cols}
        ups = {((c // glu_block) * 2 * glu_block + c % glu_block + glu_block) // scale_cols for c in cols}
        span = max(span, len(gates), len(ups))
    return span


class _HeldColumnsPlan(NamedTuple):
    """The two launches of `held_columns_into`: the slots' table (`slot_records_kernel`), then the kernel."""

    records: LaunchPlan
    columns: LaunchPlan
    num_slots: int


def _held_columns_plan(h_data: torch.Tensor, h_scale: torch.Tensor, probs_M: torch.Tensor | None, glu_block: int,
                       activation: str, held: HeldH, recipe: str, num_groups: int) -> _HeldColumnsPlan:  # fmt: skip
    rows, ffn = h_data.shape[0], h_data.shape[1] // 2
    info = recipe_named(recipe)
    assert info.block_rows is not None and held.dtype is not None  # held_columns_unavailable_reason, HeldH.of
    block_c, warps = HELD_COLUMNS[arch_of(h_data.device)]
    narrowest = GATED_NARROWEST_ONE_BLOCK[arch_of(h_data.device)]
    _, block_c, span = narrowed(info.block_rows, block_c, ffn, glu_block, held.scale_cols, narrowest)  # rows: a slot
    # As the slots kernel's grid: ceil(M / block) + N slots, enough for any split of M rows into N groups.
    num_slots = triton.cdiv(rows, info.block_rows) + num_groups
    grid = (num_slots, triton.cdiv(ffn, block_c))
    ints = (ffn, h_data.stride(0), h_scale.stride(0), segment_pitch(rows, num_groups))
    constexprs = dict(
        GLU_BLOCK=glu_block,
        HAS_PROBS=probs_M is not None,
        ACT=jit_pair(activation)["ACT"],
        OUT_DTYPE=TL_DTYPES[held.dtype],
        **held.constexprs(),
        ROW_SCALES=span,
        MX=info.scale_dtype != torch.float32,
        SLOT_ROWS=info.block_rows,
        BLOCK_C=block_c,
        HW_E4M3=hw_e4m3(h_data.device),
        num_warps=warps,
    )
    records = slot_records_plan(h_data.device, rows, num_groups, num_slots, info.block_rows, True)
    return _HeldColumnsPlan(records, LaunchPlan(_HELD_COLUMNS, grid, ints, constexprs), num_slots)


def held_columns_unavailable_reason(recipe: str, device: torch.device) -> str | None:
    """Why the quantized MLP does not make fc2's wgrad operand by `held_columns_into` for this recipe on
    this device; None where it does. Its programs hold one columnwise scale block of rows (mxfp8's 32,
    fp8_block's 128), where fp8_rowwise's scale spans a whole group; and `configs.HELD_COLUMNS_FUSED`
    chooses it over the two launches it replaces, per architecture (`held_columns_into` itself runs
    wherever the kernel can: tests and benchmarks call it directly)."""
    if recipe_named(recipe).block_rows is None:
        return f"{recipe}'s columnwise scales span whole groups: a program of one block of rows cannot make them"
    arch = arch_of(device)
    if not HELD_COLUMNS_FUSED.get(arch, False):
        return f"configs.HELD_COLUMNS_FUSED keeps the activation and its quantization apart on {arch} (faster there)"
    return None


def held_columns_into(
    h_data: torch.Tensor,
    h_scale: torch.Tensor,
    probs_M: torch.Tensor | None,
    offs: torch.Tensor,
    slot_offs: torch.Tensor,
    glu_block: int,
    activation: str,
    held: HeldH,
    recipe: str,
    col_data: torch.Tensor,
    col_scale: torch.Tensor,
) -> None:
    """Write the columnwise quantization of a = `held_gated_forward(h_data, h_scale, probs_M, glu_block,
    activation, held)` (M, F) in `recipe` (mxfp8 or fp8_block: a recipe with blocks of rows) into the
    FP8 wgrad's segments: col_data (F, segment_pitch(M, N)) and col_scale as `group_quantize_for_wgrad`
    allocates them, the same bytes as its segments form of a, a never written: two launches, the slots'
    table (`slot_records_kernel`) and the kernel. offs (N + 1,)
    the groups' device offsets, slot_offs (N + 1,) each group's first scale slot (`group_quantize`'s),
    neither read by the host."""
    if h_data.shape[1] == 0:
        return
    num_groups = offs.shape[0] - 1
    key: tuple = (tensor_key(h_data), tensor_key(h_scale), tensor_key(probs_M), glu_block, activation, held)
    key += (recipe, num_groups, *map(tensor_key, (offs, slot_offs, col_data, col_scale)))
    plan = plan_launch(
        "held_columns",
        key,
        lambda: _held_columns_plan(h_data, h_scale, probs_M, glu_block, activation, held, recipe, num_groups),
    )
    with device_ctx(h_data.device):
        table = torch.empty((plan.num_slots, 4), dtype=torch.int32, device=h_data.device)
        plan.records(offs, slot_offs, table)
        probs = probs_M if probs_M is not None else offs
        plan.columns(_u8(h_data), _u8(h_scale), probs, table, _u8(col_data), _u8(col_scale))
