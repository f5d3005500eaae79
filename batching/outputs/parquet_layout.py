"""Where a Parquet dataset keeps its files, and how a file is checked against its ledger row.

Layout::

    <root>/date=YYYY-MM-DD/model_version=<v>/part-<batch_id>.parquet   committed, published
    <root>.staging/<batch_id>.<lease_id>.parquet.tmp                   written, not yet published
    <root>.quarantine/<relative path>                                  moved aside by reconcile
    <root>/_batching_database.json                                     the database it answers to

Staging and quarantine are siblings of the root: outside it, so no reader's
``root/**/*.parquet`` glob sees them (DuckDB's does not skip ``_`` or ``.`` folders), and on the
same filesystem, so a rename into the dataset is atomic. ``date`` and ``model_version`` are
Hive partition columns: they live in the path, not in the file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePath, PurePosixPath
from typing import Any, BinaryIO
from urllib.parse import quote

import pyarrow as pa
import pyarrow.parquet as pq

from batching import errors
from batching.outputs import contract as sinks

logger = logging.getLogger(__name__)

STAGING_SUFFIX = ".parquet.tmp"
REWRITE = "rewrite"
"""The lease part of a staging file that reconcile's duplicate repair writes (``drop_rows``):
no claim holds it, so without a rule of its own a scorer starting meanwhile would sweep it."""
REWRITE_GRACE_S = 600.0
"""A rewrite's staging file younger than this is in flight; older, its repair died."""
_HASH_CHUNK = 1 << 20


# ----------------------------------------------------------------------------- file layout


@dataclass(frozen=True, slots=True)
class ParquetLayout:
    """Where a Parquet dataset keeps committed, staged and quarantined files (absolute paths).

    Staging and quarantine are siblings of the root by default: outside it, so a reader's
    ``root/**/*.parquet`` glob never matches them, and on the same filesystem, so a rename is
    atomic.
    """

    root: Path
    staging: Path
    quarantine: Path

    @classmethod
    def for_root(cls, root: str | Path, staging: str | Path | None = None) -> ParquetLayout:
        """The layout of dataset ``root``; raises ``ConfigError`` if staging is inside it."""
        base = Path(root).expanduser().absolute()
        stage = Path(staging).expanduser().absolute() if staging else _sibling(base, "staging")
        if stage == base or base in stage.parents:
            raise errors.ConfigError(
                f"staging folder {stage} is inside the dataset root {base}; readers would see "
                "uncommitted files. Put it beside the root (the default)"
            )
        return cls(base, stage, _sibling(base, "quarantine"))

    def relative_path(self, batch_id: str, model_version: str, scored_at: float) -> str:
        """``date=YYYY-MM-DD/model_version=<v>/part-<batch_id>.parquet`` (UTC day of scoring)."""
        day = datetime.fromtimestamp(scored_at, UTC).strftime("%Y-%m-%d")
        version = quote(model_version, safe="")
        return f"date={day}/model_version={version}/part-{batch_id}.parquet"

    def staging_file(self, batch_id: str, lease_id: str) -> Path:
        """The staging file of a batch; its name carries the lease that may commit it."""
        return self.staging / f"{batch_id}.{lease_id}{STAGING_SUFFIX}"

    def visible_files(self, since: float | None = None) -> list[str]:
        """Every ``*.parquet`` file a reader's glob sees, as POSIX paths relative to the root;
        with ``since``, only those in the ``date=`` partitions of its UTC day and after."""
        if not self.root.is_dir():
            return []
        folders = [self.root]
        if since is not None:
            first = "date=" + datetime.fromtimestamp(since, UTC).date().isoformat()
            folders = [
                p for p in self.root.iterdir() if p.name.startswith("date=") and p.name >= first
            ]
        found = (p for f in folders for p in f.rglob("*.parquet") if p.is_file())
        return sorted(p.relative_to(self.root).as_posix() for p in found)

    def walk_visible(self, after: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
        """The files :meth:`visible_files` lists, as path parts relative to the root, in the
        order of those parts, only those after ``after``: one folder's entries are held at a
        time, and folders wholly before ``after`` are not read (the full sweep's listing).
        Symlinked folders are not followed."""
        yield from _walk(self.root, (), after)

    def staging_files(self) -> list[Path]:
        """Every file in the staging folder."""
        if not self.staging.is_dir():
            return []
        return sorted(p for p in self.staging.iterdir() if p.is_file())

    def quarantine_file(self, path: Path) -> Path:
        """Move ``path`` into the quarantine folder (never deleted); returns where it went."""
        if self.staging in path.parents:
            rel = Path("staging") / path.name
        else:
            rel = path.relative_to(self.root)
        dest = self.quarantine / rel
        n = 0
        while dest.exists():
            n += 1
            dest = self.quarantine / f"{rel}.{n}"
        with sinks.translate_errors(f"cannot quarantine {path}"):
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, dest)
        logger.warning("file quarantined", extra={"action": "quarantine", "path": str(dest)})
        return dest


