"""moekit's performance bars, measured / bar / met or missed, from one GPU session's results, as markdown.

    python benchmarks/summarize.py OUT [--write OUT/summary.md]

OUT holds what benchmarks/gpu_session.sh leaves: mlp_vs_plain.json, moe_layer.json,
host_overhead.json, transformers.json and gpu_tests.log (any may be missing: a part that did not
run or was cut short reads "not measured" or names the cells it lacks). Every number printed is
read from those files; nothing here is measured or assumed. After the bars: the per-cell tables
the README's Performance section is written from, and the small-batch host/GPU diagnosis.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

DISTS = ("balanced", "skewed")
MLP_SHAPES = ("mixtral-8x7b", "deepseek-v3-32e", "qwen3-30b-a3b", "gpt-oss-20b")
# The layer bars: shape -> forward+backward ratio to plain_layer it must reach.
LAYER_BARS = {"qwen3-30b-a3b": 1.4, "deepseek-v3-ep8": 1.2, "gpt-oss-20b": 1.2, "mixtral-8x7b": 1.1}
SMALL_BATCHES = ("qwen3-256tok", "qwen3-1024tok", "qwen3-4096tok")
SONICMOE = ("sonicmoe", {"forward": 500.0, "forward+backward": 510.0})  # its published H100 TFLOP/s
TRANSFORMERS_BAR = 1.3
GIB = 2**30


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt(v, spec=".2f", suffix="") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


class Bars:
    """Rows of the bar table: what was measured, the bar, and whether it is met."""

    def __init__(self):
        self.rows: list[tuple[str, str, str, str]] = []

    def add(
        self,
        what: str,
        values: list[tuple[str, float]],
        expected: int,
        bar: float,
        higher: bool,
        spec: str = ".3f",
        unit: str = "x",
        word: str | None = None,
    ) -> None:
        """values: (cell label, value) of every measured cell; the worst decides, compared with the
        bar as measured (not rounded: 1.0001x misses "<= 1.00x"; the 3 decimals shown say by how
        much). expected: how many cells the bar covers (fewer measured: the verdict says so)."""
        bar_txt = f"{'>=' if higher else '<='} " + (f"{bar:.2f}x" if unit == "x" else f"{bar:g}{unit}")
        if not values:
            self.rows.append((what, "not measured", bar_txt, "not measured"))
            return
        label, worst = (min if higher else max)(values, key=lambda lv: lv[1])
        ok = worst >= bar if higher else worst <= bar
        verdict = word or ("met" if ok else "**missed**")
        if len(values) < expected:
            verdict += f" ({len(values)}/{expected} cells measured)"
        shown = f"{worst:{spec}}{unit}" + (f" ({label})" if len(values) > 1 else "")
        self.rows.append((what, shown, bar_txt, verdict))

    def add_text(self, what: str, measured: str, bar: str, verdict: str) -> None:
        self.rows.append((what, measured, bar, verdict))

    def markdown(self) -> list[str]:
        lines = ["| bar | measured (worst cell) | bar | verdict |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in self.rows]
        return lines


def _ok(records: list[dict], **match) -> list[dict]:
    return [r for r in records if r.get("tflops") and all(r.get(k) == v for k, v in match.items())]


def _roofs(payload: dict) -> str:
    roofs = (payload.get("meta") or {}).get("roofs") or []
    values = ", ".join(f"{r['tflops']:.0f}" for r in roofs)
    return f"dense bf16 8192^3 roof {values} TFLOP/s in this run (start, end)" if roofs else ""


def mlp_bars(bars: Bars, payload: dict | None) -> list[str]:
    records = (payload or {}).get("records", [])
    mine = _ok(records, impl="moekit")
    cells = len(MLP_SHAPES) * len(DISTS)
    for op in ("forward", "forward+backward"):
        bars.add(
            f"MLP {op} vs plain_mlp, every cell",
            [(f"{r['shape']} {r['dist']}", r["x_plain"]) for r in mine if r["op"] == op],
            cells,
            1.0,
            True,
        )
    ratios = [r["x_plain"] for r in mine]
    geo = [("geomean", math.exp(sum(map(math.log, ratios)) / len(ratios)))] if ratios else []
    bars.add("MLP geometric mean (forward and forward+backward)", geo, 1, 1.08, True)
    bars.add(
        "MLP Qwen3-30B-A3B cells",
        [(f"{r['dist']} {r['op']}", r["x_plain"]) for r in mine if r["shape"] == "qwen3-30b-a3b"],
        2 * len(DISTS),
        1.10,
        True,
    )
    per_cell = {(r["shape"], r["dist"]): r for r in mine if r["op"] == "forward+backward"}
    bars.add(
        "MLP peak memory of forward+backward above the start, x plain",
        [
            (f"{s} {d}", r["peak_extra_x_plain"])
            for (s, d), r in per_cell.items()
            if r.get("peak_extra_x_plain") is not None
        ],
        cells,
        1.0,
        False,
    )
    bars.add(
        "MLP memory held between forward and backward, x plain",
        [(f"{s} {d}", r["held_x_plain"]) for (s, d), r in per_cell.items() if r.get("held_x_plain") is not None],
        cells,
        0.6,
        False,
    )
    checked = [r for r in records if r.get("check") and r["op"] == "forward"]
    bad = [f"{r['impl']} {r['shape']} {r['dist']}" for r in checked if not r["check"]["ok"]]
    bound = checked[0]["check"]["bound"] if checked else None
    bars.add_text(
        "MLP output and gradients vs the float32 reference (moekit and plain, every cell)",
        f"{len(checked) - len(bad)}/{len(checked)} cells within {bound}"
        + (f"; failed: {', '.join(bad[:4])}" if bad else ""),
        "all within the bound",
        "not measured" if not checked else "**missed**" if bad else "met",
    )
    if not records:
        return []
    by = {(r["shape"], r["dist"], r["op"], r["impl"]): r for r in records}
    lines = [
        "| shape | forward x plain | forward+backward x plain | TFLOP/s fwd+bwd moekit / plain "
        "| peak (above start) x plain | held x plain |",
        "|---|---|---|---|---|---|",
    ]
    for shape in dict.fromkeys(r["shape"] for r in records):

        def pair(op, key, shape=shape):
            return " / ".join(_fmt((by.get((shape, d, op, "moekit")) or {}).get(key)) for d in DISTS)

        tf = " ; ".join(
            f"{_fmt((by.get((shape, d, 'forward+backward', 'moekit')) or {}).get('tflops'), '.0f')} / "
            f"{_fmt((by.get((shape, d, 'forward+backward', 'plain')) or {}).get('tflops'), '.0f')}"
            for d in DISTS
        )
        lines.append(
            f"| {shape} | {pair('forward', 'x_plain')} | {pair('forward+backward', 'x_plain')} | {tf} | "
            f"{pair('forward+backward', 'peak_extra_x_plain')} ({pair('forward+backward', 'peak_x_plain')} "
            f"absolute) | {pair('forward+backward', 'held_x_plain')} |"
        )
    return ["### grouped_mlp vs plain_mlp (balanced / skewed)", "", *lines, "", _roofs(payload), ""]


def layer_bars(bars: Bars, payload: dict | None) -> list[str]:
    records = (payload or {}).get("records", [])
    fb = [r for r in _ok(records, impl="moekit", op="forward+backward")]
    for shape, bar in LAYER_BARS.items():
        bars.add(
            f"layer {shape} forward+backward vs plain_layer",
            [(r["dist"], r["x_plain"]) for r in fb if r["shape"] == shape],
            len(DISTS),
            bar,
            True,
        )
    by = {(r["shape"], r["dist"], r["op"], r["impl"]): r for r in records}
    for op in ("forward+backward", "forward"):
        vs_liger = []
        for r in _ok(records, impl="moekit", op=op):
            liger = by.get((r["shape"], r["dist"], r["op"], "liger"))
            if liger and liger.get("tflops"):
                vs_liger.append((f"{r['shape']} {r['dist']}", r["tflops"] / liger["tflops"]))
        bars.add(
            f"layer {op} ahead of Liger's fused MoE (moekit / Liger TFLOP/s), every cell",
            vs_liger,
            len({(r["shape"], r["dist"]) for r in records}) or 1,
            1.0,
            True,
        )
    named = [r for r in fb if r["shape"] in LAYER_BARS]
    bars.add(
        "layer activation memory held, x plain_layer (the four layers)",
        [(f"{r['shape']} {r['dist']}", r["held_x_plain"]) for r in named if r.get("held_x_plain") is not None],
        len(LAYER_BARS) * len(DISTS),
        0.4,
        False,
    )
    bars.add(
        "layer peak memory above the start, x plain_layer (the four layers)",
        [
            (f"{r['shape']} {r['dist']}", r["peak_extra_x_plain"])
            for r in named
            if r.get("peak_extra_x_plain") is not None
        ],
        len(LAYER_BARS) * len(DISTS),
        1.0,
        False,
    )
    for shape in SMALL_BATCHES:
        bars.add(
            f"small batch {shape} forward+backward vs plain_layer",
            [(r["dist"], r["x_plain"]) for r in fb if r["shape"] == shape],
            len(DISTS),
            1.0,
            True,
        )
    shape, goals = SONICMOE
    for op, goal in goals.items():
        got = [(r["dist"], r["tflops"]) for r in _ok(records, impl="moekit", op=op, shape=shape)]
        word = "goal reached" if got and min(v for _, v in got) >= goal else "goal not reached"
        bars.add(
            f"SonicMoE's shape, moekit {op} TFLOP/s (goal: SonicMoE's published H100 figure)",
            got,
            len(DISTS),
            goal,
            True,
            spec=".0f",
            unit="",
            word=word,
        )
    if not records:
        return []
    lines = [
        "| layer | dist | TFLOP/s fwd+bwd moekit / plain / Liger | moekit x plain fwd ; fwd+bwd "
        "| held GiB moekit / plain | peak+ GiB moekit / plain |",
        "|---|---|---|---|---|---|",
    ]
    for shape, dist in dict.fromkeys((r["shape"], r["dist"]) for r in records):
        rs = {i: by.get((shape, dist, "forward+backward", i)) or {} for i in ("moekit", "plain", "liger")}
        fwd = by.get((shape, dist, "forward", "moekit")) or {}

        def gib(impl, key, rs=rs):
            v = rs[impl].get(key)
            return _fmt(v / GIB if v is not None else None)

        lines.append(
            f"| {shape} | {dist} | {' / '.join(_fmt(rs[i].get('tflops'), '.0f') for i in rs)} | "
            f"{_fmt(fwd.get('x_plain'))} ; {_fmt(rs['moekit'].get('x_plain'))} | "
            f"{gib('moekit', 'held_bytes')} / {gib('plain', 'held_bytes')} | "
            f"{gib('moekit', 'peak_extra_bytes')} / {gib('plain', 'peak_extra_bytes')} |"
        )
    return ["### MoE layer vs plain_layer and Liger", "", *lines, "", _roofs(payload), ""]


def transformers_bar(bars: Bars, payload: dict | None) -> list[str]:
    variants = (payload or {}).get("variants", {})
    x = (variants.get("moekit_apply") or {}).get("x_grouped_mm")
    bars.add(
        "Hugging Face Qwen3-MoE, apply_moekit vs transformers' grouped_mm, forward+backward tokens/s",
        [("", x)] if x else [],
        1,
        TRANSFORMERS_BAR,
        True,
    )
    if not variants:
        return []
    lines = ["| variant | tokens/s | x grouped_mm | peak+ GiB | logits rel diff |", "|---|---|---|---|---|"]
    for name, r in variants.items():
        peak = r.get("peak_extra_bytes")
        lines.append(
            f"| {name} | {_fmt(r.get('tokens_per_s'), ',.0f')} | {_fmt(r.get('x_grouped_mm'), '.3f')} | "
            f"{_fmt(peak / GIB if peak is not None else None)} | "
            f"{_fmt(r.get('logits_rel_diff_vs_grouped_mm'), '.1e')} |"
            + (f" {r['status']}: {r['reason'][:100]}" if r.get("reason") else "")
        )
    meta = payload.get("meta", {})
    return [f"### transformers Qwen3-MoE ({meta.get('tokens_per_step')} tokens per step)", "", *lines, ""]


def host_table(payload: dict | None) -> list[str]:
    records = (payload or {}).get("records", [])
    if not records:
        return []
    lines = [
        "| shape | op | impl | host ms | GPU wall ms | kernel ms | launches | host us / launch "
        "| profiled host ms in / between events | syncs | bound |",
        "|---" * 11 + "|",
    ]
    for r in records:
        lines.append(
            f"| {r['shape']} | {r['op']} | {r['impl']} | {_fmt(r.get('host_ms'), '.3f')} | "
            f"{_fmt(r.get('gpu_wall_ms'), '.3f')} | {_fmt(r.get('kernel_ms'), '.3f')} | "
            f"{_fmt(r.get('launches'), '.1f')} | {_fmt(r.get('host_us_per_launch'), '.1f')} | "
            f"{_fmt(r.get('in_events_ms'), '.3f')} / {_fmt(r.get('between_events_ms'), '.3f')} | "
            f"{r.get('host_sync')} | {r.get('bound', '-')} |"
            + (f" {r['status']}: {r['reason'][:100]}" if r.get("reason") else "")
        )
    return [
        "### small batches: host enqueue vs GPU time per step (host > kernel ms: launch/host bound)",
        "",
        *lines,
        "",
    ]


def tests_line(out: Path) -> tuple[str, str]:
    """(pytest's final counts, verdict) from gpu_tests.log, and from gpu_tests_*.log where a later call
    ran what a log cut at its time limit had not finished (read from pytest -v's per-test lines)."""
    logs = [log for log in [out / "gpu_tests.log", *sorted(out.glob("gpu_tests_*.log"))] if log.is_file()]
    if not logs:
        return "no log", "not run"
    texts = [log.read_text() for log in logs]
    counts = [re.findall(r"=+ (.*(?:passed|failed|error|skipped|deselected).*) in [\d.]+s", t) for t in texts]
    if len(logs) == 1:
        status = re.findall(r"== exit status (\d+)", texts[0])
        if not counts[0]:
            return "no pytest summary" + (f" (exit {status[-1]})" if status else ""), "**incomplete**"
        failed = re.search(r"\d+ (failed|error)", counts[0][-1])
        return counts[0][-1], "**failures**" if failed else "all passed"
    result: dict[str, str] = {}
    started: set[str] = set()
    for text in texts:
        started.update(re.findall(r"^(tests/\S+::\S+)", text, flags=re.M))
        result.update(
            (node, outcome.lower())
            for outcome, node in re.findall(r"\b(PASSED|FAILED|ERROR|SKIPPED) (tests/\S+::\S+)", text)
        )
    tally = {k: list(result.values()).count(k) for k in ("passed", "failed", "error", "skipped")}
    unfinished = started - set(result)
    text = (
        ", ".join(f"{n} {k}" for k, n in tally.items() if n)
        + f" over {len(logs)} logs ("
        + "; ".join(
            f"{log.name}: {c[-1] if c else 'cut before its summary'}" for log, c in zip(logs, counts, strict=True)
        )
        + ")"
    )
    if unfinished:
        text += f"; {len(unfinished)} started and never finished"
    if tally["failed"] or tally["error"]:
        return text, "**failures**"
    return text, "**incomplete**" if unfinished else "all passed"


def header(payloads: list[dict | None]) -> list[str]:
    meta = next((p["meta"] for p in payloads if p and p.get("meta")), None)
    if meta is None:
        return ["no results found"]
    gpu = (meta.get("gpu") or {}).get("name", meta.get("device"))
    return [
        f"GPU {gpu}; torch {meta.get('torch')} (CUDA {meta.get('cuda')}), triton {meta.get('triton')}, "
        f"transformers {meta.get('transformers')}, liger-kernel {meta.get('liger_kernel')}; "
        f"commit `{meta.get('git_commit')}` ({meta.get('git_commit_from')}); {meta.get('date')}"
    ]


def summarize(out: Path) -> str:
    mlp, layer = _load(out / "mlp_vs_plain.json"), _load(out / "moe_layer.json")
    host, hf = _load(out / "host_overhead.json"), _load(out / "transformers.json")
    bars = Bars()
    tables = mlp_bars(bars, mlp) + layer_bars(bars, layer) + transformers_bar(bars, hf) + host_table(host)
    counts, verdict = tests_line(out)
    bars.add_text("pytest -m gpu", counts, "all pass", verdict)
    partial = [
        name
        for name, p in (("mlp_vs_plain", mlp), ("moe_layer", layer), ("host_overhead", host))
        if p and p.get("partial")
    ]
    notes = (
        [f"cut short (partial JSON, the cells measured before the part's time limit): {', '.join(partial)}"]
        if partial
        else []
    )
    lines = [
        "## moekit GPU session: the performance bars",
        "",
        *header([mlp, layer, hf, host]),
        "",
        *notes,
        "",
        *bars.markdown(),
        "",
        *tables,
    ]
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the session's output directory")
    parser.add_argument("--write", type=Path, default=None, help="also write the markdown here")
    args = parser.parse_args(argv)
    text = summarize(args.out)
    print(text)
    if args.write:
        args.write.write_text(text)


if __name__ == "__main__":
    main()
