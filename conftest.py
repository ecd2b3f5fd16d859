"""Repository-wide pytest setup, loaded before any test module imports triton.

On a machine without CUDA, moekit's Triton kernels can only run under Triton's interpreter, which
is chosen when a kernel is defined: set it here, first, so every test process (xdist workers too)
sees the same mode whichever test module happens to import triton first.

Then, under the interpreter, the speed-ups of `tests/interpreter_site/sitecustomize.py` (its
docstring says what and why): loaded here for this process and its xdist workers, and that folder
put first on PYTHONPATH for the Python processes the tests start.

In an xdist worker, torch's intra-op threads are the worker's share of the machine's cores (and so
are those of the Python processes its tests start, through OMP_NUM_THREADS, unless it is set
already): by default every worker would start one thread per core, so `-n 2` on two cores ran four
busy threads on two cores. Only the speed changes: every comparison a test makes is within one
process.
"""

import importlib.util
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    _SITE = Path(__file__).resolve().parent / "tests" / "interpreter_site"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(_SITE), os.environ.get("PYTHONPATH")) if p)
    _spec = importlib.util.spec_from_file_location("moekit_interpreter_site", _SITE / "sitecustomize.py")
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    _SHARE = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)
    torch.set_num_threads(_SHARE)
