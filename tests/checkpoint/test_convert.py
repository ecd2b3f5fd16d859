"""`moekit convert` / `moekit inspect`: round trips, refusals, streaming, and loading the result.

Legend: N experts, H hidden size, F expert ffn size.
"""

from __future__ import annotations

import json
import os
import re
import tracemalloc

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")
save_file, load_file = safetensors_torch.save_file, safetensors_torch.load_file

from moekit import GroupedMLP, interleave_glu  # noqa: E402
from moekit.checkpoint import (  # noqa: E402
    Checkpoint,
    CheckpointError,
    analyze,
    convert_checkpoint,
    format_inspection,
)
from moekit.checkpoint.metadata import META_GROUPS  # noqa: E402

N, H, F = 4, 8, 6


def _hf_per_expert(
    layers=2,
    naming=("gate_proj", "up_proj", "down_proj"),
    dtype=torch.bfloat16,
    seed=0,
    prefix="model.layers.{l}.mlp.experts",
):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    gate, up, down = naming
    for layer in range(layers):
        p = prefix.format(l=layer)
        for i in range(N):
            sd[f"{p}.{i}.{gate}.weight"] = torch.randn(F, H, generator=g).to(dtype)
            sd[f"{p}.{i}.{up}.weight"] = torch.randn(F, H, generator=g).to(dtype)
            sd[f"{p}.{i}.{down}.weight"] = torch.randn(H, F, generator=g).to(dtype)
        sd[f"model.layers.{layer}.mlp.gate.weight"] = torch.randn(N, H, generator=g)
    sd["model.embed_tokens.weight"] = torch.randn(16, H, generator=g)
    return sd


def _te_per_expert(seed=0):
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(N):
        sd[f"decoder.layers.0.mlp.experts.linear_fc1.weight{i}"] = torch.randn(2 * F, H, generator=g)
        sd[f"decoder.layers.0.mlp.experts.linear_fc1.bias{i}"] = torch.randn(2 * F, generator=g)
        sd[f"decoder.layers.0.mlp.experts.linear_fc2.weight{i}"] = torch.randn(H, F, generator=g)
    return sd


def _save_sharded(sd: dict, directory, shards=3):
    """Split keys round-robin over `shards` files with an index, as Hugging Face writes them."""
    directory.mkdir()
    keys = sorted(sd)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[s::shards]}
        save_file(part, str(directory / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in sd.values())},
        "weight_map": weight_map,
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text("{}")
    return directory


def _load_all(path) -> dict:
    ckpt = Checkpoint(path)
    out = {}
    for f in ckpt.files:
        out.update(load_file(str(f)))
    return out


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k


def _leftovers(directory, name):
    return [p for p in os.listdir(directory) if p.startswith(f".{name}") or p == name]


# ---- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("glu", [None, 1, 2, 3], ids=["concat", "k1", "k2", "k3"])
def test_single_file_round_trip(tmp_path, glu):
    sd = _hf_per_expert()
    save_file(sd, str(tmp_path / "src.safetensors"), metadata={"format": "pt"})
    convert_checkpoint(
        tmp_path / "src.safetensors", tmp_path / "grouped.safetensors", "grouped", "none" if glu is None else glu
    )
    grouped = load_file(str(tmp_path / "grouped.safetensors"))
    p = "model.layers.1.mlp.experts"
    fc1 = torch.stack([torch.cat([sd[f"{p}.{i}.gate_proj.weight"], sd[f"{p}.{i}.up_proj.weight"]]) for i in range(N)])
    assert torch.equal(grouped[f"{p}.gate_up_proj"], fc1 if glu is None else interleave_glu(fc1, glu, dim=1))
    assert torch.equal(grouped[f"{p}.down_proj"], torch.stack([sd[f"{p}.{i}.down_proj.weight"] for i in range(N)]))
    assert grouped[f"{p}.gate_up_proj"].shape == (N, 2 * F, H)
    meta = Checkpoint(tmp_path / "grouped.safetensors").metadata
    records = {r["prefix"]: r for r in json.loads(meta[META_GROUPS])}
    assert records[p] == {
        "prefix": p,
        "naming": "hf",
        "layout": "grouped",
        "role": "mlp",
        "num_experts": N,
        "glu_interleave_size": glu,
    }
    assert meta["format"] == "pt"

    convert_checkpoint(tmp_path / "grouped.safetensors", tmp_path / "back.safetensors", "per-expert")
    _assert_same(load_file(str(tmp_path / "back.safetensors")), sd)


def test_sharded_round_trip_keeps_shards_and_sidecars(tmp_path):
    sd = _hf_per_expert(layers=3, dtype=torch.float16)
    src = _save_sharded(sd, tmp_path / "src")
    result = convert_checkpoint(src, tmp_path / "grouped", "grouped")
    assert result.destination.is_dir() and len(result.files) == 3
    assert (tmp_path / "grouped" / "config.json").read_text() == "{}"
    index = json.loads((tmp_path / "grouped" / "model.safetensors.index.json").read_text())
    grouped = _load_all(tmp_path / "grouped")
    assert set(index["weight_map"]) == set(grouped)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in grouped.values())
    assert all(r["layout"] == "grouped" for r in json.loads(Checkpoint(tmp_path / "grouped").metadata[META_GROUPS]))
    assert sum(k.endswith("gate_up_proj") for k in grouped) == 3

    convert_checkpoint(tmp_path / "grouped" / "model.safetensors.index.json", tmp_path / "back", "per-expert")
    _assert_same(_load_all(tmp_path / "back"), sd)


