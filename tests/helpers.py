"""Helpers of moekit's CPU and GPU tests: the tolerance rule of tests/conftest.py, plain-torch versions
of the ops written from their documented semantics (not from moekit's code), shared edge cases, NaN
poison for buffers a test allocates, and seeded random inputs."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
from collections.abc import Callable, Sequence

import pytest
import torch
from hypothesis import settings

# Hypothesis settings of the property tests: modest, deterministic, no per-example deadline.
HYPOTHESIS = settings(max_examples=25, deadline=None, derandomize=True)

BACKENDS = ("loop", "torch")
LOWP_DTYPES = (torch.float32, torch.bfloat16)

# Unit roundoff (finfo.eps / 2) of each dtype: one rounding step.
UNIT_ROUNDOFF = {dt: torch.finfo(dt).eps / 2 for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16)}

# The reordering allowance of the rule, in fp32 unit roundoffs per sqrt(reduction length) (see conftest).
REORDER_SLACK = 16

INT_SENTINEL = -(2**30)


# --------------------------------------------------------------------------------------------------
# The tolerance rule (stated in tests/conftest.py)
# --------------------------------------------------------------------------------------------------


# rel_err sums its squares over chunks of this many elements: a real-width expert gradient has billions
# of elements, and float64 copies of it whole (a, ref and their difference: 42 GiB at DeepSeek-V3's
# width with 64 experts) would not fit beside the model on an 80 GB GPU.
NORM_CHUNK = 1 << 24


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error of `a` against `ref` in float64; absolute where `ref` is all zero."""
    assert a.shape == ref.shape, f"shape {tuple(a.shape)} != reference shape {tuple(ref.shape)}"
    a_flat, r_flat = a.detach().reshape(-1), ref.detach().reshape(-1)
    diff_sq = scale_sq = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, a_flat.numel(), NORM_CHUNK):
        a64 = a_flat[start : start + NORM_CHUNK].double()
        r64 = r_flat[start : start + NORM_CHUNK].double()
        diff_sq = diff_sq + (a64 - r64).square().sum()
        scale_sq = scale_sq + r64.square().sum()
    diff = diff_sq.sqrt().item()
    if diff != diff:  # NaN anywhere in `a` (e.g. an unwritten, poisoned row)
        return float("inf")
    scale = scale_sq.sqrt().item()
    return diff / scale if scale > 0 else diff


def tolerance_floor(dtype: torch.dtype, reduction_length: int) -> float:
    """The rule's floor: one rounding of the result's dtype, plus the error a reordered fp32 sum of
    `reduction_length` terms may make (REORDER_SLACK * sqrt(length) fp32 unit roundoffs)."""
    return UNIT_ROUNDOFF[dtype] + REORDER_SLACK * max(reduction_length, 1) ** 0.5 * UNIT_ROUNDOFF[torch.float32]


# Hopper's FP8 MMA keeps about 14 bits of its running sum within one instruction chain (DeepSeek-V3's
# technical report on FP8 training: the reason it promotes every 128-deep step into fp32), so on a GPU a
# product of FP8 operands has a relative error of about that size that no output dtype removes (fp32
# outputs measured 1.0e-4 to 1.1e-4 at reductions of 1040 and 2880 on the H200, `bc06b08`). The
# interpreter's products are exact, so it keeps the rule's floor alone.
FP8_MMA_UNIT = 2.0**-13


def fp8_product_floor(dtype: torch.dtype, reduction_length: int, device: torch.device) -> float:
    """The rule's floor for a product of FP8 operands computed on `device` into `dtype`: plus
    2 * FP8_MMA_UNIT on CUDA."""
    return tolerance_floor(dtype, reduction_length) + (2 * FP8_MMA_UNIT if device.type == "cuda" else 0.0)


def assert_within_tolerance(
    ours: torch.Tensor, ref64: torch.Tensor, torch_lowp: torch.Tensor, what: str, *, reduction_length: int | None = None
) -> None:
    """The one tolerance rule: rel_err(ours) <= 2 * rel_err(torch_lowp) + floor(dtype, reduction length).
    `reduction_length` defaults to the largest dimension of the reference (a bound on the sums that
    produced it in these small tests)."""
    assert ours.dtype == torch_lowp.dtype, f"{what}: dtype {ours.dtype} vs torch's {torch_lowp.dtype}"
    length = reduction_length if reduction_length is not None else max(ref64.shape, default=1)
    err_ours = rel_err(ours, ref64)
    err_torch = rel_err(torch_lowp, ref64)
    floor = tolerance_floor(ours.dtype, length)
    bound = 2 * err_torch + floor
    assert err_ours <= bound, (
        f"{what} ({ours.dtype}): relative error {err_ours:.3e} vs float64 exceeds 2 x torch's own "
        f"{err_torch:.3e} + floor {floor:.1e} (reduction length {length}) = {bound:.3e}"
    )


