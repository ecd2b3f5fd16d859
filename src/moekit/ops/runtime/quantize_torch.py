"""Grouped FP8 quantization in plain torch: the `torch` (and `loop`) backends' `group_quantize_into`, on
any device, with the group offsets on the device and never read by the host. Bit for bit what the
Triton kernels write (`moekit.ops.kernels.quantize`, whose docstring states the scale rules); the
formats are `moekit.grouped_tensor.RECIPES`.

Legend: M rows (N groups of them, then padding rows), X columns; an (N, O, I) weight's members are
(O, I). Plain torch: importing this module needs no triton.
"""

from __future__ import annotations

import torch

from moekit.grouped_tensor import (
    E8M0_DTYPE,
    FP8_MAX,
    Recipe,
    column_slots,
    dequantize_columnwise,
    dequantize_rowwise,
    recipe_named,
)

_FLOAT32_MAX = torch.finfo(torch.float32).max


def abs_for_amax(x32: torch.Tensor) -> torch.Tensor:
    """|x| with NaN read as inf (a block holding a NaN gets a non-finite amax)."""
    return torch.where(torch.isnan(x32), torch.full_like(x32, float("inf")), x32.abs())


def block_amax(blocks: torch.Tensor, dims: int | tuple[int, ...]) -> torch.Tensor:
    """The maxima of |blocks| over `dims` (kept), inf where a block holds a NaN (amax propagates NaN:
    the check runs on the maxima, not on every element); zeros for blocks of no elements."""
    if blocks.numel() == 0:
        shape = list(blocks.shape)
        for d in (dims,) if isinstance(dims, int) else dims:
            shape[d] = 1
        return blocks.new_zeros(shape)
    amax = blocks.abs().amax(dim=dims, keepdim=True)
    return torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)


def e8m0_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E8M0 bytes as uint8, 2^-e as fp32) of fp32 block maxima: the smallest power of two >= amax /
    448, from amax's bits; amax 0 -> byte 127 (1.0); non-finite -> byte 255 (NaN)."""
    bits = amax.contiguous().view(torch.int32)
    exp, mant = bits >> 23, bits & 0x7FFFFF
    byte = (exp - 8 + (mant > 0x600000).to(torch.int32)).clamp(0, 254)
    byte = torch.where(amax == 0, torch.full_like(byte, 127), byte)
    byte = torch.where(exp == 255, torch.full_like(byte, 255), byte)
    recip = ((254 - byte) << 23).view(torch.float32)
    recip = torch.where(byte == 255, torch.full_like(recip, float("nan")), recip)
    return byte.to(torch.uint8), recip


