"""`moekit demo` end to end at a few steps: it trains, writes its files (ordinary permissions), and
the checkpoint round trip (single grouped -> discrete layout) reproduces the evaluation loss exactly."""

import json
import os
import stat

import torch

from moekit.cli import main


def test_demo_trains_and_round_trips(tmp_path, capsys):
    old, threads = os.umask(0o022), torch.get_num_threads()
    try:
        assert main(["demo", "--steps", "30", "--out", str(tmp_path), "--device", "cpu"]) == 0
    finally:
        os.umask(old)
    assert torch.get_num_threads() == threads  # the demo trains on one thread, then gives them back
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["eval_loss_single_grouped"] == summary["eval_loss_reloaded_discrete"]
    assert summary["final_train_loss"] < summary["first_loss"] - 0.5
    assert summary["reloaded_expert_keys"] == sorted([f"weight{i}" for i in range(8)] + ["_extra_state"])
    assert (tmp_path / "model.safetensors").stat().st_size > 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out, err = capsys.readouterr()
    assert "identical" in out
    # progress at every tenth of the way, with the time elapsed and, until the end, the time left
    lines = err.splitlines()
    assert [line.split("] ")[1].split()[0] for line in lines] == ["1/30", *(f"{3 * i}/30" for i in range(1, 11))]
    assert all("s left" in line for line in lines[:-1]) and "left" not in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png", "model.safetensors", "summary.json"]
    for p in tmp_path.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p.name
