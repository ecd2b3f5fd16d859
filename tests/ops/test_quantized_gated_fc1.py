"""fc1 of the quantized MLP with the gated activation and both rowwise quantizations in its epilogue
(`grouped_glu_fp8_block_ws_kernel`, `moekit.ops.runtime.quantized_gemm.quantized_glu_forward_into`): the
bytes of the FP8 forward followed by the gated quantize pass, h never written; where it applies
(fp8_block on sm_90, GLU blocks of whole 128-column blocks, no clamps), refused in one line elsewhere;
and the quantized MLP gives the same bits with and without it.

On the CPU: the kernel compiles for sm_90 (in a subprocess without the interpreter) and the refusals. On
an sm_90 GPU (pytest -m gpu): the bytes, a float64 check of the activation, the MLP's bits."""

from __future__ import annotations

import json

import pytest
import torch

import moekit
from helpers import compile_in_subprocess, rel_err, run_on_kernel
from moekit.grouped_tensor import RECIPES, dequantize_rowwise
from moekit.ops import grouped_mlp as grouped_mlp_module
from moekit.ops import library
from moekit.ops.glu import check_interleave, glu_reference
from moekit.ops.quantize import gated_forms_storage
from moekit.ops.runtime import quantized_gemm as qg

_COMPILE = """
import json, re, subprocess, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon._runtime import GluonASTSource
from moekit.ops.kernels import activations
from moekit.ops.kernels.grouped_gemm_fp8_hopper import grouped_glu_fp8_block_ws_kernel as kernel
from moekit.ops.runtime.configs import FP8_BLOCK_WS, FP8_BLOCK_WS_STAGES

bias, probs, glu_block = json.loads(sys.argv[1])
options = {"num_warps": FP8_BLOCK_WS["num_warps"], "maxnreg": FP8_BLOCK_WS["maxnreg"]}
const = {k: v for k, v in FP8_BLOCK_WS.items() if k not in options}
const.update(HAS_BIAS=bias, HAS_PROBS=probs, GLU_BLOCK=glu_block, BLOCK_GROUPS=256, NUM_PROGRAMS=132,
             STAGES=FP8_BLOCK_WS_STAGES[2], h_ty=tl.bfloat16, ACT=activations.swiglu)
pointer = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "offs_ptr": "*i64", "bias_ptr": "*bf16",
           "a_data_ptr": "*u8", "h_data_ptr": "*u8"}
sig = {n: "constexpr" if n in const else pointer.get(n, "*fp32") if n.endswith("_ptr") else "i32"
       for n in kernel.arg_names}
# As a launch specializes them: pointers and the sizes and strides of these shapes divisible by 16.
aligned = {"F", "H", "stride_xm", "stride_wr", "stride_xsm", "stride_wsg", "stride_ws_col", "stride_a_scale",
           "stride_h_scale"}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n.endswith("_ptr") or n in aligned}
src = GluonASTSource(fn=kernel, signature=sig, constexprs={(kernel.arg_names.index(k),): v for k, v in const.items()},
                     attrs=attrs)
compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
with open(sys.argv[2], "w") as f:
    f.write(compiled.asm["ptx"])
ptx = compiled.asm["ptx"]
log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", sys.argv[2], "-o", "/dev/null"],
                     capture_output=True, text=True).stderr
print(json.dumps({"shared": compiled.metadata.shared,
                  "waits": re.findall(r"wgmma\\.wait_group\\.sync\\.aligned (\\d+)", ptx),
                  "mma": sorted(set(re.findall(r"wgmma\\.mma_async\\.sync\\.aligned\\.([\\w.]+)", ptx))),
                  "serialized": [l for l in log.splitlines() if "C7514" in l or "C7515" in l],
                  "stores": sorted(set(re.findall(r"st\\.global\\.[\\w.]+", ptx)))}))
"""


@pytest.mark.parametrize("bias, probs, glu_block", [(False, True, 2048), (True, False, 128)], ids=["probs", "bias"])
def test_compiles_for_sm90(bias, probs, glu_block, tmp_path):
    """The gated kernel compiles for sm_90a within Hopper's 227 KB of shared memory, with the plain
    kernel's main loop: FP8 wgmma m64n128k32, only `wgmma.wait_group 0` and no serialization (C7514 /
    C7515); its FP8 bytes stored 16 at a time."""
    got = compile_in_subprocess(_COMPILE, json.dumps([bias, probs, glu_block]), str(tmp_path / "k.ptx"))
    assert 0 < got["shared"] <= 227 * 1024
    assert got["mma"] == ["m64n128k32.f32.e4m3.e4m3"]
    assert got["waits"] == ["0"] * 4, got["waits"]
    assert not got["serialized"], got["serialized"]
    # The FP8 bytes leave as 16-byte vectors (v4.b32), the scales as 4-byte stores; no single bytes.
    assert got["stores"] == ["st.global.b32", "st.global.v4.b32"], got["stores"]