def _flatten(inputs: dict) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, v in inputs.items():
        if isinstance(v, torch.Tensor):
            out.append((name, v))
        else:
            out.extend((f"{name}[{i}]", t) for i, t in enumerate(v))
    return out


def _leaves(inputs: dict, dtype: torch.dtype, diff: set[str]) -> dict:
    def leaf(name, t):
        t = t.detach().clone().to(dtype) if t.is_floating_point() else t
        return t.requires_grad_(True) if name in diff and t.is_floating_point() else t

    return {k: (leaf(k, v) if isinstance(v, torch.Tensor) else [leaf(k, t) for t in v]) for k, v in inputs.items()}


def check_against_reference(
    ours: Callable[..., torch.Tensor],
    torch_lowp: Callable[..., torch.Tensor],
    ref64: Callable[..., torch.Tensor],
    inputs: dict,
    dtype: torch.dtype,
    *,
    differentiable: Sequence[str] | None = None,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Run ours, torch's low-precision version and the float64 reference on the same inputs (rounded
    to `dtype` first), back-propagate the same random upstream gradient, and apply the tolerance rule
    to the output and to the gradient of every differentiable input. Each of `inputs` is a tensor or a
    list of tensors; returns ours' output and gradients (by input name) for further checks."""
    diff = set(differentiable if differentiable is not None else inputs)
    rounded = {
        k: (v.detach().to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        if isinstance(v, torch.Tensor)
        else [t.detach().to(dtype) for t in v]
        for k, v in inputs.items()
    }
    ins_ours, ins_lowp, ins_ref = (_leaves(rounded, d, diff) for d in (dtype, dtype, torch.float64))
    y_ours, y_lowp, y_ref = ours(**ins_ours), torch_lowp(**ins_lowp), ref64(**ins_ref)
    assert y_ref.dtype == torch.float64
    assert y_ours.dtype == dtype, f"output dtype {y_ours.dtype}, expected {dtype}"
    # Every sum in these ops runs over rows, features or tokens: bounded by the largest input dimension.
    length = max(max(t.shape, default=1) for _, t in _flatten(rounded))
    assert_within_tolerance(y_ours, y_ref, y_lowp, "output", reduction_length=length)
    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(y_ref.shape, generator=gen, dtype=torch.float64).to(dtype)
    y_ours.backward(grad_out.to(y_ours.device))
    y_lowp.backward(grad_out.to(y_lowp.device))
    y_ref.backward(grad_out.double().to(y_ref.device))
    result = {"out": y_ours.detach()}
    for (name, t_ours), (_, t_lowp), (_, t_ref) in zip(
        _flatten(ins_ours), _flatten(ins_lowp), _flatten(ins_ref), strict=True
    ):
        if not t_ours.requires_grad:
            continue
        assert t_ours.grad is not None, f"{name} got no gradient"
        assert t_ours.grad.shape == t_ours.shape, f"{name}: gradient shape {tuple(t_ours.grad.shape)}"
        assert_within_tolerance(t_ours.grad, t_ref.grad, t_lowp.grad, f"d {name}", reduction_length=length)
        result[name] = t_ours.grad
    return result


# --------------------------------------------------------------------------------------------------
# Plain-torch implementations, written from the documented semantics (README, docstrings), not from
# moekit's code. They keep their inputs' dtype: in float64 they are an independent check of
# moekit.reference; in bf16/fp32 they are "torch's own computation" of the tolerance rule.
# --------------------------------------------------------------------------------------------------


def splits_list(m_splits) -> list[int]:
    return [int(v) for v in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)]


def _members(t, n=None) -> list[torch.Tensor]:
    if t is None:
        return []
    if isinstance(t, torch.Tensor):
        return list(t.unbind(0))
    return list(t)


def torch_grouped_linear(x, weight, m_splits, bias=None, *, bias_scale=None):
    """Per-group `x_g @ W_g^T + b_g (* s)`, padding rows zero, in x's dtype."""
    ws, bs = _members(weight), _members(bias)
    counts = splits_list(m_splits)
    pieces, lo = [], 0
    for g, c in enumerate(counts):
        y = x[lo : lo + c] @ ws[g].t()
        if bs:
            b = bs[g][None, :]
            y = y + (b * bias_scale.reshape(-1)[lo : lo + c, None].to(b.dtype) if bias_scale is not None else b)
        pieces.append(y)
        lo += c
    pieces.append(torch.zeros(x.shape[0] - lo, ws[0].shape[0], dtype=x.dtype, device=x.device))
    return torch.cat(pieces)