def test_mixtral_names_round_trip(tmp_path):
    sd = _hf_per_expert(naming=("w1", "w3", "w2"), prefix="model.layers.{l}.block_sparse_moe.experts")
    save_file(sd, str(tmp_path / "src.safetensors"))
    convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "g.safetensors", "grouped")
    grouped = load_file(str(tmp_path / "g.safetensors"))
    p = "model.layers.0.block_sparse_moe.experts"
    assert torch.equal(grouped[f"{p}.gate_up_proj"][2], torch.cat([sd[f"{p}.2.w1.weight"], sd[f"{p}.2.w3.weight"]]))
    convert_checkpoint(tmp_path / "g.safetensors", tmp_path / "b.safetensors", "per-expert")
    _assert_same(load_file(str(tmp_path / "b.safetensors")), sd)


def test_transformer_engine_round_trip_and_interleave(tmp_path):
    sd = _te_per_expert()
    save_file(sd, str(tmp_path / "te.safetensors"))
    # TE's fc1 rows: their gate/up order is not in the file; it must be stated.
    with pytest.raises(CheckpointError, match="src-glu-interleave"):
        convert_checkpoint(tmp_path / "te.safetensors", tmp_path / "g.safetensors", "grouped")
    convert_checkpoint(tmp_path / "te.safetensors", tmp_path / "g.safetensors", "grouped", 2, src_glu_interleave="none")
    grouped = load_file(str(tmp_path / "g.safetensors"))
    p = "decoder.layers.0.mlp.experts"
    fc1 = torch.stack([sd[f"{p}.linear_fc1.weight{i}"] for i in range(N)])
    assert torch.equal(grouped[f"{p}.linear_fc1.weight"], interleave_glu(fc1, 2, dim=1))
    b1 = torch.stack([sd[f"{p}.linear_fc1.bias{i}"] for i in range(N)])
    assert torch.equal(grouped[f"{p}.linear_fc1.bias"], interleave_glu(b1, 2, dim=1))
    assert torch.equal(
        grouped[f"{p}.linear_fc2.weight"], torch.stack([sd[f"{p}.linear_fc2.weight{i}"] for i in range(N)])
    )
    # The grouped file records k=2, so going back needs no --src-glu-interleave; the default would
    # keep k=2 in the per-expert fc1 tensors, so ask for the TE file's [gates; ups] order.
    convert_checkpoint(tmp_path / "g.safetensors", tmp_path / "b.safetensors", "per-expert", "none")
    _assert_same(load_file(str(tmp_path / "b.safetensors")), sd)


def test_conversion_streams_one_expert_at_a_time(tmp_path, monkeypatch):
    import moekit.checkpoint.convert as convert

    # Non-expert tensors are copied in pieces (64 MiB by default; 64 bytes here, to see it).
    monkeypatch.setattr(convert, "COPY_PIECE_BYTES", 64)
    sd = _hf_per_expert(layers=4, dtype=torch.float32)
    save_file(sd, str(tmp_path / "src.safetensors"))
    result = convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "g.safetensors", "grouped")
    one_expert_fc1 = 2 * F * H * 4
    layer_experts = N * 3 * F * H * 4
    whole = sum(t.numel() * t.element_size() for t in sd.values())
    assert result.peak_bytes <= one_expert_fc1 < layer_experts < whole


# ---- loading converted checkpoints -------------------------------------------------------------


def _tiny_qwen3(transformers):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=H * 4,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        moe_intermediate_size=F * 2,
        num_experts=N,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_converted_checkpoint_loads_into_transformers_and_grouped_mlp(tmp_path, sharded):
    transformers = pytest.importorskip("transformers")
    model = _tiny_qwen3(transformers)
    # save_pretrained writes the hub's per-expert layout (experts.{i}.gate_proj.weight ...).
    model.save_pretrained(tmp_path / "hf", max_shard_size="40KB" if sharded else "1GB")
    assert any(".experts.0.gate_proj.weight" in k for k in _load_all(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists() == sharded
    convert_checkpoint(tmp_path / "hf", tmp_path / "grouped", "grouped")
    grouped = _load_all(tmp_path / "grouped")
    assert not any(".experts.0." in k for k in grouped)

    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids).logits
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "grouped", experts_implementation="eager")
    assert torch.equal(loaded(input_ids=ids).logits, expected)

    # The same tensors in a moekit GroupedMLP give the experts' outputs.
    prefix = "model.layers.1.mlp.experts"
    mlp = GroupedMLP(N, model.config.hidden_size, model.config.moe_intermediate_size, backend="loop")
    mlp.load_state_dict(
        {"fc1.weight": grouped[f"{prefix}.gate_up_proj"], "fc2.weight": grouped[f"{prefix}.down_proj"]}, strict=False
    )
    hidden = torch.randn(9, model.config.hidden_size)
    top_k_index = torch.randint(0, N, (9, 2), generator=torch.Generator().manual_seed(1))
    top_k_weights = torch.rand(9, 2)
    reference = model.get_submodule(prefix)(hidden, top_k_index, top_k_weights)
    from moekit import permute, unpermute

    x_sorted, m_splits, row_map = permute(hidden, top_k_index, N)
    y = unpermute(mlp(x_sorted, m_splits), row_map, top_k_weights)
    assert torch.allclose(y, reference, rtol=1e-5, atol=1e-6)

    convert_checkpoint(tmp_path / "grouped", tmp_path / "back", "per-expert")
    _assert_same(_load_all(tmp_path / "back"), _load_all(tmp_path / "hf"))


