"""moe_experts' fused layer (triton backend) holding h for its first sorted rows only and computing
the others' h again in the backward: the same bits as holding it whole, against the float64
reference, what the layer holds between forward and backward (the memory contract), and the policy
`held_h_rows`.

Legend: T tokens, K experts per token, M = T*K routed rows, N experts, H hidden size, F ffn size.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from test_moe_experts import _require_triton, check, make_inputs

from helpers import assert_no_host_sync, rand
from moekit.ops import moe_experts as moe_experts_module
from moekit.ops.activations import ACTIVATIONS
from moekit.ops.grouped_mlp import FusedSpec, fused_mlp
from moekit.ops.routing import sort_by_expert
from moekit.ops.rows import ExpertRoute
from moekit.reference import moe_experts_reference


def _hold(monkeypatch, kept_of_rows):
    """Make the layer hold h for kept_of_rows(M) rows."""
    monkeypatch.setattr(moe_experts_module, "held_h_rows", lambda rows, *_: kept_of_rows(rows))


def _assert_equal(split: dict, whole: dict) -> None:
    assert split.keys() == whole.keys()
    for name in whole:
        assert torch.equal(split[name], whole[name]), f"{name} differs from the run that holds h whole"


# Under the interpreter tl.dot is NumPy's matmul, whose bits for a row depend on the row's place in
# the tile (OpenBLAS); the GPU's MMA gives every row the same bits wherever it sits. So the CPU tests
# split where each row keeps its place in its tile: at an expert's start or a multiple of the fused
# kernels' BLOCK_M rows into an expert; the GPU tests below split anywhere.
TILE_ROWS = 16
EXPERTS, TOKENS = 5, 24
# Rows per expert, K = 2, M = 48: empty first and middle experts, expert 1 over a tile (21 rows),
# expert 4 of 17 rows, so that M - 1 is one tile into it. offs = [0, 0, 21, 21, 31, 48].
COUNTS = [0, 21, 0, 10, 17]
# kept (rows whose h is held) -> what the split is.
CPU_SPLITS = [
    pytest.param(0, id="kept0"),
    pytest.param(16, id="through-expert1"),
    pytest.param(21, id="at-expert-boundary"),
    pytest.param(47, id="kept-M-1"),
]


def _inputs(seed: int, dropped: int = 0) -> dict:
    """make_inputs' weights with COUNTS' routing; `dropped` of expert 4's copies get id N (padding)."""
    inputs = make_inputs(TOKENS, EXPERTS, 2, bias=True, seed=seed)
    flat = torch.repeat_interleave(torch.arange(EXPERTS), torch.tensor(COUNTS))
    flat[len(flat) - dropped :] = EXPERTS
    # Token t takes copies t and t + T of the sorted list: two different experts.
    ids = torch.stack([flat[:TOKENS], flat[TOKENS:]], 1)
    inputs["topk_ids"] = ids[torch.randperm(TOKENS, generator=torch.Generator().manual_seed(seed))]
    return inputs


def test_cpu_tile_rows():
    from moekit.ops.runtime.configs import glu_candidates

    for kernel in ("fwd", "bwd"):
        assert glu_candidates(kernel, torch.float32, 24, 24, True, "interpreter")[0].block_rows == TILE_ROWS


@pytest.mark.parametrize("kept", CPU_SPLITS)
def test_split_is_bit_identical_and_matches_reference(kept, monkeypatch, nan_poison):
    _require_triton()
    inputs = _inputs(seed=21)
    whole = check(inputs, torch.float32, backend="triton")
    _hold(monkeypatch, lambda rows: kept)
    split = check(inputs, torch.float32, backend="triton")  # the tolerance rule against float64
    _assert_equal(split, whole)


