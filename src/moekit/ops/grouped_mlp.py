"""Grouped MLP: fc1 (H -> 2F) + gated activation (x router probability) + fc2 (F -> H), per expert.

Legend: M rows, N experts, H hidden size, F ffn size.

Per row r of expert e with probability p_r:
    y_r = fc2_e(act(fc1_e(x_r)) * p_r) + b2_e * p_r
so the probability scales both the activation output and the fc2 bias, and `probs` gets a gradient.
"""

from __future__ import annotations

import torch

from moekit._splits import MSplits, resolve_splits
from moekit.ops.grouped_linear import (
    Weight,
    _as_list,
    _check_params,
    grouped_linear,
    grouped_linear_reference,
)
from moekit.ops.swiglu import check_activation, check_interleave, swiglu, swiglu_reference


def _check_mlp(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias):
    n1, two_f = _check_params(x, _as_list(fc1_weight), _as_list(fc1_bias))
    if two_f % 2:
        raise ValueError(f"fc1 must map to 2F features (gate and up), got out_features={two_f}")
    ffn = two_f // 2
    fc2_in = [w.shape[-1] for w in _as_list(fc2_weight)]
    if fc2_in and fc2_in[0] != ffn:
        # Checked here so the message names fc2, not the activation that _check_params would call x.
        raise ValueError(f"fc2 takes {fc2_in[0]} input features; fc1's 2F = {two_f} outputs give F = {ffn}")
    probe = x.new_empty(0, ffn)
    n2, h_out = _check_params(probe, _as_list(fc2_weight), _as_list(fc2_bias))
    if n1 != n2:
        raise ValueError(f"fc1 has {n1} experts but fc2 has {n2}")
    if h_out != x.shape[1]:
        raise ValueError(f"fc2 maps to {h_out} features; expected the hidden size {x.shape[1]}")
    return n1, ffn


def grouped_mlp(
    x: torch.Tensor,
    fc1_weight: Weight,
    fc2_weight: Weight,
    m_splits: MSplits,
    *,
    probs: torch.Tensor | None = None,
    fc1_bias: Weight | None = None,
    fc2_bias: Weight | None = None,
    activation: str = "swiglu",
    glu_interleave_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Expert MLP over rows sorted by expert.

    x: (M, H). fc1_weight: (N, 2F, H) or N x (2F, H), rows in `[gate | up]` order or interleaved
    with `glu_interleave_size`. fc2_weight: (N, H, F) or N x (H, F). probs: optional (M,).
    Biases: (N, out), N x (out,) or None. Returns (M, H) in x's dtype; padding rows are zero.
    """
    check_activation(activation)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (rows, hidden), got shape {tuple(x.shape)}")
    num_experts, ffn = _check_mlp(x, fc1_weight, fc2_weight, fc1_bias, fc2_bias)
    check_interleave(ffn, glu_interleave_size)
    # Resolve once: one host->device copy for host splits, shared by both GEMMs and the backward.
    go = resolve_splits(m_splits, num_experts, x.shape[0], x.device)
    h = grouped_linear(x, fc1_weight, go, fc1_bias, backend=backend)
    a = swiglu(h, probs=probs, glu_interleave_size=glu_interleave_size, activation=activation)
    scale = probs.reshape(-1) if probs is not None and fc2_bias is not None else None
    return grouped_linear(a, fc2_weight, go, fc2_bias, backend=backend, bias_scale=scale)


def grouped_mlp_reference(
    x: torch.Tensor,
    fc1_weight: Weight,
    fc2_weight: Weight,
    m_splits: MSplits,
    *,
    probs: torch.Tensor | None = None,
    fc1_bias: Weight | None = None,
    fc2_bias: Weight | None = None,
    activation: str = "swiglu",
    glu_interleave_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """float64 reference of `grouped_mlp`; returns float64."""
    h = grouped_linear_reference(x, fc1_weight, m_splits, fc1_bias)
    a = swiglu_reference(h, probs=probs, glu_interleave_size=glu_interleave_size, activation=activation)
    return grouped_linear_reference(a, fc2_weight, m_splits, fc2_bias, bias_scale=probs)
