"""The data layer's one error: a missing, corrupted or inconsistent store or set (a `UserError`: one
line, exit 2, naming the file and what differs)."""

from __future__ import annotations

from xmodal.base.errors import UserError


class StoreError(UserError):
    """A missing, corrupted or inconsistent store; the message names the file and what differs."""
