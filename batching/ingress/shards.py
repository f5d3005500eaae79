"""Bulk scoring in place: an input Parquet dataset as shards (file x row-group range) in the
queue, instead of one queue row per input row.

:func:`plan` reads each file's footer and fingerprint (sha256 of its bytes) and cuts its row
groups into shards of about ``rows_per_shard`` rows; :func:`records` turns them into queue
items (``lane`` :data:`LANE`, the shard as the JSON payload, its rows as the cost); a scorer
reads a claimed shard's rows back with :func:`read`, which refuses a file whose bytes are no
longer those planned (a changed input is refused, never half-scored). Enqueueing is
idempotent on the shard key, which names the file, its fingerprint and the row groups; a plan
over a file that changed since its shards were queued is refused (``compose.inplace.refuse_changed``).

100M input rows cost 100M model rows and a few thousand queue rows: every guarantee of the
queue (fencing, attempts, exactly-once commit, reconcile) then holds per shard.

Why it stays one module: the plan, the key, the split into halves and the read all do the
same row arithmetic (row groups, ``first_row``, ``skip``, ``rows``) on :class:`Shard`; apart,
a change to one could silently read other rows than the key names.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq
import sqlalchemy as sa

from batching import errors, models
from batching.store import schema

if TYPE_CHECKING:
    from batching.ingress.queue import SqlQueue

LANE = "shard"
"""The lane of shard items: a claim for shards takes this lane only."""
ROWS_PER_SHARD = 65_536
"""Rows a shard holds at least (whole row groups), unless its file has fewer left."""
KEY_PREFIX = "inplace:"
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class Shard:
    """Row groups ``[first_group, end_group)`` of one file, ``skip`` rows into them: rows
    ``[first_row, first_row + rows)`` of the file (a split shard holds part of its groups). ``path`` is absolute; ``relpath`` names it within its dataset; ``sha256`` and
    ``size`` and ``mtime_ns`` are the file's when planned."""

    path: str
    relpath: str
    sha256: str
    size: int
    mtime_ns: int
    first_group: int
    end_group: int
    first_row: int
    rows: int
    skip: int = 0
    part: str = ""

    @property
    def key(self) -> str:
        """The shard's queue key: file, fingerprint (16 hex digits) and row groups; a split
        shard's, its parent's and ``/0`` or ``/1``."""
        groups = f"rg{self.first_group}-{self.end_group - 1}"
        return f"{KEY_PREFIX}{self.relpath}@{self.sha256[:16]}:{groups}{self.part}"

    def payload(self) -> bytes:
        """The shard as its queue item's JSON payload."""
        fields = {
            "path": self.path,
            "relpath": self.relpath,
            "sha256": self.sha256,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "row_groups": [self.first_group, self.end_group],
            "rows": [self.first_row, self.rows],
            "skip": self.skip,
            "part": self.part,
        }
        return json.dumps(fields, separators=(",", ":")).encode()

    def halves(self) -> tuple[Shard, Shard]:
        """The shard cut in two (:func:`split`), keyed ``<key>/0`` and ``<key>/1``."""
        n = self.rows // 2
        first = replace(self, rows=n, part=f"{self.part}/0")
        second = replace(
            self,
            first_row=self.first_row + n,
            rows=self.rows - n,
            skip=self.skip + n,
            part=f"{self.part}/1",
        )
        return first, second

    @classmethod
    def of(cls, payload: models.Payload) -> Shard:
        """The shard a queue item holds.

        Raises:
            InputError: the payload is not a shard (this queue holds other items).
        """
        try:
            obj = json.loads(payload.data)
            (g0, g1), (r0, n) = obj["row_groups"], obj["rows"]
            shard = cls(
                str(obj["path"]),
                str(obj["relpath"]),
                str(obj["sha256"]),
                int(obj["size"]),
                int(obj["mtime_ns"]),
                int(g0),
                int(g1),
                int(r0),
                int(n),
                int(obj.get("skip", 0)),
                str(obj.get("part", "")),
            )
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            raise errors.InputError(
                "not an input shard (queue items of lane 'shard' are written by `batching "
                "bulk --in-place`); score other items with `batching score`"
            ) from None
        return shard


@dataclass(frozen=True, slots=True)
class Plan:
    """An input dataset cut into shards; ``version``: a Delta table's version, else sha256
    over its files' names and fingerprints (the dataset version lineage records)."""

    root: Path
    shards: tuple[Shard, ...]
    files: tuple[tuple[str, str, int], ...]  # (relpath, sha256, rows)
    version: str
    payload_type: str
    source: Path  # what was given: a file, a folder, a Delta table (the lineage dataset)
    payload_width: int | None = None  # numbers a row, when the files' lists are fixed-size

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def size_bytes(self) -> int:
        return sum({s.relpath: s.size for s in self.shards}.values())


