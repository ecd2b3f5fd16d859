"""Command line: `moekit demo`, `moekit convert`, `moekit inspect`, `moekit --version`.

A user mistake (a bad argument, a file that cannot be converted, a destination that cannot be
written) is one line on stderr, `moekit <command>: refused...: <what, and what is expected>`, and a
non-zero exit status, never a traceback.

Ctrl-C (SIGINT) is one line on stderr and exit status 130 wherever it lands. This module imports only
the standard library (as does `import moekit`), so `main` takes over SIGINT before anything heavy
loads, in two phases:
- while it starts (parsing, importing torch and what the command needs; nothing is written yet), it
  exits at once. A KeyboardInterrupt raised there could land inside torch's C++ initialisation (which
  aborts the process) or inside an `exec` (after which the interpreter ends the process by SIGINT
  whatever status is returned);
- while the command works, it raises `_Interrupted`, a KeyboardInterrupt that the commands catch to
  remove their temporary output (a subclass: the interpreter only takes its own KeyboardInterrupt
  for an unhandled one).
A SIGINT that the process was started ignoring (a background job, nohup) stays ignored, and one
that other code handles outside Python is left to it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_REFUSED = 2
EXIT_PROBLEMS = 1  # inspect found problems
EXIT_FAILED = 3  # convert's verification failed


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints the whole usage before the message; one line says what is wrong and where to look.
        self.exit(EXIT_REFUSED, f"{self.prog}: refused: {message} (see {self.prog} --help)\n")


def _refuse(command: str, exc: BaseException, what: str = "refused") -> int:
    problems = getattr(exc, "problems", None) or [str(exc)]
    text = "; ".join(" ".join(p.split()) for p in problems)
    print(f"moekit {command}: {what}: {text}", file=sys.stderr)
    return EXIT_REFUSED


class _Terminated(BaseException):
    """SIGTERM, raised where the process is, so that temporary output is removed on the way out."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated()


GLU_HELP = (
    "'none' ([gates; ups]) or a block size (gate and up rows interleaved in blocks of that many; "
    "1 = gpt-oss's alternating rows)"
)


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    from moekit.ops.grouped_linear import BACKENDS

    p = subparsers.add_parser(
        "demo",
        help="train a small MoE LM on a synthetic task and round-trip its checkpoint",
        description="Train a small MoE language model built from moekit layers on a synthetic task, save it in the "
        "single-grouped-weight layout, reload it into per-expert weights and check that the evaluation "
        "loss is identical. Writes OUT/model.safetensors, OUT/loss.png and OUT/summary.json.",
    )
    p.add_argument("--steps", type=int, default=400, help="training steps, a positive integer (default 400)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...")
    p.add_argument("--backend", default="auto", choices=BACKENDS, help="grouped GEMM backend (default auto)")
    p.add_argument(
        "--out",
        default="moekit-demo",
        help="folder for the checkpoint, plot and summary, created if missing (default moekit-demo)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initial weights (default 0)")
    p.add_argument(
        "--quantization",
        default="none",
        choices=("none", "fp8_block", "fp8_rowwise", "mxfp8"),
        help="the experts' linears on quantized operands: none (default), fp8_block, fp8_rowwise or mxfp8 "
        "(moekit's reference path: quantize, dequantize, compute in the model's dtype)",
    )

    def run(args: argparse.Namespace) -> int:
        from moekit.demo import run_demo

        quantization = None if args.quantization == "none" else args.quantization
        try:
            run_demo(
                steps=args.steps,
                device=args.device,
                backend=args.backend,
                out=args.out,
                seed=args.seed,
                quantization=quantization,
            )
        except (TypeError, ValueError) as exc:
            return _refuse("demo", exc)
        except OSError as exc:
            return _refuse("demo", OSError(f"cannot write {exc.filename}: {exc.strerror}"))
        except KeyboardInterrupt:
            return _interrupted("moekit demo: interrupted")
        return 0

    p.set_defaults(func=run, imports=("moekit.demo",))