# ---- refusals: nothing written ----------------------------------------------------------------


def _refuse(tmp_path, sd, match, **kwargs):
    save_file(sd, str(tmp_path / "src.safetensors"))
    with pytest.raises(CheckpointError, match=match):
        convert_checkpoint(
            tmp_path / "src.safetensors", tmp_path / "out.safetensors", kwargs.pop("to", "grouped"), **kwargs
        )
    assert _leftovers(tmp_path, "out.safetensors") == []


def test_refuses_missing_expert(tmp_path):
    sd = _hf_per_expert()
    del sd["model.layers.1.mlp.experts.2.up_proj.weight"]
    _refuse(tmp_path, sd, r"missing expert indices \[2\]")


def test_refuses_missing_last_experts_of_one_projection(tmp_path):
    sd = _hf_per_expert()
    del sd["model.layers.0.mlp.experts.3.down_proj.weight"]
    _refuse(tmp_path, sd, r"down_proj.weight: missing expert indices \[3\]")


NON_CANONICAL = {
    "leading-zero": ("01", "has a leading zero ('1' names that expert)"),
    "zero-zero": ("00", "has a leading zero ('0' names that expert)"),
    "plus": ("+1", "has a sign"),
    "minus": ("-1", "has a sign"),
    "arabic-indic-digit": ("\u0661", "has digits other than 0-9"),
    "19-digits": ("1" * 19, "has 19 digits (at most 18)"),
}


@pytest.mark.parametrize("case", NON_CANONICAL)
@pytest.mark.parametrize("naming", ["hf", "te"])
def test_refuses_non_canonical_expert_index(tmp_path, case, naming, capsys):
    """One name per expert: `experts.01` next to `experts.1` is not a duplicate to pick from, and
    `weight+1` is not expert 1; convert and inspect refuse the key, naming it (as
    GroupedLinear.load_state_dict does, test_save_load.py)."""
    from moekit.cli import main

    index, why = NON_CANONICAL[case]
    if naming == "hf":
        sd = _hf_per_expert()
        key = f"model.layers.0.mlp.experts.{index}.gate_proj.weight"
        sd[key] = torch.zeros(F, H, dtype=torch.bfloat16)
    else:
        sd = _te_per_expert()
        key = f"decoder.layers.0.mlp.experts.linear_fc2.weight{index}"
        sd[key] = torch.zeros(H, F)
    expected = f"key {key!r}: its expert index {index!r} {why}; expected a canonical decimal index"
    _refuse(tmp_path, sd, re.escape(expected), src_glu_interleave="none")
    assert main(["inspect", str(tmp_path / "src.safetensors"), "--src-glu-interleave", "none"]) == 1
    assert f"  - {expected}" in capsys.readouterr().out


def test_refusal_naming_a_long_key_stays_short(tmp_path):
    """A key is named with its middle elided: a 1 MB key gives a message of a few hundred characters."""
    sd = _hf_per_expert()
    key = f"model.layers.0.mlp.experts.{'1' * 1_000_000}.gate_proj.weight"
    sd[key] = torch.zeros(F, H, dtype=torch.bfloat16)
    save_file(sd, str(tmp_path / "src.safetensors"))
    with pytest.raises(CheckpointError) as info:
        convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "out.safetensors", "grouped")
    (message,) = info.value.problems
    assert "has 1,000,000 digits (at most 18)" in message and f"({len(key):,} characters)" in message
    assert len(message) < 400, message


def test_refuses_tensor_duplicated_across_shards(tmp_path):
    sd = _hf_per_expert()
    src = _save_sharded(sd, tmp_path / "src")
    first = sorted(src.glob("*.safetensors"))[0]
    extra = dict(load_file(str(first)))
    key = "model.layers.0.mlp.experts.0.gate_proj.weight"
    extra[key] = sd[key]
    save_file(extra, str(first))
    with pytest.raises(CheckpointError, match="duplicate tensor|index maps"):
        convert_checkpoint(src, tmp_path / "out", "grouped")
    assert _leftovers(tmp_path, "out") == []


def test_refuses_disagreeing_shapes(tmp_path):
    sd = _hf_per_expert()
    sd["model.layers.0.mlp.experts.3.up_proj.weight"] = torch.randn(F + 2, H).to(torch.bfloat16)
    _refuse(tmp_path, sd, "shapes of up_proj.weight disagree")


def test_refuses_disagreeing_dtypes(tmp_path):
    sd = _hf_per_expert()
    sd["model.layers.0.mlp.experts.3.up_proj.weight"] = sd["model.layers.0.mlp.experts.3.up_proj.weight"].float()
    _refuse(tmp_path, sd, "dtypes disagree")


