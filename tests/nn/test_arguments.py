"""moekit.nn refuses bad arguments in one line naming the argument (moekit.validation's checks), at
construction, and inputs of another dtype than its parameters at forward: booleans are booleans
(issue: `norm_topk_prob="no"` renormalised, `bias="no"` built biases), sizes positive ints, top_k
in [1, num_experts], score_func a choice, aux_loss_coef finite and >= 0 (issue: inf gave non-finite
router gradients, nan skipped the loss silently, "0.1"/None failed deep inside), and parameters in a
compute dtype (issue: integer dtypes failed inside nn.Parameter, float8 in an init kernel, bool in
addmm)."""

from __future__ import annotations

import re

import pytest
import torch

import moekit
from helpers import rand

H, F, N = 8, 6, 4


def _build(module: str, **kwargs):
    if module == "GroupedLinear":
        return moekit.GroupedLinear(N, H, F, **kwargs)
    if module == "GroupedMLP":
        return moekit.GroupedMLP(N, H, F, **kwargs)
    if module == "TopKRouter":
        return moekit.TopKRouter(H, N, 2, **kwargs)
    return moekit.MoELayer(H, F, N, 2, **kwargs)


def _refused(exc: type[Exception], pattern: str, build) -> None:
    with pytest.raises(exc, match=pattern) as info:
        build()
    assert "\n" not in str(info.value), f"more than one line: {info.value}"


BOOL_ARGS = {
    "GroupedLinear": ("bias", "single_grouped_weight", "single_grouped_bias"),
    "GroupedMLP": ("bias", "single_grouped_weight"),
    "TopKRouter": ("norm_topk_prob",),
    "MoELayer": ("norm_topk_prob", "bias", "single_grouped_weight"),
}


@pytest.mark.parametrize("value", ["no", 1, None, torch.tensor(True)], ids=["str", "int", "None", "tensor"])
@pytest.mark.parametrize("module, name", [(m, a) for m, args in BOOL_ARGS.items() for a in args])
def test_bool_arguments_are_bools(module, name, value):
    kind = type(value).__name__
    _refused(
        TypeError,
        rf"^{name} must be a bool \(True or False\), got .*\({kind}\)$",
        lambda: _build(module, **{name: value}),
    )


def test_bool_arguments_take_effect():
    """False means False (the issue's truthy strings built biases and renormalised)."""
    assert moekit.GroupedLinear(N, H, F, bias=False).biases() is None
    layer = moekit.MoELayer(H, F, N, 2, norm_topk_prob=False)
    weights, _, scores = layer.route(rand(5, H, seed=1))
    torch.testing.assert_close(weights, scores.topk(2, dim=-1).values, rtol=0, atol=0)


SIZES = {
    "GroupedLinear": ("num_gemms", "in_features", "out_features"),
    "GroupedMLP": ("num_experts", "hidden_size", "ffn_hidden_size"),
    "TopKRouter": ("hidden_size", "num_experts"),
    "MoELayer": ("hidden_size", "ffn_hidden_size", "num_experts"),
}
POSITIONAL = {"GroupedLinear": [N, H, F], "GroupedMLP": [N, H, F], "TopKRouter": [H, N, 2], "MoELayer": [H, F, N, 2]}
ORDER = {
    "GroupedLinear": ["num_gemms", "in_features", "out_features"],
    "GroupedMLP": ["num_experts", "hidden_size", "ffn_hidden_size"],
    "TopKRouter": ["hidden_size", "num_experts", "top_k"],
    "MoELayer": ["hidden_size", "ffn_hidden_size", "num_experts", "top_k"],
}


@pytest.mark.parametrize(
    "value, exc, pattern",
    [
        (0, ValueError, r"must be an int >= 1, got 0$"),
        (-2, ValueError, r"must be an int >= 1, got -2$"),
        (4.0, TypeError, r"must be an int, got 4.0 \(float\)$"),
        (True, TypeError, r"must be an int, got True \(bool\)$"),
        ("4", TypeError, r"must be an int, got '4' \(str\)$"),
    ],
    ids=["0", "negative", "float", "bool", "str"],
)
@pytest.mark.parametrize("module, name", [(m, a) for m, args in SIZES.items() for a in args])
def test_sizes_are_positive_ints(module, name, value, exc, pattern):
    args = list(POSITIONAL[module])
    args[ORDER[module].index(name)] = value
    cls = getattr(moekit, module)
    _refused(exc, rf"^{name} {pattern}", lambda: cls(*args))


