"""The joint QA answer table (9,500 answers in the paper) and the answer normalisation of
docs/papers.md#answer-table-and-normalisation.

Answers are looked up after normalisation, exactly as the reference `AnswerTable.convert_ans` does,
so a table loaded from the reference `all_ans.json` and one built here from the corpus agree on what
counts as the same answer. Imports only the standard library.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from xmodal.base.errors import UserError
from xmodal.data.jsonfile import read_json_file

# Whole-answer rewrites (reference ANS_CONVERT; plus "zero", which docs/papers.md's "number words to digits" covers).
_CONVERT: dict[str, str] = {
    "a man": "man", "the man": "man", "a woman": "woman", "the woman": "woman",
    "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5", "six": "6",
    "seven": "7", "eight": "8", "nine": "9", "ten": "10", "grey": "gray",
}


def normalize_answer(ans: str) -> str:
    """Lower-case, strip a trailing '.', strip a leading 'a '/'an '/'the ', number words -> digits,
    'grey' -> 'gray' (docs/papers.md#answer-table-and-normalisation; same order as the reference `convert_ans`)."""
    ans = ans.strip().lower()
    if not ans:
        return ""
    if ans.endswith("."):
        ans = ans[:-1].strip()
    for article in ("a ", "an ", "the "):
        if ans.startswith(article):
            ans = ans[len(article):].strip()
    return _CONVERT.get(ans, ans)


class AnswerError(UserError):
    """A bad answer file; the message names the file, the entry and what was expected."""


class AnswerTable:
    """Answer string <-> label index. Stored in the feature store as `answers.json` (a JSON list)."""

    FILE = "answers.json"

    def __init__(self, answers: list[str]):
        self.answers: list[str] = list(answers)
        self._index: dict[str, int] = {}
        for i, a in enumerate(self.answers):
            self._index.setdefault(a, i)  # first occurrence wins if a source table repeats an answer

    def __len__(self) -> int:
        return len(self.answers)

    def __contains__(self, ans: str) -> bool:
        return normalize_answer(ans) in self._index

    def index(self, ans: str) -> int | None:
        """Label of `ans` after normalisation, or None if it is not in the table."""
        return self._index.get(normalize_answer(ans))

    def answer(self, label: int) -> str:
        return self.answers[label]

    # ----------------------------------------------------------------- building

    @classmethod
    def from_reference(cls, path: str | Path, limit: int | None = None) -> AnswerTable:
        """Load the reference `all_ans.json`: a list of {"ans": str, "dsets": [...]}.

        The entries are normalised (the reference stores them normalised already, so this is a no-op
        there); `limit` keeps the first `limit` entries.
        """
        p = Path(path)
        if limit is not None and limit < 1:
            raise AnswerError(f"--num-answers {limit}: expected an answer table size >= 1")
        data = read_json_file(p, AnswerError, what="answer file", expected="a JSON answer file")
        if not isinstance(data, list):
            raise AnswerError(f"{p}: expected a JSON list of {{\"ans\": ..., \"dsets\": [...]}}, "
                              f"got {type(data).__name__}")
        answers: list[str] = []
        for i, entry in enumerate(data):
            if isinstance(entry, dict) and isinstance(entry.get("ans"), str):
                answers.append(normalize_answer(entry["ans"]))
            elif isinstance(entry, str):  # a plain list of strings (our own answers.json) is fine too
                answers.append(normalize_answer(entry))
            else:
                raise AnswerError(f"{p}: entry #{i}: expected {{\"ans\": str, \"dsets\": [...]}}, got {entry!r:.80}")
        if limit is not None:
            answers = answers[:limit]
        if not answers:
            raise AnswerError(f"{p}: the answer table is empty")
        return cls(answers)

    @classmethod
    def most_frequent(cls, answers: Iterable[str], k: int) -> AnswerTable:
        """The `k` most frequent normalised answers (ties broken alphabetically, so the table is
        deterministic). Each question contributes each of its candidate answers once."""
        counts = Counter(a for a in (normalize_answer(x) for x in answers) if a)
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return cls([a for a, _ in ranked[:k]])

    # ----------------------------------------------------------------- persistence

    def save(self, directory: str | Path) -> Path:
        p = Path(directory) / self.FILE
        p.write_text(json.dumps(self.answers, ensure_ascii=False))
        return p

    @classmethod
    def load(cls, directory: str | Path | Any) -> AnswerTable:
        """From a store folder: a local path, or a store's `data.location.Location` (anything with `/`
        and `read_text`: a remote store's file is read through its file system)."""
        p = (Path(directory) if isinstance(directory, str) else directory) / cls.FILE
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise AnswerError(f"{p}: the store has no answer table") from None
        except json.JSONDecodeError as e:
            raise AnswerError(f"{p}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise AnswerError(f"{p}: cannot be read ({type(e).__name__}: {e})") from None
        if not isinstance(data, list) or not all(isinstance(a, str) for a in data):
            raise AnswerError(f"{p}: expected a JSON list of answer strings")
        return cls(data)
