"""The suite's own setup (tests/conftest.py, where it does more than provide fixtures) and the helpers
whose answers decide other tests' verdicts (tests/helpers.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import main_loop_spills

TESTS = Path(__file__).resolve().parent

# Run as a pytest session of its own: the first test fails holding an object, the second checks that
# nothing holds it any more (pytest alone keeps it through sys.last_traceback until the next failure).
INNER = """
import sys
import weakref

held = {}


class Big:
    pass


def test_fails_holding_an_object():
    big = Big()
    held["ref"] = weakref.ref(big)
    assert False


def test_the_failed_tests_frames_are_gone():
    assert getattr(sys, "last_value", None) is None
    assert held["ref"]() is None
"""


def test_a_failed_test_lets_go_of_its_frames(tmp_path):
    """On a GPU a failed test's tensors held past its end starve every later test (the whole suite on an
    H100 once failed 152 tests behind one out-of-memory failure): conftest's teardown hook drops them."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "test_fails_holding_an_object" in proc.stdout


def test_an_xdist_worker_takes_its_share_of_the_cores(tmp_path):
    """The repository's conftest.py: under `-n 2` each worker's torch runs cpu_count // 2 intra-op
    threads (at least 1) and hands that count to the processes it starts (OMP_NUM_THREADS); a count the
    user set is left as it is. Checked in inner sessions, whose two workers report what they see."""
    inner = tmp_path / "test_inner.py"
    inner.write_text(
        "import os, torch\n"
        "def test_threads():\n"
        "    print('THREADS', torch.get_num_threads(), os.environ.get('OMP_NUM_THREADS'))\n"
        "    assert False  # so that -rA prints the output\n"
    )
    share = str(max(1, (os.cpu_count() or 1) // 2))
    for user, want in ((None, share), ("1", "1")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        # The repository's conftest.py loaded as a plugin (`-p conftest`) by every worker.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS.parent), env.get("PYTHONPATH")) if p)
        if user is not None:
            env["OMP_NUM_THREADS"] = user
        command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-rA", "-p", "no:cacheprovider", "-p", "conftest"]
        proc = subprocess.run(
            [*command, str(inner)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
        )
        seen = [line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("THREADS")]
        assert seen and all(s == [want, want] for s in seen), proc.stdout[-2000:]


# nvdisasm -c's form: labels on lines of their own, instructions as /*address*/ text ;
SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ ;
        /*0030*/                   STL [R1+0x8], R3 ;
        /*0040*/               @P1 BRA `(.L_x_1) ;
.L_x_2:
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ ;
        /*0060*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0070*/               @P1 BRA `(.L_x_2) ;
.L_x_3:
        /*0080*/                   LDL R5, [R1] ;
        /*0090*/                   STL [R1+0x4], R5 ;
        /*00a0*/               @P2 BRA `(.L_x_3) ;
.L_x_4:
        /*00b0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ ;
        /*00c0*/                   IADD3 R4, R4, 0x1, RZ ;
        /*00d0*/                   IADD3 R4, R4, 0x1, RZ ;
        /*00e0*/                   IADD3 R4, R4, 0x1, RZ ;
        /*00f0*/                   IADD3 R4, R4, 0x1, RZ ;
        /*0100*/                   LDL R5, [R1] ;
        /*0110*/               @P1 BRA `(.L_x_4) ;
        /*0120*/                   EXIT ;
"""


def test_main_loop_spills_counts_the_short_loops_that_hold_the_mma():
    """`helpers.main_loop_spills`: the loops holding the MMA instruction, the shortest and those under 1.5x
    its length (the 4-instruction loop with a spill, the 3-instruction one without), not the loop without
    an MMA nor the 7-instruction one; no such loop at all is an error, not an empty list."""
    assert main_loop_spills(SASS, "HGMMA") == [1, 0]
    with pytest.raises(AssertionError, match="no loop holds QGMMA"):
        main_loop_spills(SASS, "QGMMA")