def test_refuses_mixed_layouts(tmp_path):
    sd = _hf_per_expert()
    sd["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(N, 2 * F, H)
    sd["model.layers.0.mlp.experts.down_proj"] = torch.zeros(N, H, F)
    _refuse(tmp_path, sd, "both per-expert and grouped")


def test_refuses_grouped_without_recorded_glu_order(tmp_path):
    sd = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(N, 2 * F, H),
        "model.layers.0.mlp.experts.down_proj": torch.randn(N, H, F),
    }
    _refuse(tmp_path, sd, "not recorded", to="per-expert")
    # Stated, it converts.
    os.remove(tmp_path / "src.safetensors")
    save_file(sd, str(tmp_path / "src.safetensors"))
    convert_checkpoint(
        tmp_path / "src.safetensors", tmp_path / "out.safetensors", "per-expert", src_glu_interleave="none"
    )
    out = load_file(str(tmp_path / "out.safetensors"))
    up = out["model.layers.0.mlp.experts.2.up_proj.weight"]
    assert torch.equal(up, sd["model.layers.0.mlp.experts.gate_up_proj"][2, F:])


def test_inspect_fails_where_convert_would_refuse(tmp_path, capsys):
    """A grouped file that does not record its gate/up order: listed, exit status 1; stated, fine."""
    from moekit.cli import main

    save_file(
        {
            "model.layers.0.mlp.experts.gate_up_proj": torch.randn(N, 2 * F, H),
            "model.layers.0.mlp.experts.down_proj": torch.randn(N, H, F),
        },
        str(tmp_path / "g.safetensors"),
    )
    assert main(["inspect", str(tmp_path / "g.safetensors")]) == 1
    out = capsys.readouterr().out
    assert "not recorded" in out and "problems (convert would refuse)" in out and "--src-glu-interleave" in out
    assert main(["inspect", str(tmp_path / "g.safetensors"), "--src-glu-interleave", "none"]) == 0
    assert "problems" not in capsys.readouterr().out


def test_refuses_transposed_grouped(tmp_path):
    sd = {
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(N, H, 2 * F),
        "model.layers.0.mlp.experts.down_proj": torch.randn(N, F, H),
    }
    _refuse(tmp_path, sd, r"\[N, in, out\]", src_glu_interleave=1)


def test_refuses_unrecognised_expert_tensor(tmp_path):
    sd = _hf_per_expert()
    sd["model.layers.0.mlp.experts.0.gate_proj.weight_scale"] = torch.ones(1)
    _refuse(tmp_path, sd, "unrecognised per-expert tensor")


def test_refuses_interleave_not_dividing_ffn(tmp_path):
    _refuse(tmp_path, _hf_per_expert(), "does not divide", glu_interleave=4)


def test_refuses_existing_destination(tmp_path):
    save_file(_hf_per_expert(), str(tmp_path / "src.safetensors"))
    (tmp_path / "out.safetensors").write_bytes(b"keep me")
    with pytest.raises(CheckpointError, match="exists"):
        convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "out.safetensors", "grouped")
    assert (tmp_path / "out.safetensors").read_bytes() == b"keep me"


def test_failed_verification_leaves_nothing(tmp_path, monkeypatch):
    import moekit.checkpoint.convert as convert

    save_file(_hf_per_expert(), str(tmp_path / "src.safetensors"))
    _src_dir = _save_sharded(_hf_per_expert(), tmp_path / "sharded")

    def fail(*args, **kwargs):
        raise RuntimeError("simulated verification failure")

    monkeypatch.setattr(convert, "_verify_round_trip", fail)
    for src, dst in ((tmp_path / "src.safetensors", "out.safetensors"), (_src_dir, "out_dir")):
        with pytest.raises(RuntimeError, match="simulated"):
            convert_checkpoint(src, tmp_path / dst, "grouped")
        assert _leftovers(tmp_path, dst) == []


def test_verification_catches_a_corrupted_output(tmp_path, monkeypatch):
    import moekit.checkpoint.convert as convert

    save_file(_hf_per_expert(), str(tmp_path / "src.safetensors"))
    real = convert.reorder_glu_rows
    calls = []

    def corrupt_once(rows, src, dst, dim=0):
        calls.append(1)
        out = real(rows, src, dst, dim)
        return out.flip(0) if len(calls) == 1 else out  # write one expert's rows reversed

    monkeypatch.setattr(convert, "reorder_glu_rows", corrupt_once)
    with pytest.raises(convert.VerificationError, match="differs after the round trip"):
        convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "out.safetensors", "grouped")
    assert _leftovers(tmp_path, "out.safetensors") == []


# ---- inspect ------------------------------------------------------------------------------------


def test_inspect_table(tmp_path):
    sd = _hf_per_expert()
    save_file(sd, str(tmp_path / "src.safetensors"))
    ckpt = Checkpoint(tmp_path / "src.safetensors")
    text = format_inspection(ckpt, analyze(ckpt))
    assert "model.layers.1.mlp.experts" in text and "per-expert" in text and "BF16" in text
    assert f"fc1_weight [{2 * F}, {H}]" in text and "problems" not in text
    del sd["model.layers.1.mlp.experts.0.down_proj.weight"]
    save_file(sd, str(tmp_path / "bad.safetensors"))
    bad = Checkpoint(tmp_path / "bad.safetensors")
    assert "missing expert indices [0]" in format_inspection(bad, analyze(bad))