def _walk(
    folder: Path, parts: tuple[str, ...], after: tuple[str, ...]
) -> Iterator[tuple[str, ...]]:
    try:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return
    for entry in entries:
        child = (*parts, entry.name)
        if entry.is_dir(follow_symlinks=False):
            if child >= after[: len(child)]:
                yield from _walk(Path(entry.path), child, after)
        elif entry.name.endswith(".parquet") and child > after and entry.is_file():
            yield child


def unsafe_row(layout: ParquetLayout, row: Any) -> str | None:
    """Why a ledger row's paths may not be acted on, or None when they are safe.

    A path read back from the database is never trusted: a row naming ``../../x.parquet`` or
    an absolute path made start-up recovery move a staging file out of the dataset, and
    ``reconcile --repair`` fail on it. ``path`` must name a file inside the root, and the
    file name of ``staging_path`` (the folder part says which root wrote it) one inside the
    staging folder: no ``..``, absolute path, backslash or NUL byte, and no symlink leading
    out (paths are resolved).
    """
    path, staging_path = row.path, row.staging_path
    if not _inside(layout.root, path):
        return (
            f"ledger row for batch {row.batch_id} names a path outside the dataset root "
            f"{layout.root}: {path!r}"
        )
    name = PurePath(staging_path).name if isinstance(staging_path, str) else None
    if staging_path is not None and (
        not isinstance(staging_path, str) or _odd(staging_path) or not _inside(layout.staging, name)
    ):
        return (
            f"ledger row for batch {row.batch_id} names a staging file outside the staging "
            f"folder {layout.staging}: {staging_path!r}"
        )
    return None


def _odd(text: str) -> bool:
    return "\x00" in text or "\\" in text


def _inside(folder: Path, rel: object) -> bool:
    """Whether ``rel`` is a relative path naming something inside ``folder`` (resolved)."""
    if not isinstance(rel, str) or not rel or _odd(rel):
        return False
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts:
        return False
    try:
        base = folder.resolve()
        resolved = (folder / pure).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name the OS refuses
        return False
    return base in resolved.parents


def parse_staging_name(name: str) -> tuple[str, str] | None:
    """``(batch_id, lease_id)`` from a staging file name, or None when it is not one of ours."""
    if not name.endswith(STAGING_SUFFIX):
        return None
    parts = name[: -len(STAGING_SUFFIX)].split(".")
    if len(parts) != 2 or not all(sinks.SAFE_ID.match(p) for p in parts):
        return None
    return parts[0], parts[1]


def _sibling(root: Path, what: str) -> Path:
    return root.parent / f"{root.name}.{what}"


def rewrite_in_flight(path: Path, lease_id: str) -> bool:
    """A duplicate repair's staging file, written moments ago: its commit may follow."""
    if lease_id != REWRITE:
        return False
    try:
        return time.time() - path.stat().st_mtime < REWRITE_GRACE_S
    except FileNotFoundError:
        return False


def check_file(
    path: Path, *, n_rows: int, n_bytes: int | None, sha256: str | None
) -> tuple[str | None, frozenset[str]]:
    """Read a committed file back against its ledger row, through one open file: a rename
    under way (staging to dataset) cannot make a good file look unreadable half-way.

    Returns ``(problem, item_keys)``: ``problem`` is None when the size (bytes), sha256 and row
    count match and the file is readable; otherwise a reason, and ``item_keys`` is empty.

    Raises:
        FileNotFoundError, IsADirectoryError, NotADirectoryError: no file at ``path`` (look
            for it elsewhere; it is not corrupt).
        PermissionError: this process may not read it (not corrupt either).
    """
    try:
        with path.open("rb") as f:
            size, digest = _digest(f)
            if n_bytes is not None and size != n_bytes:
                return f"{size} bytes, ledger says {n_bytes}", frozenset()
            if sha256 is not None and digest != sha256:
                return "sha256 differs from the ledger", frozenset()
            f.seek(0)
            # No Arrow thread pool: one small column, and a pool's threads still alive at
            # exit abort the interpreter now and then (apache/arrow#34314), seen as
            # `batching reconcile` exiting -6 after a clean report.
            keys = (
                pq.ParquetFile(f, pre_buffer=False)
                .read(columns=["item_key"], use_threads=False)
                .column(0)
                .to_pylist()
            )
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError):
        raise  # not here, or not ours to read: neither says the file is corrupt
    except (OSError, pa.ArrowException) as exc:
        return f"unreadable: {exc}", frozenset()
    if len(keys) != n_rows:
        return f"{len(keys)} rows, ledger says {n_rows}", frozenset()
    return None, frozenset(keys)


