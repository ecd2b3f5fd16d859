"""torch.compile(fullgraph=True) of GroupedMLP, MoELayer and an apply_moekit Hugging Face model on
every backend: outputs and all gradients equal to eager's.

Two compilers. `aot_eager` (dynamo + AOTAutograd + the ops' fake implementations, then the traced
aten graph run eagerly) covers every backend, layout and model cheaply: it computes what eager
computes, op by op, so moekit's modules' results must be bitwise equal (a Hugging Face model's own
backward is traced through other aten ops than eager autograd runs: held to the floor below).
`inductor` (torch.compile's default) regenerates the elementwise code around moekit's custom ops
(SwiGLU of the torch/loop backends, router softmax, top-k weights), which reorders float32 sums:
there results are held to the tolerance rule's floor (tests/conftest.py: one float32 rounding plus
the reordering allowance 16 sqrt(L) u(float32)); wrong formulas or lost rows are off by far more.
Inductor compiles for 10-30 s per graph on a cold CPU cache, so it runs on MoELayer only (the
Hugging Face model under Inductor, about 30 s, matched eager within the floor when tried).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import moekit
from helpers import rel_err, tolerance_floor
from moekit.ops.runtime.backends import backend_named

# The small Hugging Face models of tests/integrations/test_transformers.py (`from test_transformers import _model`).
sys.path.insert(0, str(Path(__file__).resolve().parent / "integrations"))

TRITON_OK = backend_named("triton").unavailable_reason(torch.empty(1, 8), torch.empty(1, 8, 8)) is None
BACKENDS = [
    "loop",
    "torch",
    pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not TRITON_OK, reason="triton backend cannot run here (needs CUDA or TRITON_INTERPRET=1)"
        ),
    ),
]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles new modules: without a reset, dynamo's per-code-object cache would fill
    up across tests and fall back to eager."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(module, inputs: dict, compiler: str | None = None, **call_kwargs):
    """Forward + backward (eager, or compiled with `compiler`) with a fixed upstream gradient:
    (output, {name: gradient of every input and parameter})."""
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    module.zero_grad(set_to_none=True)
    run = module if compiler is None else torch.compile(module, fullgraph=True, backend=compiler)
    out = run(**leaves, **call_kwargs)
    out = out[0] if isinstance(out, tuple) else out
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    out.backward(upstream)
    grads = {f"input {k}": v.grad for k, v in leaves.items() if v.requires_grad}
    grads.update({f"param {k}": p.grad for k, p in module.named_parameters()})
    return out.detach(), grads


def _assert_same(eager, compiled, exact: bool):
    (out_e, grads_e), (out_c, grads_c) = eager, compiled
    assert grads_c.keys() == grads_e.keys()
    pairs = [("output", out_c, out_e)] + [(k, grads_c[k], grads_e[k]) for k in grads_e]
    for what, got, want in pairs:
        assert want is not None and got is not None, f"{what}: no gradient"
        if exact:
            assert torch.equal(got, want), f"{what}: compiled differs from eager, max {(got - want).abs().max()}"
        else:
            floor = tolerance_floor(torch.float32, max(want.shape, default=1))
            assert rel_err(got, want) <= floor, f"{what}: rel err {rel_err(got, want):.2e} > floor {floor:.1e}"


def _compare(module, inputs: dict, compiler: str, *, exact: bool, **call_kwargs):
    eager = _step(module, inputs, **call_kwargs)
    compiled = _step(module, inputs, compiler, **call_kwargs)
    _assert_same(eager, compiled, exact)


def _grouped_mlp(backend, single_grouped_weight):
    torch.manual_seed(0)
    return moekit.GroupedMLP(3, 16, 16, bias=True, single_grouped_weight=single_grouped_weight, backend=backend)


def _moe_layer(backend, single_grouped_weight):
    torch.manual_seed(0)
    return moekit.MoELayer(
        16, 16, num_experts=4, top_k=2, bias=True, single_grouped_weight=single_grouped_weight, backend=backend
    )


@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "per-expert"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_linear_fullgraph(backend, single_grouped_weight):
    """With bias, an empty expert and padding rows (the bias gradient's padding-row zeroing)."""
    torch.manual_seed(0)
    module = moekit.GroupedLinear(3, 16, 24, single_grouped_weight=single_grouped_weight, backend=backend)
    inputs = {"inp": torch.randn(13, 16, generator=torch.Generator().manual_seed(8))}
    _compare(module, inputs, "aot_eager", exact=True, m_splits=[5, 0, 6])


@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "per-expert"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mlp_fullgraph(backend, single_grouped_weight):
    """Host splits with an empty expert and padding rows; router probs get their gradient too."""
    g = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(13, 16, generator=g), "probs": torch.rand(13, generator=g)}
    _compare(_grouped_mlp(backend, single_grouped_weight), inputs, "aot_eager", exact=True, m_splits=[5, 0, 6])


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mlp_fullgraph_tensor_splits(backend):
    """m_splits as a CPU tensor: eager reads it on the host; a traced graph cannot, so under compile
    it takes the device path (offsets computed in the graph)."""
    g = torch.Generator().manual_seed(5)
    inputs = {"x": torch.randn(13, 16, generator=g), "probs": torch.rand(13, generator=g)}
    _compare(_grouped_mlp(backend, True), inputs, "aot_eager", exact=True, m_splits=torch.tensor([5, 0, 6]))