# ---- malformed files: refused as strictly as the safetensors library refuses them ---------------


def _raw_file(path, header, data=b"", *, header_len=None):
    """A hand-made safetensors file: 8-byte header length, header bytes, data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write((len(raw) if header_len is None else header_len).to_bytes(8, "little"))
        f.write(raw)
        f.write(data)
    return path


def _entry(begin, end, shape=(1,), dtype="F32"):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


MALFORMED = {
    # the same definition twice: the library keeps the last one and accepts it; which was meant is unknown
    "duplicated-key": (
        lambda p: _raw_file(
            p,
            b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
            b'"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
            bytes(4),
        ),
        "defined twice",
    ),
    "random-bytes": (lambda p: p.write_bytes(bytes(range(7, 250, 3)) * 5) and p, "header claims"),
    "json-list-header": (lambda p: _raw_file(p, b"[1, 2]"), "header is a JSON list; expected an object"),
    "not-json": (lambda p: _raw_file(p, b"{nope"), "header is not JSON"),
    "missing-data-offsets": (
        lambda p: _raw_file(p, {"a": {"dtype": "F32", "shape": [1]}}, bytes(4)),
        "no 'data_offsets'",
    ),
    "shape-offset-disagree": (
        lambda p: _raw_file(p, {"a": _entry(0, 4, shape=(2,))}, bytes(4)),
        r"needs 8 bytes, but its data_offsets \[0, 4\] span 4",
    ),
    "truncated": (lambda p: _raw_file(p, {"a": _entry(0, 4), "b": _entry(4, 8)}, bytes(6)), "truncated"),
    "offsets-past-eof": (
        lambda p: _raw_file(p, {"a": _entry(0, 4), "b": _entry(100, 104)}, bytes(8)),
        "starts at data byte 100, expected 4",
    ),
    "header-claims-6GB": (lambda p: _raw_file(p, b"{}", header_len=6 << 30), r"header claims 6.0 GiB"),
    "unknown-dtype": (lambda p: _raw_file(p, {"a": _entry(0, 4, dtype="X32")}, bytes(4)), "unknown dtype 'X32'"),
    "metadata-not-strings": (
        lambda p: _raw_file(p, {"__metadata__": {"a": 1}, "a": _entry(0, 4)}, bytes(4)),
        "__metadata__ must map strings to strings",
    ),
    "trailing-bytes": (lambda p: _raw_file(p, {"a": _entry(0, 4)}, bytes(12)), "trailing bytes"),
    "shorter-than-8-bytes": (lambda p: p.write_bytes(b"abc") and p, "shorter than the 8-byte header length"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_file_refused_by_every_reader(tmp_path, case, capsys):
    """convert, inspect and read_safetensors refuse the file with a message saying what is wrong; the
    safetensors library refuses it too (the duplicated key aside)."""
    from safetensors import safe_open

    import moekit
    from moekit.cli import main

    make, match = MALFORMED[case]
    path = make(tmp_path / "bad.safetensors")
    if case != "duplicated-key":
        with pytest.raises(Exception):  # noqa: B017 (the library's own error type)
            with safe_open(str(path), framework="pt") as f:
                [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118
    with pytest.raises(CheckpointError, match=match):
        convert_checkpoint(path, tmp_path / "out.safetensors", "grouped")
    assert _leftovers(tmp_path, "out.safetensors") == []
    with pytest.raises(CheckpointError, match=match):
        moekit.read_safetensors(path)
    assert main(["inspect", str(path)]) == 1
    err = capsys.readouterr().err
    assert "problems" in err and "Traceback" not in err


def test_header_validation_accepts_what_the_library_writes(tmp_path):
    """Padding after the header, empty and zero-size tensors: valid files stay readable."""
    save_file(
        {"a": torch.zeros(0), "b": torch.ones(3, dtype=torch.bfloat16), "c": torch.ones(2, 2)},
        str(tmp_path / "ok.safetensors"),
        metadata={"format": "pt"},
    )
    save_file({}, str(tmp_path / "empty.safetensors"))
    assert Checkpoint(tmp_path / "ok.safetensors").tensors["b"].shape == (3,)
    assert Checkpoint(tmp_path / "empty.safetensors").tensors == {}


def test_invalid_index_refused(tmp_path):
    src = _save_sharded(_hf_per_expert(), tmp_path / "src")
    (src / "model.safetensors.index.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="not a readable index JSON"):
        convert_checkpoint(src, tmp_path / "out", "grouped")
    (src / "model.safetensors.index.json").write_text('{"weight_map": ["a"]}')
    with pytest.raises(CheckpointError, match="'weight_map' maps tensor names to shard file names"):
        convert_checkpoint(src, tmp_path / "out", "grouped")
    assert _leftovers(tmp_path, "out") == []


# ---- a missing last expert ---------------------------------------------------------------------


def test_refuses_missing_last_expert_that_other_layers_have(tmp_path):
    sd = _hf_per_expert()
    for proj in ("gate_proj", "up_proj", "down_proj"):
        del sd[f"model.layers.1.mlp.experts.{N - 1}.{proj}.weight"]
    _refuse(
        tmp_path,
        sd,
        rf"model.layers.1.mlp.experts: holds {N - 1} experts, other groups of this checkpoint "
        rf"hold {N}: missing expert indices \[{N - 1}\]",
    )


@pytest.mark.parametrize("field", ["num_local_experts", "num_experts", "n_routed_experts"])
def test_refuses_missing_last_expert_that_config_json_counts(tmp_path, field):
    sd = {k: v for k, v in _hf_per_expert().items() if f".experts.{N - 1}." not in k}  # every layer lacks it
    save_file(sd, str(tmp_path / "model.safetensors"))
    nested = field == "n_routed_experts"  # also found inside a sub-config (e.g. text_config)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {field: N}} if nested else {field: N}))
    with pytest.raises(
        CheckpointError,
        match=rf"config.json \({field}={N}\) says {N}: missing expert indices "
        rf"\[{N - 1}\]",
    ):
        convert_checkpoint(tmp_path / "model.safetensors", tmp_path / "out.safetensors", "grouped")
    (tmp_path / "config.json").write_text(json.dumps({field: N - 1}))
    convert_checkpoint(tmp_path / "model.safetensors", tmp_path / "out.safetensors", "grouped")


def test_refuses_a_config_json_that_is_not_json(tmp_path):
    """config.json says how many experts a complete checkpoint holds: one that cannot be parsed is
    refused in words, not skipped (which would let a missing last expert through)."""
    save_file(_hf_per_expert(), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"num_local_experts": 4,')
    with pytest.raises(CheckpointError, match=r"config.json: cannot be read as JSON .*fix it or move it away"):
        convert_checkpoint(tmp_path / "model.safetensors", tmp_path / "out.safetensors", "grouped")
    assert not (tmp_path / "out.safetensors").exists()
    (tmp_path / "config.json").write_text(json.dumps({"num_local_experts": N}))
    convert_checkpoint(tmp_path / "model.safetensors", tmp_path / "out.safetensors", "grouped")


# ---- moekit's own files ------------------------------------------------------------------------


def test_issue_scenario_discrete_interleaved_file_converts_and_loads_exactly(tmp_path):
    """save (discrete, k=2) -> convert --to grouped --src-glu-interleave 2 -> load into k=None: exact."""
    import moekit

    saved = GroupedMLP(N, H, F, bias=True, glu_interleave_size=2, single_grouped_weight=False, backend="loop")
    with torch.no_grad():
        for p in saved.parameters():  # small integers: fc1's sums are exact in any row order
            p.copy_(torch.randint(-3, 4, p.shape))
    moekit.save_safetensors(saved, tmp_path / "d.safetensors")
    convert_checkpoint(tmp_path / "d.safetensors", tmp_path / "g.safetensors", "grouped", src_glu_interleave=2)
    loaded = GroupedMLP(N, H, F, bias=True, glu_interleave_size=None, backend="loop")
    moekit.load_safetensors(loaded, tmp_path / "g.safetensors")
    assert torch.equal(loaded.fc1.weight, moekit.deinterleave_glu(torch.stack(saved.fc1.weights()), 2, dim=1))
    x, splits = torch.randint(-3, 4, (7, H)).float(), [2, 0, 4, 1]
    assert torch.equal(loaded(x, splits), saved(x, splits))
    # The file records k=2; a different claim is refused, naming both.
    with pytest.raises(CheckpointError, match=r"records glu_interleave_size=2, but --src-glu-interleave says 1"):
        convert_checkpoint(tmp_path / "d.safetensors", tmp_path / "g1.safetensors", "grouped", src_glu_interleave=1)


def test_demo_style_single_grouped_checkpoint_is_recognised(tmp_path):
    import moekit

    model = moekit.MoELayer(H, F, N, 2, glu_interleave_size=None)
    moekit.save_safetensors(model, tmp_path / "m.safetensors")
    analysis = analyze(Checkpoint(tmp_path / "m.safetensors"))
    assert not analysis.problems
    assert {(g.prefix.rsplit(".", 1)[-1], g.layout, g.role, g.num_experts) for g in analysis.groups} == {
        ("fc1", "grouped", "fc1", N),
        ("fc2", "grouped", "linear", N),
    }
    assert "router.weight" in analysis.other_keys
    convert_checkpoint(tmp_path / "m.safetensors", tmp_path / "p.safetensors", "per-expert")
    back = moekit.MoELayer(H, F, N, 2, glu_interleave_size=3, single_grouped_weight=False)
    moekit.load_safetensors(back, tmp_path / "p.safetensors")
    x = torch.randn(5, H)
    torch.testing.assert_close(back(x), model(x), rtol=1e-6, atol=1e-6)


def test_converted_files_have_ordinary_permissions(tmp_path):
    import stat

    save_file(_hf_per_expert(), str(tmp_path / "src.safetensors"))
    src_dir = _save_sharded(_hf_per_expert(), tmp_path / "sharded")
    old = os.umask(0o022)
    try:
        convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "g.safetensors", "grouped")
        convert_checkpoint(src_dir, tmp_path / "g_dir", "grouped")
    finally:
        os.umask(old)
    for p in [tmp_path / "g.safetensors", *(tmp_path / "g_dir").iterdir()]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    assert stat.S_IMODE((tmp_path / "g_dir").stat().st_mode) == 0o755


# ---- zero-size experts ---------------------------------------------------------------------------


ZERO_SIZE = {
    # case: (per-expert tensors, convert's arguments, the grouped tensors expected)
    "te-fc1-no-rows": (  # F = 0: fused gate/up rows, whose order is stated
        {f"fc1.weight{i}": torch.zeros(0, 8) for i in range(2)},
        {"src_glu_interleave": "none"},
        {"fc1.weight": (2, 0, 8)},
    ),
    "te-fc1-no-rows-to-block-2": (
        {
            **{f"fc1.weight{i}": torch.zeros(0, 8) for i in range(2)},
            **{f"fc1.bias{i}": torch.zeros(0) for i in range(2)},
        },
        {"src_glu_interleave": "none", "glu_interleave": 2},
        {"fc1.weight": (2, 0, 8), "fc1.bias": (2, 0)},
    ),
    "te-linear-no-columns": ({f"proj.weight{i}": torch.zeros(4, 0) for i in range(3)}, {}, {"proj.weight": (3, 4, 0)}),
    "hf-no-ffn": (
        {
            **{f"experts.{i}.gate_proj.weight": torch.zeros(0, 8) for i in range(2)},
            **{f"experts.{i}.up_proj.weight": torch.zeros(0, 8) for i in range(2)},
            **{f"experts.{i}.down_proj.weight": torch.zeros(8, 0) for i in range(2)},
        },
        {},
        {"experts.gate_up_proj": (2, 0, 8), "experts.down_proj": (2, 8, 0)},
    ),
}


@pytest.mark.parametrize("case", ZERO_SIZE)
def test_zero_size_experts_convert_exactly(tmp_path, case):
    """Experts without elements are a valid edge: they convert to grouped tensors of the right shape,
    and back (and straight to per-expert) to the source, tensor for tensor."""
    sd, kwargs, expected = ZERO_SIZE[case]
    sd = {**sd, "other.weight": torch.arange(6.0).reshape(2, 3)}
    save_file(sd, str(tmp_path / "src.safetensors"))
    convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "g.safetensors", "grouped", **kwargs)
    grouped = load_file(str(tmp_path / "g.safetensors"))
    assert {key: tuple(t.shape) for key, t in grouped.items() if key != "other.weight"} == expected
    assert torch.equal(grouped["other.weight"], sd["other.weight"])
    back = "none" if "src_glu_interleave" in kwargs else "keep"
    convert_checkpoint(tmp_path / "g.safetensors", tmp_path / "b.safetensors", "per-expert", back)
    _assert_same(load_file(str(tmp_path / "b.safetensors")), sd)
    convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "p.safetensors", "per-expert", **kwargs)
    _assert_same(load_file(str(tmp_path / "p.safetensors")), sd)


def _te_grouped_file(path, weight: torch.Tensor, role: str = "linear"):
    record = {"prefix": "proj", "naming": "te", "layout": "grouped", "role": role, "glu_interleave_size": None}
    save_file({"proj.weight": weight}, str(path), metadata={META_GROUPS: json.dumps([record])})
    return path


@pytest.mark.parametrize("naming", ["te", "hf"])
def test_grouped_group_of_no_experts(tmp_path, naming):
    """N = 0 stays grouped exactly; the per-expert layout has no tensor to say the group exists, so
    converting it there is refused in one line, nothing written."""
    if naming == "te":
        _te_grouped_file(tmp_path / "src.safetensors", torch.zeros(0, 4, 8))
    else:
        save_file(
            {"experts.gate_up_proj": torch.zeros(0, 4, 8), "experts.down_proj": torch.zeros(0, 8, 2)},
            str(tmp_path / "src.safetensors"),
        )
    src = tmp_path / "src.safetensors"
    convert_checkpoint(src, tmp_path / "g.safetensors", "grouped", src_glu_interleave="none")
    _assert_same(load_file(str(tmp_path / "g.safetensors")), load_file(str(src)))
    where = "proj" if naming == "te" else "experts"
    with pytest.raises(CheckpointError, match=rf"^{where}: holds 0 experts; the per-expert layout has no tensor"):
        convert_checkpoint(src, tmp_path / "out.safetensors", "per-expert", src_glu_interleave="none")
    assert _leftovers(tmp_path, "out.safetensors") == []


def test_per_expert_output_past_the_header_limit_is_refused_before_planning(tmp_path):
    """2,000,000 experts of no elements: a 200-byte file whose per-expert form would need a header
    past safetensors' 100 MB; refused from the count, before a tensor of it is planned."""
    _te_grouped_file(tmp_path / "src.safetensors", torch.zeros(2_000_000, 0, 8))
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=r"^proj: 2,000,000 experts would be 2,000,000 per-expert tensors"):
            convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "out.safetensors", "per-expert")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    assert _leftovers(tmp_path, "out.safetensors") == []


