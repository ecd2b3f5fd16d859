"""Gated activations between the two expert linears (`glu`, `swiglu`), and the fc1 row-order conversions
(`interleave_glu`, `deinterleave_glu`).

Legend: M rows, F ffn size (the activation's output features).

fc1's output `h (M, 2F)` holds gates and ups. Standard order: `[all gates | all ups]`. With
`glu_interleave_size` (the GLU block) it comes in F / block blocks of 2 * block: `[g(block) u(block)]
...`, so one output tile of an fc1 GEMM holds both halves of the columns it produces (what a fused
GEMM + activation epilogue needs); block 1 is gpt-oss's alternating layout. Both orders are views of h as
(M, F / block, 2, block): the standard one is block = F.
"""

from __future__ import annotations

from typing import Any

import torch

from moekit.grouped_tensor import GroupedTensor
from moekit.ops import library
from moekit.ops.activations import activation_named
from moekit.ops.runtime.backends import gated_uses_triton, triton_unavailable_reason
from moekit.ops.splits import compute_dtype
from moekit.validation import check_float_tensor, check_int, check_same_device, check_tensor


def check_interleave(ffn_size: int, glu_interleave_size: int | None) -> int:
    """The GLU block (F for the standard layout) after validating `glu_interleave_size`: None or a
    positive int that divides F."""
    if glu_interleave_size is None:
        return ffn_size
    block = check_int("glu_interleave_size", glu_interleave_size, minimum=1)
    if ffn_size % block:
        raise ValueError(
            f"glu_interleave_size {block} does not divide the ffn size {ffn_size} (F % glu_interleave_size must be 0)"
        )
    return block


def check_probs(probs: torch.Tensor | None, rows: int, like: torch.Tensor) -> torch.Tensor | None:
    """`probs` (rows,) or (rows, 1), floating, on `like`'s device, as a (rows,) tensor; None stays None."""
    if probs is None:
        return None
    check_float_tensor("probs", probs)
    if probs.shape not in ((rows,), (rows, 1)):
        raise ValueError(f"probs must have shape ({rows},) or ({rows}, 1), one per row; got {tuple(probs.shape)}")
    check_same_device("probs", probs, "the input", like)
    return probs.reshape(rows)


