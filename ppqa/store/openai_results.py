"""Reading what OpenAI batches' requests got: `RequestResult`s (per request line, its choices'
answers and job states) for output files and `ppqa export --format openai-batch`, and
`question_results` for chat calls waiting on their questions. Read-only; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Connection, select

from ppqa.store.db import Database
from ppqa.store.models import DONE, Answer, Job, OpenAIBatch, OpenAIRequest, Question, Report


@dataclass
class ChoiceResult:
    choice: int
    question_id: int
    job_id: int
    job_status: str
    job_error: str | None
    text: str | None  # None: not answered
    finish_reason: str | None
    tokens: int | None
    answered_at: datetime | None


@dataclass
class RequestResult:
    batch: str  # the batch's public id
    batch_status: str
    row_id: int  # of choice 0: a stable number for the output line's ids
    line: int
    custom_id: str
    prompt_tokens: int
    model: str  # the model that answered (its latest report), else the one the batch asked for
    choices: list[ChoiceResult] = field(default_factory=list)

    @property
    def answered(self) -> bool:
        return all(c.text is not None for c in self.choices)


def export_results(db: Database, job_ids: list[int] | None = None,
                   include_all: bool = False) -> list[RequestResult]:
    """Requests of OpenAI batches, in batch then line order: those with a choice in `job_ids`,
    every one with `include_all`, else (by default) those whose jobs are all done."""
    with db.read() as conn:
        stmt = select(OpenAIRequest.batch_id).distinct()
        if job_ids:
            stmt = stmt.join(Question, Question.id == OpenAIRequest.question_id).where(
                Question.job_id.in_(job_ids))
        results = results_of(conn, sorted(conn.execute(stmt).scalars()))
    if job_ids:
        wanted = set(job_ids)
        return [r for r in results if any(c.job_id in wanted for c in r.choices)]
    if include_all:
        return results
    return [r for r in results if all(c.job_status == DONE for c in r.choices)]


def question_results(db: Database, question_ids: list[int]) -> list[ChoiceResult]:
    """The answers (so far) and job states of questions, in the order given (choice = index)."""
    with db.read() as conn:
        rows = {r.question_id: r for r in conn.execute(_choice_query().where(
            Question.id.in_(question_ids)))}
    return [_choice(i, rows[q]) for i, q in enumerate(question_ids)]


def _choice_query():
    return (select(Question.id.label("question_id"), Question.job_id, Job.status, Job.error,
                   Answer.text, Answer.finish_reason, Answer.token_count, Answer.created_at)
            .join(Job, Job.id == Question.job_id)
            .outerjoin(Answer, Answer.question_id == Question.id))


def _choice(index: int, r) -> ChoiceResult:
    return ChoiceResult(index, r.question_id, r.job_id, r.status, r.error, r.text,
                        r.finish_reason, r.token_count, r.created_at)


def results_of(conn: Connection, batch_pks: list[int]) -> list[RequestResult]:
    if not batch_pks:
        return []
    rows = conn.execute(
        _choice_query().add_columns(
            OpenAIRequest.id.label("row_id"), OpenAIRequest.line, OpenAIRequest.choice,
            OpenAIRequest.custom_id, OpenAIRequest.prompt_tokens, OpenAIBatch.public_id,
            OpenAIBatch.status.label("batch_status"), OpenAIBatch.model)
        .join(OpenAIRequest, OpenAIRequest.question_id == Question.id)
        .join(OpenAIBatch, OpenAIBatch.id == OpenAIRequest.batch_id)
        .where(OpenAIRequest.batch_id.in_(batch_pks))
        .order_by(OpenAIRequest.batch_id, OpenAIRequest.line, OpenAIRequest.choice)).all()
    ran = {job: model for job, model in conn.execute(  # latest report per job wins
        select(Report.job_id, Report.model).where(Report.job_id.in_({r.job_id for r in rows}))
        .order_by(Report.id))}
    out: list[RequestResult] = []
    for r in rows:
        if not out or (out[-1].batch, out[-1].line) != (r.public_id, r.line):
            out.append(RequestResult(r.public_id, r.batch_status, r.row_id, r.line, r.custom_id,
                                     r.prompt_tokens, ran.get(r.job_id, r.model)))
        out[-1].choices.append(_choice(r.choice, r))
    return out
