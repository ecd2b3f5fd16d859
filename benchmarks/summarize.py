"""Markdown tables from a benchmark JSON (what the README's performance section is pasted from).

    python benchmarks/summarize.py benchmarks/results/<run>.json [--backend triton]

Per shape and split: TFLOP/s of the torch backend and of the candidate backend, their ratio, and the
candidate's share of the dense bf16 roof measured in the same run; then the geometric mean and the
minimum of the ratios over all cells.
"""

from __future__ import annotations

import argparse
import json
import math


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("json_path")
    parser.add_argument("--backend", default="triton", help="the backend compared against torch")
    args = parser.parse_args()
    payload = json.loads(open(args.json_path).read())
    meta, records = payload["meta"], payload["records"]
    roofs = {r["roof_tflops"] for r in records if r.get("roof_tflops")}
    gpu = (meta.get("gpu") or {}).get("name", "?")
    print(f"GPU {gpu}, torch {meta.get('torch')}, triton {meta.get('triton')}, commit {meta.get('git_commit')}, "
          f"dense bf16 roof {', '.join(f'{v:.0f}' for v in sorted(roofs))} TFLOP/s\n")
    by_key = {(r["shape"], r["dist"], r["op"], r["backend"]): r for r in records}
    ops = list(dict.fromkeys(r["op"] for r in records))
    cells = list(dict.fromkeys((r["shape"], r["dist"]) for r in records))
    print("| shape | split | " + " | ".join(ops) + " |")
    print("|---|---|" + "---|" * len(ops))
    ratios: dict[str, list[float]] = {}
    for shape, dist in cells:
        row = []
        for op in ops:
            base = by_key.get((shape, dist, op, "torch"))
            cand = by_key.get((shape, dist, op, args.backend))
            if not base or not cand or not base.get("tflops") or not cand.get("tflops"):
                row.append("n/a")
                continue
            ratio = cand["tflops"] / base["tflops"]
            ratios.setdefault(op, []).append(ratio)
            flag = "" if cand["status"] == "ok" else f" ({cand['status']})"
            row.append(f"{base['tflops']:.0f} / {cand['tflops']:.0f} = {ratio:.2f}x, "
                       f"{cand['ratio_to_roof']:.2f} roof{flag}")
        print(f"| {shape} | {dist} | " + " | ".join(row) + " |")
    print("\ncells: torch TFLOP/s / " + args.backend + " TFLOP/s = ratio, " + args.backend + "'s share of the roof")
    everything = [v for vs in ratios.values() for v in vs]
    if everything:
        print(f"\n{args.backend} vs torch over {len(everything)} cells: geomean "
              f"{math.exp(sum(map(math.log, everything)) / len(everything)):.3f}x, min {min(everything):.3f}x")
        for op, vs in ratios.items():
            print(f"  {op}: geomean {math.exp(sum(map(math.log, vs)) / len(vs)):.3f}x, min {min(vs):.3f}x")


if __name__ == "__main__":
    main()
