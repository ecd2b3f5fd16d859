"""Every bad input gets a ValueError or TypeError whose message says what was wrong."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import moekit
from helpers import rand
from moekit.ops.runtime.backends import select_backend

N, IN, OUT = 4, 16, 32
H, F = 16, 8


def _gl(m_splits, *, rows=10, x=None, w=None, b=None, **kw):
    x = rand(rows, IN, seed=1) if x is None else x
    w = rand(N, OUT, IN, seed=2) if w is None else w
    return moekit.grouped_linear(x, w, m_splits, b, **kw)


# --------------------------------------------------------------------------------------------------
# m_splits
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m_splits, exc, msg",
    [
        pytest.param([3, 3, 4], ValueError, r"m_splits has 3 entries; expected one per group \(4\)", id="short-list"),
        pytest.param([1, 1, 1, 1, 1], ValueError, r"5 entries; expected one per group \(4\)", id="long-list"),
        pytest.param(
            torch.tensor([3, 3, 4]), ValueError, r"3 entries; expected one per group \(4\)", id="short-cpu-tensor"
        ),
        pytest.param(torch.tensor([[1, 2], [3, 4]]), ValueError, r"must be 1-D.*\(2, 2\)", id="2d-tensor"),
        pytest.param(
            torch.tensor([1.0, 2.0, 3.0, 4.0]), TypeError, r"integer tensor.*torch.float32", id="float-tensor"
        ),
        pytest.param([1.0, 2, 3, 4], TypeError, r"Python ints, got float \(1.0\)", id="float-in-list"),
        pytest.param([True, 2, 3, 4], TypeError, r"Python ints, got bool", id="bool-in-list"),
        pytest.param(None, TypeError, r"m_splits must be a list/tuple of ints.*got NoneType", id="None"),
        pytest.param(10, TypeError, r"got int", id="scalar-int"),
        pytest.param([3, -1, 4, 4], ValueError, r"non-negative; entries \[1\] are negative", id="negative"),
        pytest.param(
            torch.tensor([3, 0, -2, 4], dtype=torch.int32),
            ValueError,
            r"entries \[2\] are negative",
            id="negative-int32-tensor",
        ),
        pytest.param([3, 3, 4, 2], ValueError, r"sums to 12 but the input has only 10 rows", id="sum-past-rows"),
        pytest.param(
            torch.tensor([5, 5, 1, 0]),
            ValueError,
            r"sums to 11 but the input has only 10 rows",
            id="sum-past-rows-tensor",
        ),
        pytest.param(
            torch.tensor([2, 2, 2, 2], device="meta"),
            ValueError,
            r"m_splits is on meta but the input is on cpu",
            id="wrong-device",
        ),
        pytest.param(
            torch.tensor([2.0, 2, 2, 2], device="meta"),
            TypeError,
            r"int32 or int64, got torch.float32",
            id="wrong-device-float",
        ),
        pytest.param(
            torch.tensor([2, 2, 2, 2], dtype=torch.int16, device="meta"),
            TypeError,
            r"int32 or int64, got torch.int16",
            id="device-int16",
        ),
    ],
)
@pytest.mark.parametrize("backend", ["loop", "torch"])
def test_bad_m_splits(backend, m_splits, exc, msg):
    with pytest.raises(exc, match=msg):
        _gl(m_splits, backend=backend)


def test_bad_m_splits_in_modules_and_mlp():
    with pytest.raises(ValueError, match="sums to 12 but the input has only 10 rows"):
        moekit.GroupedLinear(N, IN, OUT)(rand(10, IN, seed=3), [3, 3, 4, 2])
    with pytest.raises(ValueError, match=r"3 entries; expected one per group \(4\)"):
        moekit.GroupedMLP(N, H, F)(rand(10, H, seed=4), [3, 3, 4])
    with pytest.raises(ValueError, match="non-negative"):
        moekit.grouped_mlp(rand(4, H, seed=5), rand(N, 2 * F, H, seed=6), rand(N, H, F, seed=7), [1, -1, 2, 2])


# --------------------------------------------------------------------------------------------------
# Shapes, dtypes, devices
# --------------------------------------------------------------------------------------------------


def test_input_features_mismatch():
    with pytest.raises(ValueError, match=r"x has 15 features .*in_features=16"):
        _gl([2, 2, 2, 2], x=rand(8, 15, seed=8))
    with pytest.raises(ValueError, match=r"last dimension is 15; expected in_features=16"):
        moekit.GroupedLinear(N, IN, OUT)(rand(8, 15, seed=9), [2, 2, 2, 2])
    with pytest.raises(ValueError, match=r"x has 15 features .*in_features=16"):
        moekit.GroupedMLP(N, H, F)(rand(8, 15, seed=10), [2, 2, 2, 2])
    with pytest.raises(ValueError, match=r"last dimension is 15; expected hidden_size=16"):
        moekit.MoELayer(H, F, N, 2)(rand(8, 15, seed=11))
    with pytest.raises(ValueError, match=r"x must be 2-D"):
        _gl([2, 2, 2, 2], x=rand(2, 4, IN, seed=12))


def test_dtype_mismatch():
    with pytest.raises(TypeError, match=r"x's dtype torch.bfloat16 differs from weight's torch.float32"):
        _gl([2, 2, 2, 2], rows=8, x=rand(8, IN, dtype=torch.bfloat16, seed=13))
    with pytest.raises(TypeError, match=r"x's dtype torch.float32 differs from bias's torch.bfloat16"):
        _gl([2, 2, 2, 2], rows=8, b=rand(N, OUT, dtype=torch.bfloat16, seed=14))
    with pytest.raises(TypeError, match=r"differs from weight.s torch.float32"):
        moekit.GroupedLinear(N, IN, OUT)(rand(8, IN, dtype=torch.float64, seed=15), [2, 2, 2, 2])
    with pytest.raises(TypeError, match=r"differs from fc1_weight.s torch.bfloat16"):
        moekit.GroupedMLP(N, H, F, dtype=torch.bfloat16)(rand(8, H, seed=16), [2, 2, 2, 2])


def test_device_mismatch():
    with pytest.raises(ValueError, match=r"weight is on meta but x is on cpu"):
        _gl([2, 2, 2, 2], rows=8, w=torch.empty(N, OUT, IN, device="meta"))
    with pytest.raises(ValueError, match=r"bias is on meta but x is on cpu"):
        _gl([2, 2, 2, 2], rows=8, b=torch.empty(N, OUT, device="meta"))


def test_bad_weight_and_bias_shapes():
    with pytest.raises(ValueError, match=r"per-group weights must all be 2-D \(out, in\) of one shape"):
        _gl([2, 2, 2, 2], rows=8, w=[torch.zeros(OUT, IN)] * 3 + [torch.zeros(OUT + 1, IN)])
    with pytest.raises(ValueError, match=r"non-empty list"):
        _gl([2, 2, 2, 2], rows=8, w=[])
    with pytest.raises(ValueError, match=r"bias has shape \(4, 31\); expected \(4, 32\)"):
        _gl([2, 2, 2, 2], rows=8, b=torch.zeros(N, OUT - 1))
    with pytest.raises(ValueError, match=r"bias must be a \(4, 32\) tensor or 4 tensors"):
        _gl([2, 2, 2, 2], rows=8, b=[torch.zeros(OUT)] * 3)
    with pytest.raises(ValueError, match="bias_scale scales the bias; it needs a bias"):
        _gl([2, 2, 2, 2], rows=8, bias_scale=torch.ones(8))
    with pytest.raises(ValueError, match=r"bias_scale must have shape \(8,\)"):
        _gl([2, 2, 2, 2], rows=8, b=torch.zeros(N, OUT), bias_scale=torch.ones(7))


def test_bad_mlp_shapes():
    x = rand(8, H, seed=17)
    w1, w2 = rand(N, 2 * F, H, seed=18), rand(N, H, F, seed=19)
    with pytest.raises(ValueError, match=r"fc1 must map to 2F features .*out_features=15"):
        moekit.grouped_mlp(x, rand(N, 15, H, seed=20), w2, [2, 2, 2, 2])
    with pytest.raises(ValueError, match=r"fc1 has 4 experts but fc2 has 3"):
        moekit.grouped_mlp(x, w1, rand(3, H, F, seed=21), [2, 2, 2, 2])
    with pytest.raises(ValueError, match=r"fc2 maps to 12 features; expected the hidden size 16"):
        moekit.grouped_mlp(x, w1, rand(N, 12, F, seed=22), [2, 2, 2, 2])
    with pytest.raises(ValueError, match=r"fc2 takes 7 input features; fc1's 2F = 16 outputs give F = 8"):
        moekit.grouped_mlp(x, w1, rand(N, H, F - 1, seed=23), [2, 2, 2, 2])
    with pytest.raises(ValueError, match=r"probs must have shape \(8,\) or \(8, 1\), one per row; got \(4,\)"):
        moekit.grouped_mlp(x, w1, w2, [2, 2, 2, 2], probs=torch.ones(4))
    with pytest.raises(TypeError, match=r"probs is torch.int64, not a floating dtype"):
        moekit.grouped_mlp(x, w1, w2, [2, 2, 2, 2], probs=torch.ones(8, dtype=torch.int64))


def test_bad_swiglu_inputs():
    with pytest.raises(
        ValueError,
        match=r"h must be 2-D \(rows, 2F\) with an even number of columns, got shape \(3, 7\)",  # noqa: E501
    ):
        moekit.glu(torch.zeros(3, 7))
    with pytest.raises(ValueError, match=r"h must be 2-D"):
        moekit.glu(torch.zeros(2, 3, 8))
    with pytest.raises(ValueError, match=r"probs is on meta but the input is on cpu"):
        moekit.glu(torch.zeros(3, 8), probs=torch.ones(3, device="meta"))


# --------------------------------------------------------------------------------------------------
# Names: backends, activations, interleave sizes, router options
# --------------------------------------------------------------------------------------------------


def test_unknown_backend():
    msg = r"unknown backend 'fast'; expected one of \('auto', 'loop', 'torch', 'triton'\)"
    with pytest.raises(ValueError, match=msg):
        _gl([2, 2, 2, 2], rows=8, backend="fast")
    with pytest.raises(ValueError, match=msg):
        moekit.GroupedLinear(N, IN, OUT, backend="fast")
    with pytest.raises(ValueError, match=msg):
        moekit.GroupedMLP(N, H, F, backend="fast")
    with pytest.raises(ValueError, match=msg):
        moekit.MoELayer(H, F, N, 2, backend="fast")
    with pytest.raises(ValueError, match=msg):
        moekit.grouped_mlp(
            rand(8, H, seed=24), rand(N, 2 * F, H, seed=25), rand(N, H, F, seed=26), [2, 2, 2, 2], backend="fast"
        )


def test_unknown_activation():
    msg = r"unknown activation 'gelu'; expected one of \('swiglu', 'clamped_swiglu', 'geglu', 'geglu_tanh', 'reglu'\)"
    with pytest.raises(ValueError, match=msg):
        moekit.glu(torch.zeros(2, 8), activation="gelu")
    with pytest.raises(ValueError, match=msg):
        moekit.grouped_mlp(
            rand(8, H, seed=27), rand(N, 2 * F, H, seed=28), rand(N, H, F, seed=29), [2, 2, 2, 2], activation="gelu"
        )
    with pytest.raises(ValueError, match=msg):
        moekit.GroupedMLP(N, H, F, activation="gelu")
    with pytest.raises(ValueError, match=msg):
        moekit.MoELayer(H, F, N, 2, activation="gelu")


@pytest.mark.parametrize(
    "k, exc, msg",
    [
        pytest.param(3, ValueError, r"glu_interleave_size 3 does not divide the ffn size 8", id="k=3-F=8"),
        pytest.param(16, ValueError, r"glu_interleave_size 16 does not divide the ffn size 8", id="k=16-F=8"),
        pytest.param(0, ValueError, r"glu_interleave_size must be an int >= 1, got 0", id="k=0"),
        pytest.param(-2, ValueError, r"glu_interleave_size must be an int >= 1, got -2", id="k=-2"),
        pytest.param(2.0, TypeError, r"glu_interleave_size must be an int, got 2.0 \(float\)", id="k=2.0"),
        pytest.param(True, TypeError, r"glu_interleave_size must be an int, got True \(bool\)", id="k=True"),
    ],
)
def test_bad_interleave_size(k, exc, msg):
    with pytest.raises(exc, match=msg):
        moekit.glu(torch.zeros(2, 2 * F), glu_interleave_size=k)
    with pytest.raises(exc, match=msg):
        moekit.GroupedMLP(N, H, F, glu_interleave_size=k)
    with pytest.raises(exc, match=msg):
        moekit.grouped_mlp(
            rand(8, H, seed=30), rand(N, 2 * F, H, seed=31), rand(N, H, F, seed=32), [2, 2, 2, 2], glu_interleave_size=k
        )
    with pytest.raises(exc, match=msg):
        moekit.interleave_glu(torch.zeros(2 * F, H), k)
    with pytest.raises(exc, match=msg):
        moekit.deinterleave_glu(torch.zeros(N, 2 * F), k, dim=1)


def test_bad_interleave_tensor():
    with pytest.raises(ValueError, match=r"dimension 1 of shape \(4, 7\) must have even length 2F, got 7"):
        moekit.interleave_glu(torch.zeros(4, 7), 1, dim=1)
    with pytest.raises(ValueError, match=r"glu_interleave_size must be an int; the standard layout needs no"):
        moekit.interleave_glu(torch.zeros(8), None)


def test_bad_module_arguments():
    with pytest.raises(ValueError, match=r"num_gemms must be an int >= 1, got 0"):
        moekit.GroupedLinear(0, IN, OUT)
    with pytest.raises(TypeError, match=r"in_features must be an int, got 16.0 \(float\)"):
        moekit.GroupedLinear(N, 16.0, OUT)
    with pytest.raises(ValueError, match=r"unknown score_func 'relu'; expected one of \('softmax', 'sigmoid'\)"):
        moekit.MoELayer(H, F, N, 2, score_func="relu")
    with pytest.raises(ValueError, match=r"aux_loss_coef must be >= 0, got -0.1"):
        moekit.MoELayer(H, F, N, 2, aux_loss_coef=-0.1)


@pytest.mark.parametrize("top_k", [5, 0, -1, 2.0, True, "2"], ids=["5>N", "0", "-1", "float-2.0", "bool", "str"])
def test_bad_top_k_fails_at_construction(top_k):
    if isinstance(top_k, int) and not isinstance(top_k, bool):
        exc, msg = ValueError, rf"top_k must be an int in \[1, num_experts=4\], got {top_k}"
    else:
        exc, msg = TypeError, rf"top_k must be an int, got {re.escape(repr(top_k))}"
    with pytest.raises(exc, match=msg):
        moekit.MoELayer(H, F, N, top_k)


@pytest.mark.parametrize("module", ["GroupedMLP", "MoELayer"])
@pytest.mark.parametrize(
    "name, sizes",
    [
        pytest.param("num_experts", (0, H, F), id="0-experts"),
        pytest.param("ffn_hidden_size", (N, H, 0), id="F=0"),
        pytest.param("hidden_size", (N, -3, F), id="H=-3"),
        pytest.param("num_experts", (4.0, H, F), id="float-experts"),
    ],
)
def test_bad_sizes_name_the_constructor_argument(module, name, sizes):
    num_experts, hidden, ffn = sizes
    bad = dict(zip(("num_experts", "hidden_size", "ffn_hidden_size"), sizes, strict=True))[name]
    if isinstance(bad, int):
        exc, msg = ValueError, rf"^{name} must be an int >= 1, got {bad}$"
    else:
        exc, msg = TypeError, rf"^{name} must be an int, got {re.escape(repr(bad))} \({type(bad).__name__}\)$"
    with pytest.raises(exc, match=msg):
        if module == "GroupedMLP":
            moekit.GroupedMLP(num_experts, hidden, ffn)
        else:
            moekit.MoELayer(hidden, ffn, num_experts, 1)


def test_moe_layer_dtype_mismatch_is_reported_at_entry():
    layer = moekit.MoELayer(H, F, N, 2)
    with pytest.raises(TypeError, match=r"MoELayer's parameters are torch.float32 but the input is torch.bfloat16"):
        layer(rand(3, H, dtype=torch.bfloat16, seed=40))


def test_bad_permute_inputs():
    x = rand(3, 4, seed=33)
    with pytest.raises(ValueError, match=r"expert_ids must lie in \[0, 4\); found values in \[0, 4\]"):
        moekit.permute(x, torch.tensor([[0, 4], [1, 2], [3, 0]]), 4)
    with pytest.raises(ValueError, match=r"found values in \[-1, 2\]"):
        moekit.permute(x, torch.tensor([[0, -1], [1, 2], [2, 0]]), 4)
    with pytest.raises(TypeError, match=r"expert_ids must be an integer tensor, got torch.float32"):
        moekit.permute(x, torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match=r"expert_ids must be \(tokens, top_k\) with tokens=3, got shape \(2, 2\)"):
        moekit.permute(x, torch.zeros(2, 2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match=r"x must be 2-D \(tokens, hidden\)"):
        moekit.permute(x[None], torch.zeros(3, 2, dtype=torch.int64), 4)
    _, _, row_map = moekit.permute(x, torch.tensor([[0, 1], [1, 2], [3, 0]]), 4)
    with pytest.raises(ValueError, match=r"tokens\*top_k = 5 rows; got shape \(3, 2\)"):
        moekit.unpermute(torch.zeros(5, 4), row_map)
    with pytest.raises(ValueError, match=r"weights must have row_map's shape \(3, 2\), got \(3, 1\)"):
        moekit.unpermute(torch.zeros(6, 4), row_map, torch.ones(3, 1))


@pytest.mark.parametrize(
    "row_map, exc, msg",
    [
        pytest.param(
            [[0, 6], [1, 2], [3, 4]],
            ValueError,
            r"values must lie in \[0, 6\).*found values in \[0, 6\]",
            id="past-the-rows",
        ),
        pytest.param([[0, -1], [1, 2], [3, 4]], ValueError, r"found values in \[-1, 4\]", id="negative"),
        pytest.param(
            [[0, 1], [1, 2], [3, 4]],
            ValueError,
            r"permutation of the sorted rows.*rows \[1\] appear more than once and rows \[5\] never",
            id="not-a-permutation",
        ),
        pytest.param(
            [[0.0, 1], [2, 3], [4, 5]], TypeError, r"row_map must be an integer tensor.*torch.float32", id="float"
        ),
        pytest.param(
            [[True, False], [True, False], [True, False]], TypeError, r"integer tensor.*torch.bool", id="bool"
        ),
    ],
)
def test_bad_unpermute_row_map(row_map, exc, msg):
    """On the CPU the map is checked before any gather: no raw IndexError, no unwritten gradient rows."""
    y = torch.zeros(6, 4, requires_grad=True)
    with pytest.raises(exc, match=msg):
        moekit.unpermute(y, torch.tensor(row_map))
    with pytest.raises(exc, match=msg):
        moekit.unpermute(y, torch.tensor(row_map), torch.ones(3, 2))


def test_bad_unpermute_operands():
    row_map = torch.arange(6).view(3, 2)
    with pytest.raises(TypeError, match=r"weights is torch.int64, not a floating dtype"):
        moekit.unpermute(torch.zeros(6, 4), row_map, torch.ones(3, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"row_map is on meta but y_sorted is on cpu"):
        moekit.unpermute(torch.zeros(6, 4), row_map.to("meta"))
    with pytest.raises(ValueError, match=r"y_sorted must be 2-D"):
        moekit.unpermute(torch.zeros(6), row_map)


def test_device_row_map_is_not_read():
    """Off the CPU the values are not read (a read would sync): a device map passes the checks (meta
    stands in for CUDA here: any read of its values would raise)."""
    out = moekit.unpermute(torch.zeros(6, 4, device="meta"), torch.empty(3, 2, dtype=torch.int64, device="meta"))
    assert out.shape == (3, 4) and out.device.type == "meta"


# --------------------------------------------------------------------------------------------------
# Explicit backends that cannot run here
# --------------------------------------------------------------------------------------------------


def test_torch_backend_refuses_float64():
    x, w = rand(8, IN, dtype=torch.float64, seed=34), rand(N, OUT, IN, dtype=torch.float64, seed=35)
    msg = r"backend='torch' cannot run here: .*float32/bfloat16/float16, got torch.float64.*Usable here: \['loop'"
    with pytest.raises(ValueError, match=msg):
        moekit.grouped_linear(x, w, [2, 2, 2, 2], backend="torch")
    with pytest.raises(ValueError, match=msg):
        moekit.GroupedLinear(N, IN, OUT, backend="torch", dtype=torch.float64)(x, [2, 2, 2, 2])


@pytest.mark.parametrize(
    "dtype, in_f, out_f, bad",
    [
        pytest.param(torch.float32, 18, 32, "in_features", id="fp32-in18"),
        pytest.param(torch.float32, 16, 30, "out_features", id="fp32-out30"),
        pytest.param(torch.bfloat16, 12, 32, "in_features", id="bf16-in12"),
        pytest.param(torch.bfloat16, 16, 97, "out_features", id="bf16-out97"),
    ],
)
def test_torch_backend_refuses_unaligned_dims(dtype, in_f, out_f, bad):
    x, w = rand(8, in_f, dtype=dtype, seed=36), rand(N, out_f, in_f, dtype=dtype, seed=37)
    align = 16 // x.element_size()
    msg = rf"backend='torch' cannot run here: .*{bad} to be a non-zero multiple of {align}.*in={in_f}, out={out_f}"
    with pytest.raises(ValueError, match=msg):
        moekit.grouped_linear(x, w, [2, 2, 2, 2], backend="torch")
    assert select_backend("auto", x, w).name == "loop"


def test_triton_backend_refuses_float64():
    pytest.importorskip("triton")
    x, w = rand(8, IN, dtype=torch.float64, seed=38), rand(N, OUT, IN, dtype=torch.float64, seed=39)
    with pytest.raises(ValueError, match=r"backend='triton' cannot run here: .*torch.float64.*Usable here"):
        moekit.grouped_linear(x, w, [2, 2, 2, 2], backend="triton")


def test_triton_backend_refuses_cpu_without_interpreter():
    """On CPU the Triton kernels run only under the interpreter, which the repository's conftest turns
    on for this process; so ask a fresh process without TRITON_INTERPRET."""
    pytest.importorskip("triton")
    code = (
        "import torch, moekit\n"
        "x, w = torch.zeros(8, 16), torch.zeros(4, 32, 16)\n"
        "try:\n"
        "    moekit.grouped_linear(x, w, [2, 2, 2, 2], backend='triton')\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
        "else:\n"
        "    print('no error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(
        r"ValueError: backend='triton' cannot run here: .*TRITON_INTERPRET=1.*"
        r"Usable here: \['loop', 'torch'\]",
        out.stdout,
    ), out.stdout


# --------------------------------------------------------------------------------------------------
# Values of the wrong type or range, refused in one line naming the argument; valid edges computed
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, exc, match",
    [
        pytest.param(
            lambda: moekit.grouped_mlp(torch.ones(8, 4, dtype=torch.int32), torch.ones(2, 8, 4, dtype=torch.int32),
                                       torch.ones(2, 4, 4, dtype=torch.int32), [4, 4]),
            TypeError, r"x is torch.int32, not a floating dtype", id="grouped_mlp-int32",
        ),
        pytest.param(lambda: moekit.swiglu(torch.ones(3, 8, dtype=torch.int64)), TypeError,
                     r"h is torch.int64, not a floating dtype", id="swiglu-int64"),
        pytest.param(lambda: moekit.glu(torch.ones(3, 8, dtype=torch.bool)), TypeError,
                     r"h is torch.bool, not a floating dtype", id="glu-bool"),
        pytest.param(lambda: moekit.grouped_linear(torch.ones(4, 8).to(torch.float8_e4m3fn),
                                                   torch.ones(2, 4, 8).to(torch.float8_e4m3fn), [2, 2]),
                     TypeError, r"x is torch.float8_e4m3fn, a float8 storage type", id="grouped_linear-float8"),
        pytest.param(lambda: moekit.moe_experts(torch.ones(4, 8), torch.zeros(4, 2, dtype=torch.complex64),
                                                torch.ones(4, 2), torch.ones(3, 16, 8), torch.ones(3, 8, 8)),
                     TypeError, r"topk_ids must be an integer tensor, got torch.complex64", id="complex-ids"),
        pytest.param(lambda: moekit.permute(torch.ones(4, 8), torch.zeros(4, 2, dtype=torch.int64), 3.5),
                     TypeError, r"num_experts must be an int, got 3.5 \(float\)", id="permute-num_experts-float"),
        pytest.param(lambda: moekit.permute(torch.ones(4, 8), torch.zeros(4, 2, dtype=torch.int64), True),
                     TypeError, r"num_experts must be an int, got True \(bool\)", id="permute-num_experts-bool"),
        pytest.param(lambda: moekit.permute(torch.ones(4, 8), torch.zeros(4, 2, dtype=torch.int64), None),
                     TypeError, r"num_experts must be an int, got None", id="permute-num_experts-None"),
        pytest.param(lambda: moekit.permute(torch.ones(4, 8), torch.zeros(4, 2, dtype=torch.int64), "3"),
                     TypeError, r"num_experts must be an int, got '3' \(str\)", id="permute-num_experts-str"),
        pytest.param(lambda: moekit.grouped_linear([[1.0] * 8] * 4, torch.ones(2, 4, 8), [2, 2]), TypeError,
                     r"x must be a torch.Tensor, got list", id="x-list"),
        pytest.param(lambda: moekit.grouped_mlp(torch.ones(4, 8), torch.ones(2, 8, 8), torch.ones(2, 8, 4), [2, 2],
                                                probs=[0.5] * 4),
                     TypeError, r"probs must be a torch.Tensor, got list", id="probs-list"),
        pytest.param(lambda: moekit.grouped_linear(torch.ones(4, 8), torch.ones(2, 4, 8), [2, 2],
                                                   torch.ones(2, 4), bias_scale=[1.0] * 4),
                     TypeError, r"bias_scale must be a torch.Tensor, got list", id="bias_scale-list"),
        pytest.param(lambda: moekit.grouped_linear(torch.ones(4, 8), torch.ones(2, 4, 8).numpy(), [2, 2]),
                     TypeError, r"weight must be a torch.Tensor, got ndarray", id="weight-numpy"),
        pytest.param(lambda: moekit.grouped_linear(torch.ones(4, 8), torch.ones(2, 4, 8), [2, 2],
                                                   torch.ones(2, 4), bias_scale=torch.ones(4, device="meta")),
                     ValueError, r"bias_scale is on meta but x is on cpu", id="bias_scale-device"),
        pytest.param(lambda: moekit.GroupedTensor.empty(-1, (4, 5)), ValueError,
                     r"num_tensors must be an int >= 0, got -1", id="grouped_tensor-negative"),
        pytest.param(lambda: moekit.GroupedTensor.empty(2, (4, -5)), ValueError,
                     r"each dimension of shape must be an int >= 0, got -5", id="grouped_tensor-negative-dim"),
    ],
)  # fmt: skip
def test_wrong_types_and_ranges_are_refused_in_one_line(call, exc, match):
    with pytest.raises(exc, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_zero_width_input_gives_the_right_zeros():
    """A 0-feature input: every backend that runs gives (rows, out) zeros (and zero gradients) where torch's
    grouped_mm would reject the strides; "auto" picks a backend that runs."""
    x = torch.randn(10, 0, requires_grad=True)
    w = torch.randn(3, 16, 0, requires_grad=True)
    y = moekit.grouped_linear(x, w, [3, 3, 4])
    assert y.shape == (10, 16) and torch.equal(y, torch.zeros(10, 16))
    y.sum().backward()
    assert x.grad.shape == (10, 0) and w.grad.shape == (3, 16, 0)
    with pytest.raises(ValueError, match=r"backend='torch' cannot run here: .*non-zero multiple"):
        moekit.grouped_linear(x, w, [3, 3, 4], backend="torch")
