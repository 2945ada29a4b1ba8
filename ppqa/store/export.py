"""The rows an export writes: one per question of the selected jobs, streamed from one read
transaction by `open_export` (with the CSV columns they need), or as a list by `export_rows`.

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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import groupby

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


# Rows fetched from the database at a time while an export is written.
FETCH_ROWS = 1000


class ExportRows:
    """An export's rows, read from the store as they are consumed (`open_export`), with the
    columns a CSV of them needs, known before the first row; counts of what went by so far."""

    def __init__(self, columns: tuple[str, ...], rows: Iterator[dict]) -> None:
        self.columns = columns
        self._rows = rows
        self.count = self.answered = 0
        self.jobs: set[int] = set()

    def __iter__(self) -> Iterator[dict]:
        for row in self._rows:
            self.count += 1
            self.answered += row["answer"] is not None
            self.jobs.add(row["job"])
            yield row


@contextmanager
def open_export(db: Database, job_ids: list[int] | None = None, include_all: bool = False
                ) -> Iterator[ExportRows]:
    """The export's rows (see the module doc), fetched FETCH_ROWS at a time inside one read
    transaction (a consistent snapshot) that stays open while the caller iterates, so an
    export's memory does not grow with its size. StoreError for a job id that does not exist."""
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
        jobs = {row.id: row.params or {} for row in conn.execute(stmt)}
        if not jobs:
            yield ExportRows(EXPORT_COLUMNS, iter(()))
            return
        # The model and mode that actually ran: the job's latest report, else what it asked for.
        ran = {}
        for job_id, model, mode in conn.execute(
                select(Report.job_id, Report.model, Report.mode)
                .where(Report.job_id.in_(list(jobs))).order_by(Report.id)):
            ran[job_id] = (model, mode)
        result = conn.execute(
            select(Question.job_id, Question.id, Document.name, Question.custom_id,
                   Question.text, Answer.text.label("answer"), Answer.finish_reason,
                   Answer.token_count, Answer.created_at, Question.choices, Answer.choice,
                   Answer.choice_scores, Answer.sample)
            .join(Job, Job.id == Question.job_id).join(Document, Document.id == Job.document_id)
            .outerjoin(Answer, Answer.question_id == Question.id)
            .where(Question.job_id.in_(list(jobs)))
            .order_by(Question.job_id, Question.position, Answer.sample)
            .execution_options(yield_per=FETCH_ROWS))
        try:
            yield ExportRows(_columns(conn, jobs), _rows(result, jobs, ran))
        finally:
            result.close()


def export_rows(db: Database, job_ids: list[int] | None = None, include_all: bool = False
                ) -> list[dict]:
    """Every row of the export at once (`open_export` streams them)."""
    with open_export(db, job_ids, include_all) as rows:
        return list(rows)


def _columns(conn, jobs: dict[int, dict]) -> tuple[str, ...]:
    """The CSV columns of the selected jobs' rows: CHOICE_COLUMNS where a question has choices,
    the sample column where a job has several samples, VOTE_COLUMNS where both meet."""
    def any_choices(job_ids: list[int]) -> bool:
        return bool(job_ids) and conn.execute(
            select(Question.id).where(Question.job_id.in_(job_ids),
                                      Question.choices.is_not(None)).limit(1)).first() is not None

    sampled = [j for j, params in jobs.items() if params.get("samples", 1) > 1]
    columns = EXPORT_COLUMNS
    if any_choices(list(jobs)):
        columns += CHOICE_COLUMNS
    if sampled:
        columns += (SAMPLE_COLUMN,)
        if any_choices(sampled):
            columns += VOTE_COLUMNS
    return columns


def _rows(result, jobs: dict[int, dict], ran: dict) -> Iterator[dict]:
    """Export rows from the joined query's rows, a question's samples together (its votes
    need them all)."""
    for _, group in groupby(result, key=lambda r: r.id):
        rows, voted = [], []
        for r in group:
            params = jobs[r.job_id]
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
            rows.append(row)
        add_votes(voted, label="choice")
        yield from rows


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
