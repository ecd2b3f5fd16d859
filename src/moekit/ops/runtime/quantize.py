"""Host side of the grouped FP8 quantization kernels (`moekit.ops.kernels.quantize`): the Triton
backend's `group_quantize_into`, planned and launched by the one recipe of `moekit.ops.runtime.launch`.

Legend: M rows (N groups of them, then padding rows), X columns; an (N, O, I) weight's members are
(O, I); a slot is one block of rows of one group.

One launch covers every group: for mxfp8 and fp8_block one launch whatever the forms asked (a tile
gives its rows' rowwise and its columns' columnwise scales; the columnwise form on Hopper by the Gluon
kernel `moekit.ops.kernels.quantize_hopper.quantize_slots_tma_kernel` where `QUANTIZE_SLOTS_TMA` has an
entry for the recipe's block and the form and x is TMA-aligned bf16/fp16, the same bytes); for
fp8_rowwise one (rowwise alone: whole rows) or, with the columnwise form, two over the same tiles (the
maxima of whole rows and whole groups into a zeroed int32 buffer, then both forms' bytes) plus that
buffer's memset. The outputs' arguments
and their layouts are `moekit.ops.runtime.quantize_torch.group_quantize_into`'s, whose bytes these
kernels reproduce; with `col_segments` the columnwise data goes straight into the FP8 wgrad's operand
layout (the kernels' SEGMENTS stores), so that the wgrad skips its own transpose of it.

`group_dequantize`: one launch of one elementwise pass for either form of every recipe, the torch
path's bytes (`moekit.ops.runtime.quantize_torch.group_dequantize`) without its float32 temporaries.

`transpose_weight_into`: the FP8 dgrad's transposed weight (`moekit.ops.quantize.TransposedWeight`),
one launch, tiles read along I and written along O, the scales moved in the same programs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from moekit.grouped_tensor import Recipe, recipe_named
from moekit.ops.kernels.quantize import (
    amax_spans_kernel,
    dequantize_kernel,
    quantize_rows_kernel,
    quantize_slots_kernel,
    quantize_spans_kernel,
    quantize_tiles_kernel,
    slot_records_kernel,
    transpose_weight_kernel,
)
from moekit.ops.kernels.quantize_hopper import quantize_slots_tma_kernel
from moekit.ops.runtime.configs import (
    DEQUANTIZE_TILES,
    QUANTIZE_AMAX_SPANS,
    QUANTIZE_CHUNKS,
    QUANTIZE_ONE_PASS_ROWS,
    QUANTIZE_SLOTS,
    QUANTIZE_SLOTS_TMA,
    QUANTIZE_SPANS,
    QUANTIZE_TILES,
    SLOT_RECORDS,
    TRANSPOSE_TILES,
    Arch,
)
from moekit.ops.runtime.device import capability
from moekit.ops.runtime.launch import (
    INTERPRET,
    Launcher,
    LaunchPlan,
    arch_of,
    block_groups,
    check_triton_device,
    device_ctx,
    device_index,
    empty,
    grid_size,
    plan_launch,
    tensor_key,
    tma_ok,
    unavailable_reason,
)
from moekit.ops.runtime.quantize_torch import (
    SEGMENT_COLUMNS,
    check_transposed_outputs,
    segment_pitch,
    transposed_source,
)

_TILES = Launcher(quantize_tiles_kernel)
_SLOTS = Launcher(quantize_slots_kernel)
_SLOTS_TMA = Launcher(quantize_slots_tma_kernel)
_SLOT_RECORDS = Launcher(slot_records_kernel)
_ROWS = Launcher(quantize_rows_kernel)
_AMAX = Launcher(amax_spans_kernel)
_SPANS = Launcher(quantize_spans_kernel)
_DEQUANTIZE = Launcher(dequantize_kernel)
_TRANSPOSE = Launcher(transpose_weight_kernel)


class QuantizePlan(NamedTuple):
    """The launches of one problem: mxfp8 and fp8_block's tiles (rowwise alone, a weight's blocks) or
    slots (the columnwise form, the Triton kernel or on Hopper the Gluon one, after `records` fills
    their table of the slots' rows); fp8_rowwise's whole rows (rowwise only), or its two passes over
    spans of a group's rows (the maxima, then the data) when the columnwise form is asked; None where
    there is nothing to launch."""

    tiles: LaunchPlan | None
    slots: LaunchPlan | None
    rows: LaunchPlan | None
    amax: LaunchPlan | None
    spans: LaunchPlan | None
    records: LaunchPlan | None = None
    record_slots: int = 0


class _Problem(NamedTuple):
    """One `group_quantize_into` problem as its plans see it: x as given ((M, X) rows or an (N, O, I)
    weight), x2 its 2-D view, rows M (x2's, or the index's when the rows are gathered from x2), N
    groups, the forms asked (rowwise, columnwise, a noop flag, the wgrad's segments, rows gathered by
    an index), the segments' row pitch (0 without them), and whether a weight's transposed copy is
    written by the same launch (fp8_block's 128 x 128 tiles)."""

    x: torch.Tensor
    x2: torch.Tensor
    rows: int
    num_groups: int
    forms: tuple[bool, bool, bool, bool, bool]
    pitch: int
    transposed: bool = False


def _num_slots(info: Recipe, x: torch.Tensor, rows: int, tile_rows: int, num_groups: int) -> int:
    """Programs along the rows of the tiles kernel: every member's blocks of a weight, or ceil(M /
    tile_rows) + N, enough for any split of the M = rows rows into N groups and the padding."""
    if x.dim() == 3:
        return x.shape[0] * triton.cdiv(x.shape[1], tile_rows)
    return triton.cdiv(rows, tile_rows) + num_groups


def hw_e4m3(device: torch.device) -> bool:
    """Whether the kernels encode E4M3 by the hardware's conversion (CUDA sm_89+, whose cvt.rn.satfinite
    rounds and saturates by the same rule; the NaN sign is set apart) rather than by integer arithmetic
    (the interpreter, whose fp8 cast follows other rules, and older GPUs without the instruction)."""
    return not INTERPRET and device.type == "cuda" and capability(device_index(device)) >= (8, 9)


def _plan(info: Recipe, problem: _Problem) -> QuantizePlan:
    """The launches of one problem in `info`'s recipe."""
    x, x2, rows, num_groups, forms, pitch, transposed = problem
    rowwise, columnwise, has_noop, segments, gather = forms
    cols = x2.shape[1]
    arch = arch_of(x2.device)
    ints = (rows, cols, num_groups, x2.stride(0))
    hw = hw_e4m3(x2.device)
    if info.block_cols is not None and info.block_rows is not None:  # mxfp8, fp8_block: a tile = a block of each form
        tile_m, tile_k = info.block_rows, info.block_cols
        # Rowwise scales: (rows, column blocks), or (weight row blocks, column blocks) for a weight's tiles.
        stride_scale = triton.cdiv(cols, tile_k)
        if columnwise:
            layout = ("segments-gathered" if gather else "segments") if segments else "rows"
            tma_slots = _slots_tma_plan(info, problem, stride_scale)
            if tma_slots is not None:
                return tma_slots
            block_c, chunk, warps, stages, band, maxnreg = QUANTIZE_SLOTS[arch][(tile_k, layout)]
            if block_c % tile_k or tile_m % chunk or (segments and (chunk % 16 or SEGMENT_COLUMNS % tile_m)):
                raise RuntimeError(
                    f"QUANTIZE_SLOTS[{arch!r}][{(tile_k, layout)}] = {(block_c, chunk)} does not fit {info.name}'s "
                    f"{tile_m} x {tile_k} blocks"
                )
            slot_grid = (_num_slots(info, x, rows, tile_m, num_groups), triton.cdiv(cols, block_c))
            slots = LaunchPlan(
                _SLOTS,
                slot_grid if band == 0 else (slot_grid[0] * slot_grid[1],),
                (cols, x2.stride(0), stride_scale, pitch),
                dict(
                    MX=info.scale_dtype != torch.float32,
                    ROWWISE=rowwise,
                    SEGMENTS=segments,
                    GATHER=gather,
                    TILE_K=tile_k,
                    SLOT_ROWS=tile_m,
                    BLOCK_C=block_c,
                    CHUNK=chunk,
                    STAGES=stages,
                    BAND=band,
                    HAS_NOOP=has_noop,
                    HW_E4M3=hw,
                    num_warps=warps,
                    **({"maxnreg": maxnreg} if maxnreg else {}),
                ),
            )
            if not (slot_grid[0] and slot_grid[1]):
                return QuantizePlan(None, None, None, None, None)
            records = slot_records_plan(x2.device, rows, num_groups, slot_grid[0], tile_m, segments)
            return QuantizePlan(None, slots, None, None, None, records, slot_grid[0])
        tile = info.weight_tile is not None and x.dim() == 3
        form = "tile" if tile else "rows"
        block_r, block_c, warps, steps, stages, maxnreg = QUANTIZE_TILES[arch][(tile_k, form)]
        if block_c % tile_k or (form == "tile" and (block_r != tile_m or block_c != tile_k)):
            raise RuntimeError(
                f"QUANTIZE_TILES[{arch!r}][{(tile_k, form)}] = {(block_r, block_c)} does not fit {info.name}'s "
                f"{tile_m} x {tile_k} blocks"
            )
        row_programs = triton.cdiv(rows, block_r) if form == "rows" else _num_slots(info, x, rows, tile_m, num_groups)
        programs = row_programs * triton.cdiv(triton.cdiv(cols, block_c), steps)
        launch = LaunchPlan(
            _TILES,
            (programs,),
            (*ints, stride_scale, x.shape[1] if tile else 0),
            dict(
                MX=info.scale_dtype != torch.float32,
                TILE=tile,
                TRANSPOSED=tile and transposed,
                TILE_K=tile_k,
                BLOCK_R=block_r,
                BLOCK_C=block_c,
                STEPS=steps,
                STAGES=stages,
                HAS_NOOP=has_noop,
                BLOCK_GROUPS=block_groups(num_groups),
                HW_E4M3=hw,
                num_warps=warps,
                **({"maxnreg": maxnreg} if maxnreg else {}),
            ),
        )
        return QuantizePlan(launch if programs else None, None, None, None, None)
    row_plan = amax_plan = spans_plan = None
    if columnwise:  # two passes over x: the maxima of whole rows and whole groups, then both forms
        span, block_cols, warps = QUANTIZE_AMAX_SPANS[arch]
        grid = (_num_spans(rows, num_groups, span), triton.cdiv(cols, block_cols))
        consts = dict(ROWWISE=rowwise, GATHER=gather, HAS_NOOP=has_noop, BLOCK_GROUPS=block_groups(num_groups + 1))
        if grid[1]:
            amax_plan = LaunchPlan(_AMAX, grid, ints, dict(consts, SPAN=span, BLOCK_COLS=block_cols, num_warps=warps))
            span, block_cols, warps, steps, stages = QUANTIZE_SPANS[arch]
            if segments and (span % 16 or SEGMENT_COLUMNS % span):
                raise RuntimeError(
                    f"QUANTIZE_SPANS[{arch!r}]'s span {span} must divide the wgrad's {SEGMENT_COLUMNS}-column segments "
                    "in multiples of 16"
                )
            grid = (_num_spans(rows, num_groups, span), triton.cdiv(triton.cdiv(cols, block_cols), steps))
            spans = dict(consts, SPAN=span, BLOCK_COLS=block_cols, STEPS=steps, STAGES=stages, HW_E4M3=hw)
            spans.update(SEGMENTS=segments, num_warps=warps)
            spans_plan = LaunchPlan(_SPANS, grid, (*ints, pitch), spans)
    elif rowwise and rows:
        most_cols, elements, warps = QUANTIZE_ONE_PASS_ROWS[arch]
        one_pass = cols <= most_cols
        if one_pass:  # whole rows in registers: one read of x
            block_cols = triton.next_power_of_2(cols)
            block_rows = max(1, elements // block_cols)
        else:
            block_rows, block_cols, warps = QUANTIZE_CHUNKS[arch]
        chunks = dict(
            HAS_NOOP=has_noop,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
            ONE_PASS=one_pass,
            HW_E4M3=hw,
            num_warps=warps,
        )
        row_plan = LaunchPlan(_ROWS, (triton.cdiv(rows, block_rows),), ints, chunks)
    return QuantizePlan(None, None, row_plan, amax_plan, spans_plan)


def hopper_slots_entry(
    info: Recipe, x: torch.Tensor, arch: Arch, rowwise: bool, segments: bool, gather: bool = False
) -> tuple[int, int, int, int, bool, int] | None:
    """The `QUANTIZE_SLOTS_TMA` entry the Gluon kernel runs the columnwise form of x (with the rowwise
    form if `rowwise`; into the wgrad's segments if `segments`; rows gathered from x by an index if
    `gather`: the form's name + "-gathered") with on `arch`, or None where it does not take the problem
    and the Triton slots kernel runs: a recipe other than fp8_block (128 x 128 blocks, fp32 scales) and
    mxfp8 (32-element blocks, E8M0 scales; the (M, X) form of rows read in place only), an architecture
    or form without an entry, a weight (3-D x), x not bf16/fp16, not TMA-aligned (16-byte base and row
    stride) or empty, rows past TMA's int32 coordinates; gathered rows whose column count is not a
    multiple of 16 (the GATHER form's cp.async copies 16 bytes under a column mask, and the compiler
    splits them into 2-byte copies, which cp.async cannot do, unless it knows the count's divisibility
    by 16)."""
    form = ("segments" if rowwise else "segments-columnwise") if segments else "rows"
    entry = QUANTIZE_SLOTS_TMA.get(arch, {}).get((info.block_cols or 0, form + ("-gathered" if gather else "")))
    block = info.block_rows == 128 and info.block_cols == 128 and info.scale_dtype == torch.float32
    mx = info.block_rows == 32 and info.block_cols == 32 and info.scale_dtype != torch.float32
    takes = block or (mx and not segments and not gather)
    if entry is None or not takes or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    if not tma_ok(x) or x.stride(1) != 1 or x.shape[0] >= 2**31 - 2**20 or (gather and x.shape[1] % 16):
        return None
    return entry


def _slots_tma_plan(info: Recipe, problem: _Problem, stride_scale: int) -> QuantizePlan | None:
    """The plan of the Gluon kernel's launch of the columnwise form (`quantize_slots_tma_kernel`:
    fp8_block's, mxfp8's (M, X) form; the Triton slots kernel's bytes) and of the launch before it that
    fills its table of the slots' rows (`slot_records_kernel`), or None where it does not apply
    (`hopper_slots_entry`) or there is nothing to do. Rows gathered by an index: its GATHER form
    (cp.async copies instead of TMA boxes) where the table has a "-gathered" entry. A persistent launch:
    `programs an SM` x the SMs, at most one a work item."""
    x, x2, rows, num_groups, forms, pitch, _ = problem
    rowwise, _, has_noop, segments, gather = forms
    entry = hopper_slots_entry(info, x, arch_of(x2.device), rowwise, segments, gather)
    if entry is None or rows >= 2**31 - 2**20:
        return None
    chunk, warps, stages, per_sm, slots_fastest, maxnreg = entry
    assert info.block_rows is not None  # a recipe hopper_slots_entry takes
    slot_rows = info.block_rows
    num_slots = _num_slots(info, x, rows, slot_rows, num_groups)
    work = num_slots * triton.cdiv(x2.shape[1], 128)
    if not work:
        return None
    slots = LaunchPlan(
        _SLOTS_TMA,
        (grid_size(x2.device, work, per_sm),),
        (rows, x2.shape[1], x2.stride(0), stride_scale, pitch, num_slots),
        dict(
            ROWWISE=rowwise,
            SEGMENTS=segments,
            GATHER=gather,
            CHUNK=chunk,
            STAGES=stages,
            SLOTS_FASTEST=slots_fastest,
            HAS_NOOP=has_noop,
            HW_E4M3=hw_e4m3(x2.device),
            MX=slot_rows == 32,
            num_warps=warps,
            **({"maxnreg": maxnreg} if maxnreg else {}),
        ),
    )
    records = slot_records_plan(x2.device, rows, num_groups, num_slots, slot_rows, segments)
    return QuantizePlan(None, slots, None, None, None, records, num_slots)


def slot_records_plan(
    device: torch.device, rows: int, num_groups: int, num_slots: int, slot_rows: int, segments: bool
) -> LaunchPlan:
    """The launch of `slot_records_kernel` that fills the (num_slots, 4) int32 table of the slots' rows
    (blocks of slot_rows rows of one group, from the offsets and the slot offsets on the device; with
    `segments` each slot's first column in the FP8 wgrad's segments): what the kernels that walk slots
    read instead of deriving a slot's rows from the offsets in every program."""
    block_s, records_warps = SLOT_RECORDS[arch_of(device)]
    return LaunchPlan(
        _SLOT_RECORDS,
        (triton.cdiv(num_slots, block_s),),
        (rows, num_groups, num_slots),
        dict(
            SLOT_ROWS=slot_rows,
            SEGMENTS=segments,
            BLOCK_S=block_s,
            BLOCK_GROUPS=block_groups(num_groups),
            num_warps=records_warps,
        ),
    )


def _num_spans(rows: int, num_groups: int, span: int) -> int:
    """Programs along the rows of the span kernels: ceil(M / span) + N + 1, enough for any split of the
    M rows into N groups and the padding rows (`moekit.ops.kernels.quantize._span_of`)."""
    return triton.cdiv(rows, span) + num_groups + 1


def _u8(t: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as the bytes the kernels store (uint8); an absent one as a pointer never used."""
    if t is None:
        return fallback
    return t.view(torch.uint8) if t.element_size() == 1 else t


def group_quantize_into(
    recipe: str,
    x: torch.Tensor,
    offs: torch.Tensor,
    slot_offs: torch.Tensor,
    noop: torch.Tensor | None,
    row_data: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    col_data: torch.Tensor | None,
    col_scale: torch.Tensor | None,
    col_segments: bool = False,
    index: torch.Tensor | None = None,
    data_t: torch.Tensor | None = None,
    scale_t: torch.Tensor | None = None,
) -> None:
    """`moekit.ops.runtime.quantize_torch.group_quantize_into` by moekit's kernels: the same arguments
    (x (M, X) or an (N, O, I) weight with unit last stride and contiguous rows; outputs contiguous, in
    the shapes `moekit.grouped_tensor` gives them; col_segments: col_data (X, segment_pitch(M, N)),
    written on the columns in use only; index: (M,) contiguous integer rows of x, the columnwise form
    asked; data_t, scale_t: the weight's transposed copy), the same bytes. With index the Triton kernels
    read each row where it lies in x (the Gluon kernel's TMA boxes cannot gather rows). fp8_block's
    transposed copy is written by the tiles kernel from the bytes it holds (no second read of the FP8
    weight); fp8_rowwise's by `transpose_weight_into` after the quantization. No host read of offs,
    slot_offs, noop or index."""
    info = recipe_named(recipe)
    check_triton_device(x)
    x2 = x.reshape(-1, x.shape[-1])
    num_groups = offs.shape[0] - 1
    gather = index is not None
    if index is not None and (x.dim() != 2 or col_data is None or index.dim() != 1 or not index.is_contiguous()):
        raise ValueError("index gathers (M, X) rows for the columnwise form: a contiguous (M,) index, 2-D x")
    rows = index.shape[0] if index is not None else x2.shape[0]  # M, the problem's rows
    segments = col_data is not None and col_segments
    pitch = 0
    if segments:
        assert col_data is not None  # segments
        pitch = segment_pitch(rows, num_groups)
        if x.dim() != 2 or tuple(col_data.shape) != (x2.shape[1], pitch):
            raise ValueError(
                f"col_segments takes (M, X) rows and col_data (X, {pitch}) (the wgrad's layout), got x "
                f"{tuple(x.shape)} and col_data {tuple(col_data.shape)}"
            )
    transposed = check_transposed_outputs(x, data_t, scale_t)
    # fp8_block's copy comes from the tiles the kernel quantizes (its rowwise form); another recipe's
    # from its stored form afterwards.
    fused = transposed and info.weight_tile is not None and row_data is not None
    forms = (row_data is not None, col_data is not None, noop is not None, segments, gather)
    key: tuple = (info.name, tensor_key(x), tensor_key(offs), tensor_key(slot_offs), forms, rows, fused)
    key += tuple(tensor_key(t) for t in (row_data, row_scale, col_data, col_scale, noop, index, data_t, scale_t))
    problem = _Problem(x, x2, rows, num_groups, forms, pitch, fused)
    plan = plan_launch("group_quantize", key, lambda: _plan(info, problem))
    noop_arg = noop if noop is not None else offs
    index_arg = index if index is not None else offs  # a pointer never read without GATHER
    with device_ctx(x.device):
        if plan.tiles is not None:
            t_args = (_u8(data_t, x2), _u8(scale_t, x2)) if fused else (x2, x2)  # never read without TRANSPOSED
            plan.tiles(x2, offs, slot_offs, noop_arg, _u8(row_data, x2), _u8(row_scale, x2), *t_args)
        if plan.slots is not None:
            # Both slots kernels read their slots' rows from a table the launch before fills.
            assert plan.records is not None  # every slots plan has its table
            table = torch.empty((plan.record_slots, 4), dtype=torch.int32, device=x.device)
            plan.records(offs, slot_offs, table)
            plan.slots(
                x2,
                index_arg,
                table,
                noop_arg,
                _u8(row_data, x2),
                _u8(row_scale, x2),
                _u8(col_data, x2),
                _u8(col_scale, x2),
            )
        if plan.rows is not None:
            plan.rows(x2, offs, noop_arg, _u8(row_data, x2), _u8(row_scale, x2))
        if plan.amax is not None and plan.spans is not None:
            # The maxima as int32 fp32 bits, folded by atomic max from zero: the rows' (if asked), then
            # the groups' columns.
            row_rows = rows if row_data is not None else 0
            amax = torch.zeros(row_rows + num_groups * x2.shape[1], dtype=torch.int32, device=x.device)
            row_amax, col_amax = amax[:row_rows] if row_rows else amax, amax[row_rows:]
            plan.amax(x2, index_arg, offs, noop_arg, row_amax, col_amax)
            outputs = (_u8(row_data, x2), _u8(row_scale, x2), _u8(col_data, x2), _u8(col_scale, x2))
            plan.spans(x2, index_arg, offs, noop_arg, row_amax, col_amax, *outputs)
    if transposed and not fused:
        assert scale_t is not None and data_t is not None  # transposed
        transpose_weight_into(
            recipe, *transposed_source(recipe, row_data, row_scale, col_data, col_scale), data_t, scale_t
        )


def _dequantize_plan(
    info: Recipe, data: torch.Tensor, scale: torch.Tensor, num_groups: int, columnwise: bool, dtype: torch.dtype
) -> LaunchPlan | None:
    """The one launch of `group_dequantize`: which scale row and column each element reads (the kernel's
    SCALE_ROWS, BLOCK_R, BLOCK_C) follows the form, the recipe and whether data is a weight."""
    weight = data.dim() == 3
    rows, cols = data.numel() // max(data.shape[-1], 1), data.shape[-1]
    member_rows = data.shape[1] if weight else 1
    scale_cols = scale.shape[-1]
    block_rows = 0
    if columnwise:
        block_cols = 1  # a scale per column
        block_rows = info.block_rows or 0
        scale_rows = 1 if weight else 2
        member_slots = scale.shape[1] if weight else 1
    elif weight and info.weight_tile is not None:
        scale_rows, block_rows, block_cols = 1, info.weight_tile, info.weight_tile
        member_slots = scale.shape[1]
    else:
        scale_rows, block_cols, member_slots = 0, info.block_cols or 0, 1
    block_m, block_x, warps = DEQUANTIZE_TILES[arch_of(data.device)]
    grid = (triton.cdiv(rows, block_m), triton.cdiv(cols, block_x))
    if not (grid[0] and grid[1]):
        return None
    max_slot = max(scale.numel() // max(scale_cols, 1) - 1, 0)
    return LaunchPlan(
        _DEQUANTIZE,
        grid,
        (rows, cols, num_groups, member_rows, member_slots, scale_cols, max_slot),
        dict(
            MX=info.scale_dtype != torch.float32,
            SCALE_ROWS=scale_rows,
            BLOCK_R=block_rows,
            BLOCK_C=block_cols,
            BLOCK_M=block_m,
            BLOCK_X=block_x,
            BLOCK_GROUPS=block_groups(num_groups),
            # The interpreter converts fp32 to bfloat16 by truncation; the GPU rounds to nearest even.
            BF16_RNE=INTERPRET and dtype == torch.bfloat16,
            num_warps=warps,
        ),
    )


def group_dequantize(
    recipe: str,
    data: torch.Tensor,
    scale: torch.Tensor,
    offs: torch.Tensor,
    slot_offs: torch.Tensor | None,
    columnwise: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`moekit.ops.runtime.quantize_torch.group_dequantize` by moekit's kernel: the same arguments (data
    and scale contiguous, in the shapes `moekit.grouped_tensor` gives them), the same bytes, one pass and
    no temporaries. dtype float32, bfloat16 or float16 (float64: the torch path, whose product is float64;
    `moekit.ops.runtime.launch.unavailable_reason` refuses it here). No host read of offs or slot_offs."""
    info = recipe_named(recipe)
    reason = unavailable_reason(data.device, dtype)  # of the result: data is float8
    if reason is not None:
        raise ValueError(reason)
    num_groups = offs.shape[0] - 1
    slots = slot_offs if slot_offs is not None else offs
    key = (info.name, tensor_key(data), tensor_key(scale), tensor_key(offs), tensor_key(slots), columnwise, dtype)
    plan = plan_launch(
        "group_dequantize", key, lambda: _dequantize_plan(info, data, scale, num_groups, columnwise, dtype)
    )
    out = empty(tuple(data.shape), data.device, dtype)
    if plan is not None:
        with device_ctx(data.device):
            plan(_u8(data, data), _u8(scale, scale), offs, slots, out)
    return out


def _transpose_plan(info: Recipe, data: torch.Tensor, scale: torch.Tensor) -> LaunchPlan | None:
    """The one launch of `transpose_weight_into`: a tile a program, the weight tile's size for
    fp8_block (its scale moves with it), TRANSPOSE_TILES' otherwise."""
    num, rows, cols = data.shape
    tile_scales = info.weight_tile is not None
    if tile_scales:
        block_o = block_i = info.weight_tile
        warps = TRANSPOSE_TILES[arch_of(data.device)][2]
    else:
        block_o, block_i, warps = TRANSPOSE_TILES[arch_of(data.device)]
    grid = (triton.cdiv(cols, block_i), triton.cdiv(rows, block_o), num)
    if not (grid[0] and grid[1] and grid[2]):
        return None
    return LaunchPlan(
        _TRANSPOSE,
        grid,
        (rows, cols, rows // 4, scale.shape[1], scale.shape[2]),
        dict(TILE_SCALES=tile_scales, WORDS=rows % 4 == 0, BLOCK_O=block_o, BLOCK_I=block_i, num_warps=warps),
    )


def transpose_weight_into(
    recipe: str, data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor, scale_t: torch.Tensor
) -> None:
    """`moekit.ops.runtime.quantize_torch.transpose_weight_into` by moekit's kernel: the same arguments
    (all contiguous: data (N, O, I) float8 with its scales (N, SO, SI), fp8_block's per 128 x 128 tile
    or fp8_rowwise's per column (SO = 1); outputs (N, I, O) and (N, SI, SO)), the same bytes, one launch
    (one read and one write of the FP8 weight), no host reads."""
    info = recipe_named(recipe)
    reason = unavailable_reason(data.device, torch.float32)  # the device's: data is float8, moved as bytes
    if reason is not None:
        raise ValueError(reason)
    if not all(t.is_contiguous() for t in (data, scale, data_t, scale_t)):
        raise ValueError("transpose_weight_into takes contiguous data, scales and outputs")
    if info.weight_tile is None and scale.shape[1] != 1:
        raise ValueError(
            f"a {info.name} weight's transposed scales are per column: (N, 1, I), got {tuple(scale.shape)}"
        )
    key = (info.name, *(tensor_key(t) for t in (data, scale, data_t, scale_t)))
    plan = plan_launch("transpose_weight", key, lambda: _transpose_plan(info, data, scale))
    if plan is not None:
        with device_ctx(data.device):
            words = data.shape[1] % 4 == 0  # the kernel writes whole int32 words of 4 rows (WORDS)
            plan(_u8(data, data), scale, data_t.view(torch.int32) if words else _u8(data_t, data_t), scale_t)
