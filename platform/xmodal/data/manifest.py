"""What every kind of data directory records and how it is read: `Manifest`, the base of the typed
`manifest.json` models (every manifest records its `kind`; reading one validates every field and names
the file, the dotted field, the bad value and what was expected), the kinds in words, the options a
store was built with against those asked for, and `ensure_derived`: the one policy for the embedded
synthetic defaults (derived data, rebuilt when built otherwise; a store the user named is never
modified). How stores are written: `xmodal.data.atomic`. The on-disk formats: docs/papers.md."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import pydantic

from xmodal.base.console import say
from xmodal.data.errors import StoreError
from xmodal.data.location import Location, is_uri, locate

MANIFEST_FILE = "manifest.json"


# kind recorded in manifest.json -> what it is, in words
KINDS: dict[str, str] = {
    "lxmert": "an LXMERT feature store",
    "features": "a feature-only image store",
    "mult": "a MulT store",
    "lxmert-finetune": "an LXMERT fine-tuning set",
}


T = TypeVar("T")


M = TypeVar("M", bound="Manifest")


def kind_name(kind: str | None) -> str:
    return KINDS.get(kind or "", f"a directory of unknown kind {kind!r}")


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Manifest(pydantic.BaseModel):
    """Base of every `manifest.json` model: unknown fields are errors, `kind` and `schema_version` are
    checked before the rest. Subclasses set KIND, SCHEMA_VERSION and, for manifests written before
    `kind` was recorded, `upgrade` (what an older format lacks, filled in on read)."""

    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=False)

    KIND: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int]
    # fields that are written for readers of the JSON but derived from the others (dropped on read)
    DERIVED: ClassVar[tuple[str, ...]] = ()

    schema_version: int
    kind: str

    # Set on read when the file was of an older format (upgraded in memory); None = current.
    _older_format: str | None = pydantic.PrivateAttr(default=None)

    @property
    def older_format(self) -> str | None:
        """Why the file this was read from is of an older format, or None."""
        return self._older_format

    @classmethod
    def upgrade(cls, raw: dict[str, Any]) -> str | None:
        """Bring an older manifest up to date in place; return what was old (None = it was current)."""
        return None

    @classmethod
    def read(cls: type[M], directory: str | Path | Location) -> M:
        """Read and validate `directory/manifest.json` (a local folder or a URI); a StoreError names
        what is wrong and where."""
        root = locate(directory)
        path = root / MANIFEST_FILE
        if not path.is_file():
            what = "does not exist" if not root.exists() else "has no manifest.json"
            raise StoreError(f"{root}: {what}; expected {KINDS[cls.KIND]} ({MANIFEST_FILE} with "
                             f"\"kind\": {cls.KIND!r})")
        raw = read_manifest_json(path)
        found = manifest_kind(raw)
        if found != cls.KIND:
            raise StoreError(f"{path}: kind {found!r} is {kind_name(found)}; expected {KINDS[cls.KIND]} "
                             f"(\"kind\": {cls.KIND!r})")
        older = cls.upgrade(raw)
        version = raw.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version != cls.SCHEMA_VERSION:
            raise StoreError(f"{path}: field schema_version = {_show(version)}: this code reads version "
                             f"{cls.SCHEMA_VERSION} of {KINDS[cls.KIND]}; re-create it")
        for name in cls.DERIVED:
            raw.pop(name, None)
        try:
            m = cls.model_validate(raw)
        except pydantic.ValidationError as e:
            raise StoreError(f"{path}: {_describe(e, cls)}") from None
        m._older_format = older
        m.check(str(path))
        return m

    def check(self, where: str) -> None:
        """Checks across fields (subclasses); raise StoreError naming `where`."""

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        return json.dumps(self.dump(), indent=2) + "\n"

    def write(self, directory: str | Path) -> None:
        (Path(directory) / MANIFEST_FILE).write_text(self.to_json())


def _describe(e: pydantic.ValidationError, cls: type[Manifest]) -> str:
    """The first problems of a ValidationError as 'field a.b.c = value: expected ...'."""
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        kind = err["type"]
        if err["loc"] and err["loc"][-1] == "[key]":  # a bad key of a mapping
            msg = err["msg"].removeprefix("Input should be ")
            parts.append(f"field {'.'.join(str(x) for x in err['loc'][:-2])} has key {_show(err['input'])}: "
                         f"expected {msg}")
        elif kind == "missing":
            parts.append(f"field {loc} is missing")
        elif kind == "extra_forbidden":
            known = ", ".join(f for f in cls.model_fields) if len(err["loc"]) == 1 else None
            parts.append(f"unknown field {loc} = {_show(err['input'])}"
                         + (f" (expected only: {known})" if known else ""))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            msg = msg[0].lower() + msg[1:] if msg else msg
            parts.append(f"field {loc} = {_show(err['input'])}: expected {msg.removeprefix('input should be ')}")
    more = len(e.errors()) - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def read_manifest_json(path: Path | Location) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise StoreError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def manifest_kind(raw: Mapping[str, Any]) -> str | None:
    """The kind a manifest records; LXMERT stores written before kinds were recorded have none but
    are recognised by their fields."""
    kind = raw.get("kind")
    if kind is None and "num_objects" in raw and "shards" in raw:
        return "lxmert"
    return kind if isinstance(kind, str) else None


def kind_at(path: Path | Location) -> str | None:
    """The kind of store or set at `path` (None if there is no manifest.json); StoreError if its
    manifest cannot be read."""
    mpath = path / MANIFEST_FILE
    if not mpath.is_file():
        return None
    return manifest_kind(read_manifest_json(mpath))


def options_json(options: Any) -> Any:
    """Options as they read back from a manifest (tuples become lists, and so on)."""
    return json.loads(json.dumps(options))


def options_diff(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """'name: built with X, asked for Y' for every option that differs."""
    keys = list(wanted) + [k for k in recorded if k not in wanted]
    return [f"{k}: built with {_show(recorded.get(k))}, asked for {_show(wanted.get(k))}" for k in keys
            if recorded.get(k) != wanted.get(k)]


def ensure_derived(path: str | Path, *, kind: str, read: Callable[[Path], Manifest],
                   stale: Callable[[Manifest], str | None], open_fn: Callable[[Path], T],
                   build: Callable[[Path, bool], T], what: str) -> T:
    """The policy of every embedded default (data the jobs build on first use): derived data.

    Missing: built. There and current: opened. Built with other options, or over another image store
    (`stale` returns why), or its manifest is of an older format: rebuilt atomically
    (`build(path, overwrite=True)`), with a one-line note on stdout saying why. `stale` raises for a
    directory at `path` that is not derived data (e.g. a store ingested from real files): that is
    never replaced, nor is a directory of another kind or one that is not a store.
    `what` names the default in messages ("the embedded synthetic LXMERT store").
    Derived data live on this machine's disk only: a remote `path` (a URI) is refused, never written
    (stores on S3 are made by ingesting locally and uploading, docs/cluster.md).
    """
    if is_uri(str(path)) and locate(path).local is None:
        raise StoreError(f"{path}: {what} is derived data, built on this machine's disk, never at a remote "
                         "location; give a local folder (a store on S3 is ingested locally, then uploaded)")
    p = Path(path).expanduser().resolve()
    for attempt in (0, 1):
        found = kind_at(p) if p.exists() else None
        if found is None:
            if p.exists() and not (p.is_dir() and not any(p.iterdir())):
                raise StoreError(f"{p}: exists and is not a store; {what} is built here: move it away")
            try:
                return build(p, False)
            except StoreError:
                if attempt == 0 and (p / MANIFEST_FILE).is_file():  # another process built it meanwhile
                    continue
                raise
        if found != kind:
            raise StoreError(f"{p}: holds {kind_name(found)}, not {KINDS[kind]}; {what} is built here: "
                             "move it away (it is not replaced)")
        manifest = read(p)
        why = stale(manifest)
        if why is None and manifest.older_format:
            why = f"its manifest is of an older format ({manifest.older_format})"
        if why is None:
            return open_fn(p)
        say(f"[xmodal] note: rebuilding {p} ({what}): {why}")
        return build(p, True)
    raise AssertionError("unreachable")
