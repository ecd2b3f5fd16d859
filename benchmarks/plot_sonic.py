"""moekit beside SonicMoE at a glance: one plot from `bench_moe_layer.py --router --impls moekit,plain,sonicmoe`
runs (their JSONs), measuring nothing.

    python benchmarks/plot_sonic.py RUN.json [RUN.json ...] --out sonic.png

Each shape is taken from the last run given that timed both moekit and SonicMoE on it (balanced routing),
so a list ordered oldest first shows each shape's latest run, as the README's SonicMoE table does. Top:
moekit's speed as a fraction of SonicMoE's (SonicMoE's ms over moekit's), forward and forward+backward,
with the bars moekit holds itself to (1.0 forward, 1.05 forward+backward). Bottom: moekit's memory over
SonicMoE's, held for the backward and peak above the start (at most 1.0 is the bar). Every shape is
labelled with the GPU and the commit of the run it comes from: runs on different GPUs or commits are not
side by side, only each pair within its run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import runner

OPS = ("forward", "forward+backward")
SPEED_BARS = {"forward": 1.0, "forward+backward": 1.05}


def pairs(paths: list[Path]) -> dict[str, dict]:
    """{shape: {op: (moekit record, SonicMoE record), "run": (gpu, commit), "dims": (T, E, K, H, F)}}: each
    shape from the last run in `paths` holding both columns, timed, on balanced routing."""
    found: dict[str, dict] = {}
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"plot_sonic.py: {path} is not a file (a bench_moe_layer JSON is expected)")
        payload = json.loads(path.read_text())
        if "records" not in payload or "meta" not in payload:
            raise SystemExit(f"plot_sonic.py: {path} is not a bench_moe_layer JSON (no records / meta)")
        meta = payload["meta"]
        gpu = (meta.get("gpu") or {}).get("name", "?").replace("NVIDIA ", "").split(" 80GB")[0]
        by = {
            (r["shape"], r["op"], r["impl"]): r
            for r in payload["records"]
            if r.get("dist") == "balanced" and r.get("status") == "ok" and r.get("ms")
        }
        for shape in dict.fromkeys(s for s, _, _ in by):
            cells = {op: (by.get((shape, op, "moekit")), by.get((shape, op, "sonicmoe"))) for op in OPS}
            if all(m and s for m, s in cells.values()):
                r = cells["forward"][0]
                dims = (r["tokens"], r["experts"], r["top_k"], r["hidden"], r["ffn"])
                found[shape] = {**cells, "run": (gpu, str(meta.get("git_commit"))[:7]), "dims": dims}
    if not found:
        raise SystemExit("plot_sonic.py: no run given timed both moekit and SonicMoE on any shape")
    return found


def plot(found: dict[str, dict], path: Path) -> None:
    plt = runner.pyplot()

    shapes = list(found)
    fig, (ax_speed, ax_mem) = plt.subplots(2, 1, figsize=(max(8.0, 1.5 * len(shapes) + 2), 7.5))
    width = 0.38
    for i, op in enumerate(OPS):
        xs = [s + (i - 0.5) * width for s in range(len(shapes))]
        ratios = [found[s][op][1]["ms"] / found[s][op][0]["ms"] for s in shapes]
        bars = ax_speed.bar(xs, ratios, width, label=f"{op} (bar {SPEED_BARS[op]:.2f})", color=f"C{i}")
        ax_speed.bar_label(bars, fmt="%.2f", fontsize=6)
        ax_speed.axhline(SPEED_BARS[op], color=f"C{i}", linestyle="--", linewidth=0.8)
    for i, (key, what) in enumerate((("held_bytes", "held for the backward"), ("peak_extra_bytes", "peak"))):
        xs = [s + (i - 0.5) * width for s in range(len(shapes))]
        ratios = [
            found[s]["forward+backward"][0][key] / found[s]["forward+backward"][1][key]
            if found[s]["forward+backward"][0].get(key) and found[s]["forward+backward"][1].get(key)
            else 0.0
            for s in shapes
        ]
        bars = ax_mem.bar(xs, ratios, width, label=what, color=f"C{i + 2}")
        ax_mem.bar_label(bars, fmt="%.2f", fontsize=6)
    ax_mem.axhline(1.0, color="k", linestyle="--", linewidth=0.8)
    labels = [
        f"{s}\n{found[s]['dims']}\n{found[s]['run'][0]} {found[s]['run'][1]}".replace("(", "").replace(")", "")
        for s in shapes
    ]
    for ax in (ax_speed, ax_mem):
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(labels, fontsize=6)
        ax.legend(fontsize=7, loc="lower right")
    ax_speed.set_ylabel("SonicMoE ms / moekit ms")
    ax_speed.set_title("moekit's speed as a fraction of SonicMoE's (router included; higher is better)", fontsize=9)
    ax_mem.set_ylabel("moekit / SonicMoE")
    ax_mem.set_title("moekit's memory over SonicMoE's (lower is better)", fontsize=9)
    fig.suptitle(
        "moekit beside SonicMoE; each shape from its run: GPU and commit under it", fontsize=8, x=0.01, ha="left"
    )
    fig.tight_layout()
    runner.save_figure(fig, path)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="bench_moe_layer JSONs, oldest first")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    if args.out.suffix != ".png":
        raise SystemExit(f"plot_sonic.py: --out must name a .png file, got {args.out}")
    plot(pairs(args.runs), args.out)
    return args.out


if __name__ == "__main__":
    main()
