"""The benchmarks' plumbing, on CPU: benchmarks/gpu_session.sh --smoke runs every session script on
tiny shapes and leaves its 8 files, each JSON naming the commit; the bar verdicts of
benchmarks/summarize.py, the interleaved timing rounds of benchmarks/runner.py, ab_builds.py and
bench_routing.py. And the provenance of the README's numbers: every result file cited exists, every
committed result is cited, each JSON measured the commit its name says, and the README's tables
read what their JSONs hold."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SESSION_FILES = {
    "session.log",
    "gpu_tests.log",
    "mlp_vs_plain.json",
    "moe_layer.json",
    "moe_layer.png",
    "transformers.json",
    "host_overhead.json",
    "summary.md",
}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"moekit_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_session_smoke_leaves_its_eight_files(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "PY": sys.executable,
        "MOEKIT_BENCH_COMMIT": "abc1234-test",
        "CUDA_VISIBLE_DEVICES": "",
    }
    # A budget well above the smoke run's few minutes: a test machine shared with other jobs is slow.
    command = ["bash", str(BENCHMARKS / "gpu_session.sh"), "--smoke", "--budget", "900"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert {p.name for p in tmp_path.iterdir()} == SESSION_FILES
    for name in ("mlp_vs_plain", "moe_layer", "transformers", "host_overhead"):
        payload = json.loads((tmp_path / f"{name}.json").read_text())
        assert payload["meta"]["git_commit"] == "abc1234-test", name
        assert payload["meta"]["torch"] and "partial" not in payload, name
    records = json.loads((tmp_path / "mlp_vs_plain.json").read_text())["records"]
    assert {r["status"] for r in records} == {"ok"} and all(r["tflops"] and r["x_plain"] for r in records)
    summary = (tmp_path / "summary.md").read_text()
    assert "| MLP geometric mean (forward and forward+backward) |" in summary
    assert "| pytest -m gpu | no pytest summary" in summary  # not run with --smoke
    log = (tmp_path / "session.log").read_text()
    assert "done; every part finished" in log and summary.splitlines()[0] in log  # the summary is printed


def test_bench_routing_smoke_checks_both_paths(tmp_path):
    out = tmp_path / "routing.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    command = [sys.executable, str(BENCHMARKS / "bench_routing.py"), "--smoke", "--sweep", "--topk", "--out", str(out)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert "partial" not in payload and payload["meta"]["smoke"]
    topk = [r for r in payload["records"] if r.get("part") == "topk"]
    assert [r["form"] for r in topk] == ["moekit_packed", "moekit", "torch"]  # --topk: one smoke shape
    routing = [r for r in payload["records"] if r.get("part") != "topk"]
    timed = [r for r in routing if "config" not in r]
    assert [r["path"] for r in timed] == ["torch", "triton"] * 2
    assert len(routing) == len(timed) + 6  # --sweep: six tile configs on one shape
    assert all(r["exact"] and r["host_us"] > 0 for r in routing)


def test_sweep_gathered_loads_smoke_checks_every_form_against_the_tma_one(tmp_path):
    """sweep_gathered_loads.py on a tiny shape under the interpreter, with a table variant: every kind
    is timed, and every form and variant gives the bits of the base tables' form over the gathered rows
    (the `..._equal` entries)."""
    out = tmp_path / "sweep.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    command = [sys.executable, str(BENCHMARKS / "sweep_gathered_loads.py"), "--smoke", "--variants", "base,load8"]
    command += ["--rounds", "1"]  # the rounds' interleaving: test_time_rounds_rotates_order_...
    proc = subprocess.run(command + ["--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cells = json.loads(out.read_text())["cells"]
    assert sorted(cells) == sorted(
        f"smoke/{k}" for k in ("fc2_fwd", "fc1_dgrad", "fc1_fwd", "fc1_wgrad", "fc2_bwd", "fc2_wgrad")
    )
    checks = [v for cell in cells.values() for k, v in cell.items() if k.endswith("_equal")]
    assert len(checks) == 2 * 1 + 4 * 5 and all(v is True for v in checks), cells
    rounds = [v for cell in cells.values() for k, v in cell.items() if k.endswith("_ms_rounds")]
    assert len(rounds) == 2 * 2 + 4 * 6 and all(len(r) == 1 for r in rounds), cells


def test_sweep_grouped_mm_smoke_times_equal_and_ragged_groups(tmp_path):
    """sweep_grouped_mm.py on a tiny shape under the interpreter: fc2's forward and fc1's dgrad on equal
    groups and on the layer's ragged ones, the Triton kernel's bits checked in each; --pick without a
    results file is refused in one line."""
    out = tmp_path / "mm.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "PYTHONPATH": str(BENCHMARKS)}
    command = [sys.executable, str(BENCHMARKS / "sweep_grouped_mm.py"), "--smoke", "--rounds", "1", "--reps", "1"]
    proc = subprocess.run(command + ["--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cells = json.loads(out.read_text())["cells"]
    products = ("fc2_fwd", "fc1_dgrad", "fc2_fwd_ragged", "fc1_dgrad_ragged")
    assert set(cells) == {f"smoke/{p}" for p in products}
    assert all(cell["triton0_equal"] is True for cell in cells.values()), cells
    bad = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "--out: the results' path is needed" in bad.stderr


def test_sweep_grouped_mm_pick_takes_the_fastest_bit_equal_variant_on_ragged_groups(monkeypatch):
    """`pick` (gpu_mm_schedules.sh's AB=auto): the variant with the best geometric-mean speed-up over the
    base kernel on the _ragged products, at least the margin, and none whose bits differ anywhere."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sweep = _load("sweep_grouped_mm")

    def cell(staged_ms, pingpong_ms, pingpong_equal=True):
        return {"ws_ms": 1.0, "ws_staged_rows_ms": staged_ms, "ws_staged_rows_equal": True,
                "ws_pingpong_ms": pingpong_ms, "ws_pingpong_equal": pingpong_equal}  # fmt: skip

    results = {
        "cells": {"a/fc2_fwd": cell(1.0, 0.5), "a/fc2_fwd_ragged": cell(0.9, 0.95), "b/x_ragged": cell(0.95, 1.0)}
    }
    assert sweep.pick(results, ["pingpong", "staged_rows"]) == "staged_rows"  # equal groups do not count
    results["cells"]["b/x_ragged"] = cell(0.95, 0.8)
    assert sweep.pick(results, ["pingpong", "staged_rows"]) == "pingpong"
    results["cells"]["a/fc2_fwd"] = cell(1.0, 0.5, pingpong_equal=False)
    assert sweep.pick(results, ["pingpong", "staged_rows"]) == "staged_rows"
    assert sweep.pick(results, ["pingpong", "staged_rows"], margin=1.2) == ""


def test_write_tables_puts_each_named_change_into_a_copy_of_configs(tmp_path, monkeypatch):
    """runner.write_tables (gpu_prelude.sh's changed_src): every TABLE_CHANGES entry written into a copy
    of configs.py's source holds there, on import, exactly what the change names, every other entry as
    it was; an entry the source does not hold is refused in one line."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    runner = _load("runner")
    from moekit.ops.runtime import configs

    source = Path(configs.__file__)
    for name, changes in runner.TABLE_CHANGES.items():
        copy = tmp_path / f"configs_{name}.py"
        copy.write_text(source.read_text())
        runner.write_tables(copy, changes)
        spec = importlib.util.spec_from_file_location(f"configs_{name}", copy)
        changed = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, changed)  # its dataclasses look their module up there
        spec.loader.exec_module(changed)
        for table in changes:
            assert getattr(changed, table) == {**getattr(configs, table), **changes[table]}, (name, table)
    copy.write_text(source.read_text())
    with pytest.raises(SystemExit, match="write_tables: MM_WS's NO_SUCH_KEY is in .* 0 times, not once"):
        runner.write_tables(copy, {"MM_WS": {"NO_SUCH_KEY": 1}})


def test_sweep_rows_smoke_checks_every_variant_against_the_base_bits(tmp_path):
    """sweep_rows.py on a tiny shape under the interpreter: the three kinds (bf16 and FP8 gathers, the
    combine) under every table variant (the unrolled sums and the gathers' other tiles among them), each
    with the base table's bits, beside the copy and index_select; an unknown variant is refused in one
    line."""
    out = tmp_path / "rows.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    command = [sys.executable, str(BENCHMARKS / "sweep_rows.py"), "--smoke", "--rounds", "1"]
    proc = subprocess.run(command + ["--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    variants = list(payload["variants"])
    assert variants[0] == "base" and {"unroll4", "copy_rows_1k", "sum_tile_4k"} <= set(variants)
    cells = payload["cells"]
    expected = {f"smoke/{kind}/{v}" for kind in ("gather", "gather_fp8", "combine") for v in variants}
    assert set(cells) == expected | {"smoke/copy/torch", "smoke/gather/index_select"}
    assert all(cells[name]["equal"] is True and len(cells[name]["ms_rounds"]) == 1 for name in expected), cells
    bad = subprocess.run(command + ["--variants", "base,nope"], env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and "unknown variants ['nope']" in bad.stderr


def test_sweep_quantize_smoke_checks_variants_against_the_base_bytes(tmp_path):
    """sweep_quantize.py on a tiny routing under the interpreter: both routed kinds under table variants of
    the routed operands' entry (one walk among them), the weight's kind under a tiles entry, mxfp8's
    two forms under a one-walk `(32, "rows")` entry and fc2's wgrad operand from the held h under a
    `HELD_COLUMNS` entry, each with the base table's bytes, beside the copy and the gather-first and
    apart designs (whose bytes are the same); the entry it varies is the one the runtime reads (an --entry that
    does not fit the blocks is refused by the runtime, naming that key); a malformed --entry is refused
    in one line."""
    out = tmp_path / "quantize.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    command = [sys.executable, str(BENCHMARKS / "sweep_quantize.py"), "--smoke", "--rounds", "1"]
    proc = subprocess.run(
        command + ["--variants", "s3,c128,t_w8_steps2,mx_c32,hc_b32_w4", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert list(payload["variants"]) == ["base", "s3", "c128", "t_w8_steps2", "mx_c32", "hc_b32_w4"]
    cells = payload["cells"]
    expected = {f"smoke/{kind}/{v}" for kind in ("dy", "x") for v in ("base", "s3", "c128")}
    expected |= {"smoke/w/base", "smoke/w/t_w8_steps2", "smoke/mx/base", "smoke/mx/mx_c32"}
    expected |= {"smoke/held/base", "smoke/held/hc_b32_w4"}
    expected |= {"smoke/dy_gather_first/-", "smoke/x_gather_first/-", "smoke/held_apart/-"}
    assert set(cells) == expected | {"smoke/copy/torch"}
    assert all(cells[name]["equal"] is True and len(cells[name]["ms_rounds"]) == 1 for name in expected), cells
    unfit = subprocess.run(
        command + ["--variants", "base", "--entry", "128,48,4,1,0,0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert unfit.returncode != 0 and "[(128, 'segments-gathered')] = (128, 48) does not fit" in unfit.stderr
    bad = subprocess.run(command + ["--entry", "1,2"], env=env, capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1].startswith("--entry must be six")


def test_bench_transformers_smoke_times_both_models_with_and_without_checkpointing(tmp_path):
    """bench_transformers.py --smoke with both models and activation checkpointing off and on: four
    cases, each with every variant timed and its logits near the baseline's; the top-level variants
    are the first case's (what summarize.py reads)."""
    pytest.importorskip("transformers")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MOEKIT_BENCH_COMMIT": "abc1234-test"}
    command = [sys.executable, str(BENCHMARKS / "bench_transformers.py"), "--smoke", "--out", str(tmp_path)]
    command += ["--models", "qwen3-30b-a3b", "gpt-oss-20b", "--checkpointing", "both"]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((tmp_path / "transformers.json").read_text())
    assert payload["meta"]["git_commit"] == "abc1234-test" and "partial" not in payload
    cases = payload["cases"]
    assert [(c["model"], c["activation_checkpointing"]) for c in cases] == [
        ("qwen3-30b-a3b", False),
        ("qwen3-30b-a3b", True),
        ("gpt-oss-20b", False),
        ("gpt-oss-20b", True),
    ]
    assert payload["variants"] == cases[0]["variants"]
    for case in cases:
        variants = case["variants"]
        assert set(variants) == {"transformers_grouped_mm", "moekit_apply", "moekit_experts_implementation"}
        for name, r in variants.items():
            assert r["status"] == "ok" and r["tokens_per_s"] > 0 and r["x_grouped_mm"] > 0, (case["model"], name, r)
            assert r["logits_rel_diff_vs_grouped_mm"] < 1e-5, (case["model"], name)
    assert cases[2]["config"]["hidden_size"] == 64 and cases[2]["config"]["num_local_experts"] == 8


def test_bench_glu_layouts_smoke_times_every_case_against_gate_up(tmp_path):
    """bench_glu_layouts.py --smoke (the Triton kernels under the interpreter): every case of the
    layouts asked for in both orientations, timed, its ratio to gate|up stored, its output and
    gradients equal to the baseline's within fp32 rounding (fc1's de-interleaved)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1", "MOEKIT_BENCH_COMMIT": "abc1234-test"}
    command = [sys.executable, str(BENCHMARKS / "bench_glu_layouts.py"), "--smoke", "--interleaves", "2,F"]
    proc = subprocess.run(command + ["--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((tmp_path / "glu_layouts.json").read_text())
    assert "partial" not in payload and payload["meta"]["git_commit"] == "abc1234-test"
    assert payload["meta"]["backend"] == "triton" and len(payload["meta"]["roofs"]) == 2
    records = payload["records"]
    cases = [(r["orientation"], r["layout"], r["op"]) for r in records]
    assert cases == [
        (o, layout, op)
        for o in ("stored", "transposed")
        for layout in (("gate|up", "k2", "k=F") if o == "stored" else ("k2", "k=F"))
        for op in ("forward", "forward+backward")
    ]
    for r in records:
        assert r["status"] == "ok" and r["ms"] > 0 and r["x_gate_up"] > 0 and len(r["ms_rounds"]) == 1, r
        assert r["kernels"] == {"fwd": "triton", "bwd": "triton"}, r
        assert max(r["errors_vs_gate_up"].values()) < 1e-5, r
    assert "x gate|up" in proc.stdout


def _run_quantized(out: Path, *extra: str) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MOEKIT_BENCH_COMMIT": "abc1234-test"}
    command = [sys.executable, str(BENCHMARKS / "bench_quantized.py"), "--smoke", "--out", str(out), *extra]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((out / "quantized.json").read_text())
    timed = any(r["status"] == "ok" for r in payload["layer"])  # the layer's plot where it has a cell
    assert {p.name for p in out.iterdir()} == {"quantized.json", "quantized.md"} | (
        {"quantized.png"} if timed else set()
    )
    assert "partial" not in payload and payload["meta"]["smoke"]
    assert payload["meta"]["git_commit"] == "abc1234-test" and "torchao" in payload["meta"]
    return payload


def test_bench_quantized_smoke_runs_every_cpu_path(tmp_path):
    """bench_quantized.py --smoke: the roofs, every group_quantize cell (alloc and out= the same bytes;
    the CUDA graph skipped with its reason; the wgrad's segments operands without out=), every FP8
    grouped GEMM alone (torch's bf16 grouped mm skipped off CUDA) and every layer column on CPU (bf16
    within bf16's error of the float64 reference, FP8 within FP8's; torchao skipped with its reason,
    its layer code run with a bf16 stand-in)."""
    payload = _run_quantized(tmp_path)
    assert {name for name, r in payload["roofs"].items() if r["status"] == "ok"} == {
        "bf16_mm",
        "fp8_mm_rowwise",
        "fp8_mm_tensorwise",
        "hbm_copy",
    }
    quantize = payload["quantize"]
    # shapes x recipes x (activations and weight in two forms each, the two segments operands in one) x modes
    assert len(quantize) == 2 * 3 * (2 * 2 + 2) * 3
    for r in quantize:
        if r["recipe"] == "fp8_block" and r["operand"] == "weight" and r["columnwise"]:
            assert r["status"] == "unsupported", r
        elif r["operand"].startswith("segments") and r["mode"] == "out":
            assert r["status"] == "unsupported" and "out=" in r["reason"], r
        elif r["mode"] == "graph":
            assert r["status"] == "skipped" and "CUDA" in r["reason"], r
        else:
            assert r["status"] == "ok" and r["same_bytes_as_alloc"] is True and r["gb_per_s"] > 0, r
            assert r["bytes_written"] > 0 and r["fraction_of_hbm"] > 0, r
    layer = payload["layer"]
    assert [r["column"] for r in layer] == [
        "plain_bf16",
        "moekit_bf16",
        "moekit_fp8_block",
        "moekit_fp8_rowwise",
        "moekit_fp8_block_hpw",
        "moekit_fp8_rowwise_hpw",
        "torchao_fp8",
    ] * 2
    for r in layer:
        if r["column"].startswith("moekit_fp8"):
            assert r["quantized_wgrad"] is not r["column"].endswith("_hpw"), r
        if r["column"] == "torchao_fp8":
            assert r["status"] == "skipped" and "torchao" in r["reason"], r
            assert r["stand_in_rel_err_fro"] < 0.02, r
            continue
        assert r["status"] == "ok" and r["ms"] > 0 and r["tflops"] > 0 and r["x_plain_bf16"] > 0, r
        assert len(r["ms_rounds"]) == 1 and r["first_call_s"] is not None, r  # smoke: one round
        bound = 0.02 if r["column"].endswith("bf16") else 0.15
        assert 0 < r["rel_err_fro"] < bound, r
    gemm = payload["gemm"]
    assert len(gemm) == 2 * 2 * 3 * 3  # shapes x linears x (torch bf16, two FP8 recipes) x (fwd, dgrad, wgrad)
    for r in gemm:
        if r["impl"] == "torch_bf16":
            assert r["status"] == "skipped" and "CUDA" in r["reason"], r
        else:  # moekit's FP8 kernels, under the interpreter
            assert r["status"] == "ok" and r["ms"] > 0 and r["tflops"] > 0, r
    summary = (tmp_path / "quantized.md").read_text()
    assert "| smoke | moekit_fp8_rowwise |" in summary and "| hbm_copy |" in summary
    assert "| smoke | fc1 | wgrad | skipped |" in summary


def test_bench_quantized_replots_a_committed_run(tmp_path):
    """--replot draws the layer's plot of a committed run (the README's) without measuring; a file that is
    not a run, or a run without a timed layer cell, is refused in one line."""
    source = RESULTS / "h100_quantized_layer_3eaa03f.json"
    command = [sys.executable, str(BENCHMARKS / "bench_quantized.py"), "--out", str(tmp_path)]
    proc = subprocess.run([*command, "--replot", str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    png = tmp_path / "h100_quantized_layer_3eaa03f.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"meta": {}, "layer": []}))
    for bad, says in ((tmp_path / "absent.json", "must be a bench_quantized JSON file"), (empty, "no timed layer")):
        proc = subprocess.run([*command, "--replot", str(bad)], capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and says in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]


def test_bench_quantized_routed_splits_take_the_routing_counts(tmp_path):
    """--splits routed: the quantize part's groups are bench_moe_layer's balanced routing's counts
    (random draws), recorded as such, and the segments operand writes the bytes of its first call."""
    payload = _run_quantized(
        tmp_path, "--parts", "quantize", "--roofs", "hbm_copy", "--splits", "routed", "--operands", "segments",
        "--recipes", "fp8_block",
    )  # fmt: skip
    alloc = [r for r in payload["quantize"] if r["mode"] == "alloc"]
    assert len(alloc) == 2 and all(r["splits"] == "routed" and r["status"] == "ok" for r in alloc), alloc
    assert all(r["rowwise"] and r["columnwise"] and r["bytes_written"] > r["bytes_read"] // 2 for r in alloc), alloc


def test_bench_quantized_gathered_operands_read_the_routed_rows(tmp_path):
    """The gathered segments operands: the token rows and the routing's index (`index=`), every row of
    the routed M counted as read, and the same bytes written as the materialized operand's."""
    payload = _run_quantized(
        tmp_path, "--parts", "quantize", "--roofs", "hbm_copy", "--splits", "routed", "--recipes", "fp8_block",
        "--operands", "segments,segments_gathered,segments_columnwise_gathered",
    )  # fmt: skip
    alloc = {(r["shape"], r["operand"]): r for r in payload["quantize"] if r["mode"] == "alloc"}
    for (shape, operand), r in alloc.items():
        assert r["status"] == "ok", r
        if operand.endswith("_gathered"):
            plain = alloc[(shape, "segments")]
            assert r["index_rows"] == plain["x_shape"][0] and r["x_shape"][0] <= r["index_rows"], r  # T <= T K
            assert r["bytes_read"] == plain["bytes_read"], r
            if operand == "segments_gathered":
                assert r["bytes_written"] == plain["bytes_written"], r


def test_bench_quantized_kernels_profile_one_step_per_column(tmp_path):
    """--kernels: each timed layer column also gets one profiled step, its kernels (here the CPU's
    operators) summed by name, largest first, and their total; the step starts without gradients."""
    extra = ("--parts", "layer", "--shapes", "smoke", "--columns", "moekit_bf16,moekit_fp8_block", "--kernels")
    payload = _run_quantized(tmp_path, *extra, "--roofs", "hbm_copy", "--rounds", "1", "--steps", "1")
    assert [r["column"] for r in payload["layer"]] == ["moekit_bf16", "moekit_fp8_block"]
    for r in payload["layer"]:
        assert r["status"] == "ok" and r["kernels_of"] == "cpu ops" and "kernels_error" not in r, r
        times = [k["ms"] for k in r["kernels"]]
        assert times and times == sorted(times, reverse=True) and all(k["launches"] > 0 for k in r["kernels"])
        assert r["kernel_ms"] >= sum(times) * (1 - 1e-9) > 0
        # The profiled step starts without gradients, as every timed step: no accumulating adds.
        assert not [k for k in r["kernels"] if k["name"] == "aten::add_"], r["kernels"]


def test_bench_quantized_budget_skips_cells_with_the_reason(tmp_path):
    payload = _run_quantized(tmp_path, "--budget-s", "0", "--shapes", "smoke", "--recipes", "mxfp8")
    cells = payload["quantize"] + payload["gemm"] + payload["layer"]
    started = [r for r in cells if r["status"] not in ("skipped", "unsupported")]
    assert not started and payload["skipped_cells"] == len(cells) - 1
    assert all(r["reason"].startswith("not run:") for r in payload["layer"] if r["column"] != "torchao_fp8")


def test_bench_quantized_baseline_column_and_roofs(tmp_path):
    """--roofs measures only the roofs named; --baseline puts an earlier run's CUDA-graph GB/s beside
    each group_quantize cell (here the committed H200 run, whose cells the smoke shapes do not have,
    and a smoke run of its own, whose graph cells are skipped on CPU: '-' either way, never a crash)."""
    first = tmp_path / "first"
    extra = ("--parts", "quantize", "--shapes", "smoke", "--recipes", "mxfp8", "--roofs", "hbm_copy")
    _run_quantized(first, *extra)
    committed = BENCHMARKS / "results" / "h200_quantized_99508e5.json"
    for baseline in (first / "quantized.json", committed):
        payload = _run_quantized(tmp_path / baseline.stem, *extra, "--baseline", str(baseline))
        assert set(payload["roofs"]) == {"hbm_copy"}
        assert payload["baseline"]["file"] == str(baseline)
        summary = (tmp_path / baseline.stem / "quantized.md").read_text()
        assert "before: CUDA graph |" in summary and "| smoke | activations | mxfp8 | row |" in summary
    assert payload["baseline"]["graph"]["deepseek-v3-ep8/activations/mxfp8/0"].startswith("2582 (0.60)")


def _records(cells: dict, impl_values: dict) -> list[dict]:
    """Records of bench_mlp_vs_plain's form: cells {(shape, dist): moekit x_plain}."""
    out = []
    for (shape, dist), ratio in cells.items():
        for op in ("forward", "forward+backward"):
            check = {"bound": 0.02, "ok": (shape, dist) != ("deepseek-v3-32e", "balanced")}
            out.append(
                {
                    "shape": shape,
                    "dist": dist,
                    "op": op,
                    "impl": "moekit",
                    "tflops": 100.0 * ratio,
                    "x_plain": ratio,
                    "check": check,
                    **impl_values,
                }
            )
            out.append(
                {
                    "shape": shape,
                    "dist": dist,
                    "op": op,
                    "impl": "plain",
                    "tflops": 100.0,
                    "x_plain": 1.0,
                    "check": {"bound": 0.02, "ok": True},
                }
            )
    return out


def test_summary_verdicts(tmp_path):
    summarize = _load("summarize")
    shapes = summarize.MLP_SHAPES
    cells = {(s, d): 1.2 for s in shapes for d in summarize.DISTS}
    cells[("gpt-oss-20b", "skewed")] = 0.97
    memory = {"peak_extra_x_plain": 0.9, "peak_x_plain": 0.95, "held_x_plain": 0.7}
    (tmp_path / "mlp_vs_plain.json").write_text(json.dumps({"meta": {}, "records": _records(cells, memory)}))
    layer = _records({("qwen3-30b-a3b", "balanced"): 1.5}, {"held_x_plain": 0.2, "peak_extra_x_plain": 0.8})
    (tmp_path / "moe_layer.json").write_text(json.dumps({"meta": {}, "records": layer, "partial": True}))
    (tmp_path / "transformers.json").write_text(json.dumps({"variants": {"moekit_apply": {"x_grouped_mm": 1.31}}}))
    log = "== exit status 1\n===== 70 passed, 3 failed, 800 deselected in 99.1s ===\n"
    (tmp_path / "gpu_tests.log").write_text(log)
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:]
        for line in summarize.summarize(tmp_path).splitlines()
        if line.startswith("| ") and " | " in line
    }
    assert rows["MLP forward vs plain_mlp, every cell"] == ["0.970x (gpt-oss-20b skewed)", ">= 1.00x", "**missed** |"]
    assert rows["MLP Qwen3-30B-A3B cells"][2] == "met |"
    assert rows["MLP output and gradients vs the float32 reference (moekit and plain, every cell)"] == [
        "15/16 cells within 0.02; failed: moekit deepseek-v3-32e balanced",
        "all within the bound",
        "**missed** |",
    ]
    assert rows["MLP geometric mean (forward and forward+backward)"][2] == "met |"  # 1.2^7 * 0.97, 8th root
    assert rows["MLP peak memory of forward+backward above the start, x plain"][2] == "met |"
    assert rows["MLP memory held between forward and backward, x plain"][:3] == [
        "0.700x (mixtral-8x7b balanced)",
        "<= 0.60x",
        "**missed** |",
    ]
    assert rows["layer qwen3-30b-a3b forward+backward vs plain_layer"][2] == "met (1/2 cells measured) |"
    assert rows["layer mixtral-8x7b forward+backward vs plain_layer"][0] == "not measured"
    assert (
        rows["Hugging Face Qwen3-MoE, apply_moekit vs transformers' grouped_mm, forward+backward tokens/s"][2]
        == "met |"
    )
    assert rows["pytest -m gpu"] == ["70 passed, 3 failed, 800 deselected", "all pass", "**failures** |"]
    assert "cut short (partial JSON" in summarize.summarize(tmp_path)