def split_gate_up(h_M2F: torch.Tensor, glu_interleave_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up), each (..., F), of h (..., 2F) in either order."""
    if h_M2F.shape[-1] % 2:
        raise ValueError(f"the GLU input's last dimension must be even (2F), got {h_M2F.shape[-1]}")
    ffn = h_M2F.shape[-1] // 2
    block = check_interleave(ffn, glu_interleave_size)
    h_blocks = h_M2F.reshape(*h_M2F.shape[:-1], ffn // block, 2, block)
    gate = h_blocks[..., 0, :].reshape(*h_M2F.shape[:-1], ffn)
    up = h_blocks[..., 1, :].reshape(*h_M2F.shape[:-1], ffn)
    return gate, up


def join_gate_up(gate: torch.Tensor, up: torch.Tensor, glu_interleave_size: int | None) -> torch.Tensor:
    """The inverse of `split_gate_up`."""
    ffn = gate.shape[-1]
    block = check_interleave(ffn, glu_interleave_size)
    lead = gate.shape[:-1]
    h = torch.stack([gate.reshape(*lead, ffn // block, block), up.reshape(*lead, ffn // block, block)], dim=-2)
    return h.reshape(*lead, 2 * ffn)


def to_held(h_M2F: torch.Tensor, glu_interleave_size: int | None, activation: str) -> torch.Tensor:
    """h as a rounded copy held for the backward stores it (the quantized MLP's FP8 h): for an activation
    with clamps (`Activation.gate_limit`, `up_limit`: gpt-oss's), each value past its clamp replaced by
    twice the limit (with its sign), the others as they are; h itself for the rest.

    Why: past its clamp a value matters to the backward only as "past the clamp" (the activation sees
    the limit, the derivative is 0), but an FP8 rounding (3 mantissa bits: up to 1/16 of the value) moves
    values near the limit to its other side, and the derivative with them. Held this way, the values on
    the inner side still round across the limit, to at most 17/16 of it, which `from_held` clamps back;
    the replaced ones stay above 3/2 of it, which it keeps: no value changes side. (A block whose other
    values are so large that twice the limit falls under FP8's normal range loses it; such a block's
    in-range values are lost to the rounding already.)"""
    act = activation_named(activation)
    if act.gate_limit is None and act.up_limit is None:
        return h_M2F
    return _held_form(h_M2F, glu_interleave_size, act.gate_limit, act.up_limit, to_held=True)


def from_held(h_M2F: torch.Tensor, glu_interleave_size: int | None, activation: str) -> torch.Tensor:
    """The inverse of `to_held` for the activation (its backward and the activation itself give the same
    values on it as on h, up to the rounding of the in-range values): values within 3/2 of a limit
    clamped to it, the others (past the clamp) kept. h itself for an activation without clamps."""
    act = activation_named(activation)
    if act.gate_limit is None and act.up_limit is None:
        return h_M2F
    return _held_form(h_M2F, glu_interleave_size, act.gate_limit, act.up_limit, to_held=False)


def _held_form(
    h_M2F: torch.Tensor,
    glu_interleave_size: int | None,
    gate_limit: float | None,
    up_limit: float | None,
    to_held: bool,
) -> torch.Tensor:
    ffn = h_M2F.shape[1] // 2
    block = check_interleave(ffn, glu_interleave_size)
    out = h_M2F.clone(memory_format=torch.contiguous_format)
    v = out.view(h_M2F.shape[0], ffn // block, 2, block)
    if gate_limit is not None:
        g = v[:, :, 0]
        if to_held:
            g.copy_(torch.where(g > gate_limit, 2 * gate_limit, g))
        else:
            g.copy_(torch.where(g > 1.5 * gate_limit, g, g.clamp(max=gate_limit)))
    if up_limit is not None:
        u = v[:, :, 1]
        if to_held:
            u.copy_(torch.where(u.abs() > up_limit, 2 * up_limit * u.sign(), u))
        else:
            u.copy_(torch.where(u.abs() > 1.5 * up_limit, u, u.clamp(-up_limit, up_limit)))
    return out


def gated_on_kernel(probs_M: torch.Tensor | None, use_triton: bool) -> bool:
    """Whether the gated activation runs on moekit's kernel: where the caller asks for it (`use_triton`)
    and the probs, if any, are of a dtype the kernels take (float64 probs keep the torch ops' float64
    math)."""
    return use_triton and (probs_M is None or triton_unavailable_reason(probs_M.device, probs_M.dtype) is None)


def gated_activation(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
    use_triton: bool,
) -> torch.Tensor:
    """The gated activation's values, not differentiable: (M, F) in h's dtype = ACT(gate(h), up(h))
    (* probs), fp32 math (float64 for float64 operands), one rounding. On moekit's kernel where
    `use_triton` (`gated_on_kernel`'s answer; h and probs then with unit column stride), else torch ops.
    `_GluFn` and the quantized MLP's node 2 (which computes the activation again in its backward from the
    h it held) both compute it here."""
    if use_triton:
        glu_block = check_interleave(h_M2F.shape[1] // 2, glu_interleave_size)
        return library.gated_forward(h_M2F, probs_M, glu_block, activation)
    act = activation_named(activation)
    gate, up = split_gate_up(h_M2F, glu_interleave_size)
    acc_t = compute_dtype(h_M2F, probs_M)
    out = act.forward(gate.to(acc_t), up.to(acc_t))
    if probs_M is not None:
        out = out * probs_M.to(acc_t)[:, None]
    return out.to(h_M2F.dtype)


def gated_activation_backward(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_interleave_size: int | None,
    activation: str,
    use_triton: bool,
    need_d_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`gated_activation`'s backward: (dh (M, 2F) in h's dtype and order, d probs (M,) in probs' dtype, or
    None where there are no probs or need_d_probs is False), from h and d out (M, F) alone: the
    activation is computed again, in fp32."""
    need_d_probs = need_d_probs and probs_M is not None
    if use_triton:
        glu_block = check_interleave(h_M2F.shape[1] // 2, glu_interleave_size)
        d_out_MF = d_out_MF if d_out_MF.stride(-1) == 1 else d_out_MF.contiguous()
        dh, d_probs32 = library.gated_backward(h_M2F, probs_M, d_out_MF, glu_block, activation, need_d_probs)
        return dh, (d_probs32.to(probs_M.dtype) if need_d_probs and probs_M is not None else None)
    act = activation_named(activation)
    gate, up = split_gate_up(h_M2F, glu_interleave_size)
    acc_t = compute_dtype(h_M2F, probs_M)
    gate, up, d_out = gate.to(acc_t), up.to(acc_t), d_out_MF.to(acc_t)
    d_probs = None
    if probs_M is not None:
        if need_d_probs:
            d_probs = (act.forward(gate, up) * d_out).sum(-1).to(probs_M.dtype)
        d_out = d_out * probs_M.to(acc_t)[:, None]
    d_gate, d_up = act.backward(gate, up, d_out)
    return join_gate_up(d_gate, d_up, glu_interleave_size).to(h_M2F.dtype), d_probs


def held_gated_activation(
    h_q: GroupedTensor, probs_M: torch.Tensor | None, glu_interleave_size: int | None, activation: str
) -> torch.Tensor:
    """`gated_activation` on moekit's kernel of h held in FP8: h_q the rowwise quantization of
    `to_held(h)`, read in the kernel's load (data * scales in fp32, one rounding to h_q's dtype, then
    `from_held`): the values of `gated_activation(from_held(h_q.dequantize()))`, without the (M, 2F)
    tensor in between. (M, F) in h_q's dtype; probs contiguous or None."""
    data, scale, recipe = h_q.rowwise_data, h_q.rowwise_scale_inv, h_q.recipe
    assert data is not None and scale is not None and recipe is not None  # a rowwise quantization
    glu_block = check_interleave(data.shape[1] // 2, glu_interleave_size)
    gate_limit, up_limit = _limits(activation)
    return library.held_gated_forward(
        data, scale, probs_M, glu_block, activation, recipe, h_q.dtype, gate_limit, up_limit
    )


def held_gated_activation_backward(
    h_q: GroupedTensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_interleave_size: int | None,
    activation: str,
    need_d_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`gated_activation_backward` on moekit's kernel of h held in FP8 (`held_gated_activation`'s h_q):
    (dh (M, 2F) in d_out's dtype, d probs (M,) in probs' dtype or None)."""
    data, scale, recipe = h_q.rowwise_data, h_q.rowwise_scale_inv, h_q.recipe
    assert data is not None and scale is not None and recipe is not None  # a rowwise quantization
    glu_block = check_interleave(data.shape[1] // 2, glu_interleave_size)
    gate_limit, up_limit = _limits(activation)
    need_d_probs = need_d_probs and probs_M is not None
    d_out_MF = d_out_MF if d_out_MF.stride(-1) == 1 else d_out_MF.contiguous()
    dh, d_probs32 = library.held_gated_backward(
        data, scale, probs_M, d_out_MF, glu_block, activation, recipe, gate_limit, up_limit, need_d_probs
    )
    return dh, (d_probs32.to(probs_M.dtype) if need_d_probs and probs_M is not None else None)


def _limits(activation: str) -> tuple[float, float]:
    """The activation's (gate, up) clamps as the held-h kernels take them, 0.0 for none."""
    act = activation_named(activation)
    return act.gate_limit or 0.0, act.up_limit or 0.0


class _GluFn(torch.autograd.Function):
    """Saves only h (and probs); the backward recomputes the activation in fp32. With use_triton both
    directions run moekit's kernel (one pass each, `moekit.ops.kernels.gated`), else plain torch ops."""

    @staticmethod
    def forward(
        ctx: Any,
        h_M2F: torch.Tensor,
        probs_M: torch.Tensor | None,
        glu_interleave_size: int | None,
        activation: str,
        use_triton: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(h_M2F, probs_M)
        ctx.glu_interleave_size, ctx.activation, ctx.use_triton = glu_interleave_size, activation, use_triton
        return gated_activation(h_M2F, probs_M, glu_interleave_size, activation, use_triton)

    @staticmethod
    def backward(ctx: Any, d_out_MF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None, None]:
        h_M2F, probs_M = ctx.saved_tensors
        need_d_probs = probs_M is not None and ctx.needs_input_grad[1]
        dh, d_probs = gated_activation_backward(
            h_M2F, probs_M, d_out_MF, ctx.glu_interleave_size, ctx.activation, ctx.use_triton, need_d_probs
        )
        return dh, d_probs, None, None, None


def _check_h(h: torch.Tensor) -> None:
    check_float_tensor("h", h)
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"h must be 2-D (rows, 2F) with an even number of columns, got shape {tuple(h.shape)}")


def glu(
    h: torch.Tensor,
    *,
    activation: str = "swiglu",
    probs: torch.Tensor | None = None,
    glu_interleave_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Gated activation of fc1's output: out = act(gate) * up (* probs per row).

    h: (M, 2F) gates and ups, standard or interleaved order (module doc). activation: a name of
    `moekit.ops.activations.ACTIVATIONS`. probs: optional (M,) router probabilities that scale each
    output row. Returns (M, F) in h's dtype; math in fp32 (float64 for float64 h) with one rounding.
    backend: "auto" runs moekit's kernel on CUDA where it runs (fp32, bf16, fp16), "triton" wherever it
    runs (the CPU under TRITON_INTERPRET=1), "torch" / "loop" plain torch ops; the same values up to
    the order of fp32 operations.
    """
    activation_named(activation)
    _check_h(h)
    probs = check_probs(probs, h.shape[0], h)
    check_interleave(h.shape[1] // 2, glu_interleave_size)
    return apply_glu(h, probs, glu_interleave_size, activation, gated_uses_triton(backend, h))


def apply_glu(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    glu_interleave_size: int | None,
    activation: str,
    use_triton: bool,
) -> torch.Tensor:
    """`glu` on checked arguments (h (M, 2F), probs (M,) or None), on moekit's kernel where use_triton
    (the caller's choice for h: `gated_uses_triton`, or the composed MLP's layer-wide `use_triton_rows`)."""
    use_triton = gated_on_kernel(probs_M, use_triton)
    if use_triton:  # unit-stride operands
        h_M2F = h_M2F if h_M2F.stride(-1) == 1 else h_M2F.contiguous()
        probs_M = probs_M.contiguous() if probs_M is not None else None
    return _GluFn.apply(h_M2F, probs_M, glu_interleave_size, activation, use_triton)


def swiglu(
    h: torch.Tensor, *, probs: torch.Tensor | None = None, glu_interleave_size: int | None = None
) -> torch.Tensor:
    """`glu` with the SwiGLU activation: silu(gate) * up (* probs)."""
    return glu(h, activation="swiglu", probs=probs, glu_interleave_size=glu_interleave_size)


def glu_reference(
    h: torch.Tensor,
    *,
    activation: str = "swiglu",
    probs: torch.Tensor | None = None,
    glu_interleave_size: int | None = None,
) -> torch.Tensor:
    """float64 reference of `glu` (autograd through plain torch ops); returns float64."""
    gate, up = split_gate_up(h.double(), glu_interleave_size)
    out = activation_named(activation).forward(gate, up)
    if probs is not None:
        out = out * probs.double().reshape(-1, 1)
    return out


def interleave_glu(t: torch.Tensor, glu_interleave_size: int, dim: int = 0) -> torch.Tensor:
    """Reorder `dim` (length 2F, standard `[gates; ups]`) into GLU blocks of `glu_interleave_size`.

    For an fc1 weight (2F, H) or bias (2F,) use dim=0; for a grouped (N, 2F, H) weight or (N, 2F) bias
    use dim=1. Returns a new contiguous tensor.
    """
    return _reorder(t, glu_interleave_size, dim, to_interleaved=True)


def deinterleave_glu(t: torch.Tensor, glu_interleave_size: int, dim: int = 0) -> torch.Tensor:
    """Inverse of `interleave_glu`: blocks of `glu_interleave_size` along `dim` back to `[gates; ups]`."""
    return _reorder(t, glu_interleave_size, dim, to_interleaved=False)


def _reorder(t: torch.Tensor, glu_interleave_size: int, dim: int, to_interleaved: bool) -> torch.Tensor:
    check_tensor("t", t)
    dim = check_int("dim", dim)
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(t.shape)}")
    dim = dim % t.dim()
    length = t.shape[dim]
    if length % 2:
        raise ValueError(f"dimension {dim} of shape {tuple(t.shape)} must have even length 2F, got {length}")
    ffn = length // 2
    if glu_interleave_size is None:
        raise ValueError("glu_interleave_size must be an int; the standard layout needs no conversion")
    block = check_interleave(ffn, glu_interleave_size)
    lead, tail = t.shape[:dim], t.shape[dim + 1 :]
    if to_interleaved:  # [2, F/block, block] -> [F/block, 2, block]
        v = t.reshape(*lead, 2, ffn // block, block, *tail).transpose(dim, dim + 1)
    else:
        v = t.reshape(*lead, ffn // block, 2, block, *tail).transpose(dim, dim + 1)
    return v.reshape(t.shape).contiguous()
