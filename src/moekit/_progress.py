"""A one-line progress report on stderr, for the command line."""

from __future__ import annotations

import sys
import time


class Progress:
    """A bar redrawn in place on a terminal. On a pipe or file: nothing when `quiet_when_piped`
    (logs stay clean), otherwise a line at every tenth of the way."""

    def __init__(self, total: int, *, quiet_when_piped: bool, width: int = 30) -> None:
        self.total, self.width, self.start = max(total, 1), width, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.quiet = quiet_when_piped and not self.tty

    def update(self, done: int, text: str) -> None:
        if self.quiet or (not self.tty and done not in (1, self.total) and done % max(1, self.total // 10)):
            return
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        end = "\r" if self.tty and done < self.total else "\n"
        sys.stderr.write(f"[{bar}] {done}/{self.total} {text} {elapsed:5.1f}s{end}")
        sys.stderr.flush()
