"""fc1 + activation over x's token rows read through the routing's token map (`glu_forward_gathered`):
by definition `glu_forward` of the gathered rows x[token_of_row], bit for bit. On an sm_90 GPU the
Hopper kernel gathers in its operand loads (GATHER); elsewhere the rows are gathered first.

legend: T tokens, M routed rows, N experts, H hidden size, F ffn size, K top-k.

On the CPU: argument checks, which path is taken, the gather-first path under the interpreter (float16
and float32: the interpreter's bfloat16 dot is wrong), and the GATHER kernel compiled for sm_90 (its
load loop's instructions read from the PTX). On an H200 (`-m gpu`): the GATHER kernel against gather +
kernel bit for bit. `moe_experts` takes this op where `gathered_fc1_pays` (F up to
configs.GATHERED_FC1_MAX_FFN; notes/moe_experts.md, "The gathered forms"); the op also stands on its own.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("moekit.ops.runtime.glu")

from helpers import CUDA, compile_in_subprocess  # noqa: E402
from moekit.ops.runtime import configs, launch  # noqa: E402
from moekit.ops.runtime import glu as rglu  # noqa: E402

ON_CPU = launch.unavailable_reason("cpu", torch.float32) is None
cpu_only = pytest.mark.skipif(not ON_CPU, reason="needs the Triton interpreter (TRITON_INTERPRET=1 before import)")
on_sm90 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU"
)


def offs_of(splits, device):
    o = [0]
    for s in splits:
        o.append(o[-1] + s)
    return torch.tensor(o, device=device, dtype=torch.int64)


def problem(T, splits, pad, H, F, dtype, device, *, bias=False, probs=True, seed=0, transposed=False):
    """x (T, H), a token map of sum(splits) + pad rows (padding rows' tokens: T + 10**6, never to be
    read by the kernel; `valid` has them at 0 for the gather-first reference), w1, offs, bias, probs."""
    gen = torch.Generator().manual_seed(seed)
    N, rows = len(splits), sum(splits)
    x = (torch.randn(T, H, generator=gen) * 2).to(device, dtype)
    tokens = torch.randint(0, T, (rows + pad, 1), generator=gen)
    valid = tokens.clone()
    tokens[rows:] = T + 10**6
    valid[rows:] = 0
    w1 = (torch.randn(N, 2 * F, H, generator=gen) / H**0.5).to(dtype)
    if transposed:  # gpt-oss's storage: a transposed view of an (N, H, 2F) tensor
        w1 = w1.transpose(1, 2).contiguous().transpose(1, 2)
    b1 = torch.randn(N, 2 * F, generator=gen).to(device, dtype) if bias else None
    p = torch.rand(rows + pad, generator=gen).to(device) if probs else None
    return x, tokens.to(device), valid.to(device), w1.to(device), offs_of(splits, device), b1, p


# ---------------------------------------------------------------------------------------------
# CPU: arguments, path choice, the gather-first path
# ---------------------------------------------------------------------------------------------


def test_bad_token_maps_are_refused():
    x, tokens, _, w1, offs, _, p = problem(20, [5, 7], 2, 32, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="token_of_row must be int32 or int64"):
        rglu.glu_forward_gathered(x, tokens.float(), w1, offs, None, p, None, "swiglu")
    with pytest.raises(ValueError, match=r"token_of_row must be \(M,\) or \(M, 1\)"):
        rglu.glu_forward_gathered(x, tokens.view(2, -1).T.contiguous(), w1, offs, None, p, None, "swiglu")
    with pytest.raises(ValueError, match="x_TH must be 2-D"):
        rglu.glu_forward_gathered(x.T.contiguous().T, tokens, w1, offs, None, p, None, "swiglu")


def test_gathered_kernel_takes_only_hopper_calls():
    """The GATHER kernel runs where the Hopper forward would (an sm_90 device, 16-bit, TMA-able rows):
    never on the CPU, never with use_tma=False, never for float32."""
    x, _, _, w1, _, _, _ = problem(20, [5, 7], 2, 32, 16, torch.float16, "cpu")
    assert not rglu.gathered_kernel_takes(x, w1, None)
    assert not rglu.gathered_kernel_takes(x, w1, None, use_tma=False)
    assert not rglu.gathered_kernel_takes(x.float(), w1.float(), None)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("map_form", ["M1-int64", "M-int32"])
def test_gather_first_path_is_glu_forward_of_the_gathered_rows(dtype, map_form, nan_poison):
    """Off Hopper: the gathered rows, then glu_forward, bit for bit (padding rows zero), into `out` too."""
    x, _, valid, w1, offs, b1, p = problem(41, [9, 0, 30, 1], 7, 64, 32, dtype, "cpu", bias=True)
    tokens = valid if map_form == "M1-int64" else valid.view(-1).to(torch.int32)
    h, act = rglu.glu_forward_gathered(x, tokens, w1, offs, b1, p, None, "swiglu")
    h_ref, act_ref = rglu.glu_forward(x[valid.view(-1)], w1, offs, b1, p, None, "swiglu")
    assert torch.equal(h, h_ref) and torch.equal(act, act_ref)
    assert torch.count_nonzero(h[40:]) == 0 and torch.count_nonzero(act[40:]) == 0
    out = (torch.empty_like(h), torch.empty_like(act))
    rglu.glu_forward_gathered(x, tokens, w1, offs, b1, p, None, "swiglu", out=out)
    assert torch.equal(out[0], h_ref) and torch.equal(out[1], act_ref)


def test_gathered_launch_plan():
    """The GATHER launch: the token map's rows are M, x's own row stride, the 4-warp load partition."""
    x, _, _, w1, _, _, p = problem(20, [5, 7], 2, 64, 128, torch.bfloat16, "cpu")
    plan = rglu._forward_ws_launch(x, w1, None, p, 128, "swiglu", 14)
    assert plan.ints[0] == 14 and plan.ints[4] == x.stride(0)
    assert plan.constexprs["GATHER"] and plan.constexprs["LOAD_WARPS"] == 4
    plain = rglu._forward_ws_launch(x, w1, None, p, 128, "swiglu")
    assert plain.ints[0] == 20 and not plain.constexprs["GATHER"] and plain.constexprs["LOAD_WARPS"] == 1


# ---------------------------------------------------------------------------------------------
# CPU: the GATHER kernel compiled for sm_90 (its own process: Gluon is not interpreted)
# ---------------------------------------------------------------------------------------------

_COMPILE_GATHER_FOR_SM90 = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from moekit.ops.kernels.glu_hopper import glu_backward_ws_kernel, glu_forward_ws_kernel
from moekit.ops.runtime import configs
from moekit.ops.runtime.glu import jit_pair

kind, gather, glu_block, paired, transposed, dtype = json.loads(sys.argv[1])
kernel = glu_forward_ws_kernel if kind == "forward" else glu_backward_ws_kernel
name = ("WS_FORWARD" if kind == "forward" else "WS_BACKWARD") + ("_GATHER" if gather else "")
config = dict(getattr(configs, name))
options = {"num_warps": config.pop("num_warps"), "maxnreg": config.pop("maxnreg")}
const = dict(config, **jit_pair("swiglu"), GLU_BLOCK=glu_block, HAS_PROBS=True,
             BLOCK_GROUPS=256, NUM_PROGRAMS=132, W_TRANSPOSED=transposed)
if kind == "forward":
    const.update(HAS_BIAS=True, PAIRED=paired)
ptr = {"probs_ptr": "*fp32", "dprobs_ptr": "*fp32", "offs_ptr": "*i64", "idx_ptr": "*i64"}
sig = {n: "constexpr" if n in const else ptr.get(n, "*" + dtype) if n.endswith("_ptr") else "i32"
       for n in kernel.arg_names}
# As the launcher specialises them: 16-byte aligned pointers, strides divisible by 16.
attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in kernel.arg_names
         if n.endswith("_ptr") or n.startswith("stride_")}
src = GluonASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()},
                     attrs=attrs)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
ptx = compiled.asm["ptx"]
load_regs = config["LOAD_REGS"]
print(json.dumps({"num_warps": compiled.metadata.num_warps, "shared": compiled.metadata.shared,
                  "cp_async_16": ptx.count("cp.async.cg.shared.global"),
                  "noinc": ptx.count("cp.async.mbarrier.arrive.noinc"),
                  "fence": ptx.count("fence.proxy.async.shared::cta"), "tma": ptx.count("cp.async.bulk.tensor.2d"),
                  "expect": ptx.count("mbarrier.arrive.expect_tx"), "setmaxnreg": "setmaxnreg" in ptx,
                  "load_regs": f"setmaxnreg.dec.sync.aligned.u32 \t{load_regs};" in ptx
                  or f"setmaxnreg.inc.sync.aligned.u32 \t{load_regs};" in ptx}))
"""