def test_write_refuses_a_header_past_the_limit(tmp_path, monkeypatch):
    """The exact check behind it: a header longer than safetensors reads is never written."""
    import moekit.checkpoint.files as files

    monkeypatch.setattr(files, "MAX_HEADER_BYTES", 200)
    outputs = [files.tensor_output(f"tensor{i}", torch.zeros(1)) for i in range(10)]
    with pytest.raises(CheckpointError, match=r"its header would take \d+ bytes \(10 tensors\), more than safetensors"):
        files.write_safetensors(tmp_path / "x.safetensors", outputs, {})
    assert not (tmp_path / "x.safetensors").exists()


# ---- refusals cost what the file holds, not what its keys claim -----------------------------------


def _sparse_hf(path, last: int):
    sd = {}
    for i in (0, last):
        sd[f"experts.{i}.gate_proj.weight"] = torch.zeros(2, 4)
        sd[f"experts.{i}.up_proj.weight"] = torch.zeros(2, 4)
        sd[f"experts.{i}.down_proj.weight"] = torch.zeros(4, 2)
    save_file(sd, str(path))
    return path


# At most 10^7: were a refusal to cost in proportion to the index again, these would fail on
# tracemalloc's peak (about 0.5 GB) rather than take the machine down.
SPARSE = {
    # the brief's 664-byte TE file with fc1.weight0 and fc1.weight10000000
    "te": (
        lambda p: save_file({"fc1.weight0": torch.zeros(2, 4), "fc1.weight10000000": torch.zeros(2, 4)}, str(p)) or p,
        "fc1.weight{i}: missing 9,999,999 expert indices [1, 2, 3, ..., 9999999] (found 2 of 0..10000000)",
        1,
    ),
    # an HF file with experts 0 and 9999999 (the brief's had 99999999)
    "hf": (
        lambda p: _sparse_hf(p, 9_999_999),
        "experts.*.gate_proj.weight: missing 9,999,998 expert indices [1, 2, 3, ..., 9999998] (found 2 of 0..9999999)",
        3,
    ),
}