def _digest(f: BinaryIO) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    while chunk := f.read(_HASH_CHUNK):
        h.update(chunk)
        size += len(chunk)
    return size, h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- its owner

OWNER_FILE = "_batching_database.json"
"""In the dataset root: the id of the queue database whose ledger the dataset's files answer
to, written by the first scorer to use the root. A second database's scorer (another
``batching.db``, a rollout walk-through's own database) writing into the same root mixed two
ledgers' files: each database's reconcile took the other's files for orphans, and its
``--repair`` set them aside (found by a walk-through); its start-up swept the other's staging
files. Readers skip it: it is not ``*.parquet``, and pyarrow and Spark skip names that begin
with ``_``."""


def _owner_of(root: Path) -> str | None:
    """The database id recorded in ``root``, or None (no file yet: an older release's dataset,
    or nothing written).

    Raises:
        SinkError: the file is there and cannot be read, or names no database.
    """
    path = root / OWNER_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except PermissionError as exc:
        raise errors.SinkError(
            f"cannot read {path} ({exc.strerror}); give this user read access to the dataset"
        ) from None
    except OSError as exc:
        raise errors.SinkError(f"cannot read {path} ({exc.strerror or exc})") from None
    try:
        found = json.loads(text).get("database_id")
    except (ValueError, AttributeError):
        found = None
    if not found:  # an empty file would otherwise stop every claim, and refuse nobody
        raise errors.SinkError(
            f"{path} names no database (damaged); it records which database this dataset's "
            "files answer to: delete it, and the next scorer records its own"
        )
    return str(found)


def _claim(root: Path, database_id: str) -> None:
    """Write ``root``'s owner file unless one is there: written whole and fsynced, then
    linked into place, so a reader never sees it half written and of two claims at once one
    wins. Where the filesystem has no hard links (vfat, some network mounts), created
    exclusively and written in place instead."""
    note = {"database_id": database_id, "about": "the batching database these files answer to"}
    body = (json.dumps(note) + "\n").encode("utf-8")
    target = root / OWNER_FILE
    tmp = root / f".{OWNER_FILE}.{uuid.uuid4().hex}.tmp"
    with sinks.translate_errors(f"cannot record the owner of {root}"):
        try:
            _write_synced(tmp, body, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                os.link(tmp, target)
            except FileExistsError:
                pass  # another claim got there first: its owner is read next
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.ENOSYS, errno.EXDEV):
                    raise
                with contextlib.suppress(FileExistsError):
                    _write_synced(target, body, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(root)


def _write_synced(path: Path, body: bytes, flags: int) -> None:
    fd = os.open(path, flags, 0o644)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)


def check_owner(root: Path, database_id: str, *, claim: bool) -> None:
    """Refuse ``root`` when another database owns it; with ``claim``, record ``database_id``
    as its owner if none is (atomically: two scorers claiming at once, one wins).

    Raises:
        ConfigError: another database owns it, or it is a Delta table.
        SinkError: the owner file cannot be read or written.
    """
    if (root / "_delta_log").is_dir():
        raise errors.ConfigError(
            f"output {root} is a Delta table (it has _delta_log); a Parquet output needs a "
            "folder of its own: set output.kind: delta, or another output.path"
        )
    owner = _owner_of(root)
    if owner is None and claim:
        _claim(root, database_id)
        owner = _owner_of(root)
    if owner is not None and owner != database_id:
        raise errors.ConfigError(
            f"output {root} holds the outputs of another queue database (its {OWNER_FILE} "
            f"names {owner}; this database is {database_id}): two databases' ledgers cannot "
            "share one dataset. Give this config an output.path of its own (or --output); "
            "if the other database is gone for good, move the dataset aside"
        )
