"""Own data: formats (Parquet, CSV secrets), chat records with the chat template the server
applies, declared and pattern secrets, data subjects kept together, the validation split by
subject, and the audit's secret check (refused in every partition, a warning in several)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from scpdr.data import (
    ChatTemplate,
    DataError,
    FieldMapping,
    Record,
    SecretsConfig,
    load_records,
    prepare_partitions,
    secret_occurrences,
    split_validation,
)
from scpdr.errors import PartitionAuditError


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _rows(n: int) -> list[dict]:
    return [
        {
            "text": f"Ticket {i} from customer {i % 5}: please call about order {1000 + i * 37}.",
            "customer": f"c{i % 5}",
            "secrets": [f"order {1000 + i * 37}"],
        }
        for i in range(n)
    ]


def test_parquet_and_csv_give_the_same_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows(6)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    csv = tmp_path / "t.csv"
    lines = ["text,customer,secrets"] + [
        f'"{r["text"]}",{r["customer"]},"{json.dumps(r["secrets"]).replace(chr(34), 2 * chr(34))}"'
        for r in rows
    ]
    csv.write_text("\n".join(lines) + "\n", encoding="utf-8")
    fields = FieldMapping(group="customer")
    a = load_records(tmp_path / "t.parquet", fields=fields)
    b = load_records(csv, fields=fields)
    assert [(r.text, r.secrets, r.group) for r in a] == [(r.text, r.secrets, r.group) for r in b]
    assert a[0].secrets == ("order 1000",) and a[0].group == "c0"


def test_a_secret_not_in_its_record_is_dropped_naming_the_record(tmp_path, caplog):
    rows = [{"id": "r1", "text": "mail me at x@y.org", "secrets": ["x@y.org", "not-there"]}]
    with caplog.at_level(logging.WARNING):
        (rec,) = load_records(_write(tmp_path / "d.jsonl", rows))
    assert rec.secrets == ("x@y.org",)
    assert "r1" in caplog.text and "not-there" not in caplog.text


def test_chat_records_use_the_chat_template_the_server_applies(tmp_path):
    from scpdr.serve.chat import chat_prompt
    from scpdr.serve.protocol import ChatMessage
    from scpdr.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    msgs = [
        {"role": "user", "content": "What is my account number?"},
        {"role": "assistant", "content": "It is 4821937560."},
    ]
    rows = [{"messages": msgs, "secrets": ["4821937560"]}]
    (rec,) = load_records(_write(tmp_path / "c.jsonl", rows), chat=ChatTemplate(tok))
    assert rec.text == rec.prompt + rec.response and rec.secrets == ("4821937560",)
    assert rec.response.startswith("It is 4821937560.")

    class State:  # what chat_prompt reads of the serving state
        tokenizer = tok

    served = chat_prompt(State(), [ChatMessage(**m) for m in msgs[:1]], gen=True)
    assert served == rec.prompt  # what is served is what was learned
    with pytest.raises(DataError, match="last message must be the assistant"):
        ChatTemplate(tok).render(msgs[:1])


def test_secret_patterns_add_matches():
    recs = [Record.make(id="a", text="call 555-0100 or 555-0199 now")]
    from scpdr.data import add_secrets

    (out,) = add_secrets(recs, SecretsConfig(patterns=(r"\d{3}-\d{4}",)))
    assert out.secrets == ("555-0100", "555-0199")
    with pytest.raises(ValueError, match="not a regular expression"):
        SecretsConfig(patterns=("(",))


def test_detect_pii_without_presidio_says_how_to_install():
    pytest.importorskip("scpdr")
    try:
        import presidio_analyzer  # noqa: F401
    except ImportError:
        from scpdr.data.secrets import detect_pii

        with pytest.raises(ImportError, match="pip install presidio-analyzer"):
            detect_pii(["x@y.org"])
    else:  # pragma: no cover - the optional extra installed
        from scpdr.data.secrets import detect_pii

        assert detect_pii(["mail jane.doe@example.com"]) == [["jane.doe@example.com"]]


def test_groups_share_a_partition_and_are_held_out_whole(tmp_path):
    src = _write(tmp_path / "t.jsonl", _rows(30))
    fields = FieldMapping(group="customer", secrets="secrets")
    data = prepare_partitions(src, k=2, val_fraction=0.2, fields=fields, seed=3)
    where = {r.group: i for i, part in enumerate(data.pset.parts) for r in part}
    for i, part in enumerate(data.pset.parts):
        assert all(where[r.group] == i for r in part)
    val_groups = {r.group for r in data.pset.validation}
    assert val_groups and not val_groups & set(where)  # whole customers held out
    assert data.pset.manifest.dataset["validation"]["source"] == "carved"
    assert data.pset.manifest.dataset["secrets"]["records"] == len(data.pset.records())


def test_split_validation_without_groups_takes_exactly_n():
    recs = [Record.make(id=f"r{i}", text=f"text {i}") for i in range(10)]
    train, val = split_validation(recs, n_val=3, seed=1)
    assert len(val) == 3 and len(train) == 7 and not {r.id for r in val} & {r.id for r in train}


def test_records_sharing_a_secret_are_kept_together(tmp_path):
    # one email in two unrelated records (different customers): they share a partition
    rows = _rows(12)
    rows[3]["text"] += " cc shared@example.org"
    rows[8]["text"] += " forwarded to shared@example.org"
    rows[3]["secrets"].append("shared@example.org")
    data = prepare_partitions(_write(tmp_path / "t.jsonl", rows), k=2, val_fraction=0.0)
    assert data.audit.passed
    assert not secret_occurrences(data.pset.parts)


def _spread_secret_file(tmp_path: Path, holders: int, n: int = 10) -> Path:
    """``n`` records of different customers; the first ``holders`` mention one email (more than
    a partition's fair share: they cannot all be kept together)."""
    rows = [
        {"id": f"r{i}", "text": f"Ticket {i} about invoice {7000 + i * 13}.", "customer": f"c{i}"}
        for i in range(n)
    ]
    for i in range(holders):
        rows[i]["text"] += " Reply to boss.secret@corp.example"
        rows[i]["secrets"] = ["boss.secret@corp.example"]
    return _write(tmp_path / "spread.jsonl", rows)


def test_the_audit_refuses_a_secret_in_every_partition_naming_records_not_the_secret(tmp_path):
    src = _spread_secret_file(tmp_path, holders=7)
    with pytest.raises(PartitionAuditError) as err:
        prepare_partitions(src, k=2, val_fraction=0.0, fields=FieldMapping(group="customer"))
    msg = str(err.value)
    assert "secrets in every partition" in msg and "--group-field" in msg
    assert "r0" in msg and "boss.secret@corp.example" not in msg
    # the CLI refuses too (exit 2), and writes no bundle
    from scpdr.cli import main

    out = tmp_path / "B"
    argv = ["train", "--data", str(src), "--group-field", "customer", "--val-fraction", "0"]
    assert main([*argv, "--base", "tiny", "--max-steps", "1", "--out", str(out)]) == 2
    assert not (out / "scpdr.json").exists()


def test_the_audit_warns_with_counts_for_a_secret_in_more_than_one_partition(tmp_path, caplog):
    # k = 3, 12 records: the email's holders are two groups (3 + 2 records), more than a
    # partition's fair share (4): the groups land in two of the three partitions
    rows = [
        {"id": f"r{i}", "text": f"Ticket {i} about invoice {7000 + i * 13}.", "customer": f"c{i}"}
        for i in range(12)
    ]
    for i in range(5):
        rows[i]["text"] += " Reply to boss.secret@corp.example"
        rows[i]["customer"] = "big" if i < 3 else "mid"
    rows[0]["secrets"] = ["boss.secret@corp.example"]
    src = _write(tmp_path / "w.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        data = prepare_partitions(src, k=3, val_fraction=0.0, fields=FieldMapping(group="customer"))
    assert data.audit.passed and len(data.audit.secret_warnings) == 1
    occ = data.audit.secret_warnings[0]
    assert len(occ.partitions) == 2 and occ.owner == "r0"
    assert "1 declared secret(s) occur in more than one partition" in caplog.text
    assert "boss.secret@corp.example" not in caplog.text
    assert data.audit.to_dict()["secret_warnings"]["count"] == 1