@pytest.mark.parametrize("glu_interleave_size", [None, 4], ids=lambda k: f"interleave-{k}")
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_split_activations_and_interleave(activation, glu_interleave_size, monkeypatch, nan_poison):
    _require_triton()
    inputs = _inputs(seed=22)
    inputs["x"] = inputs["x"] * 6  # clamped_swiglu's limits (|h| > 7) reached
    kw = dict(activation=activation, glu_interleave_size=glu_interleave_size)
    whole = check(inputs, torch.float32, backend="triton", **kw)
    _hold(monkeypatch, lambda rows: 16)
    _assert_equal(check(inputs, torch.float32, backend="triton", **kw), whole)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_split_under_activation_checkpointing(use_reentrant, monkeypatch):
    """torch.utils.checkpoint's own hooks around the split layer (the reentrant form runs the first
    forward under no_grad, where h is not split): the results of the plain split layer."""
    from torch.utils.checkpoint import checkpoint

    _require_triton()
    inputs = _inputs(seed=25)
    dy = rand(TOKENS, inputs["x"].shape[1], seed=26)
    _hold(monkeypatch, lambda rows: 16)
    results = []
    for wrapped in (False, True):
        leaves = {k: (v.clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in inputs.items()}

        def layer(x, w, leaves=leaves):
            return moe_experts_module.moe_experts(
                x,
                leaves["topk_ids"],
                w,
                leaves["fc1_weight"],
                leaves["fc2_weight"],
                fc1_bias=leaves["fc1_bias"],
                fc2_bias=leaves["fc2_bias"],
                backend="triton",
            )

        args = (leaves["x"], leaves["topk_weights"])
        y = checkpoint(layer, *args, use_reentrant=use_reentrant) if wrapped else layer(*args)
        y.backward(dy)
        results.append({"out": y.detach(), **{k: v.grad for k, v in leaves.items() if v.is_floating_point()}})
    _assert_equal(results[1], results[0])


def _fused_run(inputs: dict, dy: torch.Tensor) -> dict:
    """The fused layer's two nodes on a routing the public op refuses on the CPU: ids >= N (dropped
    copies), which sort past offs[N] into padding rows."""
    leaves = {k: (v.clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in inputs.items()}
    order = sort_by_expert(leaves["topk_ids"], EXPERTS, use_triton=True)
    x = leaves["x"]
    rows, ffn = order.token_of_row.shape[0], leaves["fc2_weight"].shape[2]
    kept = moe_experts_module.held_h_rows(rows, x.shape[1], ffn, x.element_size(), 24)
    spec = FusedSpec("triton", None, "swiglu", 1, 1)
    y = fused_mlp(
        spec,
        order.offs,
        ExpertRoute.of(order, True),
        kept,
        x,
        leaves["topk_weights"],
        [leaves["fc1_weight"]],
        [leaves["fc1_bias"]],
        [leaves["fc2_weight"]],
        [leaves["fc2_bias"]],
    )
    y.backward(dy)
    return {"out": y.detach(), **{k: v.grad for k, v in leaves.items() if v.is_floating_point()}}


@pytest.mark.parametrize("kept", [16, 46], ids=["padding-in-tail", "padding-in-both"])
def test_split_with_padding_rows(kept, monkeypatch, nan_poison):
    """4 dropped copies: rows 44..47 of 48 are padding (offs[N] = 44)."""
    _require_triton()
    inputs = _inputs(seed=23, dropped=4)
    dy = rand(TOKENS, inputs["x"].shape[1], seed=24)
    whole = _fused_run(inputs, dy)
    _hold(monkeypatch, lambda rows: kept)
    _assert_equal(_fused_run(inputs, dy), whole)
    # The dropped copies contribute nothing, as in the reference (which skips ids outside [0, N)).
    ref = {k: (v.double().requires_grad_(True) if v.is_floating_point() else v) for k, v in inputs.items()}
    y_ref = moe_experts_reference(**ref)
    y_ref.backward(dy.double())
    torch.testing.assert_close(whole["out"].double(), y_ref.detach(), rtol=1e-5, atol=1e-5)
    for name in ("x", "topk_weights", "fc1_weight", "fc2_weight", "fc1_bias", "fc2_bias"):
        torch.testing.assert_close(whole[name].double(), ref[name].grad, rtol=1e-5, atol=1e-5, msg=name)


# --------------------------------------------------------------------------------------------------
# What the layer holds between forward and backward
# --------------------------------------------------------------------------------------------------


def _held(inputs: dict) -> tuple[int, list[torch.Size], list[weakref.ref], dict]:
    """(bytes of the distinct storages the layer saves for its backward, the inputs excluded; their
    shapes; weak references to them; the leaves) of one forward on the triton backend."""
    leaves = {k: (v.clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in inputs.items()}
    given = {id(v) for v in leaves.values()}
    storages, shapes, refs = {}, [], []

    def pack(t):
        if id(t) not in given:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            shapes.append(t.shape)
            refs.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = moe_experts_module.moe_experts(**leaves, backend="triton")
    leaves["y"] = y
    return sum(storages.values()), shapes, refs, leaves


def _plain_bytes(rows: int, hidden: int, ffn: int, itemsize: int) -> float:
    """What the plain PyTorch layer holds for its backward: (4F + 3H) values a routed row."""
    return rows * (4 * ffn + 3 * hidden) * itemsize


def test_held_memory_meets_the_contract(monkeypatch):
    """F = 4H (over 3H, as Mixtral's): h whole would be over the bar; the layer holds part of it,
    within the bar, and frees it in the backward. Without the spare bytes (they cover the CUDA
    allocator's rounding, which a count of saved storages does not see): the count per row is exact."""
    _require_triton()
    monkeypatch.setattr(moe_experts_module, "HELD_SPARE_BYTES", 0)
    num_tokens, top_k, hidden, ffn = 40, 2, 16, 64
    rows = num_tokens * top_k
    inputs = make_inputs(num_tokens, 4, top_k, hidden=hidden, ffn=ffn, bias=True, seed=25)
    bar = moe_experts_module.HELD_FRACTION_OF_PLAIN * _plain_bytes(rows, hidden, ffn, 4)

    held, shapes, refs, leaves = _held(inputs)
    h_rows = [s[0] for s in shapes if s[1:] == (2 * ffn,)]
    assert len(h_rows) == 1 and 0 < h_rows[0] < rows, shapes
    assert held <= bar, f"holds {held} bytes, over {bar:.0f} (0.4 x plain)"
    leaves["y"].backward(rand(num_tokens, hidden, seed=26))
    gc.collect()
    assert all(r() is None for r in refs), "a saved tensor outlives the backward"

    # Held whole, h is over the bar: the check above means something.
    with monkeypatch.context() as m:
        _hold(m, lambda rows: rows)
        whole, *_ = _held(inputs)
    assert whole > bar


def test_h_held_whole_where_it_fits():
    """F = 1.5H: h (M, 2F) whole is within the bar, nothing is computed again."""
    _require_triton()
    num_tokens, top_k, hidden, ffn = 40, 2, 16, 24
    inputs = make_inputs(num_tokens, 4, top_k, hidden=hidden, ffn=ffn, seed=27)
    _, shapes, _, _ = _held(inputs)
    assert (num_tokens * top_k, 2 * ffn) in [tuple(s) for s in shapes]


def test_no_grad_holds_nothing_and_splits_nothing(monkeypatch):
    _require_triton()
    calls = []
    monkeypatch.setattr(moe_experts_module, "held_h_rows", lambda rows, *_: calls.append(rows) or 0)
    with torch.no_grad():
        moe_experts_module.moe_experts(**make_inputs(8, 4, 2, hidden=16, ffn=64, seed=28), backend="triton")
    assert calls == []


# --------------------------------------------------------------------------------------------------
# The policy
# --------------------------------------------------------------------------------------------------


# Saved per routed row besides h: inverse and token_of_row (int64), probs (bf16 weights).
META_BF16 = 8 + 8 + 2


def test_policy_at_mixtral():
    """Mixtral 8x7B's layer as the README measures it (T 16384, K 2, H 4096, F 14336, bf16): the
    plain layer holds 4,563,402,752 bytes; the fused one a little under 0.4x that, computing few
    rows' h again."""
    rows, hidden, ffn = 16384 * 2, 4096, 14336
    plain = _plain_bytes(rows, hidden, ffn, 2)
    assert plain == 4_563_402_752
    kept = moe_experts_module.held_h_rows(rows, hidden, ffn, 2, META_BF16)
    assert kept < rows
    held = kept * 2 * ffn * 2 + rows * META_BF16
    assert held <= 0.4 * plain
    assert (rows - kept) / rows < 0.035
    # The most rows that fit with the spare bytes: one row more would not.
    assert held + moe_experts_module.HELD_SPARE_BYTES + 2 * ffn * 2 > 0.4 * plain


@pytest.mark.parametrize(
    "hidden,ffn",
    [(2048, 768), (7168, 2048), (2880, 2880), (6144, 16384), (6144, 10752)],
    ids=["qwen3-30b", "deepseek-v3", "gpt-oss", "mixtral-8x22b", "dbrx"],
)
@pytest.mark.parametrize("rows", [1, 7, 131072])
def test_policy_holds_h_whole_up_to_about_3h(rows, hidden, ffn):
    assert moe_experts_module.held_h_rows(rows, hidden, ffn, 2, META_BF16) == rows


def test_policy_edges():
    held_h_rows = moe_experts_module.held_h_rows
    assert held_h_rows(0, 16, 64, 4, 20) == 0
    assert held_h_rows(10, 16, 0, 4, 20) == 10  # no h
    assert held_h_rows(10, 1, 1000, 4, 20) == 0  # too little room for a row after the spare bytes


# --------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu): splits anywhere, bf16, and what the allocator holds
# --------------------------------------------------------------------------------------------------

GPU_T, GPU_N, GPU_K = 1024, 8, 2


def _gpu_run(inputs: dict, dy: torch.Tensor, **kw) -> dict:
    leaves = {
        k: (v.cuda().to(torch.bfloat16).requires_grad_(True) if v.is_floating_point() else v.cuda())
        for k, v in inputs.items()
    }
    y = moe_experts_module.moe_experts(**leaves, backend="triton", **kw)
    y.backward(dy)
    return {"out": y.detach(), **{k: v.grad for k, v in leaves.items() if v.is_floating_point()}}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("glu_interleave_size", [None, 128], ids=lambda k: f"interleave-{k}")
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_split_anywhere_is_bit_identical_on_gpu(activation, glu_interleave_size, monkeypatch):
    rows = GPU_T * GPU_K
    inputs = make_inputs(GPU_T, GPU_N, GPU_K, hidden=512, ffn=1024, bias=True, experts=[1, 2, 3, 5, 6], seed=30)
    dy = rand(GPU_T, 512, seed=31).cuda().to(torch.bfloat16)
    kw = dict(activation=activation, glu_interleave_size=glu_interleave_size)
    whole = _gpu_run(inputs, dy, **kw)
    for kept in (0, 5, 777, rows - 1):
        _hold(monkeypatch, lambda rows, kept=kept: kept)
        split = _gpu_run(inputs, dy, **kw)
        differ = [k for k in whole if not torch.equal(split[k], whole[k])]
        assert not differ, f"kept {kept}: {differ} differ from the run that holds h whole"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_held_memory_on_gpu(monkeypatch):
    """F = 4H: what the allocator holds after the forward (the output excluded) is within the bar,
    where h whole would not be; no host sync on the way; the same bits as holding h whole."""
    hidden, ffn = 256, 1024
    rows = GPU_T * GPU_K
    inputs = make_inputs(GPU_T, GPU_N, GPU_K, hidden=hidden, ffn=ffn, bias=True, seed=32)
    leaves = {
        k: (v.cuda().to(torch.bfloat16).requires_grad_(True) if v.is_floating_point() else v.cuda())
        for k, v in inputs.items()
    }
    dy = rand(GPU_T, hidden, seed=33).cuda().to(torch.bfloat16)
    bar = moe_experts_module.HELD_FRACTION_OF_PLAIN * _plain_bytes(rows, hidden, ffn, 2)

    def held() -> int:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = moe_experts_module.moe_experts(**leaves, backend="triton")
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
        y.backward(dy)
        return held

    held()  # warm-up: plans, compilation
    split = held()
    assert split <= bar, f"holds {split} bytes, over {bar:.0f} (0.4 x plain)"
    assert_no_host_sync(lambda: moe_experts_module.moe_experts(**leaves, backend="triton").backward(dy))
    with monkeypatch.context() as m:
        _hold(m, lambda rows: rows)
        assert held() > bar
        whole = _gpu_run(inputs, dy)
    _assert_equal(_gpu_run(inputs, dy), whole)
