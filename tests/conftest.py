"""pytest setup of moekit's tests: the tolerance rule, stated here once, and the NaN-poison fixture.
The helpers that apply the rule live in tests/helpers.py (`from helpers import ...`).

THE TOLERANCE RULE (the only one these tests use)
-------------------------------------------------
A result computed in a low precision (float32, float16, bfloat16) may be off the float64 reference
by at most twice the error that torch's own computation of the same thing, in the same precision,
makes, plus a floor:

    rel_err(ours, ref64) <= 2 * rel_err(torch_lowp, ref64) + u(dtype) + 16 * sqrt(L) * u(float32)

- `ref64` is the op evaluated in float64 on the *same* (already rounded) inputs and the same upstream
  gradient, so only the arithmetic is measured, not the rounding of the inputs.
- `torch_lowp` is the same op written with plain torch ops (per-group `@`, `silu(g) * u`, ...) and
  run, forward and autograd backward, in the low precision itself.
- `rel_err(a, r) = ||a - r||_F / ||r||_F` (relative Frobenius norm); where `r` is exactly zero (an
  expert without rows, padding rows) it is the absolute norm `||a||_F`, so such results must be zero
  up to the floor (the tests also assert those exact zeros directly).
- The floor. `u(dtype)` is one unit roundoff (`finfo.eps / 2`: 2^-8 for bfloat16, 2^-24 for
  float32): the one rounding of a result stored in that dtype. The second term is the reordering
  allowance. Every sum here accumulates in float32 (or wider), and the order of those sums is not
  fixed: it depends on the CPU's vector width (AVX2 or AVX-512), the BLAS kernel, the number of
  threads and the tile shapes of a Triton kernel. A float32 sum of L terms taken in another order
  differs by about sqrt(L) unit roundoffs relative to the magnitudes of its terms, and a gradient
  chains several such sums whose terms partly cancel (softmax and top-k routing, SwiGLU), so the
  same computation may legitimately differ from torch's by a few times sqrt(L) u(float32) on
  another machine. `torch_lowp`'s error, measured on one machine, cannot bound that alone: on small
  tensors it can land luckily low (issue seen: 1.5e-7 on one CPU, ours 4.1e-7 on another). L is
  the reduction length: by default the largest dimension of the inputs (every sum in these ops
  runs over rows, features or tokens). For float32 at L = 64 the floor is 7.7e-6; wrong formulas,
  lost rows or swapped gate/up halves give errors of order 1e-2 to 1 and still fail by far.

`helpers.check_against_reference` applies the rule to an op's output and to the gradient of every
input; `helpers.assert_within_tolerance` to one tensor.

NaN poison: the `nan_poison` fixture makes `torch.empty`, `torch.empty_like` and `Tensor.new_empty`
return NaN-filled floating tensors (and a sentinel in integer ones) while a test runs, so a buffer
an op allocates and then fails to write in full shows up as NaN in its result (allocations inside
C++ kernels, e.g. grouped_mm's output, are not reached; tests check their padding rows for exact
zeros instead). `helpers.nan_like` gives a test's own freshly allocated buffers the same treatment.
"""

from __future__ import annotations

import fcntl
import gc
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from helpers import poison


@pytest.fixture
def nan_poison(monkeypatch):
    """While the test runs, freshly allocated tensors from torch.empty / empty_like / new_empty
    (called from Python, as moekit does) are poisoned instead of holding whatever memory had."""
    orig_empty, orig_empty_like, orig_new_empty = torch.empty, torch.empty_like, torch.Tensor.new_empty

    def empty(*args, **kwargs):
        out = orig_empty(*args, **kwargs)
        return out if kwargs.get("out") is not None else poison(out)

    def empty_like(*args, **kwargs):
        return poison(orig_empty_like(*args, **kwargs))

    def new_empty(self, *args, **kwargs):
        return poison(orig_new_empty(self, *args, **kwargs))

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Before a test's fixtures are torn down, let go of its failure: pytest keeps the last failure's
    traceback (`sys.last_traceback`, for post-mortem debugging) and with it every frame's locals, so on
    a GPU a test that failed out of memory kept its tensors until the next failure, and every later test
    of that xdist worker, and of the others sharing the GPU, failed out of memory too (the whole GPU
    suite on an H100 at `e106cec`: 152 failed behind one). The report has the traceback as text."""
    if getattr(sys, "last_value", None) is not None:
        sys.last_type = sys.last_value = sys.last_traceback = None
        if hasattr(sys, "last_exc"):
            sys.last_exc = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return (yield)


@pytest.fixture
def gpu_to_itself():
    """One test at a time on the GPU among every xdist worker that asks for it (an exclusive file lock):
    for tests that need tens of GiB (real-width models), which several workers sharing one GPU would
    otherwise run out of memory for. Tests that do not ask are not held back."""
    with open(Path(tempfile.gettempdir()) / "moekit-tests-gpu.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)