@pytest.mark.parametrize("case", SPARSE)
def test_sparse_expert_indices_are_refused_in_proportion_to_the_file(tmp_path, case, capsys):
    """Refusing costs time and memory in proportion to the file (never to the largest index in a
    key), and names a few of the missing indices, in one short line."""
    from moekit.cli import main

    make, expected, count = SPARSE[case]
    src = make(tmp_path / "src.safetensors")
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as info:
            convert_checkpoint(src, tmp_path / "out.safetensors", "grouped", src_glu_interleave="none")
        ckpt = Checkpoint(src)
        problems = analyze(ckpt, None).problems
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # the sets of all indices up to 10^8 took gigabytes
    assert len(info.value.problems) == count and info.value.problems[0].startswith(expected)
    assert problems == info.value.problems
    assert all(len(p) < 200 for p in problems)
    assert _leftovers(tmp_path, "out.safetensors") == []
    assert main(["inspect", str(src), "--src-glu-interleave", "none"]) == 1
    assert f"  - {expected}" in capsys.readouterr().out


def test_config_json_expert_count_far_past_the_file_is_refused_cheaply(tmp_path):
    save_file(_hf_per_expert(), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"num_local_experts": 10**7}))
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as info:
            convert_checkpoint(tmp_path / "model.safetensors", tmp_path / "out.safetensors", "grouped")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak
    assert f"says {10**7}: missing {10**7 - N:,} expert indices [{N}, {N + 1}, {N + 2}, ..., {10**7 - 1}]" in str(
        info.value
    )


