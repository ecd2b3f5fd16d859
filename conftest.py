"""Repository-wide pytest setup, loaded before any test module imports triton.

On a machine without CUDA, moekit's Triton kernels can only run under Triton's interpreter, which
is chosen when a kernel is defined: set it here, first, so every test process (xdist workers too)
sees the same mode whichever test module happens to import triton first.

Then, under the interpreter, the speed-ups of `tests/interpreter_site/sitecustomize.py` (its
docstring says what and why): loaded here for this process and its xdist workers, and that folder
put first on PYTHONPATH for the Python processes the tests start.
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
