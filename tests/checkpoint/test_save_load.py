"""Checkpoints: GroupedLinear layouts convert on load, safetensors files, GLU interleave sizes."""

from __future__ import annotations

import pytest
import torch

import moekit
from helpers import rand
from moekit.ops.grouped_linear import packed_view

N, IN, OUT = 4, 16, 24
H, F = 16, 8

LAYOUTS = {
    "discrete": {"single_grouped_weight": False, "single_grouped_bias": False},
    "single-w": {"single_grouped_weight": True, "single_grouped_bias": False},
    "single-b": {"single_grouped_weight": False, "single_grouped_bias": True},
    "single": {"single_grouped_weight": True, "single_grouped_bias": True},
}


def _linear(layout, *, seed=None, bias=True):
    m = moekit.GroupedLinear(N, IN, OUT, bias=bias, **LAYOUTS[layout])
    if seed is not None:
        with torch.no_grad():
            for i, p in enumerate(m.parameters()):
                p.copy_(rand(*p.shape, seed=seed + i))
    return m


def _stacked(m, name):
    if getattr(m, f"single_grouped_{name}"):
        return getattr(m, name).detach()
    return torch.stack([getattr(m, f"{name}{i}").detach() for i in range(m.num_gemms)])


def _assert_same_linear(a, b):
    assert torch.equal(_stacked(a, "weight"), _stacked(b, "weight"))
    if a.use_bias:
        assert torch.equal(_stacked(a, "bias"), _stacked(b, "bias"))
    x = rand(10, IN, seed=99)
    assert torch.equal(a(x, [3, 0, 5, 2]), b(x, [3, 0, 5, 2]))


@pytest.mark.parametrize("dst", LAYOUTS)
@pytest.mark.parametrize("src", LAYOUTS)
def test_grouped_linear_layouts_convert_on_load(src, dst):
    a = _linear(src, seed=1)
    b = _linear(dst, seed=50)
    sd = a.state_dict()
    keys_before = list(sd)
    result = b.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert list(sd) == keys_before  # the caller's dict is not modified
    _assert_same_linear(a, b)
    # Loading copies into the existing parameters: the discrete ones stay views of one buffer.
    if not LAYOUTS[dst]["single_grouped_weight"]:
        assert packed_view(b.weights()) is not None
    if not LAYOUTS[dst]["single_grouped_bias"]:
        assert packed_view(b.biases()) is not None


def test_state_dict_keys_per_layout():
    assert set(_linear("discrete").state_dict()) == {f"weight{i}" for i in range(N)} | {
        f"bias{i}" for i in range(N)
    } | {"_extra_state"}
    assert set(_linear("single").state_dict()) == {"weight", "bias", "_extra_state"}
    sd = _linear("single").state_dict()
    assert sd["weight"].shape == (N, OUT, IN) and sd["bias"].shape == (N, OUT)


@pytest.mark.parametrize("dst", LAYOUTS)
def test_packed_weight_loads(dst):
    """A packed (N*out, in) weight (and per-expert or (N, out) bias) is accepted by every layout."""
    w, b = rand(N, OUT, IN, seed=2), rand(N, OUT, seed=3)
    m = _linear(dst, seed=60)
    m.load_state_dict({"weight": w.reshape(N * OUT, IN), **{f"bias{i}": b[i] for i in range(N)}})
    assert torch.equal(_stacked(m, "weight"), w) and torch.equal(_stacked(m, "bias"), b)
    m2 = _linear(dst, seed=61)
    m2.load_state_dict({**{f"weight{i}": w[i] for i in range(N)}, "bias": b})
    assert torch.equal(_stacked(m2, "weight"), w) and torch.equal(_stacked(m2, "bias"), b)


def test_transformer_engine_style_checkpoint_without_extra_state():
    """TE's weight{i}/bias{i} names with no moekit extra state load into both layouts."""
    w, b = rand(N, OUT, IN, seed=4), rand(N, OUT, seed=5)
    te = {**{f"weight{i}": w[i] for i in range(N)}, **{f"bias{i}": b[i] for i in range(N)}}
    for layout in ("single", "discrete"):
        m = _linear(layout, seed=70)
        m.load_state_dict(te, strict=True)
        assert torch.equal(_stacked(m, "weight"), w) and torch.equal(_stacked(m, "bias"), b)