def fp32_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) of fp32 block maxima: min(448 / amax, fp32 max) and 1 / scale, each one
    correctly rounded fp32 division; amax 0 -> 1, non-finite -> NaN (the NaN itself as scale_inv, not
    1 / NaN, whose bits are the device's: 0x7fffffff on CUDA, so that every device stores 0x7fc00000)."""
    scale = (torch.full_like(amax, FP8_MAX) / amax).clamp(max=_FLOAT32_MAX)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    scale = torch.where(torch.isinf(amax), torch.full_like(scale, float("nan")), scale)
    return scale, torch.where(torch.isnan(scale), scale, torch.ones_like(scale) / scale)


def scales_of(recipe: Recipe, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the quantization multiplier (fp32), the stored scale: fp32 scale_inv, or E8M0) of block maxima."""
    if recipe.scale_dtype == torch.float32:
        return fp32_scales(amax)
    byte, recip = e8m0_scales(amax)
    return recip, byte.view(E8M0_DTYPE)


def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = -t.shape[dim] % multiple
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, extra]
    return torch.nn.functional.pad(t, pad)


# Each form below returns (x times its multiplier, in fp32: the data before the E4M3 rounding, which
# the copy into the storage does; the stored scales).


def _rowwise_blocks(recipe: Recipe, x32: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise 1 x block quantization of x32 (..., X) (block None: whole rows)."""
    cols = x32.shape[-1]
    if block is None:
        mult, stored = scales_of(recipe, block_amax(x32, -1))
        return x32 * mult, stored
    padded = _pad_to(x32, x32.dim() - 1, block)
    blocks = padded.view(*padded.shape[:-1], padded.shape[-1] // block, block)
    mult, stored = scales_of(recipe, block_amax(blocks, -1))
    return (blocks * mult).view(padded.shape)[..., :cols], stored.squeeze(-1)


def _weight_tiles(recipe: Recipe, w32: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Square tile x tile blocks of each member of an (N, O, I) weight."""
    n, r, c = w32.shape
    padded = _pad_to(_pad_to(w32, 1, tile), 2, tile)
    blocks = padded.view(n, padded.shape[1] // tile, tile, padded.shape[2] // tile, tile)
    mult, stored = scales_of(recipe, block_amax(blocks, (2, 4)))
    return (blocks * mult).view(padded.shape)[:, :r, :c], stored[:, :, 0, :, 0]


def _weight_columns(recipe: Recipe, w32: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Columnwise block x 1 quantization of each member of an (N, O, I) weight (None: whole members)."""
    if block is None:
        mult, stored = scales_of(recipe, block_amax(w32, 1))
        return w32 * mult, stored
    n, r, c = w32.shape
    padded = _pad_to(w32, 1, block)
    blocks = padded.view(n, padded.shape[1] // block, block, c)
    mult, stored = scales_of(recipe, block_amax(blocks, 2))
    return (blocks * mult).view(padded.shape)[:, :r], stored.squeeze(2)


def _row_columns(
    recipe: Recipe, x32: torch.Tensor, offs: torch.Tensor, slot_offs: torch.Tensor, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Columnwise quantization of rows x32 (M, X) in groups `offs`: per column of each block of
    block_rows rows of a group (slots from `slot_offs`), or of each whole group (slot = group; the
    padding rows' slot N is dropped). Maxima by scatter_reduce (order-free, so deterministic)."""
    rows, cols = x32.shape
    slots = column_slots(offs, slot_offs, rows, recipe.block_rows)
    total = num_slots + 1 if recipe.block_rows is None else num_slots
    amax = x32.new_zeros(total, cols)
    if rows and cols:
        amax.scatter_reduce_(0, slots[:, None].expand(rows, cols), abs_for_amax(x32), "amax", include_self=True)
    mult, stored = scales_of(recipe, amax)
    return x32 * mult.index_select(0, slots), stored[:num_slots]


SEGMENT_COLUMNS = 128
"""The FP8 wgrad's transposed operand layout starts every group's segment at a multiple of this many
columns (bytes) of a row (`segment_transposed`): 128, one cache line, so that a writer of 128 rows of a
group stores whole lines at any split of the rows, and a reduction step of up to 128 rows from a
segment's start never leaves it. `moekit.ops.kernels.grouped_wgrad_fp8.SEGMENT_COLUMNS` is the same
number for the kernels (a test keeps the two equal)."""


def segment_pitch(rows: int, num_groups: int) -> int:
    """The row pitch (bytes) of the FP8 wgrad's transposed operand layout of (rows, X) data in
    num_groups groups (`segment_transposed`): the smallest multiple of SEGMENT_COLUMNS >= rows +
    (SEGMENT_COLUMNS - 1) num_groups, room for every split of the rows (each group's segment rounded up
    to SEGMENT_COLUMNS columns, every segment starting on a 128-byte line of every row), at least
    SEGMENT_COLUMNS."""
    c = SEGMENT_COLUMNS
    return max(c, -(-(rows + (c - 1) * num_groups) // c) * c)


def segment_transposed(data_MX: torch.Tensor, offs: torch.Tensor, pitch: int) -> torch.Tensor:
    """(M, X) data whose rows are in N = len(offs) - 1 groups in the FP8 wgrad's operand layout: a fresh
    (X, pitch) tensor of data's dtype, out[:, starts[g] + j] = data[offs[g] + j, :] for the j < rows of
    group g, starts[g] the sum of the earlier groups' row counts each rounded up to SEGMENT_COLUMNS (the
    segments), zeros everywhere else (each segment's tail, the columns past the last segment). Rows
    past offs[N] are never read. A gather by destination column, from the device offsets (no host reads): the
    bytes of `moekit.ops.runtime.quantized_gemm.segment_transpose` and of the quantization kernels'
    SEGMENTS stores on every column in use."""
    rows, cols = data_MX.shape
    c = SEGMENT_COLUMNS
    widths = (offs[1:] - offs[:-1] + c - 1).div(c, rounding_mode="floor") * c
    ends = torch.cumsum(widths, 0)
    column = torch.arange(pitch, device=data_MX.device)
    group = torch.searchsorted(ends, column, right=True).clamp(max=max(offs.shape[0] - 2, 0))
    src = offs.index_select(0, group) + column - (ends - widths).index_select(0, group)
    valid = (column < ends[-1]) & (src < offs.index_select(0, group + 1))
    if rows == 0 or cols == 0:
        return data_MX.new_zeros(cols, pitch)
    src = torch.where(valid, src, torch.zeros_like(src)).clamp(max=rows - 1)
    bits = _as_bits(data_MX).index_select(0, src).T
    return torch.where(valid[None, :], bits, torch.zeros_like(bits)).contiguous().view(data_MX.dtype)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """t's bytes as an integer tensor of its element size (where() keeps them bit for bit)."""
    return t.view({1: torch.uint8, 4: torch.int32}[t.element_size()])


def _write(dst: torch.Tensor | None, new: torch.Tensor, skip: torch.Tensor | None) -> None:
    """dst = new in dst's dtype (the copy rounds fp32 to E4M3: torch's conversion, round to nearest even,
    saturating), or dst unchanged where the noop flag `skip` (a 0-d bool tensor) is set; no host read."""
    if dst is None:
        return
    if skip is None:
        dst.copy_(new)
    else:
        new = new.to(dst.dtype).contiguous()
        _as_bits(dst).copy_(torch.where(skip, _as_bits(dst), _as_bits(new)))


def transposed_source(
    recipe: str,
    row_data: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    col_data: torch.Tensor | None,
    col_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (data, scales) of a weight's quantization that its transposed copy
    (`moekit.ops.quantize.TransposedWeight`) transposes: fp8_block's rowwise tiles (a tile's transpose
    has the same scale), another recipe's columnwise form (per-column scales, one per output column of
    the dgrad); one line naming the form where it is absent."""
    rowwise = recipe_named(recipe).weight_tile is not None
    data, scale = (row_data, row_scale) if rowwise else (col_data, col_scale)
    if data is None or scale is None or data.dim() != 3:
        form = "rowwise" if rowwise else "columnwise"
        raise ValueError(f"{recipe}'s transposed weight is made from an (N, O, I) weight's {form} form")
    return data, scale


def check_transposed_outputs(x: torch.Tensor, data_t: torch.Tensor | None, scale_t: torch.Tensor | None) -> bool:
    """Whether a `group_quantize_into` call writes a transposed copy (data_t and scale_t both given, of an
    (N, O, I) weight x); one line where they are given otherwise."""
    if (data_t is None) != (scale_t is None) or (data_t is not None and x.dim() != 3):
        raise ValueError("a transposed copy is made of an (N, O, I) weight, into data_t and scale_t both")
    return data_t is not None


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
    """Quantize x into the given storage (allocated by `moekit.ops.quantize.group_quantize` in the shapes
    of `moekit.grouped_tensor`). x: (M, X) rows whose groups are `offs` (N+1,), rows past offs[N] padding
    (data 0, scale 1), columnwise scale slots from `slot_offs` (N+1,; read for the columnwise form
    and a weight's blocks only); or an (N, O, I) weight. noop: a
    float32 scalar; 1.0 leaves every output unchanged. col_segments (rows only): col_data is (X,
    segment_pitch(M, N)), the columnwise data in the FP8 wgrad's operand layout (`segment_transposed`;
    its columns past the last segment are written as zeros here, left unwritten by the kernels), the
    scales as ever. index (rows only, with the columnwise form): (M,) integer rows of x, every entry a
    row of x: the rows quantized are x[index] (M, X), never written out (x: the (T, X) rows they are
    gathered from). data_t, scale_t (a weight only, both or neither): the quantization's transposed copy
    (`moekit.ops.quantize.TransposedWeight`: `transpose_weight_into` of fp8_block's rowwise form, another
    recipe's columnwise form) written too, under the same noop flag. Every argument on x's device;
    nothing is read by the host."""
    info = recipe_named(recipe)
    transposed = check_transposed_outputs(x, data_t, scale_t)
    if index is not None:
        if x.dim() != 2 or col_data is None:
            raise ValueError("index gathers (M, X) rows for the columnwise form; got no columnwise output or a weight")
        x = x.index_select(0, index.reshape(-1))
    skip = None if noop is None else noop.reshape(()) == 1.0
    x32 = x.to(torch.float32)
    if col_segments and x.dim() != 2:
        raise ValueError(f"col_segments takes (M, X) rows, not a weight of shape {tuple(x.shape)}")
    if x.dim() == 3:
        if row_data is not None:
            if info.weight_tile is not None:
                data, scale = _weight_tiles(info, x32, info.weight_tile)
            else:
                data, scale = _rowwise_blocks(info, x32, info.block_cols)
            _write(row_data, data, skip)
            _write(row_scale, scale, skip)
        if col_data is not None:
            data, scale = _weight_columns(info, x32, info.block_rows)
            _write(col_data, data, skip)
            _write(col_scale, scale, skip)
        if transposed:
            data, scale = transposed_source(recipe, row_data, row_scale, col_data, col_scale)
            _write(data_t, data.transpose(1, 2), skip)
            _write(scale_t, scale.transpose(1, 2), skip)
        return
    rows = x32.shape[0]
    live = torch.arange(rows, device=x.device) < offs[-1]
    x32 = torch.where(live[:, None], x32, x32.new_zeros(()))  # padding rows (whatever they hold) are zeros
    if row_data is not None:
        data, scale = _rowwise_blocks(info, x32, info.block_cols)
        _write(row_data, data, skip)
        _write(row_scale, scale, skip)
    if col_data is not None:
        if col_scale is None:
            raise ValueError("columnwise data needs its scales")
        data, scale = _row_columns(info, x32, offs, slot_offs, col_scale.shape[0])
        if col_segments:
            data = segment_transposed(data.to(col_data.dtype), offs, col_data.shape[1])
        _write(col_data, data, skip)
        _write(col_scale, scale, skip)


def group_dequantize(
    recipe: str,
    data: torch.Tensor,
    scale: torch.Tensor,
    offs: torch.Tensor,
    slot_offs: torch.Tensor | None,
    columnwise: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """data * scale of one form of a quantized tensor, in `dtype`: `moekit.grouped_tensor`'s
    `dequantize_rowwise` / `dequantize_columnwise` (the product in float32, float64 for a float64
    dtype, one rounding), i.e. `GroupedTensor.dequantize`. data: (M, X) rows whose groups are `offs`
    (N+1,), or an (N, O, I) weight; slot_offs (N+1,): the columnwise scales' first slot of each group
    (columnwise rows only). A fresh tensor; no host reads."""
    info = recipe_named(recipe)
    if not columnwise:
        return dequantize_rowwise(info, data, scale, dtype)
    if slot_offs is None:
        if data.dim() != 3:
            raise ValueError("columnwise dequantization of rows needs the scale slot offsets")
        slot_offs = offs  # a weight's blocks follow from its shape
    return dequantize_columnwise(info, data, scale, offs, slot_offs, dtype)


def transpose_weight_into(
    recipe: str, data: torch.Tensor, scale: torch.Tensor, data_t: torch.Tensor, scale_t: torch.Tensor
) -> None:
    """data_t = data (N, O, I) transposed to (N, I, O), scale_t = scale (N, SO, SI) transposed to
    (N, SI, SO), in place (every address kept): the bytes of `moekit.ops.quantize.TransposedWeight`.
    Outputs contiguous; no host reads."""
    recipe_named(recipe)
    data_t.copy_(data.transpose(1, 2))
    scale_t.copy_(scale.transpose(1, 2))
