"""The one base type of every error a user can cause (a config key, a file, a record, a value).

The command line catches `UserError` once (`xmodal.cli.user_errors`) and prints its message on stderr
with exit code 2 and no traceback; any other exception is a bug and keeps its traceback.
Subclasses stay `ValueError`s, so code that catches bad values keeps working.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input, named in the message: the key, file (and line or record), the value, what is allowed."""
