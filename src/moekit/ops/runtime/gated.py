"""Host side of the gated activation on its own (`moekit.ops.kernels.gated`), planned and launched by the
recipe of `moekit.ops.runtime.launch`: the composed MLP's activation where fc1 is not fused with it.

Legend: M rows, F ffn size.
"""

from __future__ import annotations

import torch
import triton

from moekit.ops.kernels.gated import gated_backward_kernel, gated_forward_kernel
from moekit.ops.runtime.configs import GATED_TILES
from moekit.ops.runtime.glu import jit_pair
from moekit.ops.runtime.launch import Launcher, LaunchPlan, arch_of, device_ctx, plan_launch, tensor_key

_FORWARD = Launcher(gated_forward_kernel)
_BACKWARD = Launcher(gated_backward_kernel)


def _plan_forward(h_M2F: torch.Tensor, probs_M: torch.Tensor | None, glu_block: int, activation: str) -> LaunchPlan:
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    block_rows, block_c, warps = GATED_TILES[arch_of(h_M2F.device)]
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(ffn, block_c))
    ints = (rows, ffn, h_M2F.stride(0), ffn)
    constexprs = dict(
        GLU_BLOCK=glu_block,
        HAS_PROBS=probs_M is not None,
        ACT=jit_pair(activation)["ACT"],
        BLOCK_ROWS=block_rows,
        BLOCK_C=block_c,
        num_warps=warps,
    )
    return LaunchPlan(_FORWARD, grid, ints, constexprs)


def gated_forward(h_M2F: torch.Tensor, probs_M: torch.Tensor | None, glu_block: int, activation: str) -> torch.Tensor:
    """out (M, F) in h's dtype = ACT(gate(h), up(h)) (* probs per row), fp32 math, one rounding.

    h_M2F (M, 2F) with unit column stride, gates and ups in GLU blocks of `glu_block` (F: `[gate | up]`);
    probs_M (M,) contiguous or None; activation a registered name (its jit pair)."""
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    out = h_M2F.new_empty(rows, ffn)
    if out.numel() == 0:
        return out
    key = (tensor_key(h_M2F), tensor_key(probs_M), glu_block, activation)
    plan = plan_launch("gated_fwd", key, lambda: _plan_forward(h_M2F, probs_M, glu_block, activation))
    with device_ctx(h_M2F.device):
        plan(h_M2F, probs_M if probs_M is not None else h_M2F, out)
    return out


def _plan_backward(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_block: int,
    activation: str,
    need_d_probs: bool,
) -> LaunchPlan:
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    block_rows, block_c, warps = GATED_TILES[arch_of(h_M2F.device)]
    ints = (rows, ffn, h_M2F.stride(0), d_out_MF.stride(0), 2 * ffn)
    constexprs = dict(
        GLU_BLOCK=glu_block,
        HAS_PROBS=probs_M is not None,
        NEED_DPROBS=need_d_probs,
        **jit_pair(activation),
        BLOCK_ROWS=block_rows,
        BLOCK_C=block_c,
        num_warps=warps,
    )
    return LaunchPlan(_BACKWARD, (triton.cdiv(rows, block_rows),), ints, constexprs)


def gated_backward(
    h_M2F: torch.Tensor,
    probs_M: torch.Tensor | None,
    d_out_MF: torch.Tensor,
    glu_block: int,
    activation: str,
    need_d_probs: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dh (M, 2F) in h's dtype and order, d probs (M,) fp32 or None) of `gated_forward`: dh =
    ACT_GRAD(gate, up, d_out (* probs)); d probs[r] = sum over c of ACT(gate, up)[r, c] * d_out[r, c]
    (where probs and need_d_probs), one program's fixed-order fp32 sum per row. d_out_MF (M, F) with unit
    column stride; the rest as `gated_forward`."""
    rows, ffn = h_M2F.shape[0], h_M2F.shape[1] // 2
    dh = h_M2F.new_empty(rows, 2 * ffn)
    need_d_probs = need_d_probs and probs_M is not None
    d_probs = torch.zeros(rows, device=h_M2F.device, dtype=torch.float32) if need_d_probs else None
    if rows == 0 or ffn == 0:
        return dh, d_probs
    key = (tensor_key(h_M2F), tensor_key(probs_M), tensor_key(d_out_MF), glu_block, activation, need_d_probs)
    plan = plan_launch(
        "gated_bwd", key, lambda: _plan_backward(h_M2F, probs_M, d_out_MF, glu_block, activation, need_d_probs)
    )
    with device_ctx(h_M2F.device):
        plan(
            h_M2F,
            probs_M if probs_M is not None else h_M2F,
            d_out_MF,
            dh,
            d_probs if d_probs is not None else dh,
        )
    return dh, d_probs