@pytest.mark.parametrize("module", ["TopKRouter", "MoELayer"])
def test_top_k_and_score_func(module):
    cls = getattr(moekit, module)
    args = list(POSITIONAL[module])
    k = ORDER[module].index("top_k")
    for bad in (0, N + 1):
        args[k] = bad
        _refused(ValueError, rf"^top_k must be an int in \[1, num_experts={N}\], got {bad}$", lambda: cls(*args))
    args[k] = 2.0
    _refused(TypeError, r"^top_k must be an int, got 2.0 \(float\)$", lambda: cls(*args))
    _refused(
        ValueError,
        r"^unknown score_func 'Softmax'; expected one of \('softmax', 'sigmoid'\)$",
        lambda: _build(module, score_func="Softmax"),
    )
    _refused(
        TypeError, r"^score_func must be one of .*, got None \(NoneType\)$", lambda: _build(module, score_func=None)
    )


@pytest.mark.parametrize(
    "value, exc, pattern",
    [
        (float("inf"), ValueError, r"^aux_loss_coef must be a finite number, got inf$"),
        (float("nan"), ValueError, r"^aux_loss_coef must be a finite number, got nan$"),
        (-0.1, ValueError, r"^aux_loss_coef must be >= 0, got -0.1$"),
        ("0.1", TypeError, r"^aux_loss_coef must be a finite number, got '0.1' \(str\)$"),
        (None, TypeError, r"^aux_loss_coef must be a finite number, got None \(NoneType\)$"),
        (True, TypeError, r"^aux_loss_coef must be a finite number, got True \(bool\)$"),
    ],
    ids=["inf", "nan", "negative", "str", "None", "bool"],
)
@pytest.mark.parametrize("module", ["TopKRouter", "MoELayer"])
def test_aux_loss_coef_is_finite_and_non_negative(module, value, exc, pattern):
    _refused(exc, pattern, lambda: _build(module, aux_loss_coef=value))


def test_aux_loss_coef_accepts_ints_as_numbers():
    assert moekit.MoELayer(H, F, N, 2, aux_loss_coef=1).aux_loss_coef == 1.0


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float8_e4m3fn, torch.complex64], ids=str)
@pytest.mark.parametrize("module", list(BOOL_ARGS))
def test_parameter_dtype_is_a_compute_dtype(module, dtype):
    kind = "a float8 storage type" if "float8" in str(dtype) else "not a floating dtype moekit computes in"
    _refused(
        TypeError, rf"^dtype is {re.escape(str(dtype))}, {kind}; expected one of", lambda: _build(module, dtype=dtype)
    )


@pytest.mark.parametrize("x_dtype", [torch.float64, torch.bfloat16, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("module", ["GroupedLinear", "GroupedMLP", "MoELayer"])
def test_input_of_another_dtype_is_refused_at_forward(module, x_dtype):
    """The modules compute in their parameters' dtype only: another input dtype is refused, never
    cast (MoELayer at its entry, the grouped modules by their op's check), in one line."""
    built = _build(module)
    x = torch.ones(4, H, dtype=x_dtype)
    call = (lambda: built(x)) if module == "MoELayer" else (lambda: built(x, [1, 1, 2, 0]))
    layer_cast = r" or the layer \(layer.to\(.*\)\)" if x_dtype.is_floating_point else ""
    weight = "fc1_weight" if module == "GroupedMLP" else "weight"
    if module == "MoELayer":
        pattern = (
            rf"^MoELayer's parameters are torch.float32 but the input is {re.escape(str(x_dtype))}; cast the "
            rf"input \(x.to\(torch.float32\)\){layer_cast}$"
        )
    elif x_dtype.is_floating_point:
        pattern = rf"^x's dtype {re.escape(str(x_dtype))} differs from {weight}'s torch.float32; cast one to match$"
    else:  # an integer or bool input is refused as a dtype nothing computes in
        pattern = rf"^x is {re.escape(str(x_dtype))}, not a floating dtype moekit computes in"
    _refused(TypeError, pattern, call)


@pytest.mark.parametrize("module", ["GroupedLinear", "MoELayer"])
def test_input_features_checked_in_one_place(module):
    built = _build(module)
    name, size = ("in_features", H) if module == "GroupedLinear" else ("hidden_size", H)
    call = (lambda x: built(x)) if module == "MoELayer" else (lambda x: built(x, [1, 1, 1, 0]))
    _refused(
        ValueError,
        rf"^input's last dimension is 5; expected {name}={size} \(input shape \(3, 5\)\)$",
        lambda: call(torch.ones(3, 5)),
    )
    _refused(
        ValueError,
        rf"^input's last dimension is None; expected {name}={size} \(input shape \(\)\)$",
        lambda: call(torch.ones(())),
    )