def plan(
    source: str | Path,
    rows_per_shard: int = ROWS_PER_SHARD,
    on_bytes: Callable[[int, int], None] | None = None,
) -> Plan:
    """Shards of a Parquet file, of every ``*.parquet`` under a folder (sorted by path), or
    of the data files of a local Delta table's current version (its version is the plan's).
    ``on_bytes(hashed, total)`` follows the fingerprinting, the long part (~0.7 GB/s).

    Raises:
        InputError: no such file or folder, no Parquet file in it, a file unreadable, or one
            without a ``payload`` column of numbers, lists of numbers or JSON text.
    """
    if rows_per_shard < 1:
        raise errors.InputError(f"rows per shard must be >= 1, got {rows_per_shard}")
    src = Path(source).expanduser().resolve()
    table_version = None
    if (src / "_delta_log").is_dir():
        files, table_version = _delta_files(src)
        root = src
    elif src.is_dir():
        files, root = sorted(p for p in src.rglob("*.parquet") if p.is_file()), src
        if not files:
            raise errors.InputError(f"{src}: no .parquet file in this folder")
    elif src.is_file():
        files, root = [src], src.parent
    elif src.exists():  # a device, a pipe
        raise errors.InputError(f"{src}: not a file or a folder; give a Parquet or Delta input")
    else:
        raise errors.InputError(f"{src}: no such file or folder; give a Parquet or Delta input")
    shards: list[Shard] = []
    listed: list[tuple[str, str, int]] = []
    types: set[str] = set()
    widths: set[int] = set()
    total = sum(p.stat().st_size for p in files if p.is_file())
    hashed = 0

    def progress(n: int) -> None:
        nonlocal hashed
        hashed += n
        if on_bytes is not None:
            on_bytes(hashed, total)

    for path in files:
        rel = path.relative_to(root).as_posix()
        meta, payload_type, width = _footer(path)
        types.add(payload_type)
        if width is not None:
            widths.add(width)
        digest, size, mtime = fingerprint(path, progress)
        listed.append((rel, digest, meta.num_rows))
        shards.extend(_cut(path, rel, (digest, size, mtime), meta, rows_per_shard))
    if len(types) > 1:
        raise errors.InputError(
            f"{src}: payload columns differ between files ({', '.join(sorted(types))}); "
            "give one dataset of one payload type"
        )
    if len(widths) > 1:  # a shard of the other width fails whole, after every retry
        raise errors.InputError(
            f"{src}: payload lists differ in length between files "
            f"({', '.join(map(str, sorted(widths)))} numbers a row); give one dataset of "
            "one payload shape"
        )
    version = table_version or hashlib.sha256(json.dumps(listed).encode()).hexdigest()
    width = widths.pop() if widths else None
    return Plan(root, tuple(shards), tuple(listed), version, types.pop(), src, width)


def _delta_files(table: Path) -> tuple[list[Path], str]:
    """The data files of a local Delta table's current version, and that version.

    Raises:
        InputError: not a readable table, or one whose rows a file does not hold alone
            (deletion vectors).
    """
    from deltalake import DeltaTable  # only a Delta input needs it

    try:
        dt = DeltaTable(str(table))
        features = set(dt.protocol().reader_features or ())
        uris = dt.file_uris()
    except Exception as exc:  # deltalake raises its own kinds: every one is a bad input here
        raise errors.InputError(
            f"{table}: not a readable Delta table ({errors.native_text(exc)})"
        ) from None
    if "deletionVectors" in features:
        raise errors.InputError(
            f"{table}: the table may use deletion vectors (rows deleted without rewriting "
            "their files), which in-place scoring does not read; score a copy written "
            "without them (e.g. its rows read and written to a new table)"
        )
    files = sorted(Path(urllib.parse.unquote(u.removeprefix("file://"))) for u in uris)  # %-encoded
    if not files:
        raise errors.InputError(f"{table}: the Delta table holds no data file")
    return files, str(dt.version())


def _footer(path: Path) -> tuple[pq.FileMetaData, str, int | None]:
    """The file's footer, its payload type, and its lists' length when they are fixed-size."""
    try:
        meta = pq.read_metadata(path)
        schema_ = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as exc:
        raise errors.InputError(f"{path}: not a readable Parquet file ({exc})") from None
    if "payload" not in schema_.names:
        raise errors.InputError(
            f"{path}: no payload column; give a column 'payload' of lists of numbers "
            "(dense inputs or token ids) or JSON text"
        )
    kind = schema_.field("payload").type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return meta, "JSON text", None
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    fixed = pa.types.is_fixed_size_list(kind)
    if (listed or fixed) and (
        pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)
    ):  # a fixed-size list may read back as a list: the same type, its length kept apart
        return meta, "list of numbers", kind.list_size if fixed else None
    raise errors.InputError(f"{path}: payload column is {kind}; give lists of numbers or JSON text")


def _cut(
    path: Path,
    rel: str,
    stamp: tuple[str, int, int],
    meta: pq.FileMetaData,
    rows_per_shard: int,
) -> Iterator[Shard]:
    first_group = first_row = rows = 0
    for g in range(meta.num_row_groups):
        rows += meta.row_group(g).num_rows
        if rows >= rows_per_shard or g == meta.num_row_groups - 1:
            if rows:
                yield Shard(str(path), rel, *stamp, first_group, g + 1, first_row, rows)
            first_group, first_row, rows = g + 1, first_row + rows, 0


