"""The queue API the worker uses: claim jobs with a lease, heartbeat, record answers, finish.

Data flow: `claim_jobs` hands a worker every claimable job of ONE document (highest priority
first; among equals a document this worker is running first, whose KV it already holds, one no
live worker holds next, one another worker is running last; then oldest first) with the
document's text and each job's UNANSWERED questions; the worker generates without any
transaction open, writes each answer with `record_answer` as soon as it is done (its own short
transaction), extends its leases with `heartbeat`, and ends each job with `finish_job` (report
row), `fail_job` or, on shutdown, `release_jobs`.

A job is claimable when it is queued, or running with an expired lease (its worker died: only
its unanswered questions are handed out again). Claims take the write lock first on SQLite
(`BEGIN IMMEDIATE`) and lock rows with `FOR UPDATE SKIP LOCKED` on PostgreSQL, so two workers
never claim the same job. Every function that changes a job checks that the caller still owns
its lease; one that does not is told the job's current status and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, case, func, insert, select, update
from sqlalchemy.exc import IntegrityError

from ppqa.store.claim_order import claimable, next_document
from ppqa.store.db import Database
from ppqa.store.errors import InputError, StoreError
from ppqa.store.models import (DONE, FAILED, QUEUED, RUNNING, Answer, Document, Job, Question,
                               Report)
from ppqa.store.params import GenerationParams
from ppqa.store.reports import JobReport


@dataclass(frozen=True)
class ClaimedQuestion:
    id: int
    index: int  # 0-based position in the job's questions
    custom_id: str
    text: str
    choices: tuple[str, ...] | None = None  # labels to choose from (None: generate)
    samples: tuple[int, ...] = (0,)  # the samples still to answer (0 .. jobs.samples - 1)


def answer_count():
    """A question's answers so far (each sample one), as a correlated subquery on `Question`:
    the question is answered when this reaches its job's `samples`."""
    return (select(func.count(Answer.id)).where(Answer.question_id == Question.id)
            .correlate(Question).scalar_subquery())


@dataclass
class ClaimedJob:
    job_id: int
    document_id: int
    document_name: str
    document_text: str
    document_sha256: str
    params: GenerationParams
    priority: int
    attempts: int  # including this claim
    question_count: int  # all of the job's questions, answered or not
    questions: list[ClaimedQuestion]  # the unanswered ones, in order
    lease_expires_at: datetime
    template_source: str | None = None  # a user template's stored text (None: built-in)

    def __post_init__(self) -> None:
        if not self.questions:
            raise ValueError(f"claimed job {self.job_id} has no unanswered question")

    @property
    def answers_wanted(self) -> int:
        """Answers this claim is for: one per question, or per missing sample."""
        return sum(len(q.samples) for q in self.questions)


class Claims(list):
    """`claim_jobs`' list of claimed jobs; `deferred`: empty because the next document waits
    for room to be claimed whole (not because the queue holds nothing claimable)."""

    def __init__(self, jobs=(), deferred: bool = False) -> None:
        super().__init__(jobs)
        self.deferred = deferred