def test_missing_indices_lists_a_few():
    from moekit.checkpoint.layout import missing_indices

    assert missing_indices({0, 1, 2}, 3) is None
    assert missing_indices({0, 2, 5}, 6) == "missing expert indices [1, 3, 4]"
    assert missing_indices(set(), 6) == "missing expert indices [0, 1, 2, 3, 4, 5]"
    assert missing_indices({0}, 8) == "missing 7 expert indices [1, 2, 3, ..., 7]"
    assert missing_indices({0, 7, 8}, 9) == "missing expert indices [1, 2, 3, 4, 5, 6]"
    assert missing_indices({0, 8, 9}, 10) == "missing 7 expert indices [1, 2, 3, ..., 7]"
    assert missing_indices((), 10**7, start=4) == "missing 9,999,996 expert indices [4, 5, 6, ..., 9999999]"
    assert missing_indices({1}, 3, what="keys", name=lambda i: f"w{i}") == "missing keys [w0, w2]"


def test_a_temporary_name_with_an_impossible_process_id_is_left_alone(tmp_path):
    """Only the leftovers of moekit runs whose process is gone are removed; a name whose process id no
    process can have is not moekit's, and does not stop the conversion."""
    save_file(_hf_per_expert(), str(tmp_path / "src.safetensors"))
    odd = tmp_path / f".out.safetensors.moekit-convert-tmp-{10**20}"
    odd.write_bytes(b"not ours")
    result = convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "out.safetensors", "grouped")
    assert result.removed_temps == [] and odd.read_bytes() == b"not ours"


@pytest.mark.parametrize("value", ["0", "-2", "two", "\u0663", "1" * 5000, True, 2.0])
def test_glu_interleave_argument_refused_in_one_line(tmp_path, value):
    """A block size is ASCII digits of a positive int: not a digit of another script, not a number of
    thousands of digits (which int() itself refuses with a traceback), not a bool."""
    save_file(_hf_per_expert(), str(tmp_path / "src.safetensors"))
    with pytest.raises(CheckpointError) as info:
        convert_checkpoint(tmp_path / "src.safetensors", tmp_path / "out.safetensors", "grouped", value)
    (message,) = info.value.problems
    assert message.startswith("--glu-interleave must be 'none' ([gates; ups]) or a positive int") and len(message) < 300
    assert _leftovers(tmp_path, "out.safetensors") == []
