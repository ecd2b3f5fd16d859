"""The registry of gated activations: one entry per activation, used by every path of the package.

An entry names the activation and gives its torch forms, forward `act(g, u)` and backward
`grad(g, u, d_out) -> (d_g, d_u)`, which the composed paths, the float64 references and the CPU run.
Its jit pair, the kernels' ACT and ACT_GRAD, are the functions `<name>` and `<name>_grad` of
`moekit.ops.kernels.activations` (where every fused kernel, Triton and Gluon, finds them). Checkpoint
metadata, the modules and the transformers integration take the names from `ACTIVATIONS`.

Adding an activation is one entry here and its jit pair there: every path, the tests that run over
`ACTIVATIONS`, and the checkpoints' vocabulary take it from these two.

The gate g goes through the activation and multiplies the up u (`out = act(g) * u`, the gate first,
the opposite of `torch.nn.functional.glu`). Math in the inputs' dtype (the callers pass fp32 or
float64); the backward is the exact derivative, with torch's conventions at kinks (a clamp passes the
gradient at its limit, relu's derivative at 0 is 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moekit.ops.kernels.constants import CLAMPED_SWIGLU_ALPHA, CLAMPED_SWIGLU_LIMIT
from moekit.validation import check_choice

Tensor = torch.Tensor


@dataclass(frozen=True)
class Activation:
    """A gated activation: out = forward(g, u); backward(g, u, d_out) -> (d_g, d_u). gate_limit: the
    gate is clamped from above at it (None: not clamped); up_limit: the up is clamped to
    [-up_limit, up_limit] (None: not). The clamps are what a held, rounded copy of h must not blur
    (`moekit.ops.glu.to_held`)."""

    name: str
    forward: Callable[[Tensor, Tensor], Tensor]
    backward: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    description: str
    gate_limit: float | None = None
    up_limit: float | None = None


def _swiglu(g: Tensor, u: Tensor) -> Tensor:
    return F.silu(g) * u


def _swiglu_grad(g: Tensor, u: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    sig = torch.sigmoid(g)
    silu = g * sig
    return d * u * sig * (1 + g * (1 - sig)), d * silu


def _clamped_swiglu(g: Tensor, u: Tensor) -> Tensor:
    gc = g.clamp(max=CLAMPED_SWIGLU_LIMIT)
    uc = u.clamp(-CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_LIMIT)
    return gc * torch.sigmoid(CLAMPED_SWIGLU_ALPHA * gc) * (uc + 1)


def _clamped_swiglu_grad(g: Tensor, u: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    lim, alpha = CLAMPED_SWIGLU_LIMIT, CLAMPED_SWIGLU_ALPHA
    gc, uc = g.clamp(max=lim), u.clamp(-lim, lim)
    sig = torch.sigmoid(alpha * gc)
    d_g = d * (uc + 1) * sig * (1 + alpha * gc * (1 - sig)) * (g <= lim)
    d_u = d * gc * sig * ((u >= -lim) & (u <= lim))
    return d_g, d_u


def _geglu(g: Tensor, u: Tensor) -> Tensor:
    return F.gelu(g) * u


def _geglu_grad(g: Tensor, u: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    cdf = 0.5 * (1 + torch.erf(g * (1 / math.sqrt(2))))
    pdf = torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    return d * u * (cdf + g * pdf), d * g * cdf


_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)


def _geglu_tanh(g: Tensor, u: Tensor) -> Tensor:
    return F.gelu(g, approximate="tanh") * u


def _geglu_tanh_grad(g: Tensor, u: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    t = torch.tanh(_SQRT_2_OVER_PI * (g + 0.044715 * g**3))
    d_gelu = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * g * g)
    return d * u * d_gelu, d * 0.5 * g * (1 + t)


def _reglu(g: Tensor, u: Tensor) -> Tensor:
    return F.relu(g) * u


def _reglu_grad(g: Tensor, u: Tensor, d: Tensor) -> tuple[Tensor, Tensor]:
    return d * u * (g > 0), d * F.relu(g)


REGISTRY: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("swiglu", _swiglu, _swiglu_grad, "silu(g) * u"),
        Activation(
            "clamped_swiglu",
            _clamped_swiglu,
            _clamped_swiglu_grad,
            f"gpt-oss: g = min(g, {CLAMPED_SWIGLU_LIMIT}), u = clamp(u, -{CLAMPED_SWIGLU_LIMIT}, "
            f"{CLAMPED_SWIGLU_LIMIT}), g * sigmoid({CLAMPED_SWIGLU_ALPHA} g) * (u + 1)",
            gate_limit=CLAMPED_SWIGLU_LIMIT,
            up_limit=CLAMPED_SWIGLU_LIMIT,
        ),
        Activation("geglu", _geglu, _geglu_grad, "gelu(g) * u, the exact (erf) GELU"),
        Activation("geglu_tanh", _geglu_tanh, _geglu_tanh_grad, 'gelu(g, approximate="tanh") * u'),
        Activation("reglu", _reglu, _reglu_grad, "relu(g) * u"),
    )
}

ACTIVATIONS: tuple[str, ...] = tuple(REGISTRY)


def activation_named(name: str) -> Activation:
    """The registry's entry for `name`; one line naming the choices otherwise."""
    return REGISTRY[check_choice("activation", name, ACTIVATIONS)]
