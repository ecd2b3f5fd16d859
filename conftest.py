"""Repository-wide pytest setup, loaded before any test module imports triton.

On a machine without CUDA, moekit's Triton kernels can only run under Triton's interpreter, which
is chosen when a kernel is defined: set it here, first, so every test process (xdist workers too)
sees the same mode whichever test module happens to import triton first.

The interpreter re-patches triton.language (every builtin of `tl`, `tl.tensor` and `tl.math`, a few
milliseconds) at every call of a `@triton.jit` helper from inside a kernel, although the launch that
runs the kernel has patched those same modules already and restores them when it ends. moekit's
kernels call small helpers per tile: in one quantize test that re-patching was a third of the time
(43 s -> 26 s without it). `_patch_each_launch_once` skips it for a helper whose language modules
the running launch has patched; any other helper (one that also names `triton.language.core`, say)
is patched as before. What is computed does not change: the helper runs with the same patched
builtins either way.
"""

import inspect
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_each_launch_once() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or getattr(patch_lang, "once_per_launch", False):
        return  # another triton than the one this was written for (3.6), or already installed
    patched: list[set[int]] = []  # the language modules the running launch has patched

    known: dict[object, set[int]] = {}

    def languages(fn) -> set[int]:
        if fn not in known:
            mods = (v for v in fn.__globals__.values() if inspect.ismodule(v))
            known[fn] = {id(v) for v in mods if v in (tl, tl.core)}
        return known[fn]

    class LaunchScope:
        def __init__(self, scope) -> None:
            self.scope = scope

        def restore(self) -> None:
            patched.pop()
            self.scope.restore()

    def once_per_launch(fn):
        langs = languages(fn)
        if not patched:  # a launch (kernels do not launch kernels): patch, restored when it ends
            scope = patch_lang(fn)
            patched.append(langs)
            return LaunchScope(scope)
        if langs <= patched[-1]:  # a helper called from the kernel: its modules are patched already
            return None
        patched[-1] |= langs
        return patch_lang(fn)

    once_per_launch.once_per_launch = True
    interpreter._patch_lang = once_per_launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_each_launch_once()