def claim_jobs(db: Database, worker_id: str, lease_seconds: float, *, max_jobs: int = 64,
               max_questions: int | None = None, max_attempts: int = 3,
               model: str | None = None,
               whole_within: tuple[int, int | None] | None = None) -> Claims:
    """Claim the claimable jobs of one document, up to `max_jobs` and `max_questions`
    unanswered questions (the first job is taken whatever its size); [] when none is left.

    A job whose lease expired `max_attempts` times is failed instead of claimed again. A job
    found with every question answered (its worker died before finishing it) is marked done.
    `model`: only jobs that ask for no model or for this one.
    `whole_within` (jobs, questions or None): a document whose claimable jobs all fit within
    these limits is claimed whole or not at all. When they fit these but not `max_jobs` and
    `max_questions` now, nothing is claimed ([]): the caller asks again when it has more room.
    Its questions then reach the engine together, as one group (split over claims, the
    first part chose its decode mode alone and the document was read once per part). A
    document larger than the limits is claimed in parts, as without them. The empty list
    returned then is a `Claims` whose `deferred` is true.
    """
    if not worker_id or lease_seconds <= 0 or max_jobs < 1:
        raise ValueError("claim_jobs needs a worker id, lease_seconds > 0 and max_jobs >= 1")
    fetch = max_jobs if whole_within is None else max(max_jobs, whole_within[0] + 1)
    order = (Job.priority.desc(), Job.created_at, Job.id)
    with db.write() as conn:
        now = db.now(conn)
        expired = (Job.status == RUNNING) & (Job.lease_expires_at < now)
        # A dead worker that had written every answer only lost the finishing step: done, not
        # failed, whatever its attempts.
        unanswered = (select(Question.id)
                      .where(Question.job_id == Job.id, answer_count() < Job.samples).exists())
        conn.execute(update(Job).where(expired, ~unanswered).values(
            status=DONE, finished_at=now, lease_owner=None, lease_expires_at=None))
        conn.execute(update(Job).where(expired, Job.attempts >= max_attempts).values(
            status=FAILED, finished_at=now, lease_owner=None, lease_expires_at=None,
            error=f"lease expired after {max_attempts} attempts (did its worker die?)"))
        chosen: list = []
        params: dict[int, GenerationParams] = {}
        while not chosen:  # a document whose jobs all turn out answered: try the next one
            head = next_document(conn, now, model, worker_id, order)
            if head is None:
                return Claims()
            rows = conn.execute(
                select(Job.id, Job.params, Job.priority, Job.attempts, Job.question_count,
                       Job.template_source)
                .where(claimable(now, model), Job.document_id == head.document_id)
                .order_by(*order).limit(fetch).with_for_update(skip_locked=True)).all()
            open_questions = _unanswered(conn, [r.id for r in rows])
            candidates = []
            for row in rows:
                todo = open_questions.get(row.id, [])
                if not todo:  # every answer is in: only the finishing step was lost
                    conn.execute(update(Job).where(Job.id == row.id).values(
                        status=DONE, finished_at=now, lease_owner=None, lease_expires_at=None))
                    continue
                try:
                    params[row.id] = GenerationParams.from_dict(row.params)
                except InputError as exc:  # stored by a ppqa that checked less: fails alone
                    conn.execute(update(Job).where(Job.id == row.id).values(
                        status=FAILED, finished_at=now, lease_owner=None, lease_expires_at=None,
                        attempts=Job.attempts + 1, error=f"invalid job parameters: {exc}"))
                    continue
                candidates.append((row, len(todo)))
            if whole_within is not None and candidates and not _fits(
                    candidates, max_jobs, max_questions) and _fits(candidates, *whole_within):
                return Claims(deferred=True)  # the whole document later (updates commit)
            total = 0
            for row, todo in candidates[:max_jobs]:
                if chosen and max_questions is not None and total + todo > max_questions:
                    break
                chosen.append(row)
                total += todo
        expires = now + timedelta(seconds=lease_seconds)
        conn.execute(update(Job).where(Job.id.in_([r.id for r in chosen])).values(
            status=RUNNING, attempts=Job.attempts + 1, lease_owner=worker_id,
            lease_expires_at=expires, started_at=func.coalesce(Job.started_at, now)))
        doc = conn.execute(select(Document.id, Document.name, Document.text, Document.sha256)
                           .where(Document.id == head.document_id)).one()
    return Claims(ClaimedJob(job_id=r.id, document_id=doc.id, document_name=doc.name,
                             document_text=doc.text, document_sha256=doc.sha256,
                             params=params[r.id], priority=r.priority,
                             attempts=r.attempts + 1, question_count=r.question_count,
                             questions=open_questions[r.id], lease_expires_at=expires,
                             template_source=r.template_source)
                  for r in chosen)


def _fits(candidates: list, max_jobs: int, max_questions: int | None) -> bool:
    """Whether (job row, open questions) pairs fit within a claim's limits."""
    return len(candidates) <= max_jobs and (
        max_questions is None or sum(n for _, n in candidates) <= max_questions)