def test_permute_grouped_mlp_unpermute_fullgraph():
    """The three-step composition (permute, grouped_mlp with probs, unpermute) traces too."""

    class Composed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = _grouped_mlp("torch", True)

        def forward(self, x, weights):
            ids = torch.arange(x.shape[0] * 2).reshape(-1, 2) % 3
            x_sorted, m_splits, row_map = moekit.permute(x, ids, 3)
            y_sorted = self.mlp(x_sorted, m_splits)
            return moekit.unpermute(y_sorted, row_map, weights)

    g = torch.Generator().manual_seed(6)
    inputs = {"x": torch.randn(7, 16, generator=g), "weights": torch.rand(7, 2, generator=g)}
    _compare(Composed(), inputs, "aot_eager", exact=True)


@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "per-expert"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_layer_fullgraph(backend, single_grouped_weight):
    inputs = {"x": torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))}
    _compare(_moe_layer(backend, single_grouped_weight), inputs, "aot_eager", exact=True)


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_moe_layer_inductor(backend):
    """The loop backend traces to the torch backend's graph (the same Functions and ops, another
    backend name inside the ops): aot_eager covers it; Inductor runs on torch's and triton's."""
    inputs = {"x": torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3))}
    _compare(_moe_layer(backend, True), inputs, "inductor", exact=False)


def _hf_model(backend, name="qwen3_moe"):
    pytest.importorskip("transformers")
    from test_transformers import _model

    from moekit.integrations.transformers import apply_moekit

    return apply_moekit(_model(name), backend=backend)


class _LossOf(torch.nn.Module):
    """The model's language-model loss as the output (what a training step differentiates)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids).loss


def _ids():
    return torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_moekit_model_fullgraph(backend):
    # Not bitwise: AOTAutograd traces the model's own backward (embedding, attention) through other
    # aten ops than eager autograd runs, which sum in another order.
    _compare(_LossOf(_hf_model(backend)), {"input_ids": _ids()}, "aot_eager", exact=False)


def test_apply_moekit_gpt_oss_fullgraph():
    """gpt-oss: expert biases, the clamped SwiGLU and interleaved gate/up rows."""
    _compare(_LossOf(_hf_model("torch", "gpt_oss")), {"input_ids": _ids()}, "aot_eager", exact=False)


def test_experts_implementation_moekit_fullgraph():
    """The registered `experts_implementation="moekit"` path (no module swap) traces as well."""
    pytest.importorskip("transformers")
    from test_transformers import _model

    import moekit.integrations.transformers  # noqa: F401  (registers the implementation)

    _compare(
        _LossOf(_model("qwen3_moe", experts_implementation="moekit")), {"input_ids": _ids()}, "aot_eager", exact=False
    )


# --------------------------------------------------------------------------------------------------
# CUDA, bf16 (pytest -m gpu)
# --------------------------------------------------------------------------------------------------


def _cuda_step(module, x, compiled: bool, **call_kwargs):
    x = x.detach().clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    run = torch.compile(module, fullgraph=True) if compiled else module
    out = run(x, **call_kwargs)
    out.backward(
        torch.randn(out.shape, generator=torch.Generator("cuda").manual_seed(7), device="cuda", dtype=out.dtype)
    )
    grads = {"input x": x.grad, **{f"param {k}": p.grad for k, p in module.named_parameters()}}
    return out.detach(), grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("module_kind", ["grouped_mlp", "moe_layer"])
@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_cuda_bf16_inductor_fullgraph(backend, module_kind):
    """Inductor with fullgraph=True on CUDA in bf16: outputs and gradients within one bf16 rounding
    (plus the reordering floor) of eager's, on the first compiled step and on a second one."""
    torch.manual_seed(0)
    kw = dict(device="cuda", dtype=torch.bfloat16, backend=backend)
    if module_kind == "grouped_mlp":
        module = moekit.GroupedMLP(8, 256, 512, **kw)
        x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
        call = {"m_splits": torch.tensor([0, 200, 150, 0, 300, 100, 200, 0], device="cuda")}
    else:
        module = moekit.MoELayer(256, 512, num_experts=8, top_k=2, **kw)
        x = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16)
        call = {}
    eager = _cuda_step(module, x, False, **call)
    for _ in range(2):
        compiled = _cuda_step(module, x, True, **call)
        torch.cuda.synchronize()
        (out_e, grads_e), (out_c, grads_c) = eager, compiled
        assert grads_c.keys() == grads_e.keys()
        for what, got, want in [("output", out_c, out_e)] + [(k, grads_c[k], grads_e[k]) for k in grads_e]:
            floor = tolerance_floor(torch.bfloat16, max(want.shape))
            assert rel_err(got, want) <= floor, f"{what}: rel err {rel_err(got, want):.2e} > floor {floor:.1e}"
