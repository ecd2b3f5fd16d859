"""The `moekit` command, run as a user runs it (a subprocess): a user mistake is one line on stderr
and a non-zero exit, never a traceback; --version; help texts; convert's progress, and its
temporary output after SIGTERM and SIGKILL."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

safetensors_torch = pytest.importorskip("safetensors.torch")

import moekit  # noqa: E402
from moekit.cli import build_parser  # noqa: E402

N, H, F = 4, 8, 6
REFUSED = "moekit convert: refused, nothing written: "
# The command runs the moekit these tests imported, wherever the interpreter's install points.
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [str(Path(moekit.__file__).parents[1]), *filter(None, [os.environ.get("PYTHONPATH")])]
    ),
}


def _moekit(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moekit", *map(str, args)], capture_output=True, text=True, timeout=300, cwd=cwd, env=ENV
    )


def _assert_one_line_refusal(proc: subprocess.CompletedProcess, prefix: str, *phrases: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), proc.stderr
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])


def _hf_file(path, extra_bytes: int = 0):
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(N):
        sd[f"model.layers.0.mlp.experts.{i}.gate_proj.weight"] = torch.randn(F, H, generator=g)
        sd[f"model.layers.0.mlp.experts.{i}.up_proj.weight"] = torch.randn(F, H, generator=g)
        sd[f"model.layers.0.mlp.experts.{i}.down_proj.weight"] = torch.randn(H, F, generator=g)
    if extra_bytes:
        sd["model.embed_tokens.weight"] = torch.zeros(extra_bytes // 4, dtype=torch.float32)
    safetensors_torch.save_file(sd, str(path))
    return path


# ---- convert: user mistakes --------------------------------------------------------------------


def _sharded_with_bad_index(tmp_path):
    src = tmp_path / "sharded"
    src.mkdir()
    _hf_file(src / "model-00001-of-00001.safetensors")
    (src / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    return src


CONVERT_MISTAKES = {
    "missing-destination-folder": (
        lambda t: (_hf_file(t / "src.safetensors"), t / "no" / "such" / "out.safetensors"),
        "does not exist; create it first",
    ),
    "destination-ends-in-slash": (
        lambda t: (_hf_file(t / "src.safetensors"), f"{t / 'newdir'}/"),
        "names a folder, but this source converts to a single file",
    ),
    "destination-exists": (
        lambda t: (_hf_file(t / "src.safetensors"), _hf_file(t / "out.safetensors")),
        "exists; moekit does not overwrite",
    ),
    "invalid-index-json": (lambda t: (_sharded_with_bad_index(t), t / "out"), "not a readable index JSON"),
    "source-missing": (lambda t: (t / "nothing.safetensors", t / "out.safetensors"), "no such file or folder"),
    "truncated-source": (lambda t: (_truncated(t / "src.safetensors"), t / "out.safetensors"), "truncated"),
}


def _truncated(path):
    data = _hf_file(path).read_bytes()
    path.write_bytes(data[:-10])
    return path


@pytest.mark.parametrize("case", CONVERT_MISTAKES)
def test_convert_mistake_is_one_line(tmp_path, case):
    make, phrase = CONVERT_MISTAKES[case]
    src, dst = make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = _moekit("convert", src, dst, "--to", "grouped")
    _assert_one_line_refusal(proc, REFUSED, phrase)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    assert not os.path.exists(str(dst).rstrip("/")) or case == "destination-exists"


def test_convert_into_read_only_folder_is_one_line(tmp_path):
    src = _hf_file(tmp_path / "src.safetensors")
    if os.geteuid() != 0:
        folder = tmp_path / "ro"
        folder.mkdir(mode=0o555)
        dst, phrase = folder / "out.safetensors", "is not writable"
    elif os.path.isdir("/sys") and not os.path.exists("/sys/moekit-test-out.safetensors"):
        # root writes through permission bits; sysfs refuses it all the same
        dst, phrase = "/sys/moekit-test-out.safetensors", "cannot write"
    else:
        pytest.skip("running as root without a read-only folder to write to")
    proc = _moekit("convert", src, dst, "--to", "grouped")
    _assert_one_line_refusal(proc, REFUSED, phrase)
    assert not os.path.exists(dst)


def test_argument_mistakes_are_one_line(tmp_path):
    proc = _moekit("convert", tmp_path / "a", tmp_path / "b")  # --to missing
    _assert_one_line_refusal(proc, "moekit convert: refused: ", "--to", "moekit convert --help")
    proc = _moekit("convert", tmp_path / "a", tmp_path / "b", "--to", "grouped", "--glu-interleave", "two")
    _assert_one_line_refusal(proc, "moekit convert: refused", "--glu-interleave must be 'none'")


# ---- demo: user mistakes -----------------------------------------------------------------------


def test_demo_mistakes_are_one_line(tmp_path):
    (tmp_path / "file").write_text("keep me")
    cases = [
        (["--steps", "0"], "--steps must be an int >= 1, got 0"),
        (["--seed", str(2**64)], f"--seed must be an int from -2**63 to 2**63 - 2, got {2**64}"),
        (["--out", tmp_path / "file"], "is an existing file; expected a folder"),
        (["--device", "nonsense"], "is not a device"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "has no usable CUDA device; use --device cpu or auto"))
        cases.append((["--backend", "triton"], "backend='triton' cannot run here"))
    # as a user runs it: not under the Triton interpreter that the test session turns on
    env = {k: v for k, v in ENV.items() if k != "TRITON_INTERPRET"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "moekit", "demo", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        for args, _ in cases
    ]
    for proc, (args, phrase) in zip(procs, cases, strict=True):
        out, err = proc.communicate(timeout=300)
        _assert_one_line_refusal(
            subprocess.CompletedProcess(args, proc.returncode, out, err), "moekit demo: refused: ", phrase
        )
    assert (tmp_path / "file").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # no moekit-demo folder made


# ---- version and help --------------------------------------------------------------------------


def test_version():
    proc = _moekit("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"moekit {moekit.__version__}"


def test_console_script_entry_point_runs():
    """The callable pyproject.toml names for the `moekit` script, called as pip's wrapper calls it."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    config = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    module, function = config["project"]["scripts"]["moekit"].split(":")
    wrapper = f"import sys; from {module} import {function}; sys.exit({function}())"
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, "--version"], capture_output=True, text=True, env=ENV, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"moekit {moekit.__version__}", proc.stderr


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_a_help_line_and_help_shows_flag_names():
    parser = build_parser()
    commands = _subparsers(parser)
    assert set(commands) == {"demo", "convert", "inspect"}
    for name, sub in [("moekit", parser), *commands.items()]:
        for action in sub._actions:
            assert action.help and action.help.strip(), f"{name}: {action.option_strings or action.dest} has no help"
        text = sub.format_help()
        # the Python parameter names of the functions behind the commands are not the user's words
        for python_name in ("src_glu_interleave", "glu_interleave:", "glu_interleave=", "run_demo"):
            assert python_name not in text, (name, python_name)
    proc = _moekit("convert", "--help")
    assert proc.returncode == 0
    for flag in ("--to", "--glu-interleave", "--src-glu-interleave", "SRC", "DST"):
        assert flag in proc.stdout