def _unanswered(conn, job_ids: list[int]) -> dict[int, list[ClaimedQuestion]]:
    """The questions of `job_ids` that miss an answer, each with the samples it misses."""
    rows = conn.execute(
        select(Question.job_id, Question.id, Question.position, Question.custom_id, Question.text,
               Question.choices, Job.samples)
        .join(Job, Job.id == Question.job_id)
        .where(Question.job_id.in_(job_ids), answer_count() < Job.samples)
        .order_by(Question.job_id, Question.position)).all()
    have: dict[int, set[int]] = {}
    if any(r.samples > 1 for r in rows):
        for qid, sample in conn.execute(select(Answer.question_id, Answer.sample).where(
                Answer.question_id.in_([r.id for r in rows if r.samples > 1]))):
            have.setdefault(qid, set()).add(sample)
    out: dict[int, list[ClaimedQuestion]] = {}
    for job_id, qid, pos, cid, text, choices, samples in rows:
        missing = tuple(i for i in range(samples) if i not in have.get(qid, ()))
        out.setdefault(job_id, []).append(ClaimedQuestion(
            qid, pos, cid, text, None if choices is None else tuple(choices), missing))
    return out


def _owned(worker_id: str, job_ids: list[int]):
    return and_(Job.id.in_(job_ids), Job.lease_owner == worker_id, Job.status == RUNNING)


def heartbeat(db: Database, worker_id: str, job_ids: list[int], lease_seconds: float) -> list[int]:
    """Extend the leases this worker still holds; return the ids it no longer owns
    (cancelled, or taken over by another worker after its lease expired): stop working on them."""
    if not job_ids:
        return []
    with db.write() as conn:
        now = db.now(conn)
        conn.execute(update(Job).where(_owned(worker_id, job_ids))
                     .values(lease_expires_at=now + timedelta(seconds=lease_seconds)))
        owned = set(conn.execute(select(Job.id).where(_owned(worker_id, job_ids))).scalars())
    return [j for j in job_ids if j not in owned]


def record_answer(db: Database, question_id: int, text: str, token_count: int,
                  finish_reason: str, *, total_seconds: float | None = None,
                  worker_id: str | None = None, choice_scores: list[dict] | None = None,
                  sample: int = 0) -> bool:
    """Store a question's answer (its sample `sample`) in its own transaction. False if it
    already had one (the unique constraint keeps the first); StoreError if the question does
    not exist. `choice_scores` ([{"choice", "logprob", "prob"}]): a chosen answer, whose text
    is the chosen label."""
    if not finish_reason or len(finish_reason) > 32:
        raise ValueError(f"finish_reason must be 1 to 32 characters, got {finish_reason!r}")
    if token_count < 0:
        raise ValueError(f"token_count must be >= 0, got {token_count}")
    try:
        with db.write() as conn:
            conn.execute(insert(Answer).values(
                question_id=question_id, text=storable(text), token_count=token_count,
                finish_reason=finish_reason, total_seconds=total_seconds, worker=worker_id,
                created_at=db.now(conn), sample=sample, **_choice_values(text, choice_scores)))
        return True
    except IntegrityError:
        with db.read() as conn:
            if conn.execute(select(Answer.id).where(Answer.question_id == question_id,
                                                    Answer.sample == sample)).first():
                return False
        raise StoreError(f"no question {question_id}") from None


def record_answers(db: Database, rows: list[tuple], *, worker_id: str | None = None) -> None:
    """Store many answers (question id, text, tokens, finish reason, total seconds[, choice
    scores[, sample]]) in one transaction; a question that already has an answer (for that
    sample) keeps its first one (then each row is written on its own, as `record_answer` does)."""
    rows = [(*row, None, 0)[:7] for row in rows]
    for _, _, tokens, reason, _, _, _ in rows:
        if not reason or len(reason) > 32 or tokens < 0:
            raise ValueError(f"bad answer row: {tokens} tokens, finish_reason {reason!r}")
    try:
        with db.write() as conn:
            now = db.now(conn)
            conn.execute(insert(Answer), [
                {"question_id": qid, "text": storable(text), "token_count": tokens,
                 "finish_reason": reason, "total_seconds": seconds, "worker": worker_id,
                 "created_at": now, "sample": sample, **_choice_values(text, scores)}
                for qid, text, tokens, reason, seconds, scores, sample in rows])
    except IntegrityError:
        for qid, text, tokens, reason, seconds, scores, sample in rows:
            record_answer(db, qid, text, tokens, reason, total_seconds=seconds,
                          worker_id=worker_id, choice_scores=scores, sample=sample)


