"""The one base type of every error a user can cause (a config key, a file, a record, a value).

The command line catches `UserError` once (`xmodal.base.commands.user_errors`) and prints its message on stderr
with exit code 2 and no traceback; any other exception is a bug and keeps its traceback.
Subclasses stay `ValueError`s, so code that catches bad values keeps working.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input, named in the message: the key, file (and line or record), the value, what is allowed."""


class RunInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (SIGINT) or SIGTERM: the command line prints `str(self)`, one line
    saying where it stopped and how to resume, and exits 130 (128 + SIGINT, as a shell does).
    `hint`: what the command line needs to find the run again (its generated name), set by the caller
    that named it."""

    def __init__(self, how: str, step: int, note: str = ""):
        super().__init__(how, step, note)
        self.how, self.step, self.note, self.hint = how, step, note, ""

    def __str__(self) -> str:
        return (f"[xmodal] stopped {self.how}; rerun the same command{self.hint} to resume from step "
                f"{self.step}{self.note}")
