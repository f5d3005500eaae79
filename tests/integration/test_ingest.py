"""Enqueue files: JSONL and Parquet (JSON strings, structs, list and fixed-size-list tensors)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batching import errors, models
from batching.ingress import ingest


def write_jsonl(path: Path, rows: Sequence[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_fields_defaults_and_cost(tmp_path: Path) -> None:
    recs = ingest.read_records(
        write_jsonl(
            tmp_path / "r.jsonl",
            [
                {"item_key": "a", "payload": {"tokens": [5, 6, 7]}},
                {
                    "item_key": "b",
                    "payload": {"x": [1.0]},
                    "tenant": "t",
                    "priority": 3,
                    "deadline": "2030-01-01T00:00:00Z",
                    "cost": 9,
                    "lane": "short",
                },
            ],
        )
    )
    a, b = recs
    assert (a.cost, a.tenant, a.priority, a.deadline_at) == (3, "default", 0, None)
    assert json.loads(a.payload.data) == {"tokens": [5, 6, 7]}
    assert (b.cost, b.tenant, b.priority, b.lane) == (9, "t", 3, "short")
    assert b.deadline_at == pytest.approx(1893456000.0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "r.jsonl:2: not valid JSON"),
        ('{"payload": {}}', "r.jsonl:2: item_key must be a non-empty string"),
        ('{"item_key": "k"}', "r.jsonl:2: missing payload"),
        ('{"item_key": "k", "payload": 3}', "r.jsonl:2: payload must be a JSON object or array"),
        ('{"item_key": "k", "payload": {}, "prio": 1}', "r.jsonl:2: unknown field(s) prio"),
        ('{"item_key": "k", "payload": {}, "cost": 0}', "r.jsonl:2: cost must be >= 1"),
        ('{"item_key": "k", "payload": {}, "deadline": "soon"}', "r.jsonl:2: deadline must be"),
        ('{"item_key": "k", "payload": {}, "priority": "high"}', "r.jsonl:2: priority must be"),
        ('{"item_key": "k", "payload": {}, "priority": 3000000000}', "r.jsonl:2: priority 30000"),
        ('{"item_key": "k\\u0000", "payload": {}}', "r.jsonl:2: item_key contains a NUL"),
        ('{"item_key": "k", "payload": {}, "lane": "\\ud800"}', "r.jsonl:2: lane is not valid"),
        ('{"item_key": "k", "payload": {"x": [NaN, 1]}}', "r.jsonl:2: payload holds NaN"),
        ('{"item_key": "k", "payload": {"x": [-Infinity]}}', "r.jsonl:2: payload holds NaN"),
        ('{"item_key": "k", "payload": {"x": [1e400]}}', "r.jsonl:2: payload holds NaN"),
        (
            '{"item_key": "k", "payload": {}, "deadline": 1e400}',
            "r.jsonl:2: deadline must be a fin",
        ),
    ],
)
def test_jsonl_bad_record_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"item_key": "ok", "payload": {}}\n' + line + "\n")
    with pytest.raises(errors.InputError) as info:
        ingest.read_records(path)
    assert str(info.value).startswith(str(tmp_path / message.split(":")[0]))
    assert message.split(":", 1)[1].strip().split(" (")[0] in str(info.value)


def test_parquet_fixed_size_list_becomes_tensor_payloads(tmp_path: Path) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    col = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 4)
    pq.write_table(pa.table({"item_key": ["a", "b", "c"], "payload": col}), tmp_path / "t.parquet")
    recs = ingest.read_records(tmp_path / "t.parquet")
    assert [r.payload.format for r in recs] == [models.PayloadFormat.TENSOR] * 3
    assert all(r.payload.shape == (4,) and r.payload.dtype == "float32" for r in recs)
    back = np.stack([np.frombuffer(r.payload.data, dtype="<f4") for r in recs])
    np.testing.assert_array_equal(back, x)


def test_parquet_variable_lists_cost_is_length(tmp_path: Path) -> None:
    col = pa.array([[1, 2, 3], [4], [5, 6], []], type=pa.list_(pa.int64()))
    keys = ["a", "b", "c", "empty"]
    pq.write_table(pa.table({"item_key": keys, "payload": col}), tmp_path / "v.parquet")
    recs = ingest.read_records(tmp_path / "v.parquet")
    assert [r.cost for r in recs] == [3, 1, 2, 1]  # at least 1, as a given cost must be
    assert np.frombuffer(recs[2].payload.data, dtype="<i8").tolist() == [5, 6]


def test_parquet_json_strings_and_structs(tmp_path: Path) -> None:
    pq.write_table(
        pa.table({"item_key": ["a"], "payload": ['{"x": [1, 2]}'], "priority": [2]}),
        tmp_path / "s.parquet",
    )
    pq.write_table(
        pa.table({"item_key": ["b"], "payload": [{"tokens": [1, 2]}]}), tmp_path / "st.parquet"
    )
    (a,) = ingest.read_records(tmp_path / "s.parquet")
    (b,) = ingest.read_records(tmp_path / "st.parquet")
    assert (json.loads(a.payload.data), a.priority) == ({"x": [1, 2]}, 2)
    assert json.loads(b.payload.data) == {"tokens": [1, 2]}


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (pa.table({"item_key": ["a"]}), "missing column(s) payload; every file needs item_key"),
        (
            pa.table({"item_key": ["a"], "payload": ["{}"], "extra": [1]}),
            "unknown column(s) extra; allowed: cost, deadline, item_key, lane, payload, priority,"
            " tenant",
        ),
        (pa.table({"item_key": ["a"], "payload": ["nope"]}), "row 1: payload is not valid JSON"),
        (
            pa.table({"item_key": ["a", "b"], "payload": [[1.0], [2.0]], "cost": [1, -7]}),
            "row 2: cost must be >= 1, got -7",
        ),
        (pa.table({"item_key": ["a"], "payload": ['{"x": [NaN]}']}), "row 1: payload holds NaN"),
        (
            pa.table({"item_key": ["a", "b", "c"], "payload": [[2.0], [1.0, None], [None]]}),
            "row 2: payload has a null element (2 in all)",
        ),
        (
            pa.table({"item_key": ["a", "b", "c"], "payload": [[2.0], None, None]}),
            "row 2: payload is null (2 null row(s) in all)",
        ),
    ],
)
def test_parquet_bad_input(tmp_path: Path, table: pa.Table, message: str) -> None:
    pq.write_table(table, tmp_path / "bad.parquet")
    with pytest.raises(errors.InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ingest.read_records(tmp_path / "bad.parquet")


def test_unknown_suffix_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(errors.InputError, match="unknown file type"):
        ingest.read_records(tmp_path / "x.csv")
    with pytest.raises(errors.InputError, match="no such file"):
        ingest.read_records(tmp_path / "missing.jsonl")
    with pytest.raises(errors.InputError, match="is a folder; give a "):
        ingest.read_records(tmp_path)


def test_a_key_twice_in_one_jsonl_file_is_refused_naming_both_lines(tmp_path: Path) -> None:
    rows: list[object] = [
        {"item_key": "a", "payload": {"x": [1.0]}},
        {"item_key": "b", "payload": {"x": [2.0]}},
        {"item_key": "a", "payload": {"x": [3.0]}},  # a second request under the same key
    ]
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    path.write_text(path.read_text().replace("\n", "\n\n", 1))  # blank lines keep numbering
    with pytest.raises(errors.InputError, match=r"r\.jsonl:4: item_key 'a' repeats line 1"):
        ingest.read_records(path)


def test_a_key_twice_in_one_parquet_file_is_refused_naming_both_rows(tmp_path: Path) -> None:
    table = pa.table({"item_key": ["a", "b", "b"], "payload": ['{"x": [1]}'] * 3})
    pq.write_table(table, tmp_path / "r.parquet")
    with pytest.raises(errors.InputError, match=r"r\.parquet:row 3: item_key 'b' repeats row 2"):
        ingest.read_records(tmp_path / "r.parquet")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_progress_is_reported_while_reading_and_at_the_end(
    tmp_path: Path, suffix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingest, "PROGRESS_EVERY", 4)
    rows = [{"item_key": f"k{i}", "payload": {"x": [i]}} for i in range(10)]
    if suffix == ".jsonl":
        path = write_jsonl(tmp_path / "r.jsonl", rows)
    else:
        path = tmp_path / "r.parquet"
        keys = [r["item_key"] for r in rows]
        pq.write_table(pa.table({"item_key": keys, "payload": [[i] for i in range(10)]}), path)
    seen: list[int] = []
    assert len(ingest.read_records(path, seen.append)) == 10
    assert seen == [4, 8, 10]
