"""moekit.ops.runtime.launch: the keys under which a compiled binary is reused must be at least as
fine as Triton's own specialization (else a binary compiled for aligned or divisible arguments
would run on others); plans and their cache; the passthrough under the interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from moekit.ops.runtime import launch as triton_launch  # noqa: E402


def _triton_specialization():
    """Triton's own argument specialization for an sm_90 target (no GPU needed)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    return lambda arg: native_specialize_impl(backend, arg, False, True, True)


def _tensors():
    base = torch.empty(64, dtype=torch.float32)
    out = [
        base,
        base[1:],
        base[4:],
        torch.empty(8, dtype=torch.bfloat16),
        torch.empty(8, dtype=torch.bfloat16)[3:],
        torch.empty(8, dtype=torch.int64),
    ]
    assert base.data_ptr() % 16 == 0, "the test needs one aligned tensor"
    return out


INTS = [
    0,
    1,
    2,
    3,
    15,
    16,
    17,
    32,
    48,
    -1,
    -16,
    -17,
    2**31 - 16,
    2**31 - 1,
    2**31,
    2**31 + 16,
    2**32,
    -(2**31),
    -(2**31) - 16,
    2**62,
    2**63,
    2**63 + 16,
    2**64 - 16,
]


def test_arg_key_is_at_least_as_fine_as_triton_specialization():
    specialize = _triton_specialization()
    seen: dict = {}
    for arg in [*INTS, *_tensors(), True, False, 1.0, 2.5, None]:
        key = (type(arg), triton_launch.arg_key(arg))
        spec = specialize(arg)
        assert seen.setdefault(key, spec) == spec, f"{arg!r}: same key as an argument Triton specializes apart"


def test_arg_key_separates_what_triton_separates_for_tensors():
    keys = {triton_launch.arg_key(t) for t in _tensors()}
    # float32 aligned / unaligned (two views), bf16 aligned / unaligned, int64 aligned.
    assert len(keys) == 5


def test_tensor_key_covers_alignment_shape_strides_dtype():
    base = torch.empty(64)
    keys = [
        triton_launch.tensor_key(t)
        for t in (base[:16], base[1:17], base[:16].view(4, 4), base[:32].view(4, 8)[:, ::2], base[:16].double())
    ]
    assert len(set(keys)) == len(keys)
    assert triton_launch.tensor_key(None) is None


def test_plan_cache_empties_past_its_limit():
    cache = triton_launch.PlanCache(limit=3)
    for i in range(3):
        cache.put(i, str(i))
    assert len(cache) == 3
    assert cache.put(3, "3") == "3" and dict(cache) == {3: "3"}


def test_interpreter_launches_take_tritons_path():
    """Under the interpreter (CPU tests) a launcher and a plan are plain `kernel[grid](...)` calls."""
    from moekit.ops.kernels.rows import gather_sum_rows_kernel

    if not triton_launch.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (the root conftest sets it on CPU machines)")
    launcher = triton_launch.Launcher(gather_sum_rows_kernel)
    assert not launcher.direct
    src = torch.arange(12.0).view(4, 3)
    index = torch.tensor([[2], [0]])
    out = torch.full((2, 3), float("nan"))
    plan = triton_launch.LaunchPlan(
        launcher, (1, 1), (2, 3, 1, 3, 3), dict(HAS_WEIGHT=False, COPY=True, BLOCK_ROWS=2, BLOCK_D=4, num_warps=4)
    )
    plan(src, index, src, out)
    assert torch.equal(out, src[[2, 0]])
