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