def storable(answer: str) -> str:
    """An answer's text as the store keeps it: a NUL character, which a model can generate
    (a byte token) and PostgreSQL's text cannot hold, becomes U+FFFD, on every backend alike."""
    return answer.replace("\x00", "\ufffd")


def _choice_values(text: str, scores: list[dict] | None) -> dict:
    """The answers row's choice columns: every row of one insert names the same columns."""
    return {"choice": None if scores is None else text, "choice_scores": scores}


def _status(conn, job_id: int) -> str:
    status = conn.execute(select(Job.status).where(Job.id == job_id)).scalar_one_or_none()
    if status is None:
        raise StoreError(f"no job {job_id}")
    return status


def finish_job(db: Database, job_id: int, worker_id: str, report: JobReport | dict) -> str:
    """Write the run's report and end the job: done if every question has an answer, else
    queued again for the rest. Returns the job's status afterwards (unchanged if not owned)."""
    if isinstance(report, dict):
        report = JobReport.from_dict(report)
    with db.write() as conn:
        now = db.now(conn)
        status = _status(conn, job_id)
        conn.execute(insert(Report).values(job_id=job_id, worker=worker_id, created_at=now,
                                           **report.to_dict()))
        if not conn.execute(select(Job.id).where(_owned(worker_id, [job_id]))).first():
            return status
        remaining = conn.execute(
            select(func.count(Question.id)).join(Job, Job.id == Question.job_id)
            .where(Question.job_id == job_id, answer_count() < Job.samples)).scalar_one()
        new = DONE if remaining == 0 else QUEUED
        conn.execute(update(Job).where(Job.id == job_id).values(
            status=new, lease_owner=None, lease_expires_at=None,
            finished_at=now if new == DONE else None))
    return new


def fail_job(db: Database, job_id: int, worker_id: str, error: str, max_attempts: int = 3, *,
             retry: bool = True) -> str:
    """Record a failed run: queued again while attempts < max_attempts (and `retry`), else
    failed with `error`. Returns the job's status afterwards (unchanged if not owned)."""
    with db.write() as conn:
        now = db.now(conn)
        status = _status(conn, job_id)
        row = conn.execute(select(Job.attempts).where(_owned(worker_id, [job_id]))).first()
        if row is None:
            return status
        new = QUEUED if retry and row.attempts < max_attempts else FAILED
        conn.execute(update(Job).where(Job.id == job_id).values(
            status=new, error=str(error)[:10_000], lease_owner=None, lease_expires_at=None,
            finished_at=now if new == FAILED else None))
    return new


def release_jobs(db: Database, worker_id: str, job_ids: list[int]) -> list[int]:
    """Give jobs back at once (graceful shutdown): queued again, and the interrupted claim does
    not count as an attempt. Returns the ids released (those this worker still owned)."""
    if not job_ids:
        return []
    with db.write() as conn:
        owned = list(conn.execute(select(Job.id).where(_owned(worker_id, job_ids))).scalars())
        if owned:
            conn.execute(update(Job).where(Job.id.in_(owned)).values(
                status=QUEUED, lease_owner=None, lease_expires_at=None,
                attempts=case((Job.attempts > 0, Job.attempts - 1), else_=0)))
    return sorted(owned)


def requeue_expired(db: Database, max_attempts: int = 3) -> dict[str, list[int]]:
    """Turn running jobs whose lease expired back into queued ones (failed ones past
    `max_attempts`), so that status shows the truth; claims take them either way."""
    with db.write() as conn:
        now = db.now(conn)
        expired = conn.execute(select(Job.id, Job.attempts).where(
            Job.status == RUNNING, Job.lease_expires_at < now)).all()
        failed = [r.id for r in expired if r.attempts >= max_attempts]
        requeued = [r.id for r in expired if r.attempts < max_attempts]
        if failed:
            conn.execute(update(Job).where(Job.id.in_(failed)).values(
                status=FAILED, finished_at=now, lease_owner=None, lease_expires_at=None,
                error=f"lease expired after {max_attempts} attempts (did its worker die?)"))
        if requeued:
            conn.execute(update(Job).where(Job.id.in_(requeued)).values(
                status=QUEUED, lease_owner=None, lease_expires_at=None))
    return {"requeued": requeued, "failed": failed}
