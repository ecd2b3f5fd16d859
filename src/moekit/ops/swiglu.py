"""Gated activations between the two expert linears, and the fc1 row-order conversions.

Legend (moekit.ops): M rows, F ffn size (output features). The GLU block size, `glu_interleave_size`,
has no letter: `block` below (F for the standard layout).

fc1's output `h (M, 2F)` holds gates and ups. Standard order: `[all gates | all ups]`. With
interleave size `block` it comes in F/block blocks of 2 * block: `[g(block) u(block)] ...`, so one output tile of
an fc1 GEMM holds both halves of the columns it produces (what a fused GEMM+SwiGLU epilogue needs).
Both orders are views of `h` as (M, F/block, 2, block): the standard one is block = F.
"""

from __future__ import annotations

import torch

from moekit._splits import compute_dtype

ACTIVATIONS = ("swiglu", "clamped_swiglu")
CLAMPED_SWIGLU_LIMIT = 7.0
CLAMPED_SWIGLU_ALPHA = 1.702


def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")


def check_interleave(ffn_size: int, k: int | None) -> int:
    """Return the effective block size (F for the standard layout) after validating k."""
    if k is None:
        return ffn_size
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"glu_interleave_size must be a positive int or None, got {k!r}")
    if ffn_size % k:
        raise ValueError(f"glu_interleave_size {k} does not divide the ffn size {ffn_size} (F % k must be 0)")
    return k


