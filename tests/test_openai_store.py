"""OpenAI files and batches in the store, on SQLite and PostgreSQL: all-or-nothing ingest, a
batch cancelled while validating, expiry, finalization only when due, file bytes."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from sqlalchemy import func, select, update

from ppqa.engine.loading.presets import preset_config
from ppqa.openai.batch_in import plan_batch_file
from ppqa.openai.batch_out import batch_files
from ppqa.openai.prompt_model import PromptModel
from ppqa.store import openai_batches as batches
from ppqa.store import openai_files as files
from ppqa.store import queue
from ppqa.store.errors import NotFoundError, StoreError
from ppqa.store.models import Job
from tests.openai_fixtures import FERRY, MODEL, QUESTIONS, batch_file, chat_body

MODEL_INFO = PromptModel(MODEL, preset_config("tiny-mha")[2], 4096)


def plan(n: int = 3):
    bodies = {f"r{i}": chat_body(FERRY, q) for i, q in enumerate(QUESTIONS[:n])}
    return plan_batch_file(batch_file(bodies), "three.jsonl", MODEL_INFO)


def new_batch(db, window=timedelta(hours=24)):
    upload = files.create_file(db, "three.jsonl", "batch", b"...")
    return batches.create_batch(db, model=MODEL, input_file_id=upload.public_id,
                                completion_window="24h", window=window, metadata={"k": "v"})


def job_count(db) -> int:
    with db.read() as conn:
        return conn.execute(select(func.count(Job.id))).scalar_one()


def test_files_keep_their_bytes_and_page(any_db):
    data = bytes(range(256)) * 3
    first = files.create_file(any_db, "a.bin", "batch", data)
    second = files.create_file(any_db, "b.jsonl", "user_data", b"{}\n")
    assert files.file_content(any_db, first.public_id) == (first, data)
    page, more = files.list_files(any_db, limit=1)
    assert [f.public_id for f in page] == [second.public_id] and more
    page, more = files.list_files(any_db, limit=5, after=second.public_id)
    assert [f.public_id for f in page] == [first.public_id] and not more
    assert [f.public_id for f in files.list_files(any_db, purpose="batch")[0]] == [first.public_id]
    files.delete_file(any_db, first.public_id)
    with pytest.raises(NotFoundError):
        files.get_file(any_db, first.public_id)


def test_batch_lifecycle_to_completed(any_db):
    row = new_batch(any_db)
    assert row.status == "validating" and row.counts == (0, 0, 0)
    row, results = batches.ingest_plan(any_db, plan(), model=MODEL, batch=row.public_id)
    assert row.status == "in_progress" and row.counts == (3, 0, 0) and row.jobs_open == 1
    assert not row.due and batches.due_batches(any_db) == []
    assert batches.finalize_batch(any_db, row.public_id, batch_files).status == "in_progress"
    [claim] = queue.claim_jobs(any_db, "w", 60)
    for q in claim.questions:
        queue.record_answer(any_db, q.id, f"answer {q.custom_id}", 2, "stop")
    queue.finish_job(any_db, claim.job_id, "w", dict(
        device="cpu", model=MODEL, mode="stock", wall_seconds=1.0, questions=3,
        prompt_tokens=3, answer_tokens=6))
    row = batches.get_batch(any_db, row.public_id)
    assert row.due and row.counts == (3, 3, 0)
    assert batches.due_batches(any_db) == [row.public_id]
    row = batches.finalize_batch(any_db, row.public_id, batch_files)
    assert row.status == "completed" and row.completed_at is not None
    assert row.output_file_id and row.error_file_id is None
    _, content = files.file_content(any_db, row.output_file_id)
    assert content.decode().count("\n") == 3 and '"content": "answer r1"' in content.decode()
    with pytest.raises(StoreError, match="only validating or in-progress"):
        batches.cancel_batch(any_db, row.public_id)


def test_cancelled_while_validating_queues_nothing(any_db):
    row = new_batch(any_db)
    assert batches.cancel_batch(any_db, row.public_id).status == "cancelled"
    with pytest.raises(StoreError, match="no longer validating"):
        batches.ingest_plan(any_db, plan(), model=MODEL, batch=row.public_id)
    assert job_count(any_db) == 0  # the jobs rolled back with the refusal


def test_a_cancelling_batch_keeps_the_answers_its_worker_still_writes(any_db):
    """Cancelled while a worker holds its job: `cancelling` until the job's lease runs out (the
    worker lets go at its next heartbeat, writing what it answered meanwhile), then `cancelled`
    with those answers in its output file; a queued batch's cancel ends it at once."""
    row = new_batch(any_db)
    row, _ = batches.ingest_plan(any_db, plan(), model=MODEL, batch=row.public_id)
    [claim] = queue.claim_jobs(any_db, "w", 60)
    assert batches.cancel_batch(any_db, row.public_id).status == "cancelling"
    first = claim.questions[0]
    queue.record_answers(any_db, [(first.id, "written after the cancel", 2, "stop", 0.1)],
                         worker_id="w")
    assert batches.finalize_batch(any_db, row.public_id, batch_files).status == "cancelling"
    assert queue.heartbeat(any_db, "w", [claim.job_id], 60) == [claim.job_id]  # not its own
    with any_db.write() as conn:  # the lease it had runs out
        conn.execute(update(Job).where(Job.id == claim.job_id).values(
            lease_expires_at=datetime(2000, 1, 1)))
    row = batches.finalize_batch(any_db, row.public_id, batch_files)
    assert row.status == "cancelled" and row.counts == (3, 1, 2)
    _, content = files.file_content(any_db, row.output_file_id)
    assert "written after the cancel" in content.decode()
    queued = new_batch(any_db)
    queued, _ = batches.ingest_plan(any_db, plan(2), model=MODEL, batch=queued.public_id)
    queued = batches.cancel_batch(any_db, queued.public_id)
    assert batches.finalize_batch(any_db, queued.public_id, batch_files).status == "cancelled"


def test_expired_batch_cancels_its_jobs_and_reports_them(any_db):
    row = new_batch(any_db, window=timedelta(seconds=0))
    row, _ = batches.ingest_plan(any_db, plan(2), model=MODEL, batch=row.public_id)
    assert row.due  # its window is over while its job is still queued
    assert batches.due_batches(any_db) == [row.public_id]
    row = batches.finalize_batch(any_db, row.public_id, batch_files)
    assert row.status == "expired" and row.expired_at is not None and row.output_file_id is None
    assert row.counts == (2, 0, 2)
    _, content = files.file_content(any_db, row.error_file_id)
    assert content.decode().count('"code": "batch_expired"') == 2
    assert queue.claim_jobs(any_db, "w", 60) == []  # its jobs were cancelled


def test_failed_validation_records_errors(any_db):
    row = new_batch(any_db)
    batches.fail_batch(any_db, row.public_id, [{"code": "invalid_request", "message": "x:1: bad",
                                               "param": None, "line": 1}])
    row = batches.get_batch(any_db, row.public_id)
    assert row.status == "failed" and row.errors[0]["line"] == 1
    listed, more = batches.list_batches(any_db)
    assert [b.public_id for b in listed] == [row.public_id] and not more
