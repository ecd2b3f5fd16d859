"""Command line: `moekit demo`, `moekit convert`, `moekit inspect`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from moekit.ops.grouped_linear import BACKENDS


def _add_demo(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train a small MoE LM on a synthetic task and round-trip its checkpoint")
    p.add_argument("--steps", type=int, default=400, help="training steps (default 400)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="grouped GEMM backend")
    p.add_argument("--out", default="moekit-demo", help="output folder for checkpoint, plot and summary")
    p.add_argument("--seed", type=int, default=0)

    def run(args: argparse.Namespace) -> int:
        from moekit.demo import run_demo

        run_demo(steps=args.steps, device=args.device, backend=args.backend, out=args.out, seed=args.seed)
        return 0

    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moekit", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_demo(subparsers)
    from moekit.convert import add_convert_subcommands

    add_convert_subcommands(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
