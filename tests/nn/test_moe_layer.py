"""MoELayer against a plain-PyTorch re-implementation of the layer built from the same weights."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import moekit
from helpers import (
    BACKENDS,
    BF16,
    CUDA,
    GPU_BACKENDS,
    GPU_F,
    GPU_H,
    GPU_M,
    GPU_N,
    LOWP_DTYPES,
    assert_no_host_sync,
    assert_no_nan,
    assert_within_tolerance,
    check_against_reference,
    rand,
    rel_err,
    require_backend,
    torch_glu,
)

H, F, N = 16, 16, 4


def _ids(dt):
    return str(dt).removeprefix("torch.")


def torch_moe(
    x,
    router,
    fc1_weight,
    fc2_weight,
    fc1_bias=None,
    fc2_bias=None,
    *,
    top_k,
    score_func="softmax",
    norm_topk_prob=True,
    activation="swiglu",
    glu_interleave_size=None,
    aux_loss_coef=0.0,
):
    """The layer in plain torch, in x's dtype: route, run each token's experts, weight and sum.
    Returns (y (..., H), aux loss or None)."""
    x_TH = x.reshape(-1, x.shape[-1])
    logits = x_TH @ router.t()
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    weights, ids = scores.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    h = torch.einsum("tkoh,th->tko", fc1_weight[ids], x_TH)
    if fc1_bias is not None:
        h = h + fc1_bias[ids]
    a = torch_glu(h.reshape(-1, h.shape[-1]), activation=activation, glu_interleave_size=glu_interleave_size)
    y = torch.einsum("tkhf,tkf->tkh", fc2_weight[ids], a.reshape(*ids.shape, -1))
    if fc2_bias is not None:
        y = y + fc2_bias[ids]
    out = (y * weights[..., None].to(y.dtype)).sum(1).reshape(x.shape)
    aux = None
    if aux_loss_coef > 0:
        share = torch.bincount(ids.reshape(-1), minlength=router.shape[0]).to(scores.dtype) / ids.numel()
        aux = aux_loss_coef * router.shape[0] * (share * scores.mean(0)).sum()
    return out, aux


def _inputs(*, bias, seed=0, num_experts=N):
    d = {
        "router": rand(num_experts, H, scale=0.5, seed=seed),
        "fc1_weight": rand(num_experts, 2 * F, H, scale=H**-0.5, seed=seed + 1),
        "fc2_weight": rand(num_experts, H, F, scale=F**-0.5, seed=seed + 2),
    }
    if bias:
        d["fc1_bias"] = rand(num_experts, 2 * F, scale=0.5, seed=seed + 3)
        d["fc2_bias"] = rand(num_experts, H, scale=0.5, seed=seed + 4)
    return d


_PARAM_NAMES = {
    "router": "router.weight",
    "fc1_weight": "experts.fc1.weight",
    "fc2_weight": "experts.fc2.weight",
    "fc1_bias": "experts.fc1.bias",
    "fc2_bias": "experts.fc2.bias",
}


def _layer_fn(layer):
    """Call `layer` with the given tensors as its parameters (so their gradients are read directly)."""

    def run(x, **params):
        return functional_call(layer, {_PARAM_NAMES[k]: v for k, v in params.items()}, (x,))

    return run


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=_ids)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reimplementation(backend, dtype, score_func, norm_topk_prob, bias, nan_poison):
    top_k = 2
    layer = moekit.MoELayer(
        H, F, N, top_k, score_func=score_func, norm_topk_prob=norm_topk_prob, bias=bias, backend=backend, dtype=dtype
    )
    kw = {"top_k": top_k, "score_func": score_func, "norm_topk_prob": norm_topk_prob}
    inputs = {"x": rand(2, 8, H, seed=1), **_inputs(bias=bias, seed=2)}  # 3-D input: (batch, seq, H)
    res = check_against_reference(
        _layer_fn(layer),
        lambda x, **p: torch_moe(x, **p, **kw)[0],
        lambda x, **p: torch_moe(x, **p, **kw)[0],
        inputs,
        dtype,
    )
    assert res["out"].shape == (2, 8, H)
    for name, t in res.items():
        assert_no_nan(t, name)
    assert torch.count_nonzero(res["router"]) > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_equals_num_experts(backend):
    layer = moekit.MoELayer(H, F, N, N, backend=backend)
    kw = {"top_k": N}
    check_against_reference(
        _layer_fn(layer),
        lambda x, **p: torch_moe(x, **p, **kw)[0],
        lambda x, **p: torch_moe(x, **p, **kw)[0],
        {"x": rand(10, H, seed=3), **_inputs(bias=False, seed=4)},
        torch.float32,
    )


@pytest.mark.parametrize("activation, k", [("clamped_swiglu", None), ("swiglu", 2), ("clamped_swiglu", 1)])
def test_activation_and_interleave(activation, k):
    layer = moekit.MoELayer(H, F, N, 2, activation=activation, glu_interleave_size=k, bias=True)
    kw = {"top_k": 2, "activation": activation, "glu_interleave_size": k}
    inputs = {"x": rand(12, H, scale=3.0, seed=5), **_inputs(bias=True, seed=6)}
    check_against_reference(
        _layer_fn(layer),
        lambda x, **p: torch_moe(x, **p, **kw)[0],
        lambda x, **p: torch_moe(x, **p, **kw)[0],
        inputs,
        torch.float32,
    )


def _load(layer, d, dtype=torch.float32):
    with torch.no_grad():
        for k, v in d.items():
            layer.get_parameter(_PARAM_NAMES[k]).copy_(v.to(dtype))


def test_unused_experts_get_zero_gradients_in_every_layout():
    """8 experts, top-1, 2 tokens: at least 6 experts get no rows; their parameters get zeros, not None.
    The single and discrete layouts agree bitwise."""
    num_experts = 8
    d = _inputs(bias=True, seed=7, num_experts=num_experts)
    x = rand(2, H, seed=8)
    results = {}
    for single in (True, False):
        layer = moekit.MoELayer(H, F, num_experts, 1, bias=True, single_grouped_weight=single)
        if single:
            _load(layer, d)
        else:
            _load(layer, {"router": d["router"]})
            for name, lin in (("fc1", layer.experts.fc1), ("fc2", layer.experts.fc2)):
                with torch.no_grad():
                    for i in range(num_experts):
                        getattr(lin, f"weight{i}").copy_(d[f"{name}_weight"][i])
                        getattr(lin, f"bias{i}").copy_(d[f"{name}_bias"][i])
        y = layer(x)
        y.backward(rand(2, H, seed=9))
        for name, p in layer.named_parameters():
            assert p.grad is not None, f"{name} got no gradient (single={single})"
        used = set(layer.route(x)[1].reshape(-1).tolist())
        grads = {}
        for j, lin in ((1, layer.experts.fc1), (2, layer.experts.fc2)):
            gw = (
                lin.weight.grad
                if single
                else torch.stack([getattr(lin, f"weight{i}").grad for i in range(num_experts)])
            )
            for e in range(num_experts):
                assert (torch.count_nonzero(gw[e]) == 0) == (e not in used), f"fc{j} expert {e}"
            grads[j] = gw
        results[single] = (y.detach(), layer.router.weight.grad, grads[1], grads[2])
    for a, b in zip(results[True], results[False], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_gradient(score_func):
    """aux_loss_coef > 0 in training: the gradients equal those of loss + coef * aux added by hand (the
    tolerance rule against float64, the layer in fp32); self.aux_loss holds the value, detached."""
    coef, top_k = 0.05, 2
    d = _inputs(bias=False, seed=10)
    x, g = rand(12, H, seed=11), rand(12, H, seed=12)
    kw = {"top_k": top_k, "score_func": score_func}

    def layer_grads(aux_coef, train=True):
        layer = moekit.MoELayer(H, F, N, top_k, score_func=score_func, aux_loss_coef=aux_coef)
        _load(layer, d)
        layer.train(train)
        xi = x.clone().requires_grad_()
        (layer(xi) * g).sum().backward()  # the aux loss is NOT added here: the layer injects it
        return [xi.grad] + [layer.get_parameter(_PARAM_NAMES[k]).grad for k in d], layer.aux_loss

    def manual_grads(dtype, with_aux=True):
        leaves = {k: v.detach().clone().to(dtype).requires_grad_() for k, v in d.items()}
        xi = x.detach().clone().to(dtype).requires_grad_()
        y, aux = torch_moe(xi, **leaves, **kw, aux_loss_coef=coef)
        loss = (y * g.to(dtype)).sum() + (aux if with_aux else 0)
        loss.backward()
        return [xi.grad] + [leaves[k].grad for k in d], aux.detach()

    grads, aux = layer_grads(coef)
    lowp, aux_lowp = manual_grads(torch.float32)
    ref, aux_ref = manual_grads(torch.float64)
    assert aux is not None and not aux.requires_grad
    assert_within_tolerance(aux.reshape(1), aux_ref.reshape(1), aux_lowp.reshape(1), "aux loss")
    for name, got, want_lowp, want in zip(["x", *d], grads, lowp, ref, strict=True):
        assert_within_tolerance(got, want, want_lowp, f"d {name} with the aux loss")
    # The aux term really contributes, and only through the scores: without it (coef 0, or eval mode)
    # the router gradient differs by d(coef * aux) / d router, and the experts' gradients are the same.
    grads0, aux0 = layer_grads(0.0)
    grads_eval, _ = layer_grads(coef, train=False)
    assert aux0 is None
    ref0, _ = manual_grads(torch.float64, with_aux=False)
    assert rel_err(ref[1] - ref0[1], torch.zeros_like(ref0[1])) > 1e-4
    assert rel_err(grads[1] - grads0[1], ref[1] - ref0[1]) < 1e-3
    assert torch.equal(grads_eval[1], grads0[1])
    for a, b in zip(grads[2:], grads0[2:], strict=True):
        assert torch.equal(a, b)


def test_route_outputs():
    layer = moekit.MoELayer(H, F, N, 2, score_func="softmax", norm_topk_prob=True)
    weights, ids, scores = layer.route(rand(5, H, seed=13))
    assert weights.dtype == torch.float32 and ids.shape == (5, 2) and scores.shape == (5, N)
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    torch.testing.assert_close(scores.sum(-1), torch.ones(5))
    assert torch.equal(ids, scores.topk(2, dim=-1).indices)
    layer.norm_topk_prob = False  # the router's setting, set through the layer
    assert layer.router.norm_topk_prob is False
    w2, _, s2 = layer.route(rand(5, H, seed=13))
    torch.testing.assert_close(w2, s2.topk(2, dim=-1).values)


# --------------------------------------------------------------------------------------------------
# The named parts: TopKRouter (+ its load-balancing loss) and GroupedMLP experts
# --------------------------------------------------------------------------------------------------


def torch_router(x, weight, *, top_k, score_func="softmax", norm_topk_prob=True):
    """The router in plain torch, in x's dtype: (top-k weights, ids, scores)."""
    logits = x @ weight.t()
    scores = logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()
    weights, ids = scores.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids, scores