def _split_gate_up(h_M2F: torch.Tensor, k: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    if h_M2F.shape[-1] % 2:
        raise ValueError(f"the GLU input's last dimension must be even (2F), got {h_M2F.shape[-1]}")
    ffn = h_M2F.shape[-1] // 2
    block = check_interleave(ffn, k)
    h_blocks = h_M2F.reshape(*h_M2F.shape[:-1], ffn // block, 2, block)
    gate = h_blocks[..., 0, :].reshape(*h_M2F.shape[:-1], ffn)
    up = h_blocks[..., 1, :].reshape(*h_M2F.shape[:-1], ffn)
    return gate, up


def _join_gate_up(gate: torch.Tensor, up: torch.Tensor, k: int | None) -> torch.Tensor:
    ffn = gate.shape[-1]
    block = check_interleave(ffn, k)
    lead = gate.shape[:-1]
    h = torch.stack([gate.reshape(*lead, ffn // block, block), up.reshape(*lead, ffn // block, block)], dim=-2)
    return h.reshape(*lead, 2 * ffn)


def _act_fwd(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "swiglu":
        return torch.nn.functional.silu(gate) * up
    g = gate.clamp(max=CLAMPED_SWIGLU_LIMIT)
    u = up.clamp(-CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_LIMIT)
    return g * torch.sigmoid(CLAMPED_SWIGLU_ALPHA * g) * (u + 1)


def _act_bwd(gate, up, d_out, activation):
    """d gate, d up of the activation given d out (all fp32). Clamps pass gradient at the limit
    itself, as torch.clamp does."""
    if activation == "swiglu":
        sig = torch.sigmoid(gate)
        silu = gate * sig
        return d_out * up * sig * (1 + gate * (1 - sig)), d_out * silu
    lim, alpha = CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_ALPHA
    g = gate.clamp(max=lim)
    u = up.clamp(-lim, lim)
    sig = torch.sigmoid(alpha * g)
    d_g = d_out * (u + 1) * sig * (1 + alpha * g * (1 - sig)) * (gate <= lim)
    d_u = d_out * g * sig * ((up >= -lim) & (up <= lim))
    return d_g, d_u


class _GluFn(torch.autograd.Function):
    """Saves only h (and probs); the backward recomputes the activation in fp32."""

    @staticmethod
    def forward(ctx, h_M2F, probs_M, k, activation):
        gate, up = _split_gate_up(h_M2F, k)
        acc_t = compute_dtype(h_M2F, probs_M)
        out = _act_fwd(gate.to(acc_t), up.to(acc_t), activation)
        if probs_M is not None:
            out = out * probs_M.to(acc_t)[:, None]
        ctx.save_for_backward(h_M2F, probs_M)
        ctx.k, ctx.activation = k, activation
        return out.to(h_M2F.dtype)

    @staticmethod
    def backward(ctx, d_out_MF):
        h_M2F, probs_M = ctx.saved_tensors
        gate, up = _split_gate_up(h_M2F, ctx.k)
        acc_t = compute_dtype(h_M2F, probs_M)
        gate, up, d_out = gate.to(acc_t), up.to(acc_t), d_out_MF.to(acc_t)
        d_probs = None
        if probs_M is not None:
            if ctx.needs_input_grad[1]:
                d_probs = (_act_fwd(gate, up, ctx.activation) * d_out).sum(-1).to(probs_M.dtype)
            d_out = d_out * probs_M.to(acc_t)[:, None]
        d_gate, d_up = _act_bwd(gate, up, d_out, ctx.activation)
        return _join_gate_up(d_gate, d_up, ctx.k).to(h_M2F.dtype), d_probs, None, None


def _check_probs(h: torch.Tensor, probs: torch.Tensor | None) -> torch.Tensor | None:
    if probs is None:
        return None
    rows = h.shape[0]
    if probs.shape not in ((rows,), (rows, 1)):
        raise ValueError(f"probs must have shape ({rows},) or ({rows}, 1), one per row; got {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise TypeError(f"probs must be floating point, got {probs.dtype}")
    if probs.device != h.device:
        raise ValueError(f"probs is on {probs.device} but the input is on {h.device}")
    return probs.reshape(rows)


def swiglu(
    h: torch.Tensor,
    *,
    probs: torch.Tensor | None = None,
    glu_interleave_size: int | None = None,
    activation: str = "swiglu",
) -> torch.Tensor:
    """Gated activation of fc1's output.

    h: (M, 2F) gates and ups (standard or interleaved order, see module doc).
    probs: optional (M,) router probabilities that scale each output row.
    Returns (M, F) in h's dtype; math in fp32 with one rounding at the end.
    """
    check_activation(activation)
    if h.dim() != 2:
        raise ValueError(f"h must be 2-D (rows, 2F), got shape {tuple(h.shape)}")
    probs = _check_probs(h, probs)
    check_interleave(h.shape[1] // 2, glu_interleave_size)
    return _GluFn.apply(h, probs, glu_interleave_size, activation)


def swiglu_reference(
    h: torch.Tensor,
    *,
    probs: torch.Tensor | None = None,
    glu_interleave_size: int | None = None,
    activation: str = "swiglu",
) -> torch.Tensor:
    """float64 reference of `swiglu` (autograd through plain torch ops); returns float64."""
    check_activation(activation)
    gate, up = _split_gate_up(h.double(), glu_interleave_size)
    out = _act_fwd(gate, up, activation)
    if probs is not None:
        out = out * probs.double().reshape(-1, 1)
    return out


def interleave_glu(t: torch.Tensor, k: int, dim: int = 0) -> torch.Tensor:
    """Reorder `dim` (length 2F, standard `[gates; ups]`) into interleave blocks of size k.

    For an fc1 weight (2F, H) or bias (2F,) use dim=0; for a grouped (N, 2F, H) weight or
    (N, 2F) bias use dim=1. Returns a new contiguous tensor.
    """
    return _reorder(t, k, dim, to_interleaved=True)


def deinterleave_glu(t: torch.Tensor, k: int, dim: int = 0) -> torch.Tensor:
    """Inverse of `interleave_glu`: interleave-k order along `dim` back to `[gates; ups]`."""
    return _reorder(t, k, dim, to_interleaved=False)


def _reorder(t: torch.Tensor, k: int, dim: int, to_interleaved: bool) -> torch.Tensor:
    dim = dim % t.dim()
    length = t.shape[dim]
    if length % 2:
        raise ValueError(f"dimension {dim} of shape {tuple(t.shape)} must have even length 2F, got {length}")
    ffn = length // 2
    if k is None:
        raise ValueError("k must be an int; the standard layout needs no conversion")
    check_interleave(ffn, k)
    lead, tail = t.shape[:dim], t.shape[dim + 1 :]
    if to_interleaved:
        # [2, F/k, k] -> [F/k, 2, k]
        v = t.reshape(*lead, 2, ffn // k, k, *tail).transpose(dim, dim + 1)
    else:
        v = t.reshape(*lead, ffn // k, 2, k, *tail).transpose(dim, dim + 1)
    return v.reshape(t.shape).contiguous()
