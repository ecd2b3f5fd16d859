"""Repository-wide pytest setup, loaded before any test module imports triton.

On a machine without CUDA, moekit's Triton kernels can only run under Triton's interpreter, which
is chosen when a kernel is defined: set it here, first, so every test process (xdist workers too)
sees the same mode whichever test module happens to import triton first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