def test_refusals_name_what_the_kernel_cannot_take():
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    reason = qg.fp8_glu_unavailable_reason
    assert "fp8_block, not 'fp8_rowwise'" in reason("fp8_rowwise", cpu, bf16, 256, 256, 256, 0.0, 0.0)
    assert "not torch.float32" in reason("fp8_block", cpu, torch.float32, 256, 256, 256, 0.0, 0.0)
    assert "GLU blocks of 64 columns" in reason("fp8_block", cpu, bf16, 256, 256, 64, 0.0, 0.0)
    assert "GLU blocks of 2880 columns" in reason("fp8_block", cpu, bf16, 2880, 2880, 2880, 0.0, 0.0)
    assert "clamped" in reason("fp8_block", cpu, bf16, 256, 256, 256, 7.0, 7.0)
    assert "bytes are not a TMA operand" in reason("fp8_block", cpu, bf16, 100, 256, 256, 0.0, 0.0)
    assert "sm_90" in reason("fp8_block", cpu, bf16, 256, 256, 256, 0.0, 0.0)


def _hopper_or_skip() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel runs on sm_90")


# (F, glu_interleave_size): [gate | up], GLU blocks of one and of two scale blocks, Qwen3-30B-A3B's F.
LAYOUTS = [
    pytest.param((256, None), id="gate|up-F256"),
    pytest.param((384, 128), id="k128"),
    pytest.param((512, 256), id="k256"),
    pytest.param((768, None), id="qwen3"),
]
# Skewed groups: empty ones, one row, a 129-row one; 73 padding rows after them.
SPLITS = [0, 300, 1, 0, 129, 427]
ROWS = sum(SPLITS) + 73


def _case(ffn: int, k: int | None, hidden: int, dtype: torch.dtype, bias: bool, probs: bool, nonfinite: bool = False):
    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(ffn + hidden)
    n = len(SPLITS)
    x = torch.randn(ROWS, hidden, device=cuda, generator=gen).to(dtype)
    x[5, 7] = 300.0  # a large value: its block's scale differs from its neighbours'
    if nonfinite:  # one row of x non-finite (NaN scale and data): that row of h and a is NaN
        x[320, 3] = float("inf")
    w1 = (torch.randn(n, 2 * ffn, hidden, device=cuda, generator=gen) / hidden**0.5).to(dtype)
    b1 = (torch.randn(n, 2 * ffn, device=cuda, generator=gen) * 0.1).to(dtype) if bias else None
    p = torch.rand(ROWS, device=cuda, generator=gen) if probs else None
    offs = torch.tensor([0, *torch.tensor(SPLITS).cumsum(0).tolist()], device=cuda)
    x_q = moekit.group_quantize(x, torch.tensor(SPLITS, device=cuda), "fp8_block", backend="triton")
    w_q = moekit.group_quantize(w1, None, "fp8_block", backend="triton")
    return x_q, w_q, b1, p, offs