@pytest.mark.parametrize(
    "kind,gather,glu_block,paired,transposed,dtype",
    [
        ("forward", True, 768, False, False, "bf16"),
        ("forward", True, 768, False, False, "fp16"),
        ("forward", True, 4, True, True, "bf16"),
        ("forward", True, 2880, False, True, "bf16"),
        ("forward", False, 768, False, False, "bf16"),
        ("backward", True, 256, False, False, "bf16"),
        ("backward", True, 1, False, True, "fp16"),
        ("backward", False, 256, False, False, "bf16"),
    ],
    ids=[
        "fwd-gather-gate|up-bf16",
        "fwd-gather-gate|up-fp16",
        "fwd-gather-k4-transposed",
        "fwd-gather-gptoss",
        "fwd-tma-x",
        "bwd-gather-gate|up-bf16",
        "bwd-gather-k1-transposed-fp16",
        "bwd-tma-dy",
    ],
)
def test_gather_kernels_compile_for_sm90(kind, gather, glu_block, paired, transposed, dtype):
    """The GATHER variants compile for sm_90 into the TMA kernels' warps (forward 16, backward 12) inside
    227 KB of shared memory: the gathered slot (x's, or d out's) by cp.async copies of 16 bytes, as many
    a thread as the slot's BLOCK_M x BLOCK_RED 16-bit values over the load partition's threads (4 in the
    forward's 32-column steps, 8 in the backward's 64), one counted arrival, the weights by 2 TMA boxes
    under one expect, a proxy fence before wgmma, the load partition at 40 registers. Without GATHER
    the rows still come by TMA and no cp.async is issued."""
    args = json.dumps([kind, gather, glu_block, paired, transposed, dtype])
    got = compile_in_subprocess(_COMPILE_GATHER_FOR_SM90, args)
    warps = 16 if kind == "forward" else 12
    assert got["num_warps"] == warps and got["setmaxnreg"] and 0 < got["shared"] <= 227 * 1024, got
    if gather:
        table = configs.WS_FORWARD_GATHER if kind == "forward" else configs.WS_BACKWARD_GATHER
        copies = table["BLOCK_M"] * table["BLOCK_RED"] * 2 // 16 // (table["LOAD_WARPS"] * 32)
        assert copies == (4 if kind == "forward" else 8)
        assert (got["cp_async_16"], got["noinc"], got["fence"], got["tma"]) == (copies, 1, 1, 2), got
        assert got["expect"] == 1 and got["load_regs"], got
    else:  # three boxes a slot (the backward's loop is emitted in more than one copy)
        assert (got["cp_async_16"], got["noinc"], got["fence"]) == (0, 0, 0) and got["tma"] >= 3, got


