"""The activation registry (moekit.ops.activations): every entry's torch backward is the exact derivative
of its forward (float64 autograd), its jit pair exists in moekit.ops.kernels.activations and nothing else
does, and the pair computes the registry's values (Triton interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

import moekit
from moekit.ops.activations import ACTIVATIONS, REGISTRY, activation_named


def _gate_up(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Values across every regime: the clamps at +-7, relu's kink side, gelu's tails.
    g = torch.cat([torch.linspace(-9, 9, 61, dtype=torch.float64), torch.randn(60, generator=gen, dtype=torch.float64)])
    u = torch.cat([torch.linspace(8, -8, 61, dtype=torch.float64), torch.randn(60, generator=gen, dtype=torch.float64)])
    return g, u


def test_registry_names_are_the_public_tuple():
    assert moekit.ACTIVATIONS == ACTIVATIONS == tuple(REGISTRY)
    assert set(ACTIVATIONS) == {"swiglu", "clamped_swiglu", "geglu", "geglu_tanh", "reglu"}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_torch_backward_is_the_derivative_of_the_forward(name):
    act = activation_named(name)
    g, u = _gate_up(0)
    # Off the kinks (clamp limits, relu at 0), where the derivative is defined.
    keep = ((g - 7).abs() > 1e-3) & ((u.abs() - 7).abs() > 1e-3) & (g.abs() > 1e-3)
    g, u = g[keep].requires_grad_(), u[keep].requires_grad_()
    d_out = torch.randn(g.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    act.forward(g, u).backward(d_out)
    d_g, d_u = act.backward(g.detach(), u.detach(), d_out)
    torch.testing.assert_close(d_g, g.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_u, u.grad, rtol=1e-12, atol=1e-12)


def test_kinks_follow_torch():
    """At the kinks the backward takes torch's conventions: a clamp passes the gradient at its limit,
    relu's derivative at 0 is 0."""
    for name, g0, u0 in (("clamped_swiglu", 7.0, 7.0), ("clamped_swiglu", 1.0, -7.0), ("reglu", 0.0, 2.0)):
        act = activation_named(name)
        g = torch.tensor([g0], dtype=torch.float64, requires_grad=True)
        u = torch.tensor([u0], dtype=torch.float64, requires_grad=True)
        act.forward(g, u).backward(torch.ones(1, dtype=torch.float64))
        d_g, d_u = act.backward(g.detach(), u.detach(), torch.ones(1, dtype=torch.float64))
        torch.testing.assert_close(d_g, g.grad, rtol=1e-12, atol=0, msg=name)
        torch.testing.assert_close(d_u, u.grad, rtol=1e-12, atol=0, msg=name)


def test_unknown_activation_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"unknown activation 'gelu'; expected one of \('swiglu'"):
        activation_named("gelu")
    with pytest.raises(TypeError, match="activation must be one of"):
        activation_named(None)


def test_every_entry_has_its_jit_pair_and_no_pair_is_unregistered():
    kernels = pytest.importorskip("moekit.ops.kernels.activations")
    import triton

    pairs = {name for name, v in vars(kernels).items() if isinstance(v, triton.runtime.JITFunction)}
    pairs |= {name for name, v in vars(kernels).items() if type(v).__name__ == "InterpretedFunction"}
    expected = {n for name in ACTIVATIONS for n in (name, name + "_grad")}
    assert expected <= pairs
    assert {p for p in pairs if not p.startswith("_")} == expected


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the jit pairs run under the interpreter")
@pytest.mark.parametrize("name", ACTIVATIONS)
def test_jit_pair_matches_the_registry(name):
    import triton
    import triton.language as tl

    from moekit.ops.runtime.glu import jit_pair

    @triton.jit
    def kernel(g_ptr, u_ptr, d_ptr, out_ptr, dg_ptr, du_ptr, ACT: tl.constexpr, ACT_GRAD: tl.constexpr):
        offs = tl.arange(0, 128)
        g, u, d = tl.load(g_ptr + offs), tl.load(u_ptr + offs), tl.load(d_ptr + offs)
        tl.store(out_ptr + offs, ACT(g, u))
        d_g, d_u = ACT_GRAD(g, u, d)
        tl.store(dg_ptr + offs, d_g)
        tl.store(du_ptr + offs, d_u)

    g, u = _gate_up(2)
    g, u = torch.cat([g, g[:7]]).float(), torch.cat([u, u[:7]]).float()  # 128 values
    d = torch.randn(128, generator=torch.Generator().manual_seed(3))
    out, d_g, d_u = (torch.full((128,), float("nan")) for _ in range(3))
    kernel[(1,)](g, u, d, out, d_g, d_u, **jit_pair(name))
    act = activation_named(name)
    ref_g, ref_u = act.backward(g.double(), u.double(), d.double())
    torch.testing.assert_close(out.double(), act.forward(g.double(), u.double()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_g.double(), ref_g, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(d_u.double(), ref_u, rtol=1e-5, atol=1e-5)


def _nan_cases(device: str) -> torch.Tensor:
    """h (4, 2 * 32) with a NaN gate (row 0), a NaN up beside a negative gate (row 1: relu's and the
    clamps' masks are 0 there), a NaN up beside a gate past the clamp (row 2) and an inf up (row 3)."""
    h = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    h[0, 3] = float("nan")
    h[1, 5], h[1, 32 + 5] = -1.0, float("nan")
    h[2, 7], h[2, 32 + 7] = 100.0, float("nan")
    h[3, 9], h[3, 32 + 9] = -1.0, float("inf")
    return h.to(device)


def _nan_pattern(name: str, h: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    h = h.clone().requires_grad_()
    out = moekit.glu(h, activation=name, backend=backend)
    out.backward(torch.ones_like(out))
    return torch.isnan(out), torch.isnan(h.grad)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel runs under the interpreter")
@pytest.mark.parametrize("name", sorted(moekit.ACTIVATIONS))
def test_non_finite_h_gives_torchs_nans(name):
    """moekit's gated kernel gives NaN in the output and in h's gradient exactly where torch's ops do, for
    a NaN gate, a NaN up where the activation's mask is zero, and an inf up (the term times the mask:
    NaN, not zero). Under the interpreter here; on the GPU below."""
    h = _nan_cases("cpu")
    kernel, ref = _nan_pattern(name, h, "triton"), _nan_pattern(name, h, "torch")
    assert torch.equal(kernel[0], ref[0]) and torch.equal(kernel[1], ref[1]), name
    assert ref[0][0].any() and ref[1][1].any()  # the cases reach the output and the gradient


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(moekit.ACTIVATIONS))
def test_non_finite_h_gives_torchs_nans_on_the_gpu(name):
    """The same on the GPU, where tl.minimum / tl.maximum drop a NaN operand unless asked to keep it (the
    interpreter keeps it, so only the GPU can tell)."""
    h = _nan_cases("cuda")
    kernel, ref = _nan_pattern(name, h, "triton"), _nan_pattern(name, h, "torch")
    assert torch.equal(kernel[0], ref[0]) and torch.equal(kernel[1], ref[1]), name
