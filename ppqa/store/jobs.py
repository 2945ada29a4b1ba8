"""Adding jobs to the store and changing them by hand: ingest, cancel, retry.

The CLI reads and checks input (`ppqa.files.inputs`), builds `IngestRequest`s and calls `ingest`, which
writes documents, jobs and questions in ONE write transaction: either every request lands or,
on any refusal (an identical job already queued, a bad template), nothing does. Ingests of the
same document at once are serialized (SQLite's write lock; on PostgreSQL a transaction-scoped
advisory lock per document), so the document is stored once and `--force`-less duplicates are
refused however the ingests interleave.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection, func, insert, select, update
from sqlalchemy import text as sql

from ppqa.store.db import Database
from ppqa.store.errors import InputError, StoreError
from ppqa.files.inputs import QuestionInput, read_template
from ppqa.store.models import (CANCELLED, FAILED, QUEUED, RUNNING, Document, Job,
                               Question)
from ppqa.store.params import GenerationParams
from ppqa.store.queue import answer_count
from ppqa.templates import check_template


MAX_PRIORITY = 2**31 - 1  # jobs.priority is a 32-bit INTEGER on PostgreSQL
MAX_NAME = Document.__table__.c.name.type.length  # VARCHARs: PostgreSQL refuses longer text
MAX_MODEL = Job.__table__.c.model.type.length


@dataclass
class IngestRequest:
    document_text: str
    name: str
    questions: list[QuestionInput]
    params: GenerationParams = field(default_factory=GenerationParams)
    priority: int = 0
    where: str = ""  # prefix for messages ("batch.jsonl:3"); empty for a single ingest
    # A user template's text, kept with the job; None: read (and checked) at ingest from
    # params.template when that is a file, None for a built-in template.
    template_source: str | None = None

    def __post_init__(self) -> None:
        if not self.document_text.strip():
            raise InputError(self._at("the document is empty"))
        if not self.questions:
            raise InputError(self._at("no questions"))
        if not self.name.strip():
            raise InputError(self._at("the document name is empty"))
        for what, value, most in (("document name", self.name, MAX_NAME),
                                  ("model name", self.params.model or "", MAX_MODEL)):
            if len(value) > most:
                raise InputError(self._at(f"the {what} is {len(value)} characters long; the "
                                          f"store takes up to {most}"))
        chosen = next((q for q in self.questions if q.choices is not None), None)
        if chosen is not None and self.params.json_schema is not None:
            raise InputError(self._at(f"{chosen.where}: a question with choices and a JSON schema "
                                      "do not go together: it is answered by choosing one of "
                                      "its labels, not by generating JSON"))
        for what, value in (("document", self.document_text), ("document name", self.name)):
            if "\x00" in value:
                raise InputError(self._at(f"the {what} contains a NUL character (\\u0000), "
                                          "which the store cannot hold"))
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise InputError(self._at(f"priority must be a whole number, got {self.priority!r}"))
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise InputError(self._at(f"priority must be from {-MAX_PRIORITY} to {MAX_PRIORITY}, "
                                      f"got {self.priority}"))

    def _at(self, message: str) -> str:
        return f"{self.where}: {message}" if self.where else message


@dataclass
class IngestResult:
    job_id: int
    document_id: int
    document_name: str
    document_is_new: bool
    question_count: int

    def to_dict(self) -> dict:
        return {"job": self.job_id, "document": self.document_id,
                "document_name": self.document_name, "document_is_new": self.document_is_new,
                "questions": self.question_count}


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def job_key(document_sha256: str, questions: list[QuestionInput], params: GenerationParams,
            template_source: str | None = None) -> str:
    """Identity of a job's work: same document, same questions and ids, same parameters (and,
    for a user template, the same template text; a question's choices, when it has them)."""
    payload = {"document": document_sha256,
               "questions": [[q.custom_id, q.text] if q.choices is None
                             else [q.custom_id, q.text, list(q.choices)] for q in questions],
               "params": params.to_dict()}
    if template_source is not None:
        payload["template_sha256"] = sha256_text(template_source)
    return sha256_text(json.dumps(payload, sort_keys=True, ensure_ascii=False))


def ingest(db: Database, requests: list[IngestRequest], *, force: bool = False,
           on_written: Callable[[Connection, datetime, list[IngestResult]], None] | None = None
           ) -> list[IngestResult]:
    """Queue every request, or none: see the module doc. `force` allows identical jobs.
    `on_written(conn, now, results)` runs in the same transaction after the jobs are written
    (what else must land with them, e.g. an OpenAI batch's request rows); if it raises, nothing
    is written."""
    for req in requests:  # template files are read and checked before the transaction starts
        if req.template_source is None:
            label, req.template_source = read_template(req.params.template)
            if label != req.params.template:
                req.params = GenerationParams.from_dict({**req.params.to_dict(), "template": label})
        else:
            try:
                check_template(req.template_source, req.params.template)
            except ValueError as exc:
                raise InputError(req._at(str(exc))) from None
    results = []
    with db.write() as conn:
        if db.dialect == "postgresql":
            _lock_documents(conn, {sha256_text(req.document_text) for req in requests})
        now = db.now(conn)
        for req in requests:
            results.append(_ingest_one(conn, req, now, force))
        if on_written is not None:
            on_written(conn, now, results)
    return results