# ---------------------------------------------------------------------------------------------
# GPU (sm_90): the GATHER kernel against gather + kernel, bit for bit
# ---------------------------------------------------------------------------------------------

# T, splits, padding rows, H, F, glu_interleave_size, bias, transposed, token-map form
GATHER_CASES = {
    # Qwen3-30B-A3B's expert widths at T 4096 (E 128, K 8): M = 32768 routed rows
    "qwen3_T4096": (4096, None, 0, 2048, 768, None, False, False, "M1-int64"),
    "empty_experts_padding": (600, [0, 300, 1, 0, 500, 0], 77, 256, 384, None, True, False, "M-int32"),
    "one_row": (5, [0, 1, 0], 0, 64, 128, None, False, False, "M1-int64"),
    "all_padding": (50, [0, 0, 0], 300, 64, 128, None, False, False, "M1-int64"),
    "odd_H_200": (900, [100, 233, 0, 444], 13, 200, 256, None, True, False, "M-int64"),
    "interleave_k4_transposed": (700, [250, 0, 350, 424], 6, 192, 384, 4, True, True, "M1-int64"),
    "gptoss_partial_tile": (1500, [1000, 0, 2000, 1096], 0, 2880, 2880, None, True, True, "M1-int32"),
}


def qwen_splits(T, N=128, K=8, seed=5):
    """Uneven expert counts of T * K rows from a random top-k routing."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randn(T, N, generator=gen).topk(K, dim=1).indices
    return torch.bincount(ids.view(-1), minlength=N).tolist()


@pytest.mark.gpu
@on_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(GATHER_CASES), ids=list(GATHER_CASES))
def test_gpu_gathered_forward_is_gather_then_kernel(case, dtype, nan_poison):
    """glu_forward_gathered on the GATHER kernel == the rows gathered, then the Hopper kernel, bit for
    bit, h and act, NaN-poisoned outputs; padding rows zero although their tokens lie far out of x."""
    T, splits, pad, H, F, k, bias, transposed, form = GATHER_CASES[case]
    splits = qwen_splits(T) if splits is None else splits
    x, tokens, valid, w1, offs, b1, p = problem(
        T, splits, pad, H, F, dtype, CUDA, bias=bias, transposed=transposed, seed=7
    )
    if form.startswith("M-"):
        tokens = tokens.view(-1)
    tokens = tokens.to(torch.int32 if form.endswith("int32") else torch.int64)
    # The GATHER kernel takes row strides that are multiples of 16 elements (H = 200: the rows first,
    # which read every row's token: padding rows get valid ones there).
    takes = rglu.gathered_kernel_takes(x, w1, k)
    assert takes == (H % 16 == 0)
    tokens = tokens if takes else valid.view(tokens.shape).to(tokens.dtype)
    h, act = rglu.glu_forward_gathered(x, tokens, w1, offs, b1, p, k, activation="swiglu")
    x_MH = x[valid.view(-1)]
    assert rglu.hopper_kernels_take("fwd", x_MH, w1, F, F if k is None else k, True, None)
    h_ref, act_ref = rglu.glu_forward(x_MH, w1, offs, b1, p, k, "swiglu")
    assert torch.equal(h, h_ref) and torch.equal(act, act_ref)
    rows = sum(splits)
    assert torch.count_nonzero(h[rows:]) == 0 and torch.count_nonzero(act[rows:]) == 0
    # Into the rows of larger buffers (the split launches of moe_experts), from a slice of the map.
    lo = rows // 3
    h_out, act_out = torch.empty_like(h[lo:]), torch.empty_like(act[lo:])
    offs_tail = (offs - lo).clamp(min=0, max=tokens.shape[0] - lo)
    rglu.glu_forward_gathered(x, tokens[lo:], w1, offs_tail, b1, p[lo:] if p is not None else None, k, "swiglu",
                              out=(h_out, act_out))  # fmt: skip
    assert torch.equal(h_out, h_ref[lo:]) and torch.equal(act_out, act_ref[lo:])


@pytest.mark.gpu
@on_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", list(GATHER_CASES), ids=list(GATHER_CASES))
def test_gpu_gathered_backward_is_gather_then_kernel(case, dtype, nan_poison):
    """glu_backward_gathered_partials on the backward's GATHER kernel == d out's rows gathered, then the
    Hopper backward, bit for bit: dh, act_p and the d probs partials, NaN-poisoned outputs; padding rows
    zero although their tokens lie far out of d out."""
    T, splits, pad, H, F, k, _, transposed, form = GATHER_CASES[case]
    splits = qwen_splits(T) if splits is None else splits
    d_out, tokens, valid, _, offs, _, p = problem(T, splits, pad, H, F, dtype, CUDA, seed=8)
    gen = torch.Generator().manual_seed(9)
    w2 = (torch.randn(len(splits), H, F, generator=gen) / F**0.5).to(CUDA, dtype)
    if transposed:  # gpt-oss's storage: a transposed view of an (N, F, H) tensor
        w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    h = torch.randn(tokens.shape[0], 2 * F, generator=gen).to(CUDA, dtype)
    if form.startswith("M-"):
        tokens = tokens.view(-1)
    tokens = tokens.to(torch.int32 if form.endswith("int32") else torch.int64)
    dy_MH = d_out[valid.view(-1)]
    # The Hopper backward needs 64 | H where w2 is stored (N, H, F) (odd_H_200 runs the Triton kernel).
    hopper = rglu.hopper_kernels_take("bwd", dy_MH, w2, F, F if k is None else k, True, None)
    takes = rglu.gathered_backward_kernel_takes(d_out, w2, k)
    assert takes == (hopper and H % 16 == 0) and (hopper or case == "odd_H_200")
    tokens = tokens if takes else valid.view(tokens.shape).to(tokens.dtype)
    dh, act_p, part = rglu.glu_backward_gathered_partials(d_out, tokens, w2, h, offs, p, k, "swiglu")
    dh_ref, act_ref, part_ref = rglu.glu_backward_partials(dy_MH, w2, h, offs, p, k, "swiglu")
    rows = sum(splits)
    assert torch.equal(dh[:rows], dh_ref[:rows]) and torch.equal(act_p[:rows], act_ref[:rows])
    assert torch.equal(part[:, :rows], part_ref[:, :rows])
    assert torch.count_nonzero(dh[rows:]) == 0 and torch.count_nonzero(act_p[rows:]) == 0