@pytest.mark.parametrize("layout", ["single", "discrete"])
@pytest.mark.parametrize(
    "case, make, names",
    [
        pytest.param("missing", lambda sd: sd.pop("weight2"), ["weight2"], id="missing-weight2"),
        pytest.param(
            "extra", lambda sd: sd.__setitem__("weight4", torch.zeros(OUT, IN)), ["weight4"], id="extra-weight4"
        ),
        pytest.param(
            "shape",
            lambda sd: sd.__setitem__("weight1", torch.zeros(OUT, IN + 1)),
            ["weight1", "(24, 17)"],
            id="misshaped-weight1",
        ),
        pytest.param("bias", lambda sd: sd.pop("bias0"), ["bias0"], id="missing-bias0"),
        pytest.param(
            "bias-shape",
            lambda sd: sd.__setitem__("bias3", torch.zeros(OUT + 2)),
            ["bias3", "(26,)"],
            id="misshaped-bias3",
        ),
    ],
)
def test_bad_expert_keys_raise_naming_them(layout, case, make, names):
    sd = dict(_linear("discrete", seed=6).state_dict())
    make(sd)
    m = _linear(layout, seed=80)
    before = _stacked(m, "weight").clone()
    with pytest.raises(ValueError) as info:
        m.load_state_dict(sd)
    for name in names:
        assert name in str(info.value), f"{name!r} not in {info.value}"
    assert torch.equal(_stacked(m, "weight"), before)  # nothing half-loaded


@pytest.mark.parametrize("layout", ["single", "discrete"])
def test_bad_grouped_keys_raise(layout):
    good = _linear("single", seed=7).state_dict()
    m = _linear(layout)
    with pytest.raises(ValueError, match=r"'weight' has shape \(4, 24, 15\); expected \(4, 24, 16\) or packed"):
        m.load_state_dict({**good, "weight": torch.zeros(N, OUT, IN - 1)})
    with pytest.raises(ValueError, match=r"'bias' has shape \(3, 24\)"):
        m.load_state_dict({**good, "bias": torch.zeros(N - 1, OUT)})
    with pytest.raises(ValueError, match="both 'weight' and per-expert keys.*weight0.*ambiguous"):
        m.load_state_dict({**good, "weight0": torch.zeros(OUT, IN)})


NON_CANONICAL_KEYS = {
    "weight01": "has a leading zero ('1' names that expert)",
    "weight00": "has a leading zero ('0' names that expert)",
    "weight+1": "has a sign",
    "weight-1": "has a sign",
    "weight\u0661": "has digits other than 0-9",
    "bias01": "has a leading zero ('1' names that expert)",
    "weight" + "1" * 19: "has 19 digits (at most 18)",
}