def test_summary_merges_a_cut_gpu_test_log_with_the_rest(tmp_path):
    """A pytest -m gpu log cut at its time limit counts with a later log of what it had not finished;
    a test started in the cut log and finished nowhere leaves the verdict incomplete."""
    summarize = _load("summarize")
    a, b, c = (f"tests/test_x.py::test_{n}" for n in "abc")
    (tmp_path / "gpu_tests.log").write_text(
        f"{a} \n{b} \n[gw0] [ 50%] PASSED {a} \n[gw1] [ 60%] SKIPPED {b} \n{c} \n== exit status 124\n"
    )
    assert summarize.tests_line(tmp_path) == ("no pytest summary (exit 124)", "**incomplete**")
    (tmp_path / "gpu_tests_rest.log").write_text(f"{c} \n[gw0] [100%] PASSED {c} \n===== 1 passed in 3.0s =====\n")
    counts, verdict = summarize.tests_line(tmp_path)
    assert counts.startswith("2 passed, 1 skipped over 2 logs") and verdict == "all passed"
    (tmp_path / "gpu_tests_rest.log").write_text(f"{c} \n[gw0] [100%] FAILED {c} \n===== 1 failed in 3.0s =====\n")
    assert summarize.tests_line(tmp_path)[1] == "**failures**"
    (tmp_path / "gpu_tests_rest.log").write_text("===== 0 passed in 0.1s =====\n")
    assert summarize.tests_line(tmp_path)[1] == "**incomplete**"


