"""OpenAI batches in the store: their rows, the jobs their requests became, and their results.

A batch comes from `POST /v1/batches` (created `validating`, then `ingest_plan` writes its jobs
and moves it to `in_progress`, or `fail_batch` records why its file was refused) or from
`ppqa ingest --openai-batch` (`ingest_plan` without a batch: created `in_progress`). Either way
its jobs, its request rows (one per choice: which question answers it) and its status change
land in ONE transaction. `cancel_batch` cancels its open jobs; `finalize_batch` ends a batch
whose jobs have all ended (or whose window expired), storing the output and error files that
the caller builds from `RequestResult`s (`openai_results.py`, `ppqa.openai.batch_out`).
Workers know nothing of batches: they answer the jobs as any others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime, timedelta, timezone

from sqlalchemy import Connection, insert, select, update

from ppqa.store.db import Database
from ppqa.store.errors import NotFoundError, StoreError
from ppqa.store.jobs import IngestResult, cancel_open_jobs, ingest
from ppqa.store.models import QUEUED, RUNNING, Answer, Job, OpenAIBatch, OpenAIRequest, Question
from ppqa.store.openai_files import insert_file, new_public_id
from ppqa.store.openai_results import RequestResult, results_of

# OpenAI's batch statuses; `finalizing` is only ever seen inside finalize_batch's transaction.
VALIDATING, IN_PROGRESS, FINALIZING = "validating", "in_progress", "finalizing"
COMPLETED, FAILED, EXPIRED = "completed", "failed", "expired"
CANCELLING, CANCELLED = "cancelling", "cancelled"
OPEN_STATUSES = (IN_PROGRESS, CANCELLING)  # jobs in the queue; finalize_batch will end them
CHAT_ENDPOINT = "/v1/chat/completions"


@dataclass
class BatchRow:
    """A batch as stored, with its request counts (total, completed, failed) now."""

    id: int
    public_id: str
    endpoint: str
    completion_window: str
    input_file_id: str | None
    model: str
    status: str
    user_metadata: dict | None
    errors: list | None
    output_file_id: str | None
    error_file_id: str | None
    created_at: datetime
    expires_at: datetime | None
    in_progress_at: datetime | None
    finalizing_at: datetime | None
    completed_at: datetime | None
    failed_at: datetime | None
    expired_at: datetime | None
    cancelling_at: datetime | None
    cancelled_at: datetime | None
    counts: tuple[int, int, int] = (0, 0, 0)
    jobs_open: int = 0  # its jobs still queued or running

    @property
    def due(self) -> bool:
        """Open, and its jobs all ended or its window over: `finalize_batch` would end it."""
        return self.status in OPEN_STATUSES and (
            self.jobs_open == 0 or (self.expires_at is not None
                                    and datetime.now(timezone.utc).replace(tzinfo=None)
                                    >= self.expires_at))


_COLUMNS = [getattr(OpenAIBatch, f.name) for f in fields(BatchRow)
            if f.name not in ("counts", "jobs_open")]


def create_batch(db: Database, *, model: str, input_file_id: str, completion_window: str,
                 window: timedelta, metadata: dict | None,
                 endpoint: str = CHAT_ENDPOINT) -> BatchRow:
    """A new batch, `validating`: its file is read and its jobs written by `ingest_plan`."""
    with db.write() as conn:
        now = db.now(conn)
        pk = _insert_batch(conn, now, model, VALIDATING, endpoint, completion_window,
                           input_file_id, metadata, now + window)
        return _batch(conn, pk)


def _insert_batch(conn, now, model, status, endpoint, window, input_file_id, metadata,
                  expires_at) -> int:
    return conn.execute(insert(OpenAIBatch).values(
        public_id=new_public_id("batch_"), endpoint=endpoint, completion_window=window,
        input_file_id=input_file_id, model=model, status=status, user_metadata=metadata,
        created_at=now, expires_at=expires_at,
        in_progress_at=now if status == IN_PROGRESS else None)).inserted_primary_key[0]


def ingest_plan(db: Database, plan, *, model: str, batch: str | None = None,
                force: bool = True) -> tuple[BatchRow, list[IngestResult]]:
    """Write a `ppqa.openai.plan.BatchPlan`'s jobs and request rows, all or nothing, for the
    validating batch `batch` (StoreError if it is not validating any more: cancelled) or for
    a new batch (the CLI's)."""
    made: dict[str, int] = {}

    def write_rows(conn: Connection, now: datetime, results: list[IngestResult]) -> None:
        if batch is None:
            pk = _insert_batch(conn, now, model, IN_PROGRESS, CHAT_ENDPOINT, "none", None,
                               None, None)
        else:
            row = conn.execute(select(OpenAIBatch.id, OpenAIBatch.status).where(
                OpenAIBatch.public_id == batch).with_for_update()).first()
            if row is None or row.status != VALIDATING:
                raise StoreError(f"batch {batch} is no longer validating")
            pk = row.id
            conn.execute(update(OpenAIBatch).where(OpenAIBatch.id == pk).values(
                status=IN_PROGRESS, in_progress_at=now))
        made["pk"] = pk
        conn.execute(insert(OpenAIRequest), [
            {"batch_id": pk, "line": c.line, "choice": c.choice, "custom_id": c.custom_id,
             "question_id": qid, "prompt_tokens": c.prompt_tokens}
            for c, qid in zip(plan.choices, _question_ids(conn, plan, results))])

    results = ingest(db, plan.jobs, force=force, on_written=write_rows)
    with db.read() as conn:
        return _batch(conn, made["pk"]), results


def ingest_chat(db: Database, plan) -> list[int]:
    """Write a chat call's plan (no batch row: the caller waits on it); its question ids, in
    choice order."""
    ids: list[int] = []
    ingest(db, plan.jobs, force=True,
           on_written=lambda conn, now, results: ids.extend(_question_ids(conn, plan, results)))
    return ids


def _question_ids(conn: Connection, plan, results: list[IngestResult]) -> list[int]:
    """The question id of each of `plan.choices`, once its jobs are written."""
    job_ids = [r.job_id for r in results]
    question_of = {(job, pos): qid for job, pos, qid in conn.execute(
        select(Question.job_id, Question.position, Question.id)
        .where(Question.job_id.in_(job_ids)))}
    return [question_of[(job_ids[c.job], c.position)] for c in plan.choices]


def fail_batch(db: Database, batch: str, errors: list[dict]) -> None:
    """A validating batch whose file was refused: failed, with the reasons (OpenAI's
    `errors.data`: code, message, line, param)."""
    with db.write() as conn:
        conn.execute(update(OpenAIBatch).where(
            OpenAIBatch.public_id == batch, OpenAIBatch.status == VALIDATING).values(
            status=FAILED, failed_at=db.now(conn), errors=errors))


def get_batch(db: Database, batch: str) -> BatchRow:
    with db.read() as conn:
        return _batch(conn, _pk(conn, batch))


def list_batches(db: Database, *, limit: int = 20, after: str | None = None,
                 status: str | None = None) -> tuple[list[BatchRow], bool]:
    """(batches newest first, has_more), after the batch `after`."""
    stmt = select(OpenAIBatch.id).order_by(OpenAIBatch.id.desc()).limit(limit + 1)
    if status is not None:
        stmt = stmt.where(OpenAIBatch.status == status)
    with db.read() as conn:
        if after is not None:
            stmt = stmt.where(OpenAIBatch.id < _pk(conn, after))
        pks = list(conn.execute(stmt).scalars())
        return [_batch(conn, pk) for pk in pks[:limit]], len(pks) > limit


def batches_with_status(db: Database, statuses: tuple[str, ...]) -> list[str]:
    with db.read() as conn:
        return list(conn.execute(select(OpenAIBatch.public_id).where(
            OpenAIBatch.status.in_(statuses)).order_by(OpenAIBatch.id)).scalars())


def due_batches(db: Database) -> list[str]:
    """Open batches that `finalize_batch` would end now: past their expiry, or without a
    queued or running job (an EXISTS per batch, not a read of every request row)."""
    with db.read() as conn:
        now = db.now(conn)
        rows = conn.execute(select(OpenAIBatch.id, OpenAIBatch.public_id, OpenAIBatch.expires_at)
                            .where(OpenAIBatch.status.in_(OPEN_STATUSES))
                            .order_by(OpenAIBatch.id)).all()
        due = []
        for pk, public_id, expires_at in rows:
            open_job = (select(OpenAIRequest.id)
                        .join(Question, Question.id == OpenAIRequest.question_id)
                        .join(Job, Job.id == Question.job_id)
                        .where(OpenAIRequest.batch_id == pk, Job.status.in_((QUEUED, RUNNING)))
                        .limit(1))
            if (expires_at is not None and now >= expires_at) or \
                    conn.execute(open_job).first() is None:
                due.append(public_id)
    return due


def cancel_batch(db: Database, batch: str) -> BatchRow:
    """Validating: cancelled at once. In progress: its open jobs cancelled, the batch
    `cancelling` until `finalize_batch` writes what was answered, once no worker may still
    deliver an answer for it (the leases its running jobs had have run out). Else StoreError."""
    with db.write() as conn:
        now = db.now(conn)
        pk = _pk(conn, batch, lock=True)
        status = conn.execute(select(OpenAIBatch.status).where(OpenAIBatch.id == pk)).scalar_one()
        if status == VALIDATING:
            conn.execute(update(OpenAIBatch).where(OpenAIBatch.id == pk).values(
                status=CANCELLED, cancelling_at=now, cancelled_at=now))
        elif status == IN_PROGRESS:
            cancel_open_jobs(conn, now, _job_ids(conn, pk))
            conn.execute(update(OpenAIBatch).where(OpenAIBatch.id == pk).values(
                status=CANCELLING, cancelling_at=now))
        elif status != CANCELLING:
            raise StoreError(f"batch {batch} is {status}; only validating or in-progress "
                             "batches can be cancelled")
        return _batch(conn, pk)


def finalize_batch(db: Database, batch: str,
                   make_files: Callable[[list[RequestResult]], tuple[bytes | None, bytes | None]]
                   ) -> BatchRow:
    """End an open batch whose jobs have all ended: completed (or cancelled, if cancelling),
    with the output and error files `make_files` builds; past its expiry, its open jobs are
    cancelled first and it ends expired. Unchanged otherwise. One transaction, so two servers
    on one store never both finalize it."""
    with db.write() as conn:
        now = db.now(conn)
        pk = _pk(conn, batch, lock=True)
        row = _batch(conn, pk)
        if row.status not in OPEN_STATUSES:
            return row
        job_ids = _job_ids(conn, pk)
        expired = row.status == IN_PROGRESS and row.expires_at is not None and now >= row.expires_at
        if expired:
            cancel_open_jobs(conn, now, job_ids)
        elif conn.execute(select(Job.id).where(Job.id.in_(job_ids),
                                               Job.status.in_((QUEUED, RUNNING)))).first():
            return row
        elif row.status == CANCELLING and conn.execute(select(Job.id).where(
                Job.id.in_(job_ids), Job.lease_expires_at >= now)).first():
            return row  # a worker may still be writing answers of a job cancelled under it
        final = EXPIRED if expired else CANCELLED if row.status == CANCELLING else COMPLETED
        conn.execute(update(OpenAIBatch).where(OpenAIBatch.id == pk).values(
            status=final, finalizing_at=now))  # what make_files sees (error codes)
        output, errors = make_files(results_of(conn, [pk]))
        ids = {}
        for kind, content in (("output", output), ("error", errors)):
            if content:
                ids[f"{kind}_file_id"] = insert_file(
                    conn, now, f"{row.public_id}_{kind}.jsonl", "batch_output", content).public_id
        conn.execute(update(OpenAIBatch).where(OpenAIBatch.id == pk).values(
            **ids, **{f"{final}_at": now}))
        return _batch(conn, pk)


def _pk(conn: Connection, batch: str, lock: bool = False) -> int:
    stmt = select(OpenAIBatch.id).where(OpenAIBatch.public_id == batch)
    pk = conn.execute(stmt.with_for_update() if lock else stmt).scalar_one_or_none()
    if pk is None:
        raise NotFoundError(f"no batch {batch!r}")
    return pk


def _job_ids(conn: Connection, pk: int) -> list[int]:
    return list(conn.execute(
        select(Question.job_id).distinct().join(
            OpenAIRequest, OpenAIRequest.question_id == Question.id)
        .where(OpenAIRequest.batch_id == pk)).scalars())


def _batch(conn: Connection, pk: int) -> BatchRow:
    row = BatchRow(*conn.execute(select(*_COLUMNS).where(OpenAIBatch.id == pk)).one())
    lines: dict[int, list[tuple[bool, str]]] = {}
    job_status: dict[int, str] = {}
    for line, answered, job_id, status in conn.execute(
            select(OpenAIRequest.line, Answer.id.is_not(None), Job.id, Job.status)
            .join(Question, Question.id == OpenAIRequest.question_id)
            .join(Job, Job.id == Question.job_id)
            .outerjoin(Answer, Answer.question_id == Question.id)
            .where(OpenAIRequest.batch_id == pk)):
        lines.setdefault(line, []).append((bool(answered), status))
        job_status[job_id] = status
    completed = sum(all(a for a, _ in choices) for choices in lines.values())
    ended = row.status not in (VALIDATING, *OPEN_STATUSES)
    failed = sum(1 for choices in lines.values() if not all(a for a, _ in choices)
                 and (ended or any(s not in (QUEUED, RUNNING) for _, s in choices)))
    row.counts = (len(lines), completed, failed)
    row.jobs_open = sum(1 for s in job_status.values() if s in (QUEUED, RUNNING))
    return row