def _fused(x_q, w_q, b1, p, offs, glu_block, dtype):
    forms = gated_forms_storage("fp8_block", ROWS, w_q.shape[1] // 2, x_q.device, len(SPLITS))

    def run():
        qg.quantized_glu_forward_into(
            x_q.rowwise_data, x_q.rowwise_scale_inv, w_q.rowwise_data, w_q.rowwise_scale_inv, offs, b1, p, glu_block,
            "swiglu", dtype, *forms,
        )  # fmt: skip
        return forms

    return run_on_kernel(run, "grouped_glu_fp8_block_ws_kernel")


def _apart(x_q, w_q, b1, p, offs, glu_block, dtype):
    h = qg.quantized_gemm_forward(
        "fp8_block", x_q.rowwise_data, x_q.rowwise_scale_inv, w_q.rowwise_data, w_q.rowwise_scale_inv, offs, b1,
        out_dtype=dtype,
    )  # fmt: skip
    forms = gated_forms_storage("fp8_block", ROWS, w_q.shape[1] // 2, x_q.device, len(SPLITS))
    library.gated_quantize_into(h, p, offs, glu_block, "swiglu", "fp8_block", 0.0, 0.0, *forms)
    return forms, h


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _same_bytes(fused, apart) -> None:
    for name, f, s in zip(("a_data", "a_scale", "h_data", "h_scale"), fused, apart, strict=True):
        diff = (_bytes(f) != _bytes(s)).nonzero()
        assert diff.numel() == 0, f"{name}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "hidden, dtype, bias, probs",
    [(384, torch.bfloat16, False, True), (2048, torch.bfloat16, True, True), (256, torch.float16, True, False)],
    ids=["bf16-probs", "bf16-bias-probs-H2048", "fp16-bias"],
)
def test_gpu_bytes_are_the_gemm_and_the_gated_pass(layout, hidden, dtype, bias, probs, nan_poison):
    """The four outputs' bytes equal the FP8 forward followed by `gated_quantize_into` (storage poisoned
    before either writes); the activation within the FP8 bound of its float64 value."""
    _hopper_or_skip()
    ffn, k = layout
    glu_block = check_interleave(ffn, k)
    case = _case(ffn, k, hidden, dtype, bias, probs)
    fused = _fused(*case, glu_block, dtype)
    apart, h = _apart(*case, glu_block, dtype)
    _same_bytes(fused, apart)
    # The activation against float64 from the FP8 operands (the GEMM's own check covers h).
    x_q, w_q, b1, p, offs = case
    info = RECIPES["fp8_block"]
    x64 = dequantize_rowwise(info, x_q.rowwise_data, x_q.rowwise_scale_inv, torch.float64)
    w64 = dequantize_rowwise(info, w_q.rowwise_data, w_q.rowwise_scale_inv, torch.float64)
    used = sum(SPLITS)
    h64 = torch.zeros(ROWS, 2 * ffn, dtype=torch.float64, device=h.device)
    for g, (lo, hi) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist(), strict=True)):
        h64[lo:hi] = x64[lo:hi] @ w64[g].T + (b1[g].double() if b1 is not None else 0.0)
    a64 = glu_reference(h64, probs=p, glu_interleave_size=k)
    a = dequantize_rowwise(info, fused[0], fused[1], torch.float64)
    assert rel_err(a[:used], a64[:used]) < 0.08
    assert torch.count_nonzero(fused[0].view(torch.uint8)[used:]) == 0 and bool((fused[1][used:] == 1.0).all())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[2]])
def test_gpu_bytes_with_a_nonfinite_row_are_the_gemm_and_the_gated_pass(layout, nan_poison):
    """A non-finite row of h (x's row holds an inf: its FP8 scale and bytes are NaN) takes the epilogue's
    NaN fix-up, which runs only in a warp group whose rows hold a non-finite block maximum: every byte,
    NaN bytes and their signs included, equals the FP8 forward followed by `gated_quantize_into`."""
    _hopper_or_skip()
    ffn, k = layout
    glu_block = check_interleave(ffn, k)
    case = _case(ffn, k, 384, torch.bfloat16, True, True, nonfinite=True)
    fused = _fused(*case, glu_block, torch.bfloat16)
    apart, h = _apart(*case, glu_block, torch.bfloat16)
    assert bool(h[320].isnan().all()) and not bool(h[319].isnan().any())
    _same_bytes(fused, apart)


@pytest.mark.gpu
def test_gpu_quantized_mlp_same_bits_with_and_without_it(monkeypatch):
    """grouped_mlp(..., quantization="fp8_block") on the GPU: output and every gradient the same bits with
    fc1's gated epilogue (chosen by the config table for this test) and with the GEMM and the gated pass
    apart."""
    _hopper_or_skip()
    cuda = torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(0)
    hidden, ffn, n = 512, 256, len(SPLITS)
    x0 = torch.randn(ROWS, hidden, device=cuda, generator=gen).bfloat16()
    w1 = (torch.randn(n, 2 * ffn, hidden, device=cuda, generator=gen) / hidden**0.5).bfloat16()
    w2 = (torch.randn(n, hidden, ffn, device=cuda, generator=gen) / ffn**0.5).bfloat16()
    probs0 = torch.rand(ROWS, device=cuda, generator=gen)
    dy = torch.randn(ROWS, hidden, device=cuda, generator=gen).bfloat16()
    splits = torch.tensor(SPLITS, device=cuda)

    def step():
        x, a, b, p = (t.clone().requires_grad_() for t in (x0, w1, w2, probs0))
        y = moekit.grouped_mlp(x, a, b, splits, probs=p, backend="triton", quantization="fp8_block")
        y.backward(dy)
        return [y, x.grad, a.grad, b.grad, p.grad]

    # The table keeps the pair apart on sm90 (measured faster); on for this comparison.
    monkeypatch.setitem(qg.GATED_FC1_EPILOGUE, "sm90", True)
    calls = []
    real = library.quantized_gated_fc1_into
    monkeypatch.setattr(library, "quantized_gated_fc1_into", lambda *a: calls.append(1) or real(*a))
    fused = step()
    assert calls, "fc1's gated epilogue did not run"
    monkeypatch.setattr(grouped_mlp_module, "quantized_gated_fc1_of", lambda *a: None)
    apart = step()
    assert len(calls) == 1
    for name, f, s in zip(("y", "dx", "dw1", "dw2", "dprobs"), fused, apart, strict=True):
        assert torch.equal(f, s), f"{name} differs"
