"""Ingest (documents stored once, identical jobs refused, all-or-nothing), cancel/retry rules,
the read views and export files."""

import csv
import json

import pytest
from sqlalchemy import func, select

from ppqa.store import queue
from ppqa.store.errors import InputError, StoreError
from ppqa.files.export import export_format, write_export
from ppqa.store.export import export_rows
from ppqa.files.inputs import QuestionInput
from ppqa.store.jobs import IngestRequest, cancel_job, ingest, retry_job
from ppqa.store.models import Document, Job
from ppqa.store.params import GenerationParams
from ppqa.store.views import job_detail, list_jobs, queue_status


def request(document="Doc.", questions=("A?", "B?"), name="doc", **params):
    qs = [QuestionInput(str(i + 1), q, f"t:{i}") for i, q in enumerate(questions)]
    return IngestRequest(document, name, qs, GenerationParams(**params))


def count(db, model):
    with db.read() as conn:
        return conn.execute(select(func.count()).select_from(model)).scalar_one()


def test_same_document_is_stored_once_and_identical_jobs_are_refused(sqlite_db):
    first = ingest(sqlite_db, [request()])[0]
    other_params = ingest(sqlite_db, [request(max_new_tokens=8, name="renamed")])[0]
    assert first.document_is_new and not other_params.document_is_new
    assert other_params.document_id == first.document_id
    assert other_params.document_name == "doc"  # the first name stays
    with pytest.raises(InputError, match=f"identical job .*: job {first.job_id} .*--force"):
        ingest(sqlite_db, [request()])
    forced = ingest(sqlite_db, [request()], force=True)[0]
    assert forced.job_id > other_params.job_id
    assert (count(sqlite_db, Document), count(sqlite_db, Job)) == (1, 3)


def test_ingest_is_all_or_nothing(sqlite_db):
    ingest(sqlite_db, [request("Existing.")])
    batch = [request("New doc."), request("Existing.")]  # the second is a duplicate
    with pytest.raises(InputError, match="identical job"):
        ingest(sqlite_db, batch)
    assert (count(sqlite_db, Document), count(sqlite_db, Job)) == (1, 1)
    with pytest.raises(InputError, match="unknown template"):
        ingest(sqlite_db, [request("Another.", template="nope")])
    assert count(sqlite_db, Job) == 1


def test_cancel_and_retry_rules(sqlite_db, add_job):
    job = add_job(sqlite_db)
    assert cancel_job(sqlite_db, job) == "cancelled"
    with pytest.raises(StoreError, match=f"job {job} is cancelled; only queued or running"):
        cancel_job(sqlite_db, job)
    assert retry_job(sqlite_db, job) == "queued"
    with pytest.raises(StoreError, match=f"job {job} is queued; only failed or cancelled"):
        retry_job(sqlite_db, job)
    queue.claim_jobs(sqlite_db, "w", 60)
    queue.fail_job(sqlite_db, job, "w", "broken", retry=False)
    assert retry_job(sqlite_db, job) == "queued"
    assert list_jobs(sqlite_db)[0]["attempts"] == 0 and list_jobs(sqlite_db)[0]["error"] is None
    with pytest.raises(StoreError, match="no job 99"):
        cancel_job(sqlite_db, 99)


def test_views(sqlite_db, add_job):
    a = add_job(sqlite_db, "Doc A.", name="a")
    add_job(sqlite_db, "Doc A.", ("Other?",), name="a")
    b = add_job(sqlite_db, "Doc B.", name="b")
    claim = queue.claim_jobs(sqlite_db, "w", 60)[0]
    queue.record_answer(sqlite_db, claim.questions[0].id, "yes", 1, "stop")
    cancel_job(sqlite_db, b)
    status = queue_status(sqlite_db)
    assert status["totals"]["jobs"] == {"queued": 0, "running": 2, "done": 0, "failed": 0,
                                        "cancelled": 1}
    assert (status["totals"]["questions"], status["totals"]["answered"]) == (5, 1)
    assert [(d["name"], d["questions"], d["answered"]) for d in status["documents"]] == [
        ("a", 3, 1), ("b", 2, 0)]
    assert [j["job"] for j in list_jobs(sqlite_db, status="running")] == [a + 1, a]
    with pytest.raises(StoreError, match="unknown status"):
        list_jobs(sqlite_db, status="sleeping")
    detail = job_detail(sqlite_db, a)
    assert detail["answered"] == 1 and detail["lease_owner"] == "w"
    assert [(q["question_id"], q["answer"]) for q in detail["questions_detail"]] == [
        ("1", "yes"), ("2", None)]


