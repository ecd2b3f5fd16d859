"""The README's usage example runs as written on a CPU-only machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _use_example() -> str:
    text = README.read_text()
    use = text[text.index("\n## Use\n") :]
    match = re.search(r"```python\n(.*?)```\n", use, flags=re.S)
    assert match, "the README's Use section has no python block"
    return match.group(1)


def test_readme_use_example_runs_on_cpu():
    code = _use_example()
    assert "moekit." in code
    # A fresh interpreter with no GPU visible: the example must pick the CPU itself. TRITON_INTERPRET
    # is dropped so it runs as a user's machine would.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"the README's example failed:\n{out.stderr[-3000:]}"