def torch_switch_loss(ids, scores, coef):
    """coef * N * sum_e f_e * P_e: f_e the share of the routed copies on e, P_e e's mean score."""
    num_experts = scores.shape[1]
    share = torch.bincount(ids.reshape(-1), minlength=num_experts).to(scores.dtype) / ids.numel()
    return coef * num_experts * (share * scores.mean(0)).sum()


@pytest.mark.parametrize("norm_topk_prob", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_and_its_loss_match_reimplementation(score_func, norm_topk_prob):
    """TopKRouter alone: its top-k weights and its load-balancing loss (from load_balancing_stats),
    outputs and the gradients of x and the gate, by the tolerance rule against float64."""
    top_k, coef = 2, 0.3
    router = moekit.TopKRouter(H, N, top_k, score_func=score_func, norm_topk_prob=norm_topk_prob, aux_loss_coef=coef)
    kw = {"top_k": top_k, "score_func": score_func, "norm_topk_prob": norm_topk_prob}
    inputs = {"x": rand(11, H, seed=20), "weight": rand(N, H, scale=0.5, seed=21)}

    def ours_weights(x, weight):
        return functional_call(router, {"weight": weight}, (x,)).weights

    def ours_loss(x, weight):
        routing = functional_call(router, {"weight": weight}, (x,))
        return router.load_balancing_loss(router.load_balancing_stats(routing))

    def torch_loss(x, weight):
        _, ids, scores = torch_router(x, weight, **kw)
        return torch_switch_loss(ids, scores, coef)

    check_against_reference(
        ours_weights,
        lambda **p: torch_router(**p, **kw)[0],
        lambda **p: torch_router(**p, **kw)[0],
        inputs,
        torch.float32,
    )
    res = check_against_reference(ours_loss, torch_loss, torch_loss, inputs, torch.float32)
    assert torch.count_nonzero(res["weight"]) > 0
    routing = router(inputs["x"])
    _, ids, scores = torch_router(inputs["x"], router.weight.detach(), **kw)
    assert torch.equal(routing.ids, ids) and routing.ids.dtype == torch.int64
    assert routing.weights.dtype == routing.scores.dtype == torch.float32


def test_load_balancing_statistics_of_parts_add_up():
    """The statistics of two token sets (two ranks) add up to the whole's, and the parts computed
    against the totals (what expert parallelism backpropagates on each rank) sum to the whole's
    loss, with the same router gradient (float64: to rounding)."""
    router = moekit.TopKRouter(H, N, 2, aux_loss_coef=0.2, dtype=torch.float64)
    x = rand(13, H, dtype=torch.float64, seed=22)
    whole = router.load_balancing_stats(router(x))
    loss = router.load_balancing_loss(whole)
    (d_whole,) = torch.autograd.grad(loss, router.weight)
    parts = [router.load_balancing_stats(router(piece)) for piece in (x[:5], x[5:], x[:0])]
    totals = moekit.nn.LoadBalancingStats(
        *(sum(getattr(p, f) for p in parts) for f in ("copies", "score_sum", "tokens"))
    )
    for field in ("copies", "tokens"):
        assert torch.equal(getattr(totals, field), getattr(whole, field)), field
    assert_within_tolerance(totals.score_sum, whole.score_sum, whole.score_sum, "score sums", reduction_length=13)
    detached = totals._replace(score_sum=totals.score_sum.detach())
    part_losses = [router.load_balancing_loss(p, detached) for p in parts]
    (d_parts,) = torch.autograd.grad(sum(part_losses), router.weight)
    assert rel_err(sum(part_losses), loss) < 1e-14
    assert rel_err(d_parts, d_whole) < 1e-13 and d_whole.abs().sum() > 0


@pytest.mark.parametrize("shape", [(0, H), (2, 0, H)], ids=["0-tokens", "0-sequences"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_is_zero_without_tokens(shape, score_func, nan_poison):
    """Training on 0 tokens with aux_loss_coef > 0: the loss is 0 (issue: NaN) and the router gets a
    zero gradient (not NaN, not None), as every expert parameter does."""
    layer = moekit.MoELayer(H, F, N, 2, score_func=score_func, aux_loss_coef=0.1)
    x = torch.zeros(shape, requires_grad=True)
    y = layer(x)
    assert y.shape == shape
    y.sum().backward()
    assert layer.aux_loss is not None and float(layer.aux_loss) == 0.0
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), name
    assert x.grad.shape == shape


@pytest.mark.parametrize("aux_loss_coef", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(6, H), (2, 3, H), (H,)], ids=["2-D", "3-D", "1-D"])
def test_output_is_no_view_and_in_place_ops_keep_gradients(shape, aux_loss_coef):
    """The output is never a view (FSDP2 warns about modules that return one: an in-place op on it
    would drop its hooks), in any input shape, with and without the injected aux loss; an in-place
    op on it gives the gradients the same out-of-place op gives."""
    torch.manual_seed(0)
    layer = moekit.MoELayer(H, F, N, 2, aux_loss_coef=aux_loss_coef)
    x = rand(*shape, seed=23)
    grads = []
    for in_place in (False, True):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = layer(xi)
        assert y.shape == shape and y._base is None and not y._is_view()
        y = y.mul_(3.0) if in_place else y * 3.0
        (y * rand(*shape, seed=24)).sum().backward()
        grads.append([xi.grad, *(p.grad for p in layer.parameters())])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    linear = moekit.GroupedLinear(2, H, 5)
    assert linear(rand(2, 3, H, seed=25), [4, 2])._base is None


def test_inject_aux_loss():
    """inject_aux_loss: the output's values, not a view, whose backward also backpropagates the loss
    with gradient 1 (exact here)."""
    w = rand(4, dtype=torch.float64, seed=26).requires_grad_()
    x = rand(3, 2, dtype=torch.float64, seed=27).requires_grad_()
    t = x * 3
    out = moekit.nn.inject_aux_loss(t, (w**2).sum())
    assert torch.equal(out, t) and out._base is None
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    assert torch.equal(w.grad, 2 * w.detach())


@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "discrete"])
def test_parts_keep_state_dict_and_initialisation(single_grouped_weight):
    """MoELayer = router + experts under the state-dict keys it always had (checkpoints and the
    transformers integration read `router.weight`); the router draws its initial weight as the
    nn.Linear it replaced did, so a seeded layer starts where it used to; the router's settings are
    read and set in one place."""
    layer_kw = {"bias": True, "single_grouped_weight": single_grouped_weight}
    torch.manual_seed(0)
    layer = moekit.MoELayer(H, F, 2, 1, **layer_kw)
    experts = ["weight", "bias"] if single_grouped_weight else [f"{k}{i}" for k in ("weight", "bias") for i in range(2)]
    assert list(layer.state_dict()) == [
        "router.weight",
        *(f"experts.fc1.{k}" for k in experts),
        "experts.fc1._extra_state",
        *(f"experts.fc2.{k}" for k in experts),
        "experts.fc2._extra_state",
    ]
    torch.manual_seed(0)
    gate = torch.nn.Linear(H, 2, bias=False)
    mlp = moekit.GroupedMLP(2, H, F, **layer_kw)
    assert torch.equal(layer.router.weight, gate.weight)
    for (name, p), (_, q) in zip(layer.experts.named_parameters(), mlp.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert isinstance(layer.router, moekit.TopKRouter) and moekit.nn.TopKRouter is moekit.TopKRouter
    layer.aux_loss_coef = 0.5
    assert layer.router.aux_loss_coef == 0.5 and (layer.hidden_size, layer.num_experts, layer.top_k) == (H, 2, 1)
    with pytest.raises(AttributeError, match="num_experts is fixed at construction"):
        layer.num_experts = 3


@pytest.mark.parametrize("single_grouped_weight", [True, False], ids=["grouped", "discrete"])
def test_select_experts(single_grouped_weight):
    """GroupedMLP.select_experts: a GroupedMLP of a range of the experts, same options and layout,
    whose forward on rows routed to them equals the full module's on the same rows."""
    torch.manual_seed(0)
    full = moekit.GroupedMLP(5, H, F, bias=True, glu_interleave_size=2, single_grouped_weight=single_grouped_weight)
    part = full.select_experts(1, 3)
    assert part.num_experts == 3 and part.options() == full.options()
    x, probs = rand(7, H, seed=28), rand(7, seed=29)
    torch.testing.assert_close(part(x, [2, 0, 5], probs), full(x, [0, 2, 0, 5, 0], probs), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"experts 3..5 do not exist: this GroupedMLP has 5"):
        full.select_experts(3, 3)
    with pytest.raises(ValueError, match=r"^count must be an int >= 1, got 0$"):
        full.select_experts(0, 0)


def test_reference_is_an_attribute_of_the_package():
    """`import moekit; moekit.reference` works without importing the submodule by name."""
    import subprocess
    import sys

    code = "import moekit; print(moekit.reference.grouped_mlp_reference.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "grouped_mlp_reference", out.stderr


def test_moe_layer_routes_float64_in_float64():
    layer = moekit.MoELayer(8, 4, 4, 2, dtype=torch.float64)
    weights, _, scores = layer.route(torch.randn(3, 8, dtype=torch.float64))
    assert weights.dtype == torch.float64 and scores.dtype == torch.float64


# --------------------------------------------------------------------------------------------------
# On the GPU (pytest -m gpu): no host sync in forward + backward, bit-identical gradients
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_moe_layer_forward_backward_has_no_host_sync(backend):
    require_backend(backend, GPU_H, 2 * GPU_F)
    torch.manual_seed(0)
    layer = moekit.MoELayer(GPU_H, GPU_F, GPU_N, top_k=2, aux_loss_coef=0.01, backend=backend, device=CUDA, dtype=BF16)
    x = torch.randn(GPU_M // 2, GPU_H, device=CUDA, dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)

    def step():
        layer(x).backward(dy)

    assert_no_host_sync(step)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_moe_layer_backward_is_bit_identical(backend):
    require_backend(backend, GPU_H, 2 * GPU_F)
    torch.manual_seed(0)
    layer = moekit.MoELayer(GPU_H, GPU_F, GPU_N, top_k=2, backend=backend, device=CUDA, dtype=BF16)
    x = torch.randn(GPU_M // 2, GPU_H, device=CUDA, dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)
    leaves = {"x": x, **dict(layer.named_parameters())}

    def grads():
        for t in leaves.values():
            t.grad = None
        layer(x).backward(dy)
        return {k: t.grad.clone() for k, t in leaves.items()}

    grads()  # warm-up: autotuning runs here
    first, second = grads(), grads()
    differ = [k for k in first if not torch.equal(first[k], second[k])]
    assert not differ, f"gradients differ between two identical backward passes: {differ}"
