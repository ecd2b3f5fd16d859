"""Run every moekit benchmark (grouped_linear products, grouped_mlp) and write one combined
bench_all.json + bench_all.png (+ the table on stdout).

Backends named in --isolate (default: triton, the newest code) run in a worker process of their own,
so that a kernel that crashes the process or poisons the CUDA context (an illegal address is sticky)
costs only its own cells; each worker measures the dense roof itself, and each record keeps the roof
of the process that measured it. A worker that dies or overruns --worker-timeout leaves what it
measured so far (saved after every shape) and a note in meta["workers"].

    python benchmarks/run_all.py --backends loop,torch,triton --out /tmp/bench
    python benchmarks/run_all.py --smoke --backends loop,torch,triton     # CPU: proves it runs
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_grouped_linear
import bench_grouped_mlp
import runner
import torch

NAME = "bench_all"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    runner.add_common_args(parser)
    parser.add_argument("--isolate", default="triton",
                        help="comma list of backends that run in a worker process of their own ('' for none)")
    parser.add_argument("--worker-timeout", type=float, default=None,
                        help="seconds after which a worker is killed (its partial results are kept)")
    # Set by the parent for its workers: the parent prints the merged table and draws the plot.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def run_in_process(cfg: runner.BenchConfig) -> tuple[list[dict], dict, dict]:
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 references must be float32
    roof = runner.measure_roof(cfg)
    env = runner.environment(cfg, roof)
    env["splits"] = runner.splits_table(cfg)
    records: list[dict] = []
    start = time.perf_counter()
    print(f"== grouped_linear on {cfg.device} ({', '.join(cfg.backends)})", flush=True)
    bench_grouped_linear.run(cfg, roof, records)
    print(f"== grouped_mlp ({time.perf_counter() - start:.0f} s so far)", flush=True)
    bench_grouped_mlp.run(cfg, roof, records)
    env["wall_s"] = round(time.perf_counter() - start, 1)
    return records, env, roof


def _worker_groups(backends: list[str], isolate: list[str]) -> list[list[str]]:
    shared = [b for b in backends if b not in isolate]
    return ([shared] if shared else []) + [[b] for b in backends if b in isolate]


def _worker_argv(args: argparse.Namespace, backends: list[str], out: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--backends", ",".join(backends), "--isolate", "",
            "--out", str(out), "--no-plot", "--worker", "--dists", args.dists]
    for flag, value in (("--shapes", args.shapes), ("--device", args.device), ("--dtype", args.dtype)):
        if value:
            argv += [flag, value]
    return argv + [flag for flag, on in (("--quick", args.quick), ("--smoke", args.smoke)) if on]


def run_workers(args: argparse.Namespace, groups: list[list[str]]) -> tuple[list[dict], dict, list[dict]]:
    records, envs, roofs, workers = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="moekit-bench-") as tmp:
        for i, backends in enumerate(groups):
            out = Path(tmp) / f"worker{i}"
            print(f"== worker {i}: backends {','.join(backends)}", flush=True)
            start = time.perf_counter()
            try:
                rc = subprocess.run(_worker_argv(args, backends, out), timeout=args.worker_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            note = {"backends": backends, "returncode": rc, "wall_s": round(time.perf_counter() - start, 1)}
            full, partial = out / f"{NAME}.json", runner.partial_path_for(out, NAME)
            if full.exists():
                payload = json.loads(full.read_text())
                envs.append(payload["meta"])
                roofs.append(payload["meta"]["roof"])
                note["roof"] = payload["meta"]["roof"]
            elif partial.exists():
                payload = json.loads(partial.read_text())
                note["partial"] = True
                print(f"!! worker {i} ({','.join(backends)}) ended with {rc}; keeping its "
                      f"{len(payload['records'])} saved records", flush=True)
            else:
                payload = {"records": []}
                print(f"!! worker {i} ({','.join(backends)}) ended with {rc} and saved nothing", flush=True)
            records += payload["records"]
            workers.append(note)
    if not envs:
        raise SystemExit("no worker finished; nothing to merge")
    # Workers ran backend by backend; the table and JSON read better cell by cell.
    order = {b: i for i, b in enumerate(b for g in groups for b in g)}
    first_seen: dict[tuple, int] = {}
    for r in records:
        first_seen.setdefault((r["bench"], r["shape"], r["dist"], r["op"]), len(first_seen))
    records.sort(key=lambda r: (first_seen[(r["bench"], r["shape"], r["dist"], r["op"])], order[r["backend"]]))
    env = dict(envs[0])
    env.pop("wall_s", None)  # worker 0's own; each worker's is in env["workers"]
    env["roof"] = roofs[0]
    env["workers"] = workers
    env["backends"] = [b for g in groups for b in g]
    return records, env, roofs


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    cfg = runner.config_from_args(args)
    isolate = [b.strip() for b in args.isolate.split(",") if b.strip()]
    groups = _worker_groups(cfg.backends, isolate)
    if len(groups) <= 1:
        cfg.partial_path = runner.partial_path_for(cfg.out, NAME)
        records, env, roof = run_in_process(cfg)
        roofs = [roof]
    else:
        start = time.perf_counter()
        records, env, roofs = run_workers(args, groups)
        env["wall_s"] = round(time.perf_counter() - start, 1)
    print(f"== {'worker' if args.worker else 'all benchmarks'} took {env['wall_s']:.0f} s", flush=True)
    return runner.finish(NAME, records, env, cfg, roofs, table=not args.worker)


if __name__ == "__main__":
    main()
