"""Writing a feature-only store (kind "features"): one class, `FeatureWriter`, for every writer of one
(`jobs/ingest.py features` in its own process, `jobs/extract.py` from Ray Data's write tasks), to a
local folder or to a URI (`s3://bucket/prefix/store`).

While a store is written, its shards live in the writer's root:
- a local OUT: a hidden folder beside it (`.OUT.<work>`; a resumable writer's keeps that name, so that a
  rerun finds it; one that does not resume gets a new temporary name), published by one rename at the
  end, so a reader sees the old store or the new one;
- a URI: OUT itself (object stores have no rename). The manifest is written last, and readers ignore a
  prefix without one; the shards of a store being replaced (--overwrite) stay until the new manifest
  is in place.

    ROOT/writing.json            the writer's record: the options that decide the rows, the run's key
    ROOT/images/part-<first img_id>-<hash>.parquet   a shard (a TSV writer's: img_id, line)

A shard is named by its content: its first image's id and a hash of the run's key and its ids, so a
write retried (a task lost after writing, before its result came back) writes the same file again
instead of adding one. A local shard is written under a temporary name and renamed; an object appears
whole or not at all. Each shard's footer (the Arrow schema's metadata, `META`) records a sha256 of its
rows and what its writer asked to keep (the extraction: each image's input identity). A rerun lists the
shards (`existing`) and verifies each from its footer (schema, rows, ids against its name); the commit
publishes the shards it is given and removes every other shard of the root (partial or unreferenced).

The manifest's `content_sha256` is a sha256 over the shards' row digests in the manifest's order.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import re
import secrets
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from xmodal.base.console import progress_bar
from xmodal.base.outputs import check_uri, discard_partial, missing_parents, publish_dir, temp_dir_beside
from xmodal.data.atomic import check_target, local_target
from xmodal.data.errors import StoreError
from xmodal.data.location import Location, is_uri, locate
from xmodal.data.lxmert.features import (
    KIND,
    SCHEMA_VERSION,
    SHARD_DIR,
    FeatureManifest,
    FeatureShard,
    FeatureStore,
    open_features,
)
from xmodal.data.lxmert.rows import image_columns, image_schema, write_shard
from xmodal.data.lxmert.tsv import (
    IngestError,
    check_tsv_inputs,
    mark_random_weights,
    pack_images,
    parse_item,
    scan_tsv_ids,
    tsv_lines,
)
from xmodal.data.manifest import MANIFEST_FILE, kind_name, manifest_kind, options_diff, read_manifest_json

RECORD = "writing.json"
TMP = ".tmp-"
META = "xmodal.shard"  # the footer's key: {"sha256": rows' digest, "keep": what the writer asked to keep}
WRITER = "xmodal feature writer"
LINES = pa.schema([("img_id", pa.string()), ("line", pa.string())])  # a TSV writer's shards


def _safe(img_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", img_id)[:48] or "_"


def table_sha256(table: pa.Table) -> str:
    """A digest of the rows (their Arrow IPC stream, the schema's metadata left out)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema.remove_metadata()) as w:
        w.write_table(table)
    return hashlib.sha256(sink.getvalue()).hexdigest()


@dataclass(frozen=True)
class ShardInfo:
    """What the writer (and the extraction's driver) keeps of a written shard: its name, ids, rows, digest."""

    name: str
    ids: tuple[str, ...]
    sha256: str
    seconds: float = 0.0  # the write's own time (a write task's throughput)
    bytes: int = 0

    @property
    def rows(self) -> int:
        return len(self.ids)


def _fs(location: Location) -> tuple[pafs.FileSystem, str]:
    try:
        return location.fs, location.fs_path
    except StoreError:
        raise
    except (OSError, pa.ArrowException, ValueError) as e:
        raise StoreError(f"{location}: not a location pyarrow can write ({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class ShardSink:
    """Where and how a shard is written: pickled to every write task. `folder`: the shards' folder (a
    local path every writing host sees, or a URI); `key`: the run's key (in every shard's name)."""

    folder: str
    key: str
    row_group_images: int = 32

    def name(self, ids: Iterable[str]) -> str:
        ids = list(ids)
        digest = hashlib.sha256("\n".join([self.key, *ids]).encode()).hexdigest()[:16]
        return f"part-{_safe(ids[0])}-{digest}.parquet"

    def write(self, table: pa.Table, keep: Any = None) -> ShardInfo:
        """Write `table` (its first column img_id) as one shard, whole or not at all; `keep` (JSON) goes
        into its footer."""
        began = time.perf_counter()
        ids = tuple(str(x) for x in table.column("img_id").to_pylist())
        name, digest = self.name(ids), table_sha256(table)
        table = table.replace_schema_metadata({META: json.dumps({"sha256": digest, "keep": keep})})
        fs, folder = _fs(Location(self.folder))
        final = f"{folder}/{name}"
        local = isinstance(fs, pafs.LocalFileSystem)
        path = f"{folder}/{TMP}{name}-{uuid.uuid4().hex[:8]}" if local else final
        try:
            with fs.open_output_stream(path) as f:
                write_shard(table, f, self.row_group_images)
                size = f.tell()
            if local:
                fs.move(path, final)
        except BaseException:
            if local:
                Path(path).unlink(missing_ok=True)
            raise
        return ShardInfo(name, ids, digest, time.perf_counter() - began, size)


@dataclass
class Existing:
    """The shards a rerun found: `verified` (name -> info, no image in two of them) with each one's kept
    footer data; `stray`: the others (partial, unreadable, not of this run, overlapping), removed at commit."""

    verified: dict[str, ShardInfo] = field(default_factory=dict)
    kept: dict[str, Any] = field(default_factory=dict)
    stray: list[str] = field(default_factory=list)

    def ids(self) -> dict[str, str]:
        """img_id -> the verified shard holding it."""
        return {i: name for name, info in self.verified.items() for i in info.ids}


class FeatureWriter:
    """A feature-only store (or, `lines=True`, a TSV's shards) being written for `out`.

    `options`: what decides the rows, recorded in the root: a rerun with others is refused naming the
    root, whose work is kept (`restart` discards it once the new run starts). `work`: the resumable
    root's name beside a local OUT (`.OUT.<work>`); None: a writer that does not resume (a new temporary
    folder, or at a URI whatever an earlier failed write of the same options left, discarded at start).
    Constructing it checks OUT (`--overwrite` replaces a store of the same kind only; a URI is reached
    and written to). Nothing is made before `start()`."""

    def __init__(self, out: str | Path, *, options: dict[str, Any], overwrite: bool = False, restart: bool = False,
                 work: str | None = None, lines: bool = False, option: str = "OUT"):
        self.options = json.loads(json.dumps(options))
        self.overwrite, self.lines, self.option = overwrite, lines, option
        self.remote = is_uri(str(out)) and locate(str(out)).local is None
        self.resumable = work is not None
        self.started = False
        self._made: list[Path] = []
        self._key: str | None = None
        if self.remote:
            self.out = locate(str(out))
            self.root: Location | None = self.out
            self._check_remote()
        else:
            path = Path(str(out)).expanduser().resolve() if lines else local_target(str(out))
            if not lines:
                try:
                    check_target(path, overwrite, KIND)
                except StoreError as e:
                    raise StoreError(f"{option} {e}") from None
            self.out = Location(str(path))
            self.root = Location(str(path.parent / f".{path.name}.{work}")) if work else None
        self.record = self._read_record()
        if not restart:
            self._check_record()
        self.restart = restart or (self.record is not None and not self.resumable)

    # ------------------------------------------------------------------ checks

    def _check_remote(self) -> None:
        """A URI OUT, by listing only (nothing is written before `probe`): a prefix, holding nothing, or this
        writer's unfinished work, or a feature-only store to replace (--overwrite)."""
        check_uri(str(self.out), self.option)
        fs, path = _fs(self.out)
        try:
            info = fs.get_file_info(path)
            entries = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except (OSError, pa.ArrowException) as e:
            raise self._unreachable(e) from None
        if info.type == pafs.FileType.File:
            raise StoreError(f"{self.option} {self.out}: is an object, not a prefix; expected a prefix for the store")
        found = self._kind()
        if found is None:
            foreign = [i.base_name for i in entries if i.base_name not in (RECORD, SHARD_DIR, "rejects.jsonl")]
            if foreign:
                raise StoreError(f"{self.option} {self.out}: holds {foreign[0]!r}, which is not part of a store; "
                                 "choose another prefix")
        elif found != KIND:
            raise StoreError(f"{self.option} {self.out}: holds {kind_name(found)} (kind {found!r}); refusing to "
                             f"replace it with a feature-only store{' even with --overwrite' if self.overwrite else ''}")
        elif not self.overwrite:
            raise StoreError(f"{self.option} {self.out}: already exists; pass --overwrite to replace it (a "
                             "feature-only store)")

    def _unreachable(self, e: BaseException) -> StoreError:
        return StoreError(f"{self.option} {self.out}: cannot be written ({type(e).__name__}: "
                          f"{str(e).strip().splitlines()[0][:300]}); check the bucket and this process's AWS_* "
                          "credentials, endpoint and region")

    def probe(self) -> None:
        """The last check before any work: a URI OUT is written to (a small object, removed again), so that a
        missing bucket or credentials that may not write fail here, in one line naming the URI. (Removing
        it may leave the empty folder marker pyarrow's S3 file system keeps for a prefix: no object of a
        store, and the store is written there next.) A local OUT was checked writable already."""
        if not self.remote:
            return
        fs, path = _fs(self.out)
        probe = f"{path}/.xmodal-write-probe-{uuid.uuid4().hex[:8]}"
        try:
            with fs.open_output_stream(probe) as f:
                f.write(b"probe")
            fs.delete_file(probe)
        except (OSError, pa.ArrowException) as e:
            raise self._unreachable(e) from None

    def _kind(self) -> str | None:
        m = self.out / MANIFEST_FILE
        return manifest_kind(read_manifest_json(m)) if m.is_file() else None

    def _read_record(self) -> dict | None:
        """The root's record; None where there is no unfinished work. A local root, or remote shards beside
        no manifest, without one: not ours, refused."""
        if self.root is None:
            return None
        try:
            raw = json.loads((self.root / RECORD).read_text())
        except FileNotFoundError:
            raw = None
            if not (set(self._shard_names()) - self._live()) and not (not self.remote and self.root.is_dir()):
                return None
        except (OSError, ValueError):
            raw = None
        if not isinstance(raw, dict) or raw.get("writer") != WRITER:
            raise StoreError(f"{self.root}: holds no record of an unfinished store ({RECORD}); it was not made "
                             "by this writer and is left as it is: move it away, or remove it yourself")
        return raw

    def _check_record(self) -> None:
        if self.record is None:
            return
        recorded = self.record.get("options")
        if recorded != self.options or self.record.get("kind") != self._record_kind():
            diff = options_diff(recorded if isinstance(recorded, dict) else {}, self.options) \
                or [f"format: made as {self.record.get('kind')}, asked for {self._record_kind()}"]
            raise StoreError(f"{self.root}: an unfinished {self.record.get('kind')} output made with other options "
                             f"is kept there ({len(self._shard_names())} shard(s); {'; '.join(diff)}); rerun it with "
                             "its options to finish it, or pass --restart to discard it and start over")

    def _record_kind(self) -> str:
        return "tsv" if self.lines else KIND

    # ------------------------------------------------------------------ listing

    def _shard_dir(self) -> Location:
        assert self.root is not None, "start() first"
        return self.root / SHARD_DIR

    def _shard_names(self) -> list[str]:
        """The finished shards' names under the root (a local writer's temporary files left out)."""
        if self.root is None:
            return []
        fs, path = _fs(self._shard_dir())
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except (OSError, pa.ArrowException) as e:
            raise StoreError(f"{self._shard_dir()}: cannot be listed ({type(e).__name__}: {e})") from None
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.File
                      and i.base_name.startswith("part-") and i.base_name.endswith(".parquet"))

    def _live(self) -> set[str]:
        """The shards a published manifest at a remote OUT references (kept until a new one replaces it)."""
        if not self.remote or self._kind() != KIND:
            return set()
        return {f.file.removeprefix(f"{SHARD_DIR}/") for f in FeatureManifest.read(self.out).shards}

    def existing(self, schema: pa.Schema) -> Existing:
        """The shards an earlier run of this work left, each verified from its footer (the schema, the rows,
        the ids against the name); of two holding one image the first wins. The others are stray."""
        out = Existing()
        if self.record is None or self.restart:
            return out
        sink, seen, live = self.sink(), set(), self._live()
        for name in self._shard_names():
            if name in live:
                continue
            try:
                pf = pq.ParquetFile((self._shard_dir() / name).open_input_file())
                meta = json.loads((pf.schema_arrow.metadata or {}).get(META.encode(), b"{}"))
                ids = tuple(pf.read(columns=["img_id"]).column("img_id").to_pylist())
                ok = (pf.schema_arrow.remove_metadata().equals(schema) and pf.metadata.num_rows == len(ids) > 0
                      and sink.name(ids) == name and isinstance(meta.get("sha256"), str))
            except (OSError, pa.ArrowException, ValueError, KeyError):
                ok, ids = False, ()
            if not ok or seen.intersection(ids):
                out.stray.append(name)
                continue
            seen.update(ids)
            out.verified[name] = ShardInfo(name, ids, meta["sha256"])
            out.kept[name] = meta.get("keep")
        return out

    def finished_images(self) -> int:
        """Images in the root's finished shards (a live store's left out), by their footers."""
        live = self._live()
        return sum(pq.ParquetFile((self._shard_dir() / n).open_input_file()).metadata.num_rows
                   for n in self._shard_names() if n not in live)

    # ------------------------------------------------------------------ writing

    def sink(self, row_group_images: int = 32) -> ShardSink:
        """What a write task needs (the run's key: the record's, or a new one when starting over)."""
        if self._key is None:
            recorded = (self.record or {}).get("key")
            self._key = recorded if isinstance(recorded, str) and not self.restart else secrets.token_hex(8)
        return ShardSink(str(self._shard_dir()), self._key, row_group_images)

    def start(self) -> None:
        """Make the root and its record (once). Unfinished work that is not resumed (--restart) is discarded
        first; temporary files of a killed run are removed."""
        if self.started:
            return
        if self.root is None:
            path = Path(str(self.out))
            self._made = missing_parents(path)
            self.root = Location(str(temp_dir_beside(path)))
        elif self.record is not None and self.restart:
            self._discard_work()
        elif not self.remote:
            self._made = missing_parents(Path(str(self.root)))  # removed again if the run ends empty
        self.record = {"writer": WRITER, "kind": self._record_kind(), "options": self.options, "key": self.sink().key}
        fs, shards = _fs(self._shard_dir())
        fs.create_dir(shards, recursive=True)
        if not self.remote:
            for p in Path(shards).iterdir():
                if p.name.startswith(TMP):
                    p.unlink()
        self._put(RECORD, (json.dumps(self.record, indent=2) + "\n").encode())
        self.restart, self.started = False, True

    def probe_paths(self) -> tuple[str, str]:
        """(the shards' folder, the record): what every writing host must reach (`start()` first)."""
        return str(self._shard_dir()), str(self.root / RECORD)

    def write(self, table: pa.Table, row_group_images: int, keep: Any = None) -> ShardInfo:
        """One shard written from this process (an ingest's)."""
        self.start()
        return self.sink(row_group_images).write(table, keep)

    def _put(self, name: str, data: bytes | None) -> None:
        """A file of the root written (None: removed where it is)."""
        fs, path = _fs(self.root / name)
        if data is None:
            try:
                fs.delete_file(path)
            except FileNotFoundError:
                pass
            return
        with fs.open_output_stream(path) as f:
            f.write(data)

    # ------------------------------------------------------------------ the end

    def _remove(self, names: Iterable[str]) -> None:
        fs, folder = _fs(self._shard_dir())
        for n in names:
            try:
                fs.delete_file(f"{folder}/{n}")
            except FileNotFoundError:
                pass

    def _discard_work(self) -> None:
        """The unfinished work at the root (ours by its record): every shard but a live store's, the record."""
        if self.remote:
            self._remove(set(self._shard_names()) - self._live())
            self._put(RECORD, None)
        else:
            shutil.rmtree(str(self.root), ignore_errors=True)
        self.record = None

    def discard_if_empty(self) -> None:
        """After a failure: a resumable root holding no finished shard is removed (nothing to resume, nothing
        to block the next run); a non-resumable writer's work is removed whatever it holds."""
        if not self.started:
            return
        if not self.resumable or not set(self._shard_names()) - self._live():
            self._discard_work()
            if not self.remote:
                discard_partial(None, self._made)
            self.started = False

    def commit(self, shards: list[ShardInfo], manifest: Callable[[list[FeatureShard], str], FeatureManifest],
               files: dict[str, bytes | None] | None = None) -> Location:
        """Publish the store of `shards`, in this order: every other shard of the root removed (partial,
        unreferenced), the manifest (`manifest(shards, content_sha256)`) and `files` (None: removed)
        written, the store checked, then published: renamed into place (local), or its manifest written
        last (a URI) and the replaced store's shards removed after it. Returns OUT."""
        self.start()
        names = [s.name for s in shards]
        if len(set(names)) != len(names) or len({i for s in shards for i in s.ids}) != sum(s.rows for s in shards):
            raise StoreError(f"{self.root}: the shards to publish hold an image twice; nothing was published")
        live = self._live()
        self._remove(set(self._shard_names()) - set(names) - live)
        digest = hashlib.sha256("".join(s.sha256 for s in shards).encode()).hexdigest()
        m = manifest([FeatureShard(file=f"{SHARD_DIR}/{s.name}", rows=s.rows) for s in shards], digest)
        m.created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        for name, data in (files or {}).items():
            self._put(name, data)
        self._put(MANIFEST_FILE, m.to_json().encode())
        if self.remote:
            try:
                open_features(self.out)
            except StoreError:
                self._put(MANIFEST_FILE, None)
                raise
            self._remove(live - set(names))
        else:
            root, out = Path(str(self.root)), Path(str(self.out))
            open_features(root)  # check what was written before it becomes visible
            publish_dir(root, out, lambda: check_target(out, self.overwrite, KIND))
            self.root = self.out
        self._put(RECORD, None)
        return self.out

    def lines_to(self, shards: list[ShardInfo], file: Path) -> None:
        """A TSV writer's shards' lines, in this order, into `file`."""
        with open(file, "w", encoding="utf-8") as f:
            for s in shards:
                f.writelines(pq.read_table(str(self._shard_dir() / s.name), columns=["line"]).column("line").to_pylist())

    def remove_work(self) -> None:
        """After a TSV's publish: its root, now copied into the file."""
        shutil.rmtree(str(self.root), ignore_errors=True)


def ingest_features(out: str | Path, tsv: Sequence[str | Path], *, num_objects: int = 36,
                    feat_dim: int | None = None, num_object_labels: int = 1600, num_attr_labels: int = 400,
                    images_per_shard: int = 256, row_group_images: int = 32, overwrite: bool = False,
                    progress: bool = True) -> FeatureStore:
    """Reference feature TSVs (or extracted stores) -> a feature-only store at `out` (a local folder or a
    URI). Every line is pre-scanned first (a line cut short, a duplicate img_id or another feature width
    fails, named by file:line, before any decoding), then decoded and checked as the LXMERT ingest does;
    nothing is left behind on error."""
    options = {"num_objects": num_objects, "feat_dim": feat_dim, "num_object_labels": num_object_labels,
               "num_attr_labels": num_attr_labels, "images_per_shard": images_per_shard,
               "row_group_images": row_group_images}
    writer = FeatureWriter(out, options=options, overwrite=overwrite, option="output folder")  # before reading
    paths = [Path(p).expanduser().resolve() for p in tsv]
    if not paths:
        raise IngestError("need at least one feature TSV file")
    check_tsv_inputs(paths)  # a feature TSV file, or a store from jobs/extract.py
    for name, value in (("num_objects", num_objects), ("num_object_labels", num_object_labels),
                        ("num_attr_labels", num_attr_labels), ("images_per_shard", images_per_shard),
                        ("row_group_images", row_group_images), ("feat_dim", 1 if feat_dim is None else feat_dim)):
        if value < 1:
            raise IngestError(f"--{name.replace('_', '-')} {value}: expected >= 1")
    located = scan_tsv_ids(paths, progress, feat_dim)
    if not located:
        raise IngestError(f"no image in {', '.join(str(p) for p in paths)}: the files hold no line")
    mark_random_weights(paths, options)
    writer.probe()
    shards: list[ShardInfo] = []
    buffer: list = []
    width = feat_dim

    def flush() -> None:
        assert width is not None
        cols = image_columns(pack_images(buffer, num_objects, width))
        table = pa.Table.from_pydict(cols, schema=image_schema(num_objects, width))
        shards.append(writer.write(table, min(row_group_images, images_per_shard)))
        buffer.clear()

    try:
        bar = progress_bar(len(located), "decode TSV", "img", progress)
        for where, line in tsv_lines(paths):
            im = parse_item(line, where, feat_dim=width, num_objects=num_objects,
                            num_object_labels=num_object_labels, num_attr_labels=num_attr_labels)
            width = im.features.shape[1]
            buffer.append(im)
            if len(buffer) >= images_per_shard:
                flush()
            bar.update(1)
        bar.close()
        if buffer:
            flush()
        assert width is not None
        writer.commit(shards, lambda files, digest: FeatureManifest(
            schema_version=SCHEMA_VERSION, kind=KIND, num_objects=num_objects, feat_dim=width,
            num_object_labels=num_object_labels, num_attr_labels=num_attr_labels, shards=files, source="tsv",
            inputs=[str(p) for p in paths], content_sha256=digest, options={**options, "feat_dim": width}))
    except BaseException:
        writer.discard_if_empty()
        raise
    return open_features(out)