def _run_convert(args: argparse.Namespace) -> int:
    from moekit._progress import Progress
    from moekit.checkpoint import CheckpointError, convert_checkpoint
    from moekit.checkpoint.convert import VerificationError
    from moekit.checkpoint.files import human_bytes

    bars: dict[str, Progress] = {}  # one bar per phase: writing, then verifying

    def progress(phase: str, tensors: int, tensors_total: int, nbytes: int, bytes_total: int) -> None:
        if phase not in bars:
            bars[phase] = Progress(tensors_total, quiet_when_piped=True)
        bars[phase].update(
            tensors,
            f"tensors, {human_bytes(nbytes)} of {human_bytes(bytes_total)} {phase}",
            fraction=nbytes / bytes_total if bytes_total else None,
        )

    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        result = convert_checkpoint(
            args.src,
            args.dst,
            args.to,
            args.glu_interleave,
            src_glu_interleave=args.src_glu_interleave,
            progress=progress,
        )
    except CheckpointError as exc:
        return _refuse("convert", exc, "refused, nothing written")
    except VerificationError as exc:
        _refuse("convert", exc, "the output failed its verification (a moekit bug, please report it), nothing written")
        return EXIT_FAILED
    except (_Terminated, KeyboardInterrupt) as exc:
        stopped = "moekit convert: stopped by {}; its temporary output was removed, nothing written"
        if isinstance(exc, KeyboardInterrupt):
            return _interrupted(stopped.format("interrupt"))
        print(stopped.format("SIGTERM"), file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    for p in result.removed_temps:
        print(f"moekit convert: removed {p}, the temporary output of an earlier run that was killed")
    print(
        f"moekit convert: wrote {result.destination} ({len(result.files)} file(s), {result.num_groups} expert "
        f"groups, {result.num_tensors} tensors, {human_bytes(result.total_bytes)}); verified by an exact round trip"
    )
    return 0


def _run_inspect(args: argparse.Namespace) -> int:
    from moekit.checkpoint import Checkpoint, CheckpointError, analyze, format_inspection
    from moekit.checkpoint.convert import parse_glu, refusals

    try:
        ckpt = Checkpoint(args.ckpt)
        analysis = analyze(ckpt, parse_glu(args.src_glu_interleave, "--src-glu-interleave"))
    except CheckpointError as exc:
        print(f"moekit inspect: {args.ckpt}: problems (convert would refuse):", file=sys.stderr)
        print("\n".join(f"  - {p}" for p in exc.problems), file=sys.stderr)
        return EXIT_PROBLEMS
    analysis.problems = refusals(ckpt, analysis)
    print(format_inspection(ckpt, analysis))
    return EXIT_PROBLEMS if analysis.problems else 0


def _add_checkpoint_commands(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "convert",
        help="convert expert weights between per-expert and grouped layouts",
        description="Convert the expert tensors of a safetensors checkpoint between per-expert tensors "
        "(experts.{i}.gate_proj.weight, weight{i}) and grouped ones (experts.gate_up_proj, weight "
        "[N, out, in]), streaming, atomically, verified by an exact round trip. A single file converts "
        "to the file DST; a sharded checkpoint or a folder to the folder DST (same shard names, a new "
        "index, the other files copied). Refuses, writing nothing, on malformed files, missing or "
        "misshapen experts, expert indices that are not canonical decimals (experts.01, weight+1), an "
        "ambiguous layout, an unknown gate/up row order, or a DST that exists or cannot be written.",
    )
    p.add_argument("src", metavar="SRC", help="a .safetensors file, an *.safetensors.index.json, or a folder")
    p.add_argument(
        "dst",
        metavar="DST",
        help="output file (single-file SRC) or folder (sharded SRC); must not exist, its folder must",
    )
    p.add_argument("--to", required=True, choices=("grouped", "per-expert"), help="the expert layout to write")
    p.add_argument(
        "--glu-interleave",
        default="keep",
        metavar="SIZE",
        help=f"row order of the fused gate/up tensors written: {GLU_HELP}; default keep (the source's)",
    )
    p.add_argument(
        "--src-glu-interleave",
        default="keep",
        metavar="SIZE",
        help=f"row order of the source's fused gate/up tensors where the file does not say: {GLU_HELP}",
    )
    p.set_defaults(func=_run_convert, imports=("moekit.checkpoint",))
    q = subparsers.add_parser(
        "inspect",
        help="print the expert-weight layout of a safetensors checkpoint",
        description="Print the expert groups of a safetensors checkpoint (layout, naming, expert count, shapes, "
        "gate/up row order, dtype, size). Exits 1, listing them, where there are problems that would make "
        "`moekit convert` refuse the checkpoint.",
    )
    q.add_argument("ckpt", metavar="CKPT", help="a .safetensors file, an *.safetensors.index.json, or a folder")
    q.add_argument(
        "--src-glu-interleave",
        default="keep",
        metavar="SIZE",
        help=f"row order of fused gate/up tensors where the file does not record it: {GLU_HELP}",
    )
    q.set_defaults(func=_run_inspect, imports=("moekit.checkpoint",))


def build_parser() -> argparse.ArgumentParser:
    from moekit import __version__

    parser = _Parser(prog="moekit", description="moekit: grouped linears and MoE layers for PyTorch; checkpoint tools.")
    parser.add_argument(
        "--version", action="version", version=f"moekit {__version__}", help="print moekit's version and exit"
    )
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="what to do; `moekit COMMAND --help` lists its options"
    )
    _add_demo(subparsers)
    _add_checkpoint_commands(subparsers)
    return parser


class _Interrupted(KeyboardInterrupt):
    """Ctrl-C while a command works, raised where the process is (see the module's docstring)."""


def _raise_interrupted(signum: int, frame: object) -> None:
    raise _Interrupted()


def _exit_at_once(signum: int, frame: object) -> None:
    try:
        os.write(2, b"moekit: interrupted\n")  # not sys.stderr: the handler may have interrupted a write to it
    finally:
        os._exit(EXIT_INTERRUPTED)


def _interrupted(message: str) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not interrupt the message
    print(message, file=sys.stderr)
    return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `moekit` command line `argv` (default: the process's arguments); returns the exit status.
    SIGINT is handled as the module's docstring says while it runs, and left as it was on return."""
    previous = signal.getsignal(signal.SIGINT)
    handle = threading.current_thread() is threading.main_thread() and previous not in (signal.SIG_IGN, None)
    try:
        if handle:
            signal.signal(signal.SIGINT, _exit_at_once)
        args = build_parser().parse_args(argv)  # imports torch (the demo's backends)
        for module in args.imports:  # what the command needs, imported before its work starts
            importlib.import_module(module)
        if handle:
            signal.signal(signal.SIGINT, _raise_interrupted)
        return args.func(args)
    except KeyboardInterrupt:  # landed between the commands' own handlers
        return _interrupted("moekit: interrupted")
    finally:
        if handle:
            signal.signal(signal.SIGINT, previous)


def console_main() -> int:
    """The `moekit` console script and `python -m moekit`: `main`, then exit without being interrupted
    (torch's exit hooks run after the command is done; a Ctrl-C there would print a traceback)."""
    handle = signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN, None)
    if handle:
        signal.signal(signal.SIGINT, _exit_at_once)
    status = main()
    if handle:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status