@pytest.mark.parametrize("layout", ["single", "discrete"])
@pytest.mark.parametrize("bad", NON_CANONICAL_KEYS)
def test_non_canonical_expert_key_is_refused_naming_it(tmp_path, layout, bad):
    """GroupedLinear(3, 8, 16) given weight0, weight01, weight2 (and biases): `weight01` is not taken
    for expert 1. The one index rule, with the same message from load_state_dict, load_safetensors
    and `moekit convert` / `inspect`."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from moekit.checkpoint import Checkpoint, analyze

    sd = {
        **{f"weight{i}": rand(16, 8, seed=i) for i in range(3)},
        **{f"bias{i}": rand(16, seed=9 + i) for i in range(3)},
    }
    sd[bad] = sd.pop("bias1" if bad.startswith("bias") else "weight1")
    index = bad.removeprefix("weight").removeprefix("bias")
    expected = (
        f"key {bad!r}: its expert index {index!r} {NON_CANONICAL_KEYS[bad]}; expected a canonical decimal index "
        "(digits 0-9, no sign, no leading zero)"
    )
    m = moekit.GroupedLinear(3, 8, 16, single_grouped_weight=layout == "single", single_grouped_bias=layout == "single")
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError) as info:
        m.load_state_dict(sd)
    assert str(info.value) == expected
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before, strict=True))  # nothing loaded
    path = tmp_path / "gl.safetensors"
    safetensors_torch.save_file(sd, str(path))
    with pytest.raises(ValueError) as info:
        moekit.load_safetensors(m, path)
    assert str(info.value) == expected
    assert expected in analyze(Checkpoint(path), None).problems  # with the gap it leaves at expert 1


def test_no_weight_at_all_is_reported_missing():
    m = _linear("single")
    with pytest.raises(RuntimeError, match="Missing key"):
        m.load_state_dict({"bias": torch.zeros(N, OUT)})


def test_bias_keys_into_bias_free_module_are_unexpected():
    m = _linear("single", bias=False)
    sd = _linear("discrete", seed=8).state_dict()
    with pytest.raises(RuntimeError, match="Unexpected key.*bias0"):
        m.load_state_dict(sd)
    m.load_state_dict(sd, strict=False)
    assert torch.equal(_stacked(m, "weight"), _stacked(_linear("discrete", seed=8), "weight"))


# --------------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dst", LAYOUTS)
@pytest.mark.parametrize("src", LAYOUTS)
def test_safetensors_grouped_linear(tmp_path, src, dst):
    a = _linear(src, seed=9)
    path = tmp_path / "gl.safetensors"
    moekit.save_safetensors(a, path)
    b = _linear(dst, seed=90)
    moekit.load_safetensors(b, path)
    _assert_same_linear(a, b)


def test_safetensors_file_contents(tmp_path):
    """Discrete weights (views of one buffer) are stored as separate tensors, and the extra state
    travels in the metadata."""
    m = moekit.GroupedMLP(N, H, F, bias=True, glu_interleave_size=2, single_grouped_weight=False)
    path = tmp_path / "mlp.safetensors"
    moekit.save_safetensors(m, path)
    state = moekit.read_safetensors(path)
    assert state["fc1.weight0"].shape == (2 * F, H) and state["fc2.bias3"].shape == (H,)
    assert torch.equal(state["fc1.weight2"], m.fc1.weight2.detach())
    assert state["fc1._extra_state"]["glu_interleave_size"] == 2
    assert state["fc2._extra_state"]["glu"] is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp.safetensors"]  # no temporary left


def _mlp(k, *, single=True, bias=True, seed=None):
    m = moekit.GroupedMLP(N, H, F, bias=bias, glu_interleave_size=k, single_grouped_weight=single)
    if seed is not None:
        with torch.no_grad():
            for i, p in enumerate(m.parameters()):
                p.copy_(rand(*p.shape, seed=seed + i) * 0.3)
    return m


def _standard_fc1(m):
    """fc1 weight and bias of a GroupedMLP in standard [gates; ups] order."""
    w, b = _stacked(m.fc1, "weight"), _stacked(m.fc1, "bias")
    if m.glu_interleave_size is not None:
        w, b = (moekit.deinterleave_glu(t, m.glu_interleave_size, dim=1) for t in (w, b))
    return w, b


KS = [None, 1, 2, F]


@pytest.mark.parametrize("via", ["state_dict", "safetensors"])
@pytest.mark.parametrize("k_dst", KS, ids=lambda k: f"to-k={k}")
@pytest.mark.parametrize("k_src", KS, ids=lambda k: f"from-k={k}")
def test_interleave_size_converted_on_load(tmp_path, via, k_src, k_dst):
    a = _mlp(k_src, seed=10)
    b = _mlp(k_dst, single=False, seed=100)  # a different layout too
    if via == "state_dict":
        b.load_state_dict(a.state_dict())
    else:
        moekit.save_safetensors(a, tmp_path / "a.safetensors")
        moekit.load_safetensors(b, tmp_path / "a.safetensors")
    for ta, tb in zip(_standard_fc1(a), _standard_fc1(b), strict=True):
        assert torch.equal(ta, tb)
    assert torch.equal(_stacked(a.fc2, "weight"), _stacked(b.fc2, "weight"))
    x, p = rand(12, H, seed=11), rand(12, seed=12).abs()
    torch.testing.assert_close(b(x, [3, 0, 5, 4], probs=p), a(x, [3, 0, 5, 4], probs=p), rtol=4e-6, atol=1e-6)
    assert b.state_dict()["fc1._extra_state"]["glu_interleave_size"] == k_dst


@pytest.mark.parametrize("k", [1, 2])
def test_checkpoint_without_interleave_record_refused(k):
    """A checkpoint that does not say its GLU order (other tools' [gates; ups], or extra state stripped)
    is refused by a module with k set, with an error that says so; a k=None module takes it."""
    sd = {key: v for key, v in _mlp(None, seed=13).state_dict().items() if not key.endswith("_extra_state")}
    m = _mlp(k, seed=130)
    before = _stacked(m.fc1, "weight").clone()
    with pytest.raises(ValueError, match=rf"fc1.*glu_interleave_size={k}.*does not record its interleave size"):
        m.load_state_dict(sd)
    assert torch.equal(_stacked(m.fc1, "weight"), before)
    plain = _mlp(None, seed=131)
    plain.load_state_dict(sd)
    assert torch.equal(_stacked(plain.fc1, "weight"), _stacked(_mlp(None, seed=13).fc1, "weight"))


def test_safetensors_moe_layer_round_trip(tmp_path):
    a = moekit.MoELayer(H, F, N, 2, bias=True, glu_interleave_size=2)
    b = moekit.MoELayer(H, F, N, 2, bias=True, glu_interleave_size=None, single_grouped_weight=False)
    moekit.save_safetensors(a, tmp_path / "moe.safetensors")
    moekit.load_safetensors(b, tmp_path / "moe.safetensors")
    assert torch.equal(a.router.weight, b.router.weight)
    x = rand(2, 5, H, seed=14)
    torch.testing.assert_close(b(x), a(x), rtol=4e-6, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# save -> convert -> load: every layout and interleave size on both sides
# --------------------------------------------------------------------------------------------------

MATRIX_N, MATRIX_H, MATRIX_F = 3, 5, 8
MATRIX_KS = [None, 1, 2, 4]
MATRIX_MODULES = [(single, k) for single in (True, False) for k in MATRIX_KS]


def _matrix_mlp(single, k, seed=None):
    m = moekit.GroupedMLP(
        MATRIX_N, MATRIX_H, MATRIX_F, bias=True, glu_interleave_size=k, single_grouped_weight=single, backend="loop"
    )
    if seed is not None:
        with torch.no_grad():
            for i, p in enumerate(m.parameters()):
                # Small integers: fc1's sums are exact whatever the order its rows are stored in.
                p.copy_(torch.round(rand(*p.shape, seed=seed + i) * 3))
    return m


def _layout_id(single, k):
    return f"{'single' if single else 'discrete'}-k={k}"


@pytest.mark.parametrize("convert_to", ["no-convert", "grouped", "per-expert"])
@pytest.mark.parametrize("single, k_src", MATRIX_MODULES, ids=[_layout_id(*m) for m in MATRIX_MODULES])
def test_save_convert_load_matrix(tmp_path, single, k_src, convert_to):
    """A saved module, converted (any layout, any written interleave size) or not, loads into a
    module of any layout and interleave size and gives the saved module's outputs exactly."""
    from moekit.checkpoint import convert_checkpoint

    saved = _matrix_mlp(single, k_src, seed=20)
    moekit.save_safetensors(saved, tmp_path / "saved.safetensors")
    files = {"saved": tmp_path / "saved.safetensors"}
    if convert_to != "no-convert":
        for glu in ("keep", "none", 1, 2, 4):
            files[f"{convert_to}-glu={glu}"] = tmp_path / f"{glu}.safetensors"
            convert_checkpoint(files["saved"], files[f"{convert_to}-glu={glu}"], convert_to, glu)
    x = torch.round(rand(11, MATRIX_H, seed=21) * 3)
    probs = rand(11, seed=22).abs()
    splits = [4, 0, 7]
    expected = saved(x, splits, probs=probs)
    for name, path in files.items():
        for single_dst, k_dst in MATRIX_MODULES:
            loaded = _matrix_mlp(single_dst, k_dst, seed=200)
            moekit.load_safetensors(loaded, path)
            what = f"{name} -> {_layout_id(single_dst, k_dst)}"
            for ta, tb in zip(_standard_fc1(saved), _standard_fc1(loaded), strict=True):
                assert torch.equal(ta, tb), what
            assert torch.equal(loaded(x, splits, probs=probs), expected), what


def test_file_without_record_loads_as_gates_then_ups_or_is_refused(tmp_path):
    """A file that records nothing (written by another tool) is [gates; ups] to a k=None module and
    refused, with the reason, by a module with an interleave size; nothing is half-loaded."""
    from safetensors.torch import save_file

    source = _mlp(None, seed=23)
    save_file(
        {k: v.contiguous() for k, v in source.state_dict().items() if isinstance(v, torch.Tensor)},
        str(tmp_path / "te.safetensors"),
    )
    plain = _mlp(None, single=False, seed=230)
    moekit.load_safetensors(plain, tmp_path / "te.safetensors")
    assert torch.equal(_stacked(plain.fc1, "weight"), _stacked(source.fc1, "weight"))
    interleaved = _mlp(2, seed=231)
    before = _stacked(interleaved.fc1, "weight").clone()
    with pytest.raises(ValueError, match="glu_interleave_size=2.*does not record its interleave size"):
        moekit.load_safetensors(interleaved, tmp_path / "te.safetensors")
    assert torch.equal(_stacked(interleaved.fc1, "weight"), before)


def test_file_of_an_earlier_moekit_loads_and_converts(tmp_path):
    """Files written before the group records (GroupedLinear extra states as JSON) still say their order."""
    import json

    from safetensors.torch import save_file

    from moekit.checkpoint import convert_checkpoint

    source = _mlp(2, single=False, seed=24)
    sd = source.state_dict()
    extra = {k: v for k, v in sd.items() if k.endswith("_extra_state")}
    save_file(
        {k: v.contiguous() for k, v in sd.items() if k not in extra},
        str(tmp_path / "old.safetensors"),
        metadata={"format": "pt", "moekit.extra_state": json.dumps(extra)},
    )
    convert_checkpoint(tmp_path / "old.safetensors", tmp_path / "grouped.safetensors", "grouped", "none")
    for path in (tmp_path / "old.safetensors", tmp_path / "grouped.safetensors"):
        loaded = _mlp(1, seed=240)
        moekit.load_safetensors(loaded, path)
        for ta, tb in zip(_standard_fc1(source), _standard_fc1(loaded), strict=True):
            assert torch.equal(ta, tb), path.name


@pytest.mark.parametrize("to", ["grouped", "per-expert"])
def test_convert_a_bare_grouped_linear(tmp_path, to):
    """A GroupedLinear saved on its own (keys weight0.., no prefix) converts and loads back."""
    from moekit.checkpoint import convert_checkpoint

    a = _linear("single" if to == "per-expert" else "discrete", seed=25)
    moekit.save_safetensors(a, tmp_path / "a.safetensors")
    convert_checkpoint(tmp_path / "a.safetensors", tmp_path / "b.safetensors", to)
    b = _linear("discrete" if to == "per-expert" else "single", seed=250)
    moekit.load_safetensors(b, tmp_path / "b.safetensors")
    _assert_same_linear(a, b)


def test_saved_files_have_ordinary_permissions(tmp_path):
    import os
    import stat

    old = os.umask(0o022)
    try:
        moekit.save_safetensors(_linear("single", seed=26), tmp_path / "a.safetensors")
        moekit.save_safetensors(_linear("single", seed=27), tmp_path / "a.safetensors")  # replacing keeps it
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a.safetensors").st_mode) == 0o644
    assert os.listdir(tmp_path) == ["a.safetensors"]


def test_save_removes_the_leftover_of_a_killed_save(tmp_path):
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now
    leftover = tmp_path / f".a.safetensors.moekit-save-tmp-{gone.pid}"
    leftover.write_bytes(b"half a file")
    moekit.save_safetensors(_linear("single", seed=28), tmp_path / "a.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]