@pytest.fixture
def finished(sqlite_db, add_job):
    """One done job whose answers need quoting, one queued job."""
    job = add_job(sqlite_db, "Doc.", ("Comma, question?", "Quote?"), name="tricky")
    add_job(sqlite_db, "Other doc.", ("Later?",), name="later")
    claim = queue.claim_jobs(sqlite_db, "w", 60)[0]
    answers = ['Yes, "really"\nover two lines', "Zürich — ünïcode"]
    for q, text in zip(claim.questions, answers):
        queue.record_answer(sqlite_db, q.id, text, 5, "stop")
    queue.finish_job(sqlite_db, job, "w", dict(device="cpu", model="tiny", mode="parallel",
                                               wall_seconds=1.0, questions=2, prompt_tokens=9,
                                               answer_tokens=10))
    return job, answers


def test_export_rows_selection(sqlite_db, finished):
    job, answers = finished
    rows = export_rows(sqlite_db)
    assert [(r["job"], r["answer"], r["model"], r["mode"]) for r in rows] == [
        (job, answers[0], "tiny", "parallel"), (job, answers[1], "tiny", "parallel")]
    everything = export_rows(sqlite_db, include_all=True)
    assert len(everything) == 3 and everything[2]["answer"] is None
    assert everything[2]["mode"] == "auto"  # no report yet: what the job asked for
    assert [r["job"] for r in export_rows(sqlite_db, job_ids=[job + 1])] == [job + 1]
    with pytest.raises(StoreError, match="no job 42"):
        export_rows(sqlite_db, job_ids=[42])


