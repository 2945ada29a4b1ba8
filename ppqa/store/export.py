"""The rows an export writes (`export_rows`): one per question of the selected jobs.

Finished jobs by default, chosen jobs with `job_ids`, every job with `include_all`; a question
not answered yet has an empty answer; a schema job's answers are `JsonAnswer` texts. A question
with choices also gets CHOICE_COLUMNS: the chosen label, its probability and log-probability,
and every choice's scores ([{"choice", "logprob", "prob"}], in the question's order). A job of
several samples per question has a row per answered sample, with its `sample` (0, 1, ...); in
it, each row of a question with choices also has VOTE_COLUMNS (`add_votes`): the choice drawn
most often among the question's answered samples and its share of them (ties: the higher
probability, then the choice listed first; ppqa/choices.py `vote`), empty while it has none.
`ppqa.files.export` writes them.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select

from ppqa.choices import vote
from ppqa.store.db import Database
from ppqa.store.errors import StoreError
from ppqa.store.models import DONE, Answer, Document, Job, Question, Report
from ppqa.store.timefmt import iso

EXPORT_COLUMNS = ("job", "document", "question_id", "question", "answer", "finish_reason",
                  "tokens", "model", "mode", "finished_at")
CHOICE_COLUMNS = ("choice", "choice_prob", "choice_logprob", "choice_scores")
SAMPLE_COLUMN = "sample"
VOTE_COLUMNS = ("vote", "vote_share")


class JsonAnswer(str):
    """The text of an answer that a JSON schema constrained: CSV writes it as this text, JSON
    and JSONL as the value it parses to (files/export.py)."""


def export_rows(db: Database, job_ids: list[int] | None = None, include_all: bool = False
                ) -> list[dict]:
    with db.read() as conn:
        stmt = select(Job.id, Job.params)
        if job_ids:
            found = set(conn.execute(select(Job.id).where(Job.id.in_(job_ids))).scalars())
            missing = [j for j in job_ids if j not in found]
            if missing:
                raise StoreError(f"no job {missing[0]}")
            stmt = stmt.where(Job.id.in_(job_ids))
        elif not include_all:
            stmt = stmt.where(Job.status == DONE)
        jobs = {row.id: row.params for row in conn.execute(stmt)}
        if not jobs:
            return []
        # The model and mode that actually ran: the job's latest report, else what it asked for.
        ran = {}
        for job_id, model, mode in conn.execute(
                select(Report.job_id, Report.model, Report.mode)
                .where(Report.job_id.in_(list(jobs))).order_by(Report.id)):
            ran[job_id] = (model, mode)
        rows = conn.execute(
            select(Question.job_id, Question.id, Document.name, Question.custom_id,
                   Question.text, Answer.text.label("answer"), Answer.finish_reason,
                   Answer.token_count, Answer.created_at, Question.choices, Answer.choice,
                   Answer.choice_scores, Answer.sample)
            .join(Job, Job.id == Question.job_id).join(Document, Document.id == Job.document_id)
            .outerjoin(Answer, Answer.question_id == Question.id)
            .where(Question.job_id.in_(list(jobs)))
            .order_by(Question.job_id, Question.position, Answer.sample)).all()
    out, voted = [], []
    for r in rows:
        params = jobs[r.job_id] or {}
        model, mode = ran.get(r.job_id, (params.get("model"), params.get("mode")))
        answer = r.answer
        if answer is not None and params.get("json_schema") is not None and r.choices is None:
            answer = JsonAnswer(answer)
        row = {"job": r.job_id, "document": r.name, "question_id": r.custom_id,
               "question": r.text, "answer": answer, "finish_reason": r.finish_reason,
               "tokens": r.token_count, "model": model, "mode": mode,
               "finished_at": iso(r.created_at)}
        if r.choices is not None:
            row.update(_choice_fields(r.choice, r.choice_scores))
        if params.get("samples", 1) > 1:
            row[SAMPLE_COLUMN] = r.sample
            if r.choices is not None:
                voted.append((r.id, row))
        out.append(row)
    add_votes(voted, label="choice")
    return out


def add_votes(rows: Sequence[tuple[int, dict]], *, label: str) -> None:
    """Give each (question id, row) of a question with choices and several samples the
    VOTE_COLUMNS over its question's answered rows, whose drawn label is `row[label]` (None
    while the question has no answer). Shared with `ppqa show` (store/views.py)."""
    answered: dict[int, list[dict]] = {}
    for question_id, row in rows:
        row.update(dict.fromkeys(VOTE_COLUMNS))
        if row.get("choice_scores"):
            answered.setdefault(question_id, []).append(row)
    for group in answered.values():
        chosen, share = vote([row[label] for row in group], group[0]["choice_scores"])
        for row in group:
            row.update(zip(VOTE_COLUMNS, (chosen, share)))


def _choice_fields(choice: str | None, scores: list[dict] | None) -> dict:
    """CHOICE_COLUMNS of one row (empty while the question has no answer)."""
    chosen = next((s for s in scores or [] if s["choice"] == choice), None)
    return {"choice": choice, "choice_prob": chosen and chosen["prob"],
            "choice_logprob": chosen and chosen["logprob"], "choice_scores": scores}