def test_time_rounds_rotates_order_and_keeps_the_others_on_error():
    runner = _load("runner")
    calls = []
    records = [{"name": n, "flops": 2e9} for n in "abc"]

    def timer(fn):
        return fn()

    def fn_of(name, ms):
        def fn():
            calls.append(name)
            if name == "b" and len(calls) > 3:
                raise RuntimeError("boom")
            return ms

        return fn

    timed = [(r, fn_of(r["name"], ms)) for r, ms in zip(records, (1.0, 2.0, 4.0), strict=True)]
    runner.time_rounds(timed, 3, timer)
    # round 0: a b c; round 1 starts at b (which fails), then c a; round 2 starts at c, b is skipped
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a"]
    a, b, c = records
    assert a["ms_rounds"] == [1.0, 1.0, 1.0] and a["ms"] == 1.0 and a["tflops"] == 2.0
    assert b["status"] == "error" and "round 1" in b["reason"] and b["ms_rounds"] == [2.0]
    assert c["ms"] == 4.0


def test_ab_builds_smoke_same_build_is_bit_identical(tmp_path):
    out = tmp_path / "ab.json"
    src = str(BENCHMARKS.parent / "src")
    command = [
        sys.executable,
        str(BENCHMARKS / "ab_builds.py"),
        "--a",
        src,
        "--b",
        src,
        "--smoke",
        "--rounds",
        "1",
        "--shapes",
        "smoke-4e",
        "--dists",
        "balanced",  # the skewed cell is the same plumbing
        "--commit",
        "abc1234-test",
        "--out",
        str(out),
        "--timeout",
        "900",  # per probe process: a test machine shared with other jobs is slow
    ]
    proc = subprocess.run(
        command, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["meta"]["git_commit"] == "abc1234-test" and payload["meta"]["order"] == ["a", "b"]
    assert set(payload["cells"]) == {"smoke-4e/balanced"}
    assert all(c["bit_identical"] for c in payload["cells"].values())


def test_ab_builds_smoke_held_kernels(tmp_path):
    """--op held: the held-h gated kernels (forward, dh, d probs) in each build's processes, here one build
    against itself: bit-identical, at a case of one scale block a run and one of two."""
    out = tmp_path / "ab.json"
    src = str(BENCHMARKS.parent / "src")
    command = [sys.executable, str(BENCHMARKS / "ab_builds.py"), "--a", src, "--b", src, "--smoke", "--rounds", "1"]
    command += ["--op", "held", "--shapes", "fp8_block_k0_F768,mxfp8_k0_F760", "--out", str(out)]
    command += ["--commit", "abc1234-test", "--timeout", "900"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert set(payload["cells"]) == {"fp8_block_k0_F768", "mxfp8_k0_F760"}
    assert all(c["bit_identical"] for c in payload["cells"].values())


def test_ab_builds_smoke_quantized_layer(tmp_path):
    """--op layer --quantization: moe_experts with fp8_block and refreshed weight caches in each build's
    processes (here one build against itself: bit-identical), the recipe recorded; --dists takes the
    routings asked for (here `exact`, the quantized table's: the others' cells are the same plumbing),
    recorded too. Mistakes are refused in one line."""
    out = tmp_path / "ab.json"
    src = str(BENCHMARKS.parent / "src")
    base = [sys.executable, str(BENCHMARKS / "ab_builds.py"), "--a", src, "--b", src, "--smoke", "--rounds", "1"]
    command = base + ["--op", "layer", "--quantization", "fp8_block", "--shapes", "smoke", "--dists", "exact"]
    command += ["--out", str(out), "--commit", "abc1234-test", "--timeout", "900"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["meta"]["quantization"] == "fp8_block" and payload["meta"]["op"] == "layer"
    assert payload["meta"]["dists"] == ["exact"] and set(payload["cells"]) == {"smoke/exact"}
    assert all(c["bit_identical"] for c in payload["cells"].values())
    for extra, message in (
        (["--op", "mlp", "--quantization", "fp8_block"], "--quantization is for --op layer and --op qgemm"),
        (["--op", "held", "--dists", "skewed"], "--dists is for --op mlp, --op layer and --op qgemm"),
        (["--dists", "balanced,lopsided"], "--dists for --op mlp takes balanced, skewed, got ['lopsided']"),
        (["--dists", "exact"], "--dists for --op mlp takes balanced, skewed, got ['exact']"),
        (["--op", "cases", "--dists", "skewed"], "--dists is for --op mlp, --op layer and --op qgemm"),
    ):
        refused = subprocess.run(base + extra, env=env, capture_output=True, text=True)
        assert refused.returncode == 2 and message in refused.stderr.strip().splitlines()[-1], refused.stderr


def test_ab_builds_smoke_quantized_gemms(tmp_path):
    """--op qgemm: the FP8 forward and dgrad GEMMs alone at a layer shape's fc1 and fc2 in each build's
    processes (here one build against itself: bit-identical), a cell a linear and GEMM, for the groups
    asked for: exact splits (unnamed) and the layer's drawn balanced routing's counts (named)."""
    out = tmp_path / "ab.json"
    src = str(BENCHMARKS.parent / "src")
    command = [sys.executable, str(BENCHMARKS / "ab_builds.py"), "--a", src, "--b", src, "--smoke", "--rounds", "1"]
    command += ["--op", "qgemm", "--shapes", "smoke", "--dists", "exact,balanced", "--out", str(out)]
    command += ["--commit", "abc1234-test", "--timeout", "900"]
    proc = subprocess.run(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert payload["meta"]["op"] == "qgemm" and payload["meta"]["quantization"] == "fp8_block"
    gemms = [f"{linear}/{op}" for linear in ("fc1", "fc2") for op in ("fwd", "dgrad")]
    assert set(payload["cells"]) == {f"smoke{routing}/{g}" for routing in ("", "/balanced") for g in gemms}
    assert all(c["bit_identical"] for c in payload["cells"].values())


def test_ab_builds_compare_flags_a_difference_and_gives_b_over_a(capsys):
    ab = _load("ab_builds")

    def run(hash_, ms):
        return {"cell": {"hash": hash_, "kernels": {"glu_forward_kernel": ab.kernel_times([ms], 1)}}}

    same = ab.compare({"a": [run("h", 2.0), run("h", 4.0)], "b": [run("h", 2.5), run("h", 2.0)]})["cell"]
    assert same["bit_identical"] and same["kernels"]["glu_forward_kernel"]["b_over_a"] == 0.75
    assert same["kernels"]["glu_forward_kernel"]["a_ms"] == [2.0, 4.0]
    # A kernel only build B launches is listed (A's share 0, no ratio); the ratio is of a step's share.
    before, after = run("h", 1.0), run("h", 1.5)
    before["cell"]["kernels"]["glu_forward_kernel"] = ab.kernel_times([1.0, 1.0], 1)
    after["cell"]["kernels"]["new_kernel"] = ab.kernel_times([0.5], 1)
    cell = ab.compare({"a": [before], "b": [after]})["cell"]
    assert cell["kernels"]["glu_forward_kernel"]["b_over_a"] == 0.75  # 1.5 x 1 against 1.0 x 2
    assert cell["kernels"]["new_kernel"]["a_step_ms"] == [0.0] and cell["kernels"]["new_kernel"]["b_step_ms"] == [0.5]
    assert "b_over_a" not in cell["kernels"]["new_kernel"]
    # One kernel, two problems a step (a large call then a small one), two steps: the step's share is the
    # calls' sum and each call is compared by its position, where one median over all calls would mix them.
    a_times = ab.kernel_times([4.0, 1.0, 4.2, 1.0], 2)
    assert a_times["step_ms"] == pytest.approx(5.1) and a_times["per_call_ms"] == [4.1, 1.0]
    mixed = {"a": [{"cell": {"hash": "h", "kernels": {"mm": a_times}}}]}
    mixed["b"] = [{"cell": {"hash": "h", "kernels": {"mm": ab.kernel_times([4.1, 0.5, 4.1, 0.5], 2)}}}]
    entry = ab.compare(mixed)["cell"]["kernels"]["mm"]
    assert entry["b_over_a"] == pytest.approx(4.6 / 5.1)
    assert entry["per_call_b_over_a"] == pytest.approx([1.0, 0.5])
    differ = ab.compare({"a": [run("h", 1.0)], "b": [run("other", 1.0)]})["cell"]
    assert not differ["bit_identical"]
    with pytest.raises(SystemExit):
        ab.main(["--a", "/nonexistent", "--b", "/nonexistent"])
    assert "--a must be a source tree holding moekit/__init__.py" in capsys.readouterr().err


# ---- the provenance of the README's numbers ----------------------------------------------------

ROOT = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
# A result file as the READMEs name it: machine prefix, then any name; `*` stands for a part of it.
RESULT_NAME = re.compile(r"\bh[12]00[\w.*-]*\.(?:json|log|md|png|csv)\b")


def _performance_section() -> str:
    text = (ROOT / "README.md").read_text()
    return text[text.index("\n## Performance\n") : text.index("\n## Scaling out\n")]


def _cited_result_patterns() -> set[str]:
    """Result files named by README.md and benchmarks/README.md (less its history of removed ones)."""
    texts = ((ROOT / "README.md").read_text(), (BENCHMARKS / "README.md").read_text().split("\n## History\n")[0])
    return {m for text in texts for m in RESULT_NAME.findall(text)}


def test_every_cited_result_is_committed_and_every_committed_result_is_cited():
    """What the READMEs cite is in benchmarks/results, and benchmarks/results holds nothing else:
    one result set per benchmark, older runs in git history."""
    committed = {p.name for p in RESULTS.iterdir()}
    cited = _cited_result_patterns()
    assert cited, "no result file cited: the pattern no longer matches the READMEs"
    missing = sorted(c for c in cited if not fnmatch.filter(committed, c))
    assert not missing, f"cited but not in benchmarks/results: {missing}"
    uncited = sorted(f for f in committed if not any(fnmatch.fnmatch(f, c) for c in cited))
    assert not uncited, f"in benchmarks/results but cited by neither README: {uncited}"
    text = (BENCHMARKS / "README.md").read_text()
    current = text.split("\n## History\n")[0]  # the history names removed scripts
    named = set(re.findall(r"\b\w+\.(?:py|sh)\b", current))
    absent = sorted(s for s in named if not (BENCHMARKS / s).is_file() and not any((ROOT / "tests").rglob(s)))
    assert named and not absent, f"named in benchmarks/README.md but not in the tree: {absent}"


@pytest.mark.parametrize("name", sorted(p.name for p in RESULTS.glob("*.json")))
def test_each_result_measured_the_commit_its_name_says(name):
    payload = json.loads((RESULTS / name).read_text())
    recorded = payload["meta"]["git_commit"] if "meta" in payload else payload["versions"]["commit"]
    parts = name.removesuffix(".json").split("_")
    if "a" in payload.get("meta", {}) and "b" in payload["meta"]:
        # ab_builds.py: two builds, named `..._<A>_<B>`; `git_commit` is build A's, `b_commit` build B's.
        named_a, named_b = parts[-2], parts[-1]
        assert re.fullmatch(r"[0-9a-f]{7}", named_b), (name, "the name ends with build B's commit")
        recorded_b = payload["meta"].get("b_commit")
        assert recorded_b is None or recorded_b.startswith(named_b), (recorded_b, named_b)
    else:
        named_a = parts[-1]
    assert re.fullmatch(r"[0-9a-f]{7}", named_a) and recorded.startswith(named_a), (recorded, named_a)
    assert not payload.get("partial"), "a partial run is not a result the README quotes"


def _rows(section: str, first_header: str) -> dict[str, list[str]]:
    """The markdown table whose header starts with `first_header`: {first cell: the other cells}."""
    lines = section[section.index(first_header) :].splitlines()
    rows = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().replace("**", "") for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    assert rows, first_header
    return rows


def _dims(label: str) -> tuple[int, ...]:
    return tuple(int(v) for v in re.search(r"\(([\d, ]+)\)", label).group(1).split(","))


def _index(name: str, dims_of) -> dict:
    records = json.loads((RESULTS / name).read_text())["records"]
    return {(dims_of(r), r["dist"], r["op"], r["impl"]): r for r in records if r["status"] == "ok"}


def test_readme_mlp_table_reads_its_json():
    cited = "benchmarks/results/h200_mlp_vs_plain_44d05c4.json"
    section = _performance_section()
    assert cited in section
    cells = _index(Path(cited).name, lambda r: (r["rows"], r["experts"], r["hidden"], r["ffn"]))
    rows = _rows(section, "| shape (M, N, H, F) | forward |")
    assert len(rows) == 4
    for label, (fwd, fwd_bwd, peak, held) in rows.items():
        dims = _dims(label)
        for text, op in ((fwd, "forward"), (fwd_bwd, "forward+backward")):
            ratios = [cells[(dims, dist, op, "moekit")]["x_plain"] for dist in ("balanced", "skewed")]
            assert text == " / ".join(f"{x:.2f}" for x in ratios), (label, op)
        moekit = cells[(dims, "balanced", "forward+backward", "moekit")]
        assert peak == f"{moekit['peak_extra_x_plain']:.2f}x" and held == f"{moekit['held_x_plain']:.2f}x", label


IMPLS = ("moekit", "plain", "liger")


def _layer_dims(label: str) -> tuple[int, ...]:
    small = re.fullmatch(r"Qwen3 width, (\d+) tokens", label)
    return (int(small.group(1)), 128, 8, 2048, 768) if small else _dims(label)


def test_readme_layer_table_reads_its_json():
    cited = "benchmarks/results/h200_moe_layer_44d05c4.json"
    section = _performance_section()
    assert cited in section
    cells = _index(Path(cited).name, lambda r: (r["tokens"], r["experts"], r["top_k"], r["hidden"], r["ffn"]))
    rows = _rows(section, "| layer (T, N, K, H, F) | balanced |")
    assert len(rows) == 8
    gib = 2**30
    for label, (*by_dist, held, peak) in rows.items():
        dims = _layer_dims(label)
        for text, dist in zip(by_dist, ("balanced", "skewed"), strict=True):
            if text.startswith("not measured"):
                assert (dims, dist, "forward+backward", "moekit") not in cells, label
                continue
            tflops = " / ".join(f"{cells[(dims, dist, 'forward+backward', i)]['tflops']:.0f}" for i in IMPLS)
            ratio = cells[(dims, dist, "forward+backward", "moekit")]["x_plain"]
            assert text == f"{tflops}, {ratio:.2f}x", (label, dist)
        mine, plain = (cells[(dims, "balanced", "forward+backward", i)] for i in ("moekit", "plain"))
        assert held == f"{mine['held_bytes'] / gib:.2f} / {plain['held_bytes'] / gib:.2f}", label
        assert peak == f"{mine['peak_extra_bytes'] / gib:.2f} / {plain['peak_extra_bytes'] / gib:.2f}", label


def test_readme_other_layers_table_reads_its_json():
    cited = "benchmarks/results/h200_moe_layer_other_49ae755.json"
    section = _performance_section()
    assert cited in section
    cells = _index(Path(cited).name, lambda r: (r["experts"], r["top_k"], r["hidden"], r["ffn"]))
    rows = _rows(section, "| layer (N, K, H, F) | forward |")
    assert len(rows) == 9
    dists = ("balanced", "skewed")
    for label, (fwd, fwd_bwd, x_liger, held, peak) in rows.items():
        dims = _dims(label)
        for text, op in ((fwd, "forward"), (fwd_bwd, "forward+backward")):
            assert text == " / ".join(f"{cells[(dims, d, op, 'moekit')]['x_plain']:.2f}" for d in dists), label
        liger = [
            cells[(dims, d, "forward+backward", "moekit")]["tflops"]
            / cells[(dims, d, "forward+backward", "liger")]["tflops"]
            for d in dists
        ]
        assert x_liger == " / ".join(f"{x:.2f}" for x in liger), label
        mine = cells[(dims, "balanced", "forward+backward", "moekit")]
        assert held == f"{mine['held_x_plain']:.2f}x" and peak == f"{mine['peak_extra_x_plain']:.2f}x", label


def test_readme_quantized_table_reads_its_json():
    """The quantized experts' table (ms a step, x moekit bf16, held and peak GiB) is its JSON's layer part:
    every column from one run, each FP8 ratio against that run's bf16 column."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n### Quantized experts\n") : text.index("\n### Hugging Face transformers")]
    section = "\n".join(line.strip() for line in section.splitlines())  # the table sits in a list item
    name = "h100_quantized_layer_3eaa03f"
    assert f"{name}.md" in section, name
    cells = {}
    for r in json.loads((RESULTS / f"{name}.json").read_text())["layer"]:
        cells[(r["tokens"], r["experts"], r["top_k"], r["hidden"], r["ffn"], r["column"])] = r
    rows = _rows(section, "| layer (T, N, K, H, F) | plain bf16 | moekit bf16 | fp8_block |")
    assert len(rows) == 4
    columns = ("plain_bf16", "moekit_bf16", "moekit_fp8_block", "moekit_fp8_rowwise", "torchao_fp8")
    gib = 2**30
    for label, texts in rows.items():
        dims = _dims(label)
        for cell_text, column in zip(texts, columns, strict=True):
            r = cells[(*dims, column)]
            bf16 = cells[(*dims, "moekit_bf16")]
            assert r["status"] == "ok", (label, column)
            ms = f"{r['ms']:.2f}"
            if column.startswith("moekit_fp8"):
                ms += f" ({bf16['ms'] / r['ms']:.2f}x)"
            want = f"{ms}, {r['held_bytes'] / gib:.2f}, {r['peak_extra_bytes'] / gib:.1f}"
            assert cell_text == want, (label, column)


def test_readme_hugging_face_numbers_read_their_json():
    cited = "benchmarks/results/h200_transformers_44d05c4.json"
    section = _performance_section()
    assert cited in section
    paragraph = section[section.index("**Hugging Face**") :].split("\n\n")[0].replace("\n", " ")
    variants = json.loads((RESULTS / Path(cited).name).read_text())["variants"]
    for name in ("transformers_grouped_mm", "moekit_apply", "moekit_experts_implementation"):
        v = variants[name]
        assert f"{v['tokens_per_s']:,.0f} tokens/s" in paragraph, name
        if name != "transformers_grouped_mm":
            assert f"({v['x_grouped_mm']:.2f}x)" in paragraph, name
    peaks = [variants[n]["peak_extra_bytes"] / 2**30 for n in ("moekit_apply", "transformers_grouped_mm")]
    assert "peak above the start {:.2f} GiB against {:.2f}".format(*peaks) in paragraph


def _run_layer(out: Path, *extra: str) -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "MOEKIT_BENCH_COMMIT": "abc1234-test"}
    command = [sys.executable, str(BENCHMARKS / "bench_moe_layer.py"), "--smoke", "--backend", "torch"]
    command += ["--no-plot", "--shapes", "smoke", "--out", str(out), *extra]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "moe_layer.json").read_text())


def test_bench_moe_layer_reports_sonicmoe_skipped_with_its_reason(tmp_path):
    """On CPU (no bundle) the sonicmoe column is recorded, never dropped: "unavailable" with the
    reason; with --router every other column routes itself and its router gradient is compared."""
    payload = _run_layer(tmp_path / "router", "--router", "--dists", "balanced")
    assert payload["meta"]["router"] and "SonicMoE's rule" in payload["meta"]["routing_rule"]
    by = {(r["impl"], r["op"]): r for r in payload["records"]}
    assert {i for i, _ in by} == {"moekit", "plain", "liger", "sonicmoe"}
    for op in ("forward", "forward+backward"):
        sonic = by[("sonicmoe", op)]
        assert sonic["status"] == "unavailable" and sonic["ms"] is None
        assert sonic["reason"].startswith("sonicmoe not importable") or "CUDA" in sonic["reason"]
        mine = by[("moekit", op)]
        assert mine["status"] == "ok" and mine["router"] and mine["first_call_s"] >= 0
        assert set(mine["errors_vs_plain"]) == {"out", "x", "router_weight", "fc1_weight", "fc2_weight"}
        assert max(mine["errors_vs_plain"].values()) < 1e-4
    payload = _run_layer(tmp_path / "given", "--dists", "balanced", "--impls", "sonicmoe")
    assert {r["impl"] for r in payload["records"]} == {"plain", "sonicmoe"}  # plain: always, the reference
    assert all(
        r["status"] == "unavailable" and "--router" in r["reason"]
        for r in payload["records"]
        if r["impl"] == "sonicmoe"
    )


def test_bench_moe_layer_kernels_profile_every_timed_cell(tmp_path):
    """--kernels: every timed column gets one profiled call per op (forward, forward+backward), its
    kernels (here the CPU's operators) by name, largest first, and their total; the backward's call
    starts without gradients, as every timed one (no accumulating add: without the router each leaf
    gets one gradient)."""
    payload = _run_layer(tmp_path, "--dists", "balanced", "--impls", "moekit", "--kernels")
    ok = [r for r in payload["records"] if r["status"] == "ok"]
    assert {(r["impl"], r["op"]) for r in ok} == {
        (i, op) for i in ("moekit", "plain") for op in ("forward", "forward+backward")
    }
    for r in ok:
        assert r["kernels_of"] == "cpu ops" and "kernels_error" not in r, r
        times = [k["ms"] for k in r["kernels"]]
        assert times and times == sorted(times, reverse=True) and all(k["launches"] > 0 for k in r["kernels"])
        assert r["kernel_ms"] >= sum(times) * (1 - 1e-9) > 0
        assert not [k for k in r["kernels"] if k["name"] == "aten::add_"], r["kernels"]
    # The backward's profile holds the autograd nodes' backward calls and the forward's none (named, not
    # timed: one profiled call each, whose times a busy CPU can invert).
    by = {(r["impl"], r["op"]): r for r in ok}
    backward = {
        op: [k["name"] for k in by[("moekit", op)]["kernels"] if k["name"].endswith("Backward")]
        for op in ("forward", "forward+backward")
    }
    assert backward["forward+backward"] and not backward["forward"], backward


def test_sonicmoe_column_passes_its_layouts(monkeypatch):
    """The sonicmoe column's call, against a stand-in `sonicmoe` computing what SonicMoE's own
    reference (its benchmarks/moe-cute.py) computes from the same arguments: fc1 (2F, H, E) with gate
    rows 0::2 and up rows 1::2, fc2 (H, F, E), softmax over the top-k logits. The column's interleave-1
    conversion then gives plain's output; the standard layout would not."""
    import types

    import torch
    import torch.nn.functional as F

    import moekit

    def moe_TC_softmax_topk_layer(x, router_w, w1, b1, w2, b2, K, stream_id, activation, inference=False):
        assert b1 is None and b2 is None and activation == "swiglu" and not inference
        logits = F.linear(x, router_w)
        top, ids = logits.topk(K, dim=-1)
        scores = top.softmax(-1, dtype=torch.float32)
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(K):
                e = int(ids[t, k])
                h = w1[:, :, e] @ x[t]
                out[t] += scores[t, k] * (w2[:, :, e] @ (F.silu(h[0::2]) * h[1::2]))
        return out, logits, None

    enums = types.ModuleType("sonicmoe.enums")
    enums.ActivationType = types.SimpleNamespace(SWIGLU="swiglu")
    functional = types.ModuleType("sonicmoe.functional")
    functional.moe_TC_softmax_topk_layer = moe_TC_softmax_topk_layer
    for name, module in (("sonicmoe", types.ModuleType("sonicmoe")), ("sonicmoe.enums", enums)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "sonicmoe.functional", functional)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its sibling runner.py
    bench = _load("bench_moe_layer")
    run, reason = bench.sonicmoe_layer()
    assert reason is None
    shape = bench.LayerShape("t", 12, 5, 2, 16, 8)
    inputs = bench.make_inputs(shape, torch.device("cpu"), torch.float32)
    router_w, _ = bench.make_router(shape, "balanced", torch.device("cpu"), torch.float32)
    x, w1, w2 = inputs["x"], inputs["w1"], inputs["w2"]
    want = bench.with_router(bench.plain_layer)(x, w1, w2, router_w, shape.top_k)
    got = run(x, moekit.interleave_glu(w1, 1, dim=1), w2, router_w, shape.top_k)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (run(x, w1, w2, router_w, shape.top_k) - want).abs().max() > 1e-2  # a layout mistake shows


def test_plot_sonic_draws_each_shape_from_its_latest_run_and_refuses_other_files(tmp_path):
    """plot_sonic.py: the README's SonicMoE plot from committed runs (no GPU); a file that is not a
    bench_moe_layer run, or runs without a shape timed in both columns, is refused in one line."""
    runs = [
        RESULTS / "h100_moe_layer_sonic_fine_staged_rows_232e5fc.json",
        RESULTS / "h200_moe_layer_sonic_d1a2222.json",
    ]
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import plot_sonic
    finally:
        sys.path.remove(str(BENCHMARKS))
    found = plot_sonic.pairs(runs)
    assert set(found) == {"sonicmoe-e256-k16", "sonicmoe-7b", "deepseek-v3-ep8", "mixtral-8x7b", "sonicmoe"}
    assert found["sonicmoe-e256-k16"]["run"] == ("H100", "232e5fc")
    later = plot_sonic.pairs([*runs, RESULTS / "h100_moe_layer_sonic_fine_regs208_512_97d7dcb.json"])
    assert later["sonicmoe-e256-k16"]["run"] == ("H100", "97d7dcb") and later["sonicmoe-7b"]["run"][1] == "232e5fc"
    png = tmp_path / "sonic.png"
    command = [sys.executable, str(BENCHMARKS / "plot_sonic.py")]
    proc = subprocess.run([*command, *map(str, runs), "--out", str(png)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    quantized = RESULTS / "h100_quantized_layer_3eaa03f.json"
    plain_only = tmp_path / "plain.json"
    plain_only.write_text(json.dumps({"meta": {}, "records": []}))
    for bad, says in (
        ([quantized], "is not a bench_moe_layer JSON"),
        ([plain_only], "no run given timed both"),
        ([tmp_path / "absent.json"], "is not a file"),
    ):
        proc = subprocess.run(
            [*command, *map(str, bad), "--out", str(png)], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode != 0 and says in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
