"""Reading a JSON file a user gave on the command line: each way it can fail is one line that names
the file. Imports only the standard library (the answer table, which uses it, promises as much)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xmodal.base.errors import UserError


def read_json_file(path: Path, error: type[UserError], *, what: str = "file", expected: str) -> Any:
    """The parsed file. `error`: the caller's error class; `what`: the file as the missing-file line
    names it; `expected`: what the file should hold, said where it cannot be read as text."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{path}: {what} does not exist") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); expected {expected}") from None
    except OSError as e:  # a directory, unreadable
        raise error(f"{path}: cannot be read ({e.strerror}); expected {expected}") from None
