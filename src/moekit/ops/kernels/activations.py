"""The gated activations' jit pairs (jit code only), one `act` and one `grad` function per activation.

Every fused kernel, Triton (`moekit.ops.kernels.glu`) and Gluon (`moekit.ops.kernels.glu_hopper`),
takes the pair as two constexpr arguments (ACT, ACT_GRAD) and calls them in its epilogue, so an
activation is written once for every kernel. `moekit.ops.activations` is the registry that names
each pair beside its torch forward and backward; these functions are found there by name
(`<name>` and `<name>_grad`).

    act(g, u)          -> out                 gate g, up u, fp32 tensors of one shape
    grad(g, u, d_out)  -> (d_g, d_u)          d_out: the gradient of out, fp32

Both compute in fp32 from the rounded h the forward stored, with the same operations in the same
order in every kernel (the Triton and Gluon kernels give the same bits).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moekit.ops.kernels.constants import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT

# tl.minimum / tl.maximum return the other operand of a NaN on the GPU (fmin semantics) unless asked to
# keep it; the interpreter keeps it. The clamps and relu keep a NaN, as torch.clamp and relu do, so that
# a NaN in h reaches the output on every device.
KEEP_NAN = tl.constexpr(tl.PropagateNan.ALL)
CLAMP_LIMIT = tl.constexpr(CLAMPED_SWIGLU_LIMIT)
CLAMP_ALPHA = tl.constexpr(CLAMPED_SWIGLU_ALPHA)
# GELU: 1 / sqrt(2) (exact, erf) and sqrt(2 / pi), 0.044715 (tanh approximation); 1 / sqrt(2 * pi) for the
# derivative of the exact one.
_RSQRT2 = tl.constexpr(0.7071067811865476)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_RSQRT_2PI = tl.constexpr(0.3989422804014327)
_GELU_CUBIC = tl.constexpr(0.044715)


@triton.jit
def swiglu(g, u):
    """silu(g) * u."""
    return g * tl.sigmoid(g) * u


@triton.jit
def swiglu_grad(g, u, d_out):
    sig = tl.sigmoid(g)
    silu = g * sig
    return d_out * u * sig * (1.0 + g * (1.0 - sig)), d_out * silu


@triton.jit
def _times_mask(mask, term):
    """term where mask, else the term times zero: torch's product of a gradient term with a 0/1 mask
    (relu's, a clamp's), zero where the term is finite and NaN where it is not (a NaN gate or up, an
    inf), on every device; `tl.where(mask, term, 0.0)` would give zero there."""
    return tl.where(mask, term, term * 0.0)


@triton.jit
def _clamped(g, u):
    """gpt-oss's clamps, NaN kept: (min(g, 7), clamp(u, -7, 7))."""
    gc = tl.minimum(g, CLAMP_LIMIT, propagate_nan=KEEP_NAN)
    uc = tl.minimum(tl.maximum(u, -CLAMP_LIMIT, propagate_nan=KEEP_NAN), CLAMP_LIMIT, propagate_nan=KEEP_NAN)
    return gc, uc


@triton.jit
def clamped_swiglu(g, u):
    """gpt-oss: min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)."""
    gc, uc = _clamped(g, u)
    return gc * tl.sigmoid(CLAMP_ALPHA * gc) * (uc + 1.0)


@triton.jit
def clamped_swiglu_grad(g, u, d_out):
    # The clamps pass the gradient at the limit itself, as torch.clamp does.
    gc, uc = _clamped(g, u)
    sig = tl.sigmoid(CLAMP_ALPHA * gc)
    d_g = d_out * (uc + 1.0) * sig * (1.0 + CLAMP_ALPHA * gc * (1.0 - sig))
    d_u = d_out * gc * sig
    return _times_mask(g <= CLAMP_LIMIT, d_g), _times_mask((u >= -CLAMP_LIMIT) & (u <= CLAMP_LIMIT), d_u)


@triton.jit
def geglu(g, u):
    """gelu(g) * u, the exact (erf) GELU."""
    return 0.5 * g * (1.0 + tl.erf(g * _RSQRT2)) * u


@triton.jit
def geglu_grad(g, u, d_out):
    cdf = 0.5 * (1.0 + tl.erf(g * _RSQRT2))
    pdf = tl.exp(-0.5 * g * g) * _RSQRT_2PI
    return d_out * u * (cdf + g * pdf), d_out * g * cdf


@triton.jit
def _tanh(z):
    # tanh from exp(-2|z|), which never overflows: saturates to +-1 for large |z|.
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0.0, -t, t)


@triton.jit
def geglu_tanh(g, u):
    """gelu(g, approximate="tanh") * u."""
    t = _tanh(_SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g))
    return 0.5 * g * (1.0 + t) * u


@triton.jit
def geglu_tanh_grad(g, u, d_out):
    t = _tanh(_SQRT_2_OVER_PI * (g + _GELU_CUBIC * g * g * g))
    d_gelu = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_CUBIC * g * g)
    return d_out * u * d_gelu, d_out * 0.5 * g * (1.0 + t)


@triton.jit
def reglu(g, u):
    """relu(g) * u."""
    return tl.maximum(g, 0.0, propagate_nan=KEEP_NAN) * u


@triton.jit
def reglu_grad(g, u, d_out):
    # relu's derivative at 0 is 0, as torch's.
    d_g = d_out * u
    return _times_mask(g > 0.0, d_g), d_out * tl.maximum(g, 0.0, propagate_nan=KEEP_NAN)
