"""MoELayer against a plain-PyTorch re-implementation of the layer built from the same weights."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

import moekit
from helpers import (
    BACKENDS,
    LOWP_DTYPES,
    assert_no_nan,
    assert_within_tolerance,
    check_against_reference,
    rand,
    rel_err,
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
    layer.norm_topk_prob = False
    w2, _, s2 = layer.route(rand(5, H, seed=13))
    torch.testing.assert_close(w2, s2.topk(2, dim=-1).values)


def test_reference_is_an_attribute_of_the_package():
    """`import moekit; moekit.reference` works without importing the submodule by name."""
    import subprocess
    import sys

    code = "import moekit; print(moekit.reference.grouped_mlp_reference.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "grouped_mlp_reference", out.stderr