def _lock_documents(conn: Connection, shas: set[str]) -> None:
    """Hold a PostgreSQL advisory lock per document until the transaction ends, taken in one
    order (no deadlock between two ingests of several documents): the document lookup and
    insert and the identical-job check below are then one step for each document."""
    for sha in sorted(shas):
        key = int.from_bytes(bytes.fromhex(sha[:16]), "big", signed=True)
        conn.execute(sql("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


def _ingest_one(conn: Connection, req: IngestRequest, now, force: bool) -> IngestResult:
    sha = sha256_text(req.document_text)
    doc = conn.execute(select(Document.id, Document.name).where(Document.sha256 == sha)).first()
    if doc is None:
        doc_id = conn.execute(insert(Document).values(
            sha256=sha, name=req.name, text=req.document_text, created_at=now)
        ).inserted_primary_key[0]
        doc_name, is_new = req.name, True
    else:
        doc_id, doc_name, is_new = doc.id, doc.name, False
    key = job_key(sha, req.questions, req.params, req.template_source)
    if not force:
        existing = conn.execute(select(Job.id).where(Job.job_key == key, Job.status != CANCELLED)
                                .order_by(Job.id)).scalars().first()
        if existing is not None:
            raise InputError(req._at(f"an identical job is already in the store: job {existing} "
                                     "(use --force to queue it again)"))
    job_id = conn.execute(insert(Job).values(
        document_id=doc_id, question_count=len(req.questions), params=req.params.to_dict(),
        job_key=key, status=QUEUED, priority=req.priority, attempts=0, created_at=now,
        model=req.params.model, template_source=req.template_source,
        samples=req.params.samples)).inserted_primary_key[0]
    conn.execute(insert(Question), [
        {"job_id": job_id, "position": i, "custom_id": q.custom_id, "text": q.text,
         "choices": None if q.choices is None else list(q.choices)}
        for i, q in enumerate(req.questions)])
    return IngestResult(job_id, doc_id, doc_name, is_new, len(req.questions))


def _change_status(db: Database, job_id: int, allowed: tuple[str, ...], verb: str,
                   values: dict) -> str:
    """Move a job to values["status"] if its current status is one of `allowed`."""
    with db.write() as conn:
        status = conn.execute(select(Job.status).where(Job.id == job_id)).scalar_one_or_none()
        if status is None:
            raise StoreError(f"no job {job_id}")
        if status not in allowed:
            raise StoreError(f"job {job_id} is {status}; only {' or '.join(allowed)} jobs can "
                             f"be {verb}")
        if "finished_at" in values and values["finished_at"] == "now":
            values = {**values, "finished_at": db.now(conn)}
        conn.execute(update(Job).where(Job.id == job_id).values(
            lease_owner=None, lease_expires_at=None, **values))
    return values["status"]


def cancel_job(db: Database, job_id: int) -> str:
    """Cancel a queued or running job (a worker on it sees it at its next heartbeat)."""
    return _change_status(db, job_id, (QUEUED, RUNNING), "cancelled",
                          {"status": CANCELLED, "finished_at": "now"})


def cancel_open_jobs(conn: Connection, now: datetime, job_ids: list[int]) -> list[int]:
    """Cancel those of `job_ids` still queued or running, inside the caller's transaction (a
    batch cancelled as a whole); as `cancel_job`, a worker on one lets go at its heartbeat. A
    running job keeps its `lease_expires_at`: the moment by which its worker has let go, having
    written what it answered meanwhile (a cancelling batch waits for it)."""
    open_ids = list(conn.execute(select(Job.id).where(
        Job.id.in_(job_ids), Job.status.in_((QUEUED, RUNNING)))).scalars())
    if open_ids:
        conn.execute(update(Job).where(Job.id.in_(open_ids)).values(
            status=CANCELLED, finished_at=now, lease_owner=None))
    return open_ids


def retry_job(db: Database, job_id: int) -> str:
    """Queue a failed or cancelled job again, with fresh attempts; its answers so far are kept."""
    return _change_status(db, job_id, (FAILED, CANCELLED), "retried",
                          {"status": QUEUED, "attempts": 0, "error": None, "finished_at": None})


def answered_counts(conn: Connection, job_ids: list[int] | None = None) -> dict[int, int]:
    """Questions with all their answers (every sample) written so far, per job."""
    stmt = (select(Question.job_id, func.count(Question.id))
            .join(Job, Job.id == Question.job_id).where(answer_count() >= Job.samples)
            .group_by(Question.job_id))
    if job_ids is not None:
        stmt = stmt.where(Question.job_id.in_(job_ids))
    return {job_id: n for job_id, n in conn.execute(stmt)}