# ---- convert: success, progress, signals ---------------------------------------------------------


def test_convert_and_inspect_success_are_quiet_on_stderr_when_piped(tmp_path):
    src = _hf_file(tmp_path / "src.safetensors")
    proc = _moekit("convert", src, tmp_path / "g.safetensors", "--to", "grouped", "--glu-interleave", "2")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert "verified by an exact round trip" in proc.stdout
    proc = _moekit("inspect", tmp_path / "g.safetensors")
    assert proc.returncode == 0 and proc.stderr == ""
    assert "model.layers.0.mlp.experts  grouped" in proc.stdout and "F32" in proc.stdout


def test_convert_shows_a_progress_bar_on_a_terminal(tmp_path):
    pty = pytest.importorskip("pty")
    src = _hf_file(tmp_path / "src.safetensors")
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moekit", "convert", str(src), str(tmp_path / "g.safetensors"), "--to", "grouped"],
        stdout=subprocess.PIPE,
        stderr=slave,
        env=ENV,
    )
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the terminal closed: the command ended
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    assert proc.wait(timeout=300) == 0
    text = shown.decode()
    # one bar redrawn in place: tensors done and bytes done
    assert "\r" in text and "[" + "#" * 30 + "]" in text
    assert "2/2 tensors" in text and "KiB of" in text and "writing" in text and "s left" in text
    assert f"{3 * N}/{3 * N} tensors" in text and "verified" in text  # then the source's tensors, read back


