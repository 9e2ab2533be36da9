"""Records and loaders: JSONL, CSV, datasets directories, field mappings, errors with line numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scpdr.data.records import DataError, Record, content_hash, load_records, save_records


def test_record_defaults_text_to_prompt_plus_response():
    r = Record.make(id="a", prompt="Name: Ada, ID:", response=" 0123456789")
    assert r.text == "Name: Ada, ID: 0123456789"
    assert r.hash == content_hash(r.text)
    t = Record.make(id="b", text="only text")
    assert t.prompt is None and t.response is None
    with pytest.raises(DataError, match="both prompt and response"):
        Record(id="c", text="x", prompt="p")
    with pytest.raises(DataError, match="needs either 'text'"):
        Record.make(id="d", prompt="p")


def test_jsonl_round_trip_and_text_only(tmp_path: Path):
    recs = [
        Record.make(id="x1", prompt="Q: 1+1?", response=" 2"),
        Record.make(id="x2", text="just some text, ünïcode too"),
    ]
    path = save_records(tmp_path / "d.jsonl", recs)
    assert load_records(path) == recs
    # text-only rows without ids get "<stem>-<index>"
    p2 = tmp_path / "t.jsonl"
    p2.write_text('{"text": "a"}\n\n{"text": "b", "id": 7}\n', encoding="utf-8")
    got = load_records(p2)
    assert [r.id for r in got] == ["t-0", "7"]
    assert [r.text for r in got] == ["a", "b"]


def test_jsonl_bad_line_reports_line_number(tmp_path: Path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "ok2"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        load_records(p)
    p.write_text('{"text": "ok"}\n{"prompt": "only a prompt"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: .*needs a 'text' field"):
        load_records(p)
    p.write_text('{"text": "ok"}\n{"text": ["not", "a", "string"]}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'text' must be a string"):
        load_records(p)
    p.write_text('{"id": "a", "text": "x"}\n{"id": "a", "text": "y"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad\.jsonl:2: duplicate id 'a' \(first seen at .*:1\)"):
        load_records(p)


def test_csv_with_field_mapping_and_bad_row(tmp_path: Path):
    p = tmp_path / "d.csv"
    p.write_text('question,answer\n"What, exactly?",42\nWhy,"multi\nline"\n', encoding="utf-8")
    got = load_records(p, fields={"prompt": "question", "response": "answer"})
    assert [(r.prompt, r.response) for r in got] == [
        ("What, exactly?", "42"),
        ("Why", "multi\nline"),
    ]
    assert got[0].text == "What, exactly?42"
    with pytest.raises(DataError, match=r"d\.csv:2: .*needs a 'text' field"):
        load_records(p)  # no mapping: neither text nor prompt/response columns
    p.write_text("text\nfine\nalso fine,extra\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"d\.csv:3: more values than header"):
        load_records(p)
    with pytest.raises(DataError, match="unknown record field"):
        load_records(p, fields={"answer": "x"})


def test_load_from_disk_directory(tmp_path: Path):
    import datasets

    ds = datasets.Dataset.from_list(
        [{"q": "a?", "a": " yes", "key": "k1"}, {"q": "b?", "a": " no", "key": "k2"}]
    )
    datasets.DatasetDict({"train": ds, "validation": ds.select([0])}).save_to_disk(
        str(tmp_path / "hf")
    )
    got = load_records(tmp_path / "hf", fields={"prompt": "q", "response": "a", "id": "key"})
    assert [(r.id, r.text) for r in got] == [("k1", "a? yes"), ("k2", "b? no")]
    val = load_records(
        tmp_path / "hf", fields={"prompt": "q", "response": "a", "id": "key"}, split="validation"
    )
    assert len(val) == 1
    with pytest.raises(DataError, match="no split 'test'"):
        load_records(tmp_path / "hf", fields={"prompt": "q", "response": "a"}, split="test")


def test_unsupported_and_missing(tmp_path: Path):
    (tmp_path / "x.txt").write_text("hi", encoding="utf-8")
    with pytest.raises(DataError, match="unsupported data file type"):
        load_records(tmp_path / "x.txt")
    with pytest.raises(FileNotFoundError):
        load_records(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n", encoding="utf-8")
    with pytest.raises(DataError, match="no records"):
        load_records(tmp_path / "empty.jsonl")
    assert json.loads(json.dumps(Record.make(id="a", text="b").to_dict()))["text"] == "b"
