"""A one-line progress report on stderr, for the command line."""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


class Progress:
    """A bar redrawn in place on a terminal. On a pipe or file: nothing when `quiet_when_piped`
    (logs stay clean), otherwise a line at every tenth of the way. Each shows the time elapsed and,
    until the end, an estimate of the time left (the pace so far, carried on)."""

    def __init__(self, total: int, *, quiet_when_piped: bool, width: int = 30) -> None:
        self.total, self.width, self.start = max(total, 1), width, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.quiet = quiet_when_piped and not self.tty
        self.shown = 0  # the length of the line on the terminal, to blank what a shorter one leaves

    def update(self, done: int, text: str, *, fraction: float | None = None) -> None:
        """`done` of `total` steps; `fraction` of the work (default done / total) paces the estimate
        where steps differ in size (a conversion's tensors)."""
        if self.quiet or (not self.tty and done not in (1, self.total) and done % max(1, self.total // 10)):
            return
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self.start
        share = done / self.total if fraction is None else fraction
        timing = f"{elapsed:5.1f}s"
        if done < self.total and share > 0:
            timing += f", about {_duration(elapsed * (1 - share) / share)} left"
        line = f"[{bar}] {done}/{self.total} {text} {timing}"
        end = "\r" if self.tty and done < self.total else "\n"
        sys.stderr.write(line + " " * max(0, self.shown - len(line)) + end)
        sys.stderr.flush()
        self.shown = len(line) if end == "\r" else 0