def test_export_files_round_trip(sqlite_db, finished, tmp_path):
    rows = export_rows(sqlite_db)
    write_export(rows, str(tmp_path / "a.csv"), "csv")
    raw = (tmp_path / "a.csv").read_bytes()
    assert raw.startswith(b"\xef\xbb\xbf")  # BOM: spreadsheets then read UTF-8
    with open(tmp_path / "a.csv", encoding="utf-8-sig", newline="") as f:
        back = list(csv.DictReader(f))
    assert [r["answer"] for r in back] == [r["answer"] for r in rows]
    assert back[0]["tokens"] == "5" and back[0]["finished_at"].endswith("Z")
    write_export(rows, str(tmp_path / "a.jsonl"), "jsonl")
    lines = (tmp_path / "a.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == rows
    write_export(rows, str(tmp_path / "a.json"), "json")
    assert json.loads((tmp_path / "a.json").read_text(encoding="utf-8")) == rows
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_export_replaces_atomically(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")

    class Boom(dict):
        def __getitem__(self, key):
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_export([Boom()], str(target), "csv")
    assert target.read_text() == "old"  # the old file is intact and no temp file is left
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_export_format():
    assert export_format("x.JSONL", None) == "jsonl" and export_format("-", None) == "csv"
    assert export_format("x.txt", "json") == "json"
    with pytest.raises(InputError, match="cannot tell the format"):
        export_format("x.txt", None)
    with pytest.raises(InputError, match="unknown format 'xml'"):
        export_format("x.csv", "xml")


def _at_once(count, work):
    """Run work(i) on `count` threads released together; [result or exception] in order."""
    import threading

    barrier, results = threading.Barrier(count), [None] * count

    def run(i):
        barrier.wait()
        try:
            results[i] = work(i)
        except Exception as exc:  # noqa: BLE001 - returned for the test to inspect
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_ingests_of_one_new_document_at_once_store_it_once(any_db):
    """Concurrent ingests of the same new document (different questions) all land, on one
    document row; identical ones at once: exactly one lands, the others are refused."""
    for round_ in range(4):
        document = f"A brand new document, round {round_}."
        results = _at_once(6, lambda i, d=document: ingest(any_db, [request(d, (f"Q{i}?",))])[0])
        assert all(not isinstance(r, Exception) for r in results), results
        assert len({r.document_id for r in results}) == 1
        assert sum(r.document_is_new for r in results) == 1
        same = f"Another new document, round {round_}."
        results = _at_once(6, lambda i, d=same: ingest(any_db, [request(d)])[0])
        refused = [r for r in results if isinstance(r, Exception)]
        assert len(refused) == 5 and all(isinstance(r, InputError) for r in refused), results
    assert (count(any_db, Document), count(any_db, Job)) == (8, 4 * 6 + 4)


def test_nul_characters_are_refused_in_input_and_replaced_in_answers(any_db):
    """A NUL (which PostgreSQL's text cannot hold) in a document, name, question, id or choice
    is an input error naming where; one in a model's answer is stored as U+FFFD."""
    with pytest.raises(InputError, match=r"q.jsonl:3: the question contains a NUL character"):
        QuestionInput("1", "What\x00?", "q.jsonl:3")
    with pytest.raises(InputError, match=r"q.jsonl:4: the question id contains a NUL"):
        QuestionInput("a\x00", "What?", "q.jsonl:4")
    with pytest.raises(InputError, match=r"the choice contains a NUL"):
        QuestionInput("1", "What?", "q:1", choices=("yes", "n\x00o"))
    with pytest.raises(InputError, match=r"batch.jsonl:2: the document contains a NUL"):
        IngestRequest("Doc\x00.", "doc", [QuestionInput("1", "A?", "x")], where="batch.jsonl:2")
    with pytest.raises(InputError, match=r"the document name contains a NUL"):
        request(name="d\x00c")
    job = ingest(any_db, [request("A document for NUL answers.")])[0].job_id
    claim = queue.claim_jobs(any_db, "w1", 60)[0]
    assert claim.job_id == job
    ids = [q.id for q in claim.questions]
    queue.record_answers(any_db, [(ids[0], "a\x00b", 3, "stop", 0.1)], worker_id="w1")
    assert queue.record_answer(any_db, ids[1], "\x00", 1, "length", worker_id="w1")
    texts = sorted(row["answer"] for row in export_rows(any_db, job_ids=[job], include_all=True))
    assert texts == ["a\ufffdb", "\ufffd"]


def test_an_export_keeps_a_replaced_files_mode_and_appends_through_dev_stdout(
        sqlite_db, finished, tmp_path):
    """Overwriting an export keeps the file's permissions (a 0600 file stayed private only
    until the next export); /dev/stdout redirected to a file is appended to, not truncated."""
    import os
    import subprocess
    import sys

    rows = export_rows(sqlite_db)
    private = tmp_path / "private.csv"
    private.write_text("old\n")
    private.chmod(0o600)
    write_export(rows, str(private), "csv")
    assert private.stat().st_mode & 0o777 == 0o600 and "old" not in private.read_text()
    (tmp_path / "rows.json").write_text(json.dumps(rows))
    program = ("import json, sys\nprint('before', flush=True)\n"
               "from ppqa.files.export import write_export\n"
               "write_export(json.load(open(sys.argv[1])), '/dev/stdout', 'jsonl')\n"
               "print('after', flush=True)\n")
    out = tmp_path / "out.txt"
    with open(out, "w") as stream:
        subprocess.run([sys.executable, "-c", program, str(tmp_path / "rows.json")],
                       stdout=stream, check=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    lines = out.read_text().splitlines()
    assert lines[0] == "before" and lines[-1] == "after"
    assert [json.loads(line) for line in lines[1:-1]] == rows


def test_a_question_with_choices_in_a_json_schema_job_is_refused(sqlite_db):
    """Per-question choices (a JSONL or CSV line, a batch line) with a JSON schema: refused
    as the shared --choices is, naming the question's line; nothing is stored."""
    schema = '{"type": "object"}'
    questions = [QuestionInput("1", "Free?", "q.jsonl:1"),
                 QuestionInput("2", "Hourly?", "q.jsonl:2", choices=("yes", "no"))]
    with pytest.raises(InputError, match="q.jsonl:2: a question with choices and a JSON schema"):
        IngestRequest("Doc.", "doc", questions, GenerationParams(json_schema=schema))
    assert count(sqlite_db, Job) == 0


def test_names_longer_than_their_columns_are_refused_on_every_backend(any_db):
    """A question id, document name or model name longer than its column: an input error
    naming it, on SQLite as on PostgreSQL (which refused it with a database error)."""
    with pytest.raises(InputError, match="q.jsonl:1: the question id is 201 characters long"):
        QuestionInput("i" * 201, "Long id?", "q.jsonl:1")
    with pytest.raises(InputError, match="the document name is 501 characters long"):
        request(name="n" * 501)
    with pytest.raises(InputError, match="the model name is 201 characters long"):
        request(model="m" * 201)
    longest = IngestRequest("Doc.", "n" * 500, [QuestionInput("i" * 200, "Q?", "q:1")],
                            GenerationParams(model="m" * 200))
    assert ingest(any_db, [longest])[0].document_name == "n" * 500


def test_a_json_export_streams_the_same_text_json_dump_writes(tmp_path):
    """The JSON array is written a row at a time, byte for byte what json.dump(indent=2)
    writes: nested values, non-ASCII text, a schema job's answer as its value, no rows."""
    from ppqa.store.export import JsonAnswer

    rows = [{"job": 1, "answer": "Tři \"lodě\"\nráno", "choice_scores": [
                {"choice": "A", "logprob": -0.1, "prob": 0.9}], "tokens": 5},
            {"job": 2, "answer": JsonAnswer('{"n": [1, 2, {"k": null}]}'), "tokens": None}]
    for chosen in (rows, rows[:1], []):
        write_export(iter(chosen), str(tmp_path / "a.json"), "json")
        parsed = [{**r, "answer": json.loads(r["answer"])} if isinstance(r["answer"], JsonAnswer)
                  else r for r in chosen]
        expected = json.dumps(parsed, ensure_ascii=False, indent=2) + "\n"
        assert (tmp_path / "a.json").read_text(encoding="utf-8") == expected


def test_an_export_streams_rows_from_the_store(sqlite_db, add_job, tmp_path):
    """`open_export` fetches rows as the file is written: exporting 12,000 answered questions
    holds a fraction of the memory the rows as a list take, and writes the same file."""
    import tracemalloc

    from ppqa.store.export import open_export

    for j in range(12):
        job = add_job(sqlite_db, f"Document {j}.", [f"Question {i}?" for i in range(1000)],
                      name=f"d{j}")
        claim = queue.claim_jobs(sqlite_db, "w1", 600)[0]
        assert claim.job_id == job
        queue.record_answers(sqlite_db, [(q.id, f"An answer of some length to {q.text} " * 8,
                                          60, "stop", 0.1) for q in claim.questions],
                             worker_id="w1")
        queue.finish_job(sqlite_db, job, "w1", dict(
            device="cpu", model="tiny", mode="stock", wall_seconds=1.0, questions=1000,
            prompt_tokens=10, answer_tokens=60_000))

    def peak(export) -> int:
        tracemalloc.start()
        try:
            export()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def streamed():
        with open_export(sqlite_db) as rows:
            write_export(rows, str(tmp_path / "streamed.csv"), "csv", rows.columns)
        assert rows.count == rows.answered == 12_000 and len(rows.jobs) == 12

    listed = peak(lambda: write_export(export_rows(sqlite_db), str(tmp_path / "listed.csv"),
                                       "csv"))
    flat = peak(streamed)
    assert flat < listed / 4, (flat, listed)
    assert (tmp_path / "streamed.csv").read_bytes() == (tmp_path / "listed.csv").read_bytes()
