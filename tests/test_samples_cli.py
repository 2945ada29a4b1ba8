"""N samples per question through the whole path: ingest --samples -> the store (answers keyed
by question and sample; a real SQLite file) -> `ppqa run` with a tiny model -> export (a row
per sample); a job interrupted after some samples gets only the missing ones, drawn as they
would have been; and the refusals (greedy, with or without choices; out of range)."""

from __future__ import annotations

import csv
import json

import pytest
from typer.testing import CliRunner

from ppqa.cli.app import app
from ppqa.store import queue
from ppqa.store.db import open_db
from ppqa.store.migrations import migrate
from tests.helpers import WORKER_MODEL

N = 4
HOT = ["--temperature", "1.5", "--seed", "3", "--max-new-tokens", "6"]


@pytest.fixture
def cli(tmp_path):
    def run(*args, db="store.db", ok=True):
        result = CliRunner().invoke(app, ["--db", str(tmp_path / db), *map(str, args)])
        if ok:
            assert result.exit_code == 0, result.stderr
        return result

    (tmp_path / "doc.txt").write_text("Port Wren has three lighthouses and a ferry.\n")
    (tmp_path / "q.txt").write_text("Is Port Wren a town?\nDoes it have a ferry?\n")
    run.dir = tmp_path
    return run


def answers(cli, db: str) -> dict:
    """(question id, sample) -> answer, from a CSV export of everything."""
    out = cli.dir / f"{db}.csv"
    cli("export", out, "--all", db=db)
    with open(out, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["sample"] != "" for r in rows)
    return {(r["question_id"], int(r["sample"])): r["answer"] for r in rows}


def work(cli, db: str) -> None:
    summary = json.loads(cli("run", "--once", "--json", "--device", "cpu", "--model",
                             WORKER_MODEL, db=db).stdout)
    assert summary["jobs_failed"] == 0


def test_samples_differ_reproduce_and_export_a_row_each(cli):
    cli("ingest", cli.dir / "doc.txt", cli.dir / "q.txt", "--samples", N, *HOT, db="a.db")
    work(cli, "a.db")
    got = answers(cli, "a.db")
    assert sorted(got) == [(q, s) for q in ("1", "2") for s in range(N)]
    for q in ("1", "2"):
        assert len({got[(q, s)] for s in range(N)}) > 1, "the samples came out the same"
    detail = json.loads(cli("show", "1", "--json", db="a.db").stdout)
    assert detail["answered"] == 2 and detail["status"] == "done"
    assert [q["sample"] for q in detail["questions_detail"]] == [*range(N), *range(N)]
    assert f"1 #{N - 1}" in cli("show", "1", db="a.db").stdout
    # The same job in a fresh store draws the same samples; sample 0 is the one-sample answer.
    cli("ingest", cli.dir / "doc.txt", cli.dir / "q.txt", "--samples", N, *HOT, db="b.db")
    work(cli, "b.db")
    assert answers(cli, "b.db") == got
    cli("ingest", cli.dir / "doc.txt", cli.dir / "q.txt", *HOT, db="c.db")
    work(cli, "c.db")
    out = cli("export", "-", "--format", "jsonl", db="c.db").stdout
    single = {json.loads(line)["question_id"]: json.loads(line) for line in out.splitlines()}
    assert "sample" not in single["1"]  # a job of one sample exports as before
    assert {q: row["answer"] for q, row in single.items()} == {q: got[(q, 0)] for q in ("1", "2")}


def test_an_interrupted_job_draws_only_its_missing_samples(cli):
    """Samples 0 and 2 of question 1 are in (written here with made-up text); the worker
    claims only the others, and draws them as an uninterrupted run does."""
    cli("ingest", cli.dir / "doc.txt", cli.dir / "q.txt", "--samples", N, *HOT, db="full.db")
    work(cli, "full.db")
    full = answers(cli, "full.db")

    cli("ingest", cli.dir / "doc.txt", cli.dir / "q.txt", "--samples", N, *HOT, db="part.db")
    db = open_db(str(cli.dir / "part.db"))
    claim = queue.claim_jobs(db, "w1", 60)[0]
    first = claim.questions[0]
    assert [q.samples for q in claim.questions] == [tuple(range(N))] * 2
    queue.record_answers(db, [(first.id, "kept 0", 1, "stop", None, None, 0),
                              (first.id, "kept 2", 1, "stop", None, None, 2)], worker_id="w1")
    assert not queue.record_answer(db, first.id, "again", 1, "stop", sample=2)  # first kept
    queue.release_jobs(db, "w1", [claim.job_id])
    again = queue.claim_jobs(db, "w2", 60)[0]
    assert [q.samples for q in again.questions] == [(1, 3), tuple(range(N))]
    queue.release_jobs(db, "w2", [again.job_id])
    db.close()
    work(cli, "part.db")
    part = answers(cli, "part.db")
    assert part[("1", 0)] == "kept 0" and part[("1", 2)] == "kept 2"
    assert {k: v for k, v in part.items() if k not in (("1", 0), ("1", 2))} == {
        k: v for k, v in full.items() if k not in (("1", 0), ("1", 2))}


@pytest.mark.parametrize("args,message", [
    (["--samples", "3"], "3 samples need a temperature above 0: greedy decoding gives the "
                         "same answer every time"),
    (["--samples", "3", "--choices", "yes,no"], "3 samples need a temperature above 0: "
                                                 "greedy decoding gives the same answer every "
                                                 "time"),
    (["--samples", "0", "--temperature", "0.7"], "samples must be a whole number from 1 to "
                                                 "1024, got 0"),
])
def test_samples_refusals(cli, args, message):
    result = cli("ingest", cli.dir / "doc.txt", cli.dir / "q.txt", *args, ok=False)
    assert result.exit_code == 2
    where = f"{cli.dir}/" if message.startswith("q.txt") else ""
    assert result.stderr == f"error: {where}{message}\n"


def test_answers_of_a_store_from_before_samples_become_sample_zero(tmp_path):
    """A store at migration 0008 with an answer: after 0009 it is that question's sample 0,
    and a second sample of the same question can be stored beside it."""
    from sqlalchemy import text

    db = open_db(str(tmp_path / "old.db"), migrate=False, create=True)
    migrate(db, upto="0008_choices")
    with db.write() as conn:
        conn.execute(text("INSERT INTO documents (id, sha256, name, text, created_at) VALUES "
                          "(1, 'x', 'doc', 'Text.', '2026-01-01')"))
        conn.execute(text("INSERT INTO jobs (id, document_id, question_count, params, job_key, "
                          "status, priority, attempts, created_at) VALUES (1, 1, 1, '{}', 'k', "
                          "'done', 0, 1, '2026-01-01')"))
        conn.execute(text("INSERT INTO questions (id, job_id, position, custom_id, text) VALUES "
                          "(1, 1, 0, 'q', 'Q?')"))
        conn.execute(text("INSERT INTO answers (id, question_id, text, token_count, "
                          "finish_reason, created_at) VALUES (1, 1, 'A.', 2, 'stop', "
                          "'2026-01-01')"))
    assert migrate(db, upto="0009_samples") == ["0009_samples"]
    with db.read() as conn:
        assert conn.execute(text("SELECT question_id, sample, text FROM answers")).all() == [
            (1, 0, "A.")]
        assert conn.execute(text("SELECT samples FROM jobs")).scalar_one() == 1
    assert queue.record_answer(db, 1, "B.", 2, "stop", sample=1)
    assert not queue.record_answer(db, 1, "C.", 2, "stop", sample=0)
    db.close()
