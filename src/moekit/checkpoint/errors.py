"""The one exception of the checkpoint package."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint refused (nothing was written, nothing was loaded); lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(self.problems[0] if len(self.problems) == 1 else "\n  - " + "\n  - ".join(self.problems))
