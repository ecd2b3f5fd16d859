"""GroupedTensor: N tensors of any first dims (0 included) and one shape past it, packed back to back,
high-precision or quantized (FP8 with block scales).

Legend: N members (groups, experts), M rows of all members together (the sum of their first dims, plus
padding rows past it), X the columns of a 2-D member (its last dim); a weight's members are (O, I).

Two kinds of storage:

- high precision: `data`, one flat buffer; member i is the view of its rows. `GroupedLinear` keeps its
  per-expert weights (and biases) this way: the N discrete `weight{i}` parameters are views of one
  buffer, passed to a grouped GEMM as one `(N, out, in)` view without a copy.
- quantized (`moekit.group_quantize`): `recipe`, `rowwise_data` / `rowwise_scale_inv` and
  `columnwise_data` / `columnwise_scale_inv` (None where not requested). Every format stores its data in
  float8 E4M3 (`torch.float8_e4m3fn`) in the quantized tensor's own shape and layout (columnwise data is
  not transposed), and a `scale_inv` per block: the dequantization multiplier, x ~= data * scale_inv
  (TransformerEngine's naming). The formats are `RECIPES` (below) and `moekit.ops.quantize`.

The members' first dims and row offsets live on the device (`first_dims` (N,), `offsets` (N+1,), int64):
a GroupedTensor built from device `m_splits` never reads them on the host, except `split()` /
`tensors()` / `member i`, which need them as Python ints (one sync, the only one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from moekit.validation import check_bool, check_int

# --------------------------------------------------------------------------------------------------
# The quantization formats
# --------------------------------------------------------------------------------------------------

FP8_DTYPE = torch.float8_e4m3fn
E8M0_DTYPE = torch.float8_e8m0fnu
# The largest finite E4M3 value: every recipe picks its scale so that no element passes it.
FP8_MAX = 448.0


@dataclass(frozen=True)
class Recipe:
    """A quantization format. Blocks of a 2-D (M, X) tensor of rows sorted by group:

    block_cols   rowwise blocks are 1 x block_cols along X (None: the whole row)
    block_rows   columnwise blocks are block_rows x 1 along M, restarting at every group's first row so
                 that no block holds two groups' rows (None: the whole group); a last partial block
                 is a block
    weight_tile  an (N, O, I) weight's rowwise blocks are weight_tile x weight_tile squares of each
                 member (None: the weight's members follow the 2-D rules, each member a group)
    scale_dtype  float8 E8M0 (a power of two) or float32
    """

    name: str
    block_cols: int | None
    block_rows: int | None
    weight_tile: int | None
    scale_dtype: torch.dtype


RECIPES: dict[str, Recipe] = {
    # OCP microscaling: 32-element blocks, E8M0 scales.
    "mxfp8": Recipe("mxfp8", 32, 32, None, E8M0_DTYPE),
    # DeepSeek-V3's Hopper recipe: 1 x 128 activations (128 x 1 for the transposed use), 128 x 128 weights.
    "fp8_block": Recipe("fp8_block", 128, 128, 128, torch.float32),
    # One scale per row (per output channel of a weight), per column of a group columnwise.
    "fp8_rowwise": Recipe("fp8_rowwise", None, None, None, torch.float32),
}


def recipe_named(name: str) -> Recipe:
    """The recipe of `name`; one line naming the recipes otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"recipe must be one of {tuple(RECIPES)}, got {type(name).__name__}")
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; expected one of {tuple(RECIPES)}")
    return RECIPES[name]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rowwise_scale_shape(recipe: Recipe, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of `rowwise_scale_inv` for a quantized tensor of `shape` ((M, X), or (N, O, I) for a weight):
    one scale per row and column block ((M, ceil(X / block_cols)), (M, 1) for whole rows), per member's
    row and column block for a weight ((N, O, ...)), or per weight tile ((N, ceil(O / t), ceil(I / t)))."""
    *lead, cols = shape
    if len(shape) == 3 and recipe.weight_tile is not None:
        tile = recipe.weight_tile
        return (shape[0], _cdiv(shape[1], tile), _cdiv(cols, tile))
    return (*lead, 1 if recipe.block_cols is None else _cdiv(cols, recipe.block_cols))


def columnwise_scale_shape(recipe: Recipe, shape: tuple[int, ...], num_groups: int) -> tuple[int, ...]:
    """Shape of `columnwise_scale_inv`: one scale per column of each block of block_rows rows of a group.

    (M, X) rows in N groups: the groups' blocks one after another, group g's from slot
    `columnwise_scale_offsets[g]`, then the padding rows' blocks (scale 1), then unused slots (scale 1):
    ceil(M / block_rows) + N slots hold every split of M rows into N groups, so the shape follows from
    the shapes alone (device splits are never read); (N, X) for whole groups. An (N, O, I) weight
    (each member a group): (N, ceil(O / block_rows), I), or (N, 1, I) for whole members."""
    if len(shape) == 3:
        per_member = 1 if recipe.block_rows is None else _cdiv(shape[1], recipe.block_rows)
        return (shape[0], per_member, shape[2])
    rows, cols = shape
    if recipe.block_rows is None:
        return (num_groups, cols)
    return (_cdiv(rows, recipe.block_rows) + num_groups, cols)


def columnwise_defined(recipe: Recipe, weight: bool) -> bool:
    """Whether the recipe has a columnwise form for this layout: every recipe for rows; for a weight,
    not where its blocks are squares (fp8_block's 128 x 128 tiles serve both orientations of the GEMMs
    as they are, so its rowwise data is the whole of it)."""
    return not (weight and recipe.weight_tile is not None)


# --------------------------------------------------------------------------------------------------
# Dequantization (plain torch; no host reads)
# --------------------------------------------------------------------------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _byte_values(byte_dtype: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(byte_dtype).to(dtype)


# Made once at import (never inside a trace): every one-byte float moekit stores, widened.
_BYTE_VALUES = {(b, d): _byte_values(b, d) for b in (FP8_DTYPE, E8M0_DTYPE) for d in (torch.float32, torch.float64)}


def widen(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype` (float32 or float64), the values torch's conversion gives. E4M3 data and E8M0 scales
    on the CPU are looked up in a 256-entry table of their bytes (made by torch's conversion; every such
    value is exact in float32): torch converts them there one element at a time, several times slower
    than the lookup, and the reference path dequantizes on every call."""
    table = _BYTE_VALUES.get((t.dtype, dtype)) if t.device.type == "cpu" else None
    if table is None:
        return t.to(dtype)
    return table.index_select(0, t.reshape(-1).view(torch.uint8).to(torch.int32)).view(t.shape)


def _expand(scale: torch.Tensor, dim: int, block: int | None, size: int) -> torch.Tensor:
    """Repeat each scale along `dim` over its block (the whole `size` for None) and crop to `size`."""
    if block is None:
        return scale.expand(*scale.shape[:dim], size, *scale.shape[dim + 1 :])
    return scale.repeat_interleave(block, dim=dim).narrow(dim, 0, size)


def dequantize_rowwise(recipe: Recipe, data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """data * scale_inv (each block's scale over its elements) in `dtype`: the product in float32
    (float64 for a float64 `dtype`: exact there), one rounding to `dtype`."""
    acc = _acc_dtype(dtype)
    scale = widen(scale_inv, acc)
    if data.dim() == 3 and recipe.weight_tile is not None:
        scale = _expand(_expand(scale, 1, recipe.weight_tile, data.shape[1]), 2, recipe.weight_tile, data.shape[2])
    else:
        scale = _expand(scale, data.dim() - 1, recipe.block_cols, data.shape[-1])
    return (widen(data, acc) * scale).to(dtype)


def column_slots(offs: torch.Tensor, slot_offs: torch.Tensor, rows: int, block_rows: int | None) -> torch.Tensor:
    """(rows,) int64: the columnwise scale slot of every row of a tensor whose groups' rows are
    `offs` (N+1,) and whose groups' first slots are `slot_offs` (N+1,): slot_offs[g] + (r - offs[g]) //
    block_rows for row r of group g, the padding rows (past offs[N]) counting from slot_offs[N]; the
    group itself for whole groups (N for padding rows). Device ops only."""
    r = torch.arange(rows, device=offs.device)
    group = torch.searchsorted(offs[1:], r, right=True)
    if block_rows is None:
        return group
    return slot_offs[group] + torch.div(r - offs[group], block_rows, rounding_mode="floor")


def dequantize_columnwise(
    recipe: Recipe,
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    offs: torch.Tensor,
    slot_offs: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """data * the columnwise scale of each element's block, in `dtype` (as `dequantize_rowwise`)."""
    acc = _acc_dtype(dtype)
    if data.dim() == 3:  # a weight: each member one group, its blocks along O
        scale = _expand(widen(scale_inv, acc), 1, recipe.block_rows, data.shape[1])
        return (widen(data, acc) * scale).to(dtype)
    rows = data.shape[0]
    slots = column_slots(offs, slot_offs, rows, recipe.block_rows)
    # Padding rows hold zeros; whole groups have no slot for them (their index N is past the scales).
    slots = slots.clamp(max=max(scale_inv.shape[0] - 1, 0))
    scale = widen(scale_inv, acc).index_select(0, slots) if rows else data.new_zeros(0, data.shape[1], dtype=acc)
    return (widen(data, acc) * scale).to(dtype)


# --------------------------------------------------------------------------------------------------
# GroupedTensor
# --------------------------------------------------------------------------------------------------


class GroupedTensor:
    """N tensors of any first dims and one shape past it, in one buffer (high precision) or quantized.

    num_tensors: N. shape: the packed tensor's shape: (N, *member_shape) for members of one shape,
    else (M, *rest) (rows past the members' sum are padding). first_dims (N,) / offsets (N+1,): the
    members' first dims and row offsets, int64 on the device. member_shape: the members' one shape, or
    None where their first dims differ (or are known on the device only). dtype: the high-precision
    dtype (what `dequantize` returns).

    High precision: `data` (flat). Quantized: `recipe` and the storage attributes of the module
    docstring; `columnwise_scale_offsets` (N+1,) gives each group's first columnwise scale slot.
    """

    num_tensors: int
    shape: tuple[int, ...]
    data: torch.Tensor | None
    member_shape: tuple[int, ...] | None
    recipe: str | None
    rowwise_data: torch.Tensor | None
    rowwise_scale_inv: torch.Tensor | None
    columnwise_data: torch.Tensor | None
    columnwise_scale_inv: torch.Tensor | None
    columnwise_scale_offsets: torch.Tensor | None
    _first_dims: torch.Tensor | None
    _offsets: torch.Tensor | None
    _host_first_dims: tuple[int, ...] | None

    def __init__(self, data: torch.Tensor, num_tensors: int, member_shape: Sequence[int]) -> None:
        """N members of one shape over `data`, a flat buffer of N * prod(member_shape) elements."""
        member_shape = tuple(int(d) for d in member_shape)
        if data.dim() != 1:
            raise ValueError(f"data must be a flat 1-D buffer, got shape {tuple(data.shape)}")
        if data.numel() != num_tensors * math.prod(member_shape):
            raise ValueError(
                f"data has {data.numel()} elements; {num_tensors} members of shape {member_shape} need "
                f"{num_tensors * math.prod(member_shape)}"
            )
        self._init_common(num_tensors, (num_tensors, *member_shape), data.dtype, data.device)
        self.data = data
        self.member_shape = member_shape
        self._host_first_dims = (member_shape[0],) * num_tensors if member_shape else None

    def _init_common(self, num_tensors: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        self.num_tensors = num_tensors
        self.shape = shape
        self._dtype, self._device = dtype, device
        self._first_dims = None
        self._offsets = None
        self._host_first_dims = None
        self.recipe = None
        self.rowwise_data = None
        self.rowwise_scale_inv = None
        self.columnwise_data = None
        self.columnwise_scale_inv = None
        self.columnwise_scale_offsets = None

    # ---- construction ------------------------------------------------------------------------

    @classmethod
    def empty(
        cls,
        num_tensors: int,
        shape: Sequence[int],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> GroupedTensor:
        """Uninitialised storage for `num_tensors` members of `shape`."""
        num_tensors = check_int("num_tensors", num_tensors, minimum=0)
        shape = tuple(check_int("each dimension of shape", d, minimum=0) for d in shape)
        numel = num_tensors * math.prod(shape)
        return cls(torch.empty(numel, dtype=dtype, device=device), num_tensors, shape)

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor]) -> GroupedTensor:
        """Copy tensors (one dtype, one device, any first dims, one shape past the first dim) into one
        new buffer, back to back."""
        if not tensors:
            raise ValueError("from_tensors needs at least one tensor")
        first = tensors[0]
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"from_tensors takes torch.Tensors, got {type(t).__name__}")
            if t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"all members must share dtype and device; got {first.dtype} on {first.device} and "
                    f"{t.dtype} on {t.device}"
                )
            if t.dim() == 0 or t.dim() != first.dim() or t.shape[1:] != first.shape[1:]:
                raise ValueError(
                    "members must share every dim but the first (and have one); got "
                    f"{[tuple(t.shape) for t in tensors]}"
                )
        if all(t.shape == first.shape for t in tensors):
            out = cls.empty(len(tensors), first.shape, dtype=first.dtype, device=first.device)
        else:
            rest = tuple(first.shape[1:])
            rows = [int(t.shape[0]) for t in tensors]
            data = torch.empty(sum(rows) * math.prod(rest), dtype=first.dtype, device=first.device)
            out = cls._ragged(data, rows, rest)
        for member, t in zip(out.split(), tensors, strict=True):
            member.copy_(t)
        return out

    @classmethod
    def _ragged(cls, data: torch.Tensor, rows: Sequence[int], rest: tuple[int, ...]) -> GroupedTensor:
        out = cls.__new__(cls)
        out._init_common(len(rows), (sum(rows), *rest), data.dtype, data.device)
        out.data, out.member_shape = data, None
        out._host_first_dims = tuple(rows)
        return out

    @classmethod
    def quantized(
        cls,
        recipe: str,
        dtype: torch.dtype,
        shape: Sequence[int],
        first_dims: torch.Tensor,
        offsets: torch.Tensor,
        *,
        host_first_dims: Sequence[int] | None = None,
        rowwise_data: torch.Tensor | None = None,
        rowwise_scale_inv: torch.Tensor | None = None,
        columnwise_data: torch.Tensor | None = None,
        columnwise_scale_inv: torch.Tensor | None = None,
        columnwise_scale_offsets: torch.Tensor | None = None,
    ) -> GroupedTensor:
        """A quantized GroupedTensor over existing storage (what `moekit.group_quantize` returns; no
        checks of the values: the storage must follow `recipe`'s format). shape: (M, X) rows, or an (N,
        O, I) weight. first_dims (N,) and offsets (N+1,): int64 on the storage's device."""
        info = recipe_named(recipe)
        shape = tuple(int(d) for d in shape)
        num_tensors = int(first_dims.shape[0])
        stored = rowwise_data if rowwise_data is not None else columnwise_data
        if stored is None:
            raise ValueError("a quantized GroupedTensor needs rowwise or columnwise data")
        out = cls.__new__(cls)
        out._init_common(num_tensors, shape, dtype, stored.device)
        out.data = None
        weight = len(shape) == 3
        out.member_shape = shape[1:] if weight else None
        out._host_first_dims = tuple(int(d) for d in host_first_dims) if host_first_dims is not None else None
        if weight:
            out._host_first_dims = (shape[1],) * num_tensors
        out._first_dims, out._offsets = first_dims, offsets
        out.recipe = info.name
        out.rowwise_data, out.rowwise_scale_inv = rowwise_data, rowwise_scale_inv
        out.columnwise_data, out.columnwise_scale_inv = columnwise_data, columnwise_scale_inv
        out.columnwise_scale_offsets = columnwise_scale_offsets
        return out

    # ---- facts -------------------------------------------------------------------------------

    @property
    def dtype(self) -> torch.dtype:
        """The high-precision dtype (the data's, or what `dequantize` returns)."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def is_quantized(self) -> bool:
        return self.recipe is not None

    @property
    def first_dims(self) -> torch.Tensor:
        """(N,) int64 on the device: each member's first dim."""
        if self._first_dims is None:
            self._first_dims = torch.tensor(self._host_dims("first_dims"), dtype=torch.int64).to(self.device)
        return self._first_dims

    @property
    def offsets(self) -> torch.Tensor:
        """(N+1,) int64 on the device: each member's first row in the packed rows; offsets[N] is the rows
        of all members (rows past it are padding)."""
        if self._offsets is None:
            dims = self._host_dims("offsets")
            self._offsets = torch.tensor([0, *_cumsum(dims)], dtype=torch.int64).to(self.device)
        return self._offsets

    def _host_dims(self, what: str) -> tuple[int, ...]:
        if self._host_first_dims is None:
            if self._first_dims is None:
                raise ValueError(f"0-d members have no first dim, so no {what}")
            # Read on the host (a sync): only split() / member access ask where the device holds them.
            self._host_first_dims = tuple(int(d) for d in self._first_dims.tolist())
        return self._host_first_dims

    def host_first_dims(self) -> tuple[int, ...]:
        """The first dims as Python ints (reads device first dims on the host: a sync)."""
        return self._host_dims("first_dims")

    @property
    def known_host_first_dims(self) -> tuple[int, ...] | None:
        """The first dims as Python ints where the host knows them (no read), else None."""
        return self._host_first_dims

    def set_known_host_first_dims(self, dims: Sequence[int] | None) -> None:
        """Record what the host knows of the first dims after they were rewritten in place on the device
        (None: the device alone knows)."""
        self._host_first_dims = tuple(int(d) for d in dims) if dims is not None else None

    # ---- members -----------------------------------------------------------------------------

    def stacked(self) -> torch.Tensor:
        """All members as one (N, *member_shape) view (members of one shape, high precision)."""
        if self.data is None:
            raise ValueError("stacked() views high-precision data; this GroupedTensor is quantized: dequantize() it")
        if self.member_shape is None:
            raise ValueError(
                f"stacked() needs members of one shape; these have first dims {self.host_first_dims()}: use split()"
            )
        return self.data.view(self.num_tensors, *self.member_shape)

    def split(self) -> list:
        """The members: views of the high-precision data (tensors of shape (first_dims[i], ...)), or, when
        quantized, one-member quantized GroupedTensors viewing this one's storage. Reads device first
        dims on the host (a sync)."""
        if self.data is not None and self.member_shape is not None:
            stacked = self.stacked()
            return [stacked[i] for i in range(self.num_tensors)]
        dims = self.host_first_dims()
        bounds = [0, *_cumsum(dims)]
        if self.data is not None:
            rest = self.shape[1:]
            width = math.prod(rest)
            return [self.data[lo * width : hi * width].view(hi - lo, *rest) for lo, hi in pairwise(bounds)]
        return [self._quantized_member(i, bounds[i], bounds[i + 1]) for i in range(self.num_tensors)]

    def tensors(self) -> list:
        """Views of every member (`split()`)."""
        return self.split()

    def _recipe(self) -> Recipe:
        if self.recipe is None:
            raise ValueError("this GroupedTensor holds high-precision data, not a quantization")
        return recipe_named(self.recipe)

    def _quantized_member(self, i: int, lo: int, hi: int) -> GroupedTensor:
        info = self._recipe()
        slot_offs = self.columnwise_scale_offsets
        weight = len(self.shape) == 3
        sl = slice(i, i + 1) if weight else slice(lo, hi)
        rows = hi - lo
        row_data = self.rowwise_data[sl] if self.rowwise_data is not None else None
        row_scale = None
        if self.rowwise_scale_inv is not None:
            row_scale = self.rowwise_scale_inv[sl]
        col_data = self.columnwise_data[sl] if self.columnwise_data is not None else None
        col_scale = col_offs = None
        if self.columnwise_scale_inv is not None and slot_offs is not None:
            if weight:
                col_scale = self.columnwise_scale_inv[sl]
                col_offs = slot_offs.new_tensor([0, col_scale.shape[1]])
            elif info.block_rows is None:
                col_scale = self.columnwise_scale_inv[i : i + 1]
                col_offs = slot_offs.new_tensor([0, 1])
            else:
                first = int(slot_offs[i])
                count = _cdiv(rows, info.block_rows)
                col_scale = self.columnwise_scale_inv[first : first + count]
                col_offs = slot_offs.new_tensor([0, count])
        shape = (1, *self.shape[1:]) if weight else (rows, *self.shape[1:])
        dims = self.first_dims[i : i + 1]
        return GroupedTensor.quantized(
            info.name,
            self.dtype,
            shape,
            dims,
            self.offsets.new_tensor([0, rows]),
            host_first_dims=(rows,),
            rowwise_data=row_data,
            rowwise_scale_inv=row_scale,
            columnwise_data=col_data,
            columnwise_scale_inv=col_scale,
            columnwise_scale_offsets=col_offs,
        )

    def __len__(self) -> int:
        return self.num_tensors

    def __getitem__(self, i: int) -> torch.Tensor | GroupedTensor:
        if not -self.num_tensors <= i < self.num_tensors:
            raise IndexError(f"member {i} out of range for {self.num_tensors} members")
        if self.data is not None and self.member_shape is not None:
            return self.stacked()[i]
        return self.split()[i]

    # ---- dequantization ----------------------------------------------------------------------

    def dequantize(self, columnwise: bool = False) -> torch.Tensor:
        """The tensor in `dtype` and `shape`: data * scale_inv of the rowwise storage, or of the
        columnwise one with `columnwise=True` (a quantization's two forms differ in their blocks). High
        precision: the data itself, viewed in `shape`. No host reads. Plain torch, the reference
        (`moekit.group_dequantize` computes the same values with moekit's one-pass kernel where it runs)."""
        check_bool("columnwise", columnwise)
        if self.data is not None:
            return self.data.view(self.shape)
        info = self._recipe()
        if columnwise:
            data, scale, slots = self.columnwise_data, self.columnwise_scale_inv, self.columnwise_scale_offsets
            if data is None or scale is None or slots is None:
                raise ValueError("dequantize(columnwise=True): this GroupedTensor has no columnwise storage")
            return dequantize_columnwise(info, data, scale, self.offsets, slots, self.dtype)
        if self.rowwise_data is None or self.rowwise_scale_inv is None:
            raise ValueError("dequantize(): this GroupedTensor has no rowwise storage; use columnwise=True")
        return dequantize_rowwise(info, self.rowwise_data, self.rowwise_scale_inv, self.dtype)

    def storage(self) -> tuple[torch.Tensor | None, ...]:
        """Every tensor of a quantized GroupedTensor, in a fixed order (for save_for_backward and in-place
        checks): first_dims, offsets, rowwise data and scales, columnwise data, scales and scale offsets."""
        return (
            self.first_dims,
            self.offsets,
            self.rowwise_data,
            self.rowwise_scale_inv,
            self.columnwise_data,
            self.columnwise_scale_inv,
            self.columnwise_scale_offsets,
        )

    def with_storage(self, tensors: Sequence[torch.Tensor | None]) -> GroupedTensor:
        """A quantized GroupedTensor like this one over `tensors` (`storage()`'s order): how an autograd
        node rebuilds what it saved."""
        first_dims, offsets, row_data, row_scale, col_data, col_scale, col_offs = tensors
        if first_dims is None or offsets is None:
            raise ValueError("with_storage needs the first dims and offsets")
        return GroupedTensor.quantized(
            self._recipe().name,
            self.dtype,
            self.shape,
            first_dims,
            offsets,
            host_first_dims=self._host_first_dims,
            rowwise_data=row_data,
            rowwise_scale_inv=row_scale,
            columnwise_data=col_data,
            columnwise_scale_inv=col_scale,
            columnwise_scale_offsets=col_offs,
        )

    def __repr__(self) -> str:
        members = f"member_shape={self.member_shape}" if self.member_shape is not None else f"shape={self.shape}"
        quant = ""
        if self.recipe is not None:
            stored = (("rowwise", self.rowwise_data), ("columnwise", self.columnwise_data))
            quant = f", recipe={self.recipe!r}, {'+'.join(f for f, t in stored if t is not None)}"
        where = f"dtype={self.dtype}, device={self.device}"
        return f"GroupedTensor(num_tensors={self.num_tensors}, {members}, {where}{quant})"


def _cumsum(values: Sequence[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
