"""tests/interpreter_site/sitecustomize.py: its speed-ups of Triton's interpreter change no value."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from moekit.ops.kernels.schedule import _min_tuple, locate_tile

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's speed-ups")


@triton.jit
def _locate_kernel(tile_end_ptr, start_ptr, end_ptr, out_ptr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    te, s, e = tl.load(tile_end_ptr + offs), tl.load(start_ptr + offs), tl.load(end_ptr + offs)
    g, first, r0, r1 = locate_tile(t, te, s, e)
    tl.store(out_ptr + t * 4, g)
    tl.store(out_ptr + t * 4 + 1, first)
    tl.store(out_ptr + t * 4 + 2, r0)
    tl.store(out_ptr + t * 4 + 3, r1)


def _locate_every_tile(tile_end: torch.Tensor, start: torch.Tensor, end: torch.Tensor, tiles: int) -> torch.Tensor:
    out = torch.full((tiles, 4), -7, dtype=torch.int32)
    _locate_kernel[(tiles,)](tile_end, start, end, out, BLOCK=tile_end.numel())
    return out


def test_the_tile_schedules_tuple_reduce_is_numpys_with_the_generic_reduces_values(monkeypatch):
    """`locate_tile`'s (sum, max, min, min) reduce of four int32 vectors, by numpy (the site's path) and by
    the interpreter's own element-by-element combine, equal to the definition at every tile id of a
    schedule with empty groups, and past its last tile."""
    from triton.runtime import interpreter

    site = interpreter.ReduceOps.apply_impl
    assert getattr(site, "vectorized", False), "the site's reduce is not installed"
    fn = _min_tuple.fn
    assert (fn.__module__, fn.__name__) in site.reduces, "the site names a combine function that moved"

    rows = torch.tensor([0, 300, 300, 301, 700, 700, 1000, 1000], dtype=torch.int32)  # 7 groups, 3 empty
    start = torch.cat([rows[:-1], torch.full((9,), 1000, dtype=torch.int32)])  # 16 entries, the rest empty
    end = torch.cat([rows[1:], torch.full((9,), 1000, dtype=torch.int32)])
    tile_end = torch.cumsum((end - start + 127) // 128, 0).to(torch.int32)
    tiles = int(tile_end[-1]) + 2
    want = []
    for t in range(tiles):
        done = tile_end <= t
        want.append(
            [
                int(done.sum()),
                int(torch.where(done, tile_end, 0).max()),
                int(torch.where(done, 2**31 - 1, start).min()),
                int(torch.where(done, 2**31 - 1, end).min()),
            ]
        )
    got = _locate_every_tile(tile_end, start, end, tiles)
    assert got.tolist() == want
    monkeypatch.setattr(interpreter.ReduceOps, "apply_impl", site.original)
    assert _locate_every_tile(tile_end, start, end, tiles).tolist() == want


def _attributes(obj) -> dict[str, tuple[str, str]]:
    """Every attribute of a triton type or tensor as (its type's full name, its repr): what a kernel reads."""
    names = {k for k in vars(obj) if not k.startswith("_")}
    if isinstance(obj, tl.dtype):
        names.add("name")  # the site makes a type's `name` when read
    kind = {k: type(getattr(obj, k)) for k in names}
    return {k: (f"{kind[k].__module__}.{kind[k].__qualname__}", repr(getattr(obj, k))) for k in sorted(names)}


@pytest.mark.parametrize("dims", [[128], [64, 128], [1, 32], [2, 4, 8]])
def test_block_types_and_tensors_of_a_shape_are_what_the_originals_build(dims):
    """The site's block type and tensor construction (each shape's triton tuples made once and shared)
    gives the attributes, of the same types and values, that triton's own constructors give."""
    from triton.language import core

    block_init = core.block_type.__init__
    tensor_init = core.tensor.__init__
    assert hasattr(block_init, "original") and hasattr(tensor_init, "original"), "the site's types are not installed"
    for element in (tl.float32, tl.int64, tl.float8e4nv):
        want_type = core.block_type.__new__(core.block_type)
        block_init.original(want_type, element, [tl.constexpr(d) for d in dims])
        got_type = core.block_type(element, dims)
        assert _attributes(got_type) == _attributes(want_type) and got_type == want_type
        want = core.tensor.__new__(core.tensor)
        tensor_init.original(want, None, want_type)
        got = core.tensor(None, got_type)
        assert _attributes(got) == _attributes(want)
        assert core.tensor(None, core.block_type(element, dims)).shape is got.shape  # shared, never rebuilt
    for scalar_type in (tl.float32, tl.pointer_type(tl.int32)):  # scalars: a shape of ()
        want = core.tensor.__new__(core.tensor)
        tensor_init.original(want, None, scalar_type)
        assert _attributes(core.tensor(None, scalar_type)) == _attributes(want)


def test_shape_comparisons_are_the_originals():
    """The site's comparison of a triton tuple with plain ints (core.tuple, list or tuple) answers what
    triton's own does, and anything else still takes triton's own."""
    from triton.language import core

    eq = core.tuple.__eq__
    assert hasattr(eq, "original"), "the site's comparison is not installed"
    shape = core.tuple([64, 128])
    others = [core.tuple([64, 128]), [64, 128], (64, 128), [64, 64], (128,), [], core.tuple([1, 128])]
    others += [[tl.constexpr(64), 128], core.tuple([tl.constexpr(64), tl.constexpr(128)]), [64.0, 128]]
    for other in others:
        got, want = eq(shape, other), eq.original(shape, other)
        assert type(got) is type(want) and bool(got) == bool(want), other
        assert bool(shape != other) == (not bool(want)), other


def test_dtype_comparisons_are_the_originals():
    """The site's shortcut for a scalar type compared with itself answers what triton's own does, for the
    same object, another object of the same type, another type, a constexpr and a non-type."""
    from triton.language import core

    eq = core.dtype.__eq__
    assert hasattr(eq, "original"), "the site's comparison is not installed"
    for a in (tl.float32, tl.int64, tl.float8e4nv):
        for b in (a, core.dtype(a.name), tl.bfloat16, tl.constexpr(a), "fp32", None):
            assert eq(a, b) == eq.original(a, b), (a, b)