def test_progress_shows_the_time_left(monkeypatch, capsys):
    """The estimate carries the pace so far on: by steps, or by the fraction of the work given."""
    from moekit import _progress

    now = [100.0]
    monkeypatch.setattr(_progress, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    bar = _progress.Progress(4, quiet_when_piped=False, width=4)
    now[0] += 3.0
    bar.update(1, "steps")  # a quarter in 3 s: 9 s to go
    now[0] += 27.0
    bar.update(2, "steps", fraction=0.2)  # a fifth of the work in 30 s: 2 minutes to go
    now[0] += 1.0
    bar.update(4, "steps")
    assert capsys.readouterr().err.splitlines() == [
        "[#---] 1/4 steps   3.0s, about 9s left",
        "[##--] 2/4 steps  30.0s, about 2m00s left",
        "[####] 4/4 steps  31.0s",
    ]


def _interrupted_convert(tmp_path, sig) -> tuple[subprocess.Popen, list]:
    """Start a convert of a 96 MB checkpoint, and send `sig` while its temporary output exists.

    The process is stopped (SIGSTOP) first and the temporary output looked for while it cannot move:
    where the write had already finished in the moment between seeing the file and stopping it (a fast
    disk), the signal would not land mid-write, so that attempt is let finish, cleaned up and made
    again (at most 5 times)."""
    src = _hf_file(tmp_path / "src.safetensors", extra_bytes=96 << 20)
    dst = tmp_path / "out.safetensors"
    for _ in range(5):
        proc = _start_with_default_sigint("convert", src, dst, "--to", "grouped")  # exec: the pid is kept
        temp = f".out.safetensors.moekit-convert-tmp-{proc.pid}"
        deadline = time.monotonic() + 120
        while not (tmp_path / temp).exists():
            assert proc.poll() is None and time.monotonic() < deadline, "convert ended before it could be interrupted"
            time.sleep(0.002)
        proc.send_signal(signal.SIGSTOP)  # hold it mid-write, so that the signal lands there
        if (tmp_path / temp).exists():
            proc.send_signal(sig)
            proc.send_signal(signal.SIGCONT)
            return proc, [temp]
        proc.send_signal(signal.SIGCONT)
        proc.communicate(timeout=300)
        dst.unlink(missing_ok=True)
    raise AssertionError("the convert finished its write before it could be stopped, 5 times")


def test_sigterm_removes_the_temporary_output(tmp_path):
    proc, _ = _interrupted_convert(tmp_path, signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines() == ["moekit convert: stopped by SIGTERM; its temporary output was removed, nothing written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def test_sigint_while_converting_removes_the_temporary_output(tmp_path):
    proc, _ = _interrupted_convert(tmp_path, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert err.splitlines() == [
        "moekit convert: stopped by interrupt; its temporary output was removed, nothing written"
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def _start_with_default_sigint(*args) -> subprocess.Popen:
    """`python -m moekit ARGS` with SIGINT at its default disposition even where these tests run with
    it ignored (a background job): an ignored SIGINT stays ignored across exec, and moekit keeps it so."""
    start = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.executable, sys.argv[1:])"
    )
    return subprocess.Popen(
        [sys.executable, "-c", start, sys.executable, "-m", "moekit", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )


def test_import_moekit_does_not_import_torch():
    """What lets the command take over Ctrl-C before anything heavy loads (and --version answer fast)."""
    script = "import sys, moekit, moekit.cli; assert 'torch' not in sys.modules, 'torch'; print(moekit.__all__)"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr(moekit.__all__)


@pytest.mark.parametrize("after", [0.0, 0.15, 0.3, 0.6, 1.2])
def test_sigint_at_any_time_is_one_line_and_status_130(tmp_path, after):
    """Ctrl-C from the moment torch's library is loaded (its import has begun) until the conversion's
    end: one line, exit status 130, nothing written; never a traceback, an abort from torch's C++
    initialisation, or an exit by the signal itself. The later moments land while the command
    imports, reads or writes, depending on the machine."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/PID/maps to see when torch's library is loaded")
    src = _hf_file(tmp_path / "src.safetensors", extra_bytes=96 << 20)
    proc = _start_with_default_sigint("convert", src, tmp_path / "out.safetensors", "--to", "grouped")
    deadline = time.monotonic() + 120
    while "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text():
        assert proc.poll() is None and time.monotonic() < deadline, "convert ended before torch was loaded"
        time.sleep(0.002)
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    if proc.returncode == 0:
        pytest.skip(f"the conversion ended in {after} s, before the signal (a fast machine)")
    assert proc.returncode == 130, err
    assert err.splitlines() in (
        ["moekit: interrupted"],
        ["moekit convert: stopped by interrupt; its temporary output was removed, nothing written"],
    ), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def test_sigkill_leftover_is_removed_by_the_next_run(tmp_path):
    proc, (temp,) = _interrupted_convert(tmp_path, signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / temp).exists()  # a hidden file a person recognises by its name
    # a temporary of a running process (this one) is not touched
    mine = tmp_path / f".out.safetensors.moekit-convert-tmp-{os.getpid()}"
    mine.write_bytes(b"in progress")
    again = _moekit("convert", tmp_path / "src.safetensors", tmp_path / "out.safetensors", "--to", "grouped")
    assert again.returncode == 0, again.stderr
    assert f"removed {tmp_path / temp}" in again.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src.safetensors", "out.safetensors", mine.name])
