"""The held-h gated kernels of two builds on the same data (GPU): whether `held_gated_activation` and its
backward give the same bits in build B as in build A, per recipe, GLU layout and width, and how far
d probs moves (an fp32 sum whose pieces follow the kernel's tile). Each build runs in its own process
(Triton's cache keys on the source, so they never share binaries).

    python benchmarks/held_gated_bits.py --a /tmp/old/src --b src [--rows 8192]

A build is a source tree holding `moekit/`. Prints one line a case.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

# (recipe, glu_interleave_size, F): fp8_block at [gate | up] and interleave 1, a width whose ups start
# off a 128-column block (gpt-oss's 2880), mxfp8, fp8_rowwise's one scale a row, and mxfp8 where no
# tile aligns with its 32-column blocks (760).
CASES = [
    ("fp8_block", None, 768),
    ("fp8_block", 1, 768),
    ("fp8_block", None, 2880),
    ("mxfp8", None, 768),
    ("fp8_rowwise", None, 768),
    ("mxfp8", None, 760),
]


def save(tree: str, path: str, rows: int) -> None:
    """Run this build's kernels on the cases' data and save (out, dh, d probs) per case."""
    sys.path.insert(0, tree)
    import torch

    import moekit
    from moekit.ops.glu import held_gated_activation, held_gated_activation_backward, to_held

    results = {}
    for recipe, k, ffn in CASES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        h = torch.randn(rows, 2 * ffn, device="cuda", generator=gen).mul_(4).bfloat16()
        probs = torch.rand(rows, device="cuda", generator=gen).bfloat16()
        d_out = torch.randn(rows, ffn, device="cuda", generator=gen).bfloat16()
        act = "clamped_swiglu" if k == 1 else "swiglu"
        h_q = moekit.group_quantize(to_held(h, k, act), [rows // 2, rows - rows // 2], recipe, backend="triton")
        out = held_gated_activation(h_q, probs, k, act)
        dh, d_probs = held_gated_activation_backward(h_q, probs, d_out, k, act, True)
        results[(recipe, k, ffn)] = (out.cpu(), dh.cpu(), d_probs.float().cpu())
    torch.save(results, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="build A: a source tree holding moekit/")
    parser.add_argument("--b", required=True, help="build B: a source tree holding moekit/")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--save", nargs=2, metavar=("TREE", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.save:
        save(args.save[0], args.save[1], args.rows)
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for tree in (args.a, args.b):
            files.append(str(Path(tmp) / f"{len(files)}.pt"))
            cmd = [sys.executable, __file__, "--a", args.a, "--b", args.b, "--rows", str(args.rows)]
            subprocess.run([*cmd, "--save", str(Path(tree).resolve()), files[-1]], check=True)
        a, b = (torch.load(f) for f in files)
    for case, (out, dh, d_probs) in b.items():
        out_a, dh_a, d_probs_a = a[case]
        moved = ((d_probs - d_probs_a).abs() / d_probs_a.abs().clamp_min(1e-6)).max().item()
        print(
            f"{case}: out same {torch.equal(out, out_a)}, dh same {torch.equal(dh, dh_a)}, "
            f"d probs same {torch.equal(d_probs, d_probs_a)} (largest relative change {moved:.2e})"
        )


if __name__ == "__main__":
    main()