def glu_indices(ffn: int, k: int | None) -> tuple[list[int], list[int]]:
    """Column indices of the gates and ups in fc1's output, as documented: block b of size 2k holds
    gates [2kb, 2kb+k) and ups [2kb+k, 2kb+2k); k=None is [all gates | all ups]."""
    if k is None:
        return list(range(ffn)), list(range(ffn, 2 * ffn))
    gates = [2 * k * b + r for b in range(ffn // k) for r in range(k)]
    ups = [2 * k * b + k + r for b in range(ffn // k) for r in range(k)]
    return gates, ups


# Each activation written with plain torch ops, independently of moekit's registry.
TORCH_ACTIVATIONS = {
    "swiglu": lambda g, u: torch.nn.functional.silu(g) * u,
    "clamped_swiglu": lambda g, u: (
        torch.clamp(g, max=7.0) * torch.sigmoid(1.702 * torch.clamp(g, max=7.0)) * (torch.clamp(u, -7.0, 7.0) + 1)
    ),
    "geglu": lambda g, u: torch.nn.functional.gelu(g) * u,
    "geglu_tanh": lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u,
    "reglu": lambda g, u: torch.nn.functional.relu(g) * u,
}


def torch_glu(h, *, probs=None, glu_interleave_size=None, activation="swiglu"):
    ffn = h.shape[1] // 2
    gi, ui = glu_indices(ffn, glu_interleave_size)
    out = TORCH_ACTIVATIONS[activation](h[:, gi], h[:, ui])
    if probs is not None:
        out = out * probs.reshape(-1, 1).to(out.dtype)
    return out


def torch_grouped_mlp(
    x,
    fc1_weight,
    fc2_weight,
    m_splits,
    *,
    probs=None,
    fc1_bias=None,
    fc2_bias=None,
    activation="swiglu",
    glu_interleave_size=None,
):
    h = torch_grouped_linear(x, fc1_weight, m_splits, fc1_bias)
    a = torch_glu(h, probs=probs, glu_interleave_size=glu_interleave_size, activation=activation)
    return torch_grouped_linear(a, fc2_weight, m_splits, fc2_bias, bias_scale=probs)


# --------------------------------------------------------------------------------------------------
# Edge cases shared by the grouped ops: (m_splits, rows), with readable ids
# --------------------------------------------------------------------------------------------------

SPLIT_CASES = [
    pytest.param([5, 3, 6, 4], 18, id="balanced"),
    pytest.param([0, 7, 5, 6], 18, id="empty-first"),
    pytest.param([6, 0, 0, 12], 18, id="empty-middle"),
    pytest.param([9, 4, 5, 0], 18, id="empty-last"),
    pytest.param([0, 0, 18, 0], 18, id="all-on-one"),
    pytest.param([0, 1, 0, 0], 1, id="one-row"),
    pytest.param([3, 0, 4, 2], 14, id="padding-rows"),
    pytest.param([0, 0, 0, 0], 5, id="nothing-routed"),
    pytest.param([3, 1, 0, 4, 2, 0, 5], 15, id="prime-N7"),
]


def splits_as(kind: str, m_splits: list[int]):
    """m_splits in each accepted host form."""
    return {
        "list": list(m_splits),
        "tuple": tuple(m_splits),
        "cpu-int32": torch.tensor(m_splits, dtype=torch.int32),
        "cpu-int64": torch.tensor(m_splits, dtype=torch.int64),
    }[kind]


SPLIT_KINDS = ("list", "tuple", "cpu-int32", "cpu-int64")


# --------------------------------------------------------------------------------------------------
# NaN poison
# --------------------------------------------------------------------------------------------------


def poison(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "meta" or t.numel() == 0:
        return t
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(INT_SENTINEL if t.dtype in (torch.int32, torch.int64) else -1)


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """A fresh tensor like `t`, filled with NaN (floats) or a sentinel (integers)."""
    return poison(torch.empty_like(t))


def assert_no_nan(t: torch.Tensor, what: str) -> None:
    bad = torch.isnan(t.detach())
    assert not bad.any(), f"{what} has NaN (unwritten?) at rows {sorted(set(bad.nonzero()[:, 0].tolist()))[:10]}"


def rand(*shape, dtype=torch.float32, scale=1.0, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


# --------------------------------------------------------------------------------------------------
# GPU tests (pytest -m gpu): what the modules' GPU tests share. Legend: M routed rows, N experts,
# H hidden size, F ffn size.
# --------------------------------------------------------------------------------------------------

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
# "auto" on Hopper is triton (measured at least as fast in every product).
GPU_BACKENDS = ("torch", "triton", "auto")
GPU_M, GPU_N, GPU_H, GPU_F = 4096, 8, 1024, 1536

GPU_SPLITS = [
    pytest.param([512] * 8, id="balanced"),
    # 3545 of 4096 rows routed: empty experts first, in the middle and last, and padding rows.
    pytest.param([0, 700, 512, 0, 900, 333, 1100, 0], id="empty-first-middle-last+padding"),
]


def capture_cuda_graph(step, leaves):
    """Capture step() (a forward+backward) in a CUDA graph; returns (graph, step's output). Warms up
    on a side stream first (lazy init, autotuning), as torch.cuda.graphs asks; grads are set to None
    so the captured backward allocates them from the graph's pool and writes them on every replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for t in leaves:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    return graph, y_static


def require_backend(backend: str, in_features: int, out_features: int, device=None, dtype=BF16) -> None:
    """Skip (with select_backend's reason) when the backend cannot run these operands."""
    from moekit.ops.runtime.backends import select_backend

    device = device or CUDA
    try:
        select_backend(
            backend,
            torch.empty(0, in_features, device=device, dtype=dtype),
            torch.empty(1, out_features, in_features, device=device, dtype=dtype),
        )
    except ValueError as exc:
        pytest.skip(str(exc))


def on_device(fn, device):
    """Wrap `fn` so that it receives its tensor arguments on `device` and returns its result on the
    CPU, both moves differentiable: check_against_reference makes its leaves and the upstream
    gradient on the CPU (as do the plain-torch helpers above), while the op under test and the
    float64 reference run on the GPU."""

    def wrapped(**tensors):
        return fn(**{k: v.to(device) for k, v in tensors.items()}).cpu()

    return wrapped


def assert_padding_and_empty_experts(res: dict, m_splits: list[int], weight_keys: tuple[str, ...]) -> None:
    for name, t in res.items():
        assert_no_nan(t, name)
    used = sum(m_splits)
    assert torch.count_nonzero(res["out"][used:]) == 0, "padding rows of the output are not zero"
    assert torch.count_nonzero(res["x"][used:]) == 0, "padding rows of d x are not zero"
    for key in weight_keys:
        for g, count in enumerate(m_splits):
            if count == 0:
                assert torch.count_nonzero(res[key][g]) == 0, f"d {key}[{g}] of an expert without rows is not zero"


def assert_no_host_sync(step) -> None:
    """Run `step` once to warm up (lazy init, autotuning, which may sync), then once more with the
    CUDA sync debugger set to raise on any host synchronization."""
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def run_on_kernel(run, kernel: str):
    """`run()`'s result on the GPU, checked to make no host synchronization (`assert_no_host_sync`) and to
    launch a kernel whose name contains `kernel` (a dispatch that took another path fails here)."""
    result = {}

    def step():
        result["out"] = run()

    assert_no_host_sync(step)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert any(kernel in n for n in names), f"{kernel} did not run: {names}"
    return result["out"]


# The compile server's loop (`compile_in_subprocess`): each request, one JSON line on stdin, is a
# script and its argv; the script runs as `python -c` would run it (a fresh `__main__` namespace, argv
# set), its printed output captured; one JSON line answers on a private copy of the original stdout,
# so that nothing a compiler writes to file descriptor 1 can be mistaken for an answer.
_COMPILE_SERVER = """
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    request = json.loads(line)
    sys.argv = ["-c", *request["args"]]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(request["script"], "<compile script>", "exec"), {"__name__": "__main__"})
        answer = {"ok": True, "stdout": out.getvalue()}
    except BaseException:
        answer = {"ok": False, "stdout": out.getvalue(), "error": traceback.format_exc()}
    answers.write(json.dumps(answer) + "\\n")
    answers.flush()
"""

_server: subprocess.Popen | None = None


def _compile_server() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        _server = subprocess.Popen(
            [sys.executable, "-c", _COMPILE_SERVER],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    return _server


def compile_in_subprocess(script: str, *args: str, timeout: float = 300.0) -> dict:
    """Run `script` with `args` (as `python -c script args` would) in a Python process without
    TRITON_INTERPRET (Gluon's standard functions cannot be compiled where the interpreter has replaced
    them) and return the JSON object its output's last line prints; a failing script fails the test
    with its traceback's end. The process is this test process's compile server, started at the first
    call and kept for the next ones: each compile pays for its own work, not for importing torch and
    triton again (a second each); its imported modules are shared with the next scripts, so a script
    changes none of them (a table's changes go into a copy). A script that takes longer than `timeout`
    seconds fails the test and the server is killed (the next call starts another)."""
    global _server
    server = _compile_server()
    assert server.stdin is not None and server.stdout is not None
    server.stdin.write(json.dumps({"script": script, "args": list(args)}) + "\n")
    server.stdin.flush()
    ready, _, _ = select.select([server.stdout], [], [], timeout)
    if not ready:
        server.kill()
        _server = None
        pytest.fail(f"the compile script took more than {timeout:.0f} s")
    line = server.stdout.readline()
    assert line, "the compile server ended without answering"
    answer = json.loads(line)
    assert answer["ok"], answer.get("error", "")[-3000:]
    return json.loads(answer["stdout"].strip().splitlines()[-1])


def main_loop_spills(sass: str, mma: str) -> list[int]:
    """Local-memory instructions (LDL / STL: spills) in each main loop of a kernel's SASS (`nvdisasm -c`'s
    listing): the innermost loops, from a label to the branch back to it, that hold an `mma` instruction
    (HGMMA for 16-bit wgmma, QGMMA for FP8), the shortest of them and those less than 1.5 times as long
    (a loop's unrolled or predicated copies). Where the kernel's spills lie decides what they cost: in
    the tile set-up or the epilogue once a tile, in a main loop every step."""
    labels: dict[str, int] = {}
    ins: list[str] = []
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(1))
    loops = []
    for k, s in enumerate(ins):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", s)
        if m and m.group(1) in labels and labels[m.group(1)] <= k:
            body = ins[labels[m.group(1)] : k + 1]
            if any(mma in b for b in body):
                loops.append((len(body), sum(("LDL" in b or "STL" in b) for b in body)))
    assert loops, f"no loop holds {mma}"
    shortest = min(n for n, _ in loops)
    return [spills for n, spills in loops if n < 1.5 * shortest]


def quantized_mlp_step(grouped_mlp: Callable[..., torch.Tensor], recipe: str) -> Callable[[], list[torch.Tensor]]:
    """One forward and backward of `grouped_mlp(..., quantization=recipe, backend="triton")` (moekit's,
    passed in: these helpers do not import moekit) on a small
    fixed problem (21 rows in splits [9, 0, 10], so 2 padding rows and an empty expert; H 32, F 128, 3
    experts, router probs, a fixed upstream gradient), as a function returning [y, dx, dw1, dw2, d probs]:
    for tests that compare the bits of two ways of computing the quantized MLP."""
    rows, hidden, ffn, n = 21, 32, 128, 3
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(rows, hidden, generator=gen)
    w1 = torch.randn(n, 2 * ffn, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(n, hidden, ffn, generator=gen) / ffn**0.5
    probs0 = torch.rand(rows, generator=gen)
    dy = torch.randn(rows, hidden, generator=gen)
    splits = [9, 0, 10]

    def step() -> list[torch.Tensor]:
        x, a, b, p = (t.clone().requires_grad_() for t in (x0, w1, w2, probs0))
        y = grouped_mlp(x, a, b, splits, probs=p, backend="triton", quantization=recipe)
        y.backward(dy)
        return [y, x.grad, a.grad, b.grad, p.grad]

    return step


def assert_same_bits_without(
    step: Callable[[], list[torch.Tensor]],
    monkeypatch: pytest.MonkeyPatch,
    spied: tuple[object, str],
    switch: tuple[object, str],
    what: str,
) -> None:
    """`step()`'s tensors are the same bits with a path on and off: first with `spied` (module,
    function name) watched, which must be called (else "<what> did not run"), then with `switch` (module,
    name of an `..._unavailable_reason` function) answering a reason, after which the spied function
    must not be called again."""
    module, name = spied
    calls: list[int] = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    on = step()
    assert calls, f"{what} did not run"
    monkeypatch.setattr(switch[0], switch[1], lambda *a: "off for this test")
    off = step()
    assert len(calls) == 1, f"{what} ran with its switch off"
    for a, b in zip(on, off, strict=True):
        assert torch.equal(a, b)