def fingerprint(path: Path, on_chunk: Callable[[int], None] | None = None) -> tuple[str, int, int]:
    """(sha256 of the file's bytes, its size, its modification time in ns); ``on_chunk`` is
    told the bytes of each chunk read."""
    h, size = hashlib.sha256(), 0
    try:
        with path.open("rb") as f:
            mtime = os.fstat(f.fileno()).st_mtime_ns
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
                size += len(chunk)
                if on_chunk is not None:
                    on_chunk(len(chunk))
    except OSError as exc:
        raise errors.InputError(f"{path}: cannot read ({exc})") from None
    return h.hexdigest(), size, mtime


def records(shards: Sequence[Shard], tenant: str = "default") -> Iterator[models.EnqueueRecord]:
    """The queue items of ``shards``: their keys, descriptors and row counts as costs."""
    for s in shards:
        yield models.EnqueueRecord(
            item_key=s.key,
            payload=models.Payload(s.payload()),
            tenant=tenant,
            cost=s.rows,
            lane=LANE,
        )


SPLIT = "split into {a} and {b}: its worker was lost while scoring it (scored as halves)"


def split(queue: SqlQueue, lease_id: str, item: models.WorkItem, shard: Shard) -> bool:
    """The crash-isolation rule within a shard: a shard whose worker was lost (a suspect,
    claimed in isolation) is not scored again whole but queued as two halves, so a row that
    kills its scorer is cornered in about log2(rows) deaths and the rest are scored. The halves
    are queued first (idempotent on their keys), then the shard, still held by ``lease_id``,
    is closed ``cancelled`` with the reason: a death between the two splits it again, finding
    the halves already queued. Only a one-row shard is scored alone, and charged by the usual
    rule (``batching.crashes``). Returns False when the lease was lost (nothing closed).
    """
    a, b = shard.halves()
    queue.enqueue(
        [
            models.EnqueueRecord(
                h.key,
                models.Payload(h.payload()),
                item.tenant,
                item.priority,
                None,
                h.rows,
                LANE,
                item.max_attempts,
            )
            for h in (a, b)
        ]
    )
    t = schema.items
    reason = SPLIT.format(a=a.key, b=b.key)
    with queue.begin() as conn:
        closed = conn.execute(
            sa.update(t)
            .where(
                t.c.id == item.id, t.c.lease_id == lease_id, t.c.state == int(models.State.LEASED)
            )
            .values(
                state=int(models.State.CANCELLED),
                lease_id=None,
                lease_expires_at=None,
                leased_by=None,
                finished_at=queue.clock(),
                last_error=reason,
            )
        ).rowcount
    return bool(closed)


class Verified:
    """Files checked against their planned fingerprint. A file of the planned size and
    modification time is taken as planned (the quick check of make and rsync: rewriting a
    file sets its mtime); one whose mtime differs (copied to another host, touched) is hashed,
    once per worker, and refused unless its sha256 is the planned one."""

    def __init__(self) -> None:
        self._ok: set[tuple[str, int, int]] = set()
        self._lock = threading.Lock()

    def check(self, shard: Shard) -> None:
        """Raises ``InputError`` when the file is gone or no longer the one planned."""
        p = Path(shard.path)
        try:
            st = p.stat()
        except OSError as exc:
            raise errors.InputError(f"{p}: input file gone ({exc.strerror})") from None
        stamp = (shard.path, st.st_size, st.st_mtime_ns)
        if st.st_size == shard.size and st.st_mtime_ns == shard.mtime_ns:
            return
        with self._lock:
            if stamp in self._ok:
                return
        digest, size, _ = fingerprint(p)
        if (digest, size) != (shard.sha256, shard.size):
            raise errors.InputError(
                f"{p}: changed since it was planned (sha256 {shard.sha256[:16]}... then, "
                f"{digest[:16]}... now); refused rather than half-scored"
            )
        with self._lock:
            self._ok.add(stamp)


def read(shard: Shard, verified: Verified, columns: Sequence[str] = ("payload",)) -> pa.Table:
    """The shard's rows (``columns`` that the file has), after checking the file.

    Raises:
        InputError: the file changed, is gone, or its row groups do not hold the planned rows.
    """
    verified.check(shard)
    try:
        with pq.ParquetFile(shard.path, memory_map=True) as f:
            have = [c for c in columns if c in f.schema_arrow.names]
            groups = list(range(shard.first_group, shard.end_group))
            table = f.read_row_groups(groups, columns=have, use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise errors.InputError(f"{shard.path}: cannot read row groups ({exc})") from None
    if table.num_rows < shard.skip + shard.rows:
        raise errors.InputError(
            f"{shard.path}: row groups {shard.first_group}-{shard.end_group - 1} hold "
            f"{table.num_rows} rows, {shard.skip + shard.rows} planned"
        )
    return table.slice(shard.skip, shard.rows) if shard.part else table
