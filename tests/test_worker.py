"""The worker in process, with the real engine on the tiny random model `dummy:tiny-mha` (CPU).

What is checked: the answers stored are the engine's own answers for each job's parameters; each
finished job gets one report row whose figures add up; a job the model cannot hold fails alone
with the reason and is not retried; a stop releases unfinished jobs without losing a saved
answer; a job cancelled while it runs stays cancelled; after an engine failure (out of memory)
the worker retries with smaller batches. Process-level behaviour (kill -9, several
workers, signals) is in test_run_reliability.py.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from ppqa.config import SamplingParams
from ppqa.store.jobs import cancel_job
from ppqa.store.models import Answer, Job, Question, Report
from ppqa.worker.loop import Worker
from tests.helpers import job_states, make_worker
from ppqa.worker.report import ProgressSink

MODEL = "dummy:tiny-mha"
DOC = ("The harbor of Velm opened in 1901. It has three piers, a red lighthouse and a ferry "
       "that leaves every hour. The harbor master is Ada Rook.")


@pytest.fixture(scope="module")
def engine():
    from ppqa.engine.engine import Engine

    return Engine(MODEL, device="cpu")


def _stored_answers(db, job_id: int) -> list[str]:
    with db.read() as conn:
        return list(conn.execute(
            select(Answer.text).join(Question, Question.id == Answer.question_id)
            .where(Question.job_id == job_id).order_by(Question.position)).scalars())


def test_answers_are_the_engines_and_each_job_gets_a_report(sqlite_db, add_job, engine):
    questions = ["When did the harbor open?", "How many piers?", "Who is the harbor master?"]
    short = add_job(sqlite_db, DOC, questions, name="velm", max_new_tokens=5)
    longer = add_job(sqlite_db, DOC, questions[:2], name="velm", max_new_tokens=9, seed=3)
    other = add_job(sqlite_db, "A second, unrelated document.", ["What is it?"], name="other",
                    max_new_tokens=4)
    summary = make_worker(sqlite_db, engine).run()

    assert {j: s[0] for j, s in job_states(sqlite_db).items()} == {short: "done", longer: "done",
                                                               other: "done"}
    expected = {short: engine.answer(DOC, questions,
                                     sampling=SamplingParams(max_new_tokens=5, seed=0)),
                longer: engine.answer(DOC, questions[:2],
                                      sampling=SamplingParams(max_new_tokens=9, seed=3))}
    for job_id, answers in expected.items():
        assert _stored_answers(sqlite_db, job_id) == [a.text for a in answers]

    with sqlite_db.read() as conn:
        reports = {r.job_id: r for r in conn.execute(select(Report))}
        tokens = dict(conn.execute(
            select(Question.job_id, func.sum(Answer.token_count))
            .join(Answer, Answer.question_id == Question.id).group_by(Question.job_id)).all())
    assert set(reports) == {short, longer, other}
    for job_id, report in reports.items():
        assert (report.model, report.device, report.worker) == (MODEL, "cpu", summary.worker_id)
        assert report.answer_tokens == tokens[job_id] > 0
        assert report.tokens_per_second == pytest.approx(report.answer_tokens / report.wall_seconds)
        # Every job's own share of the engine's work: it was prefilled and decoded.
        assert report.prefill_seconds > 0 and report.decode_seconds > 0
        assert report.prefill_seconds + report.decode_seconds <= report.wall_seconds * 1.5
    assert reports[short].questions == 3 and reports[longer].questions == 2
    for job_id, answers in expected.items():  # the tokens the engine generated for the job
        assert reports[job_id].answer_tokens == sum(len(a.token_ids) for a in answers)
    # A mode per document group: the velm jobs were decoded together, one question alone is stock.
    assert reports[short].mode == reports[longer].mode in ("parallel", "stock")
    assert reports[other].mode == "stock"
    assert summary.count("done") == 3 and summary.questions == 6


def test_a_document_too_long_for_the_model_fails_alone(sqlite_db, add_job, engine):
    context = engine.model_config.max_position_embeddings
    too_long = add_job(sqlite_db, "word " * (2 * context), ["Anything?"], name="huge")
    fine = add_job(sqlite_db, DOC, ["How many piers?"], max_new_tokens=4)
    summary = make_worker(sqlite_db, engine, max_attempts=3).run()

    jobs = job_states(sqlite_db)
    assert jobs[fine][0] == "done"
    status, attempts, error = jobs[too_long]
    assert (status, attempts) == ("failed", 1)  # retrying cannot make it fit: no second attempt
    assert f"context of {context} tokens" in error
    assert [o.status for o in summary.jobs if o.job_id == too_long] == ["failed"]


class _StopAfterFirstAnswer(ProgressSink):
    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.answers = 0

    def answered(self, claim, answer_tokens: int) -> None:
        self.answers += 1
        self.worker.request_stop("test")


def test_stop_saves_answers_and_releases_the_rest(sqlite_db, add_job, engine):
    jobs = [add_job(sqlite_db, DOC, [f"Question {i}.{k}?" for k in range(4)], name="velm",
                    max_new_tokens=12, seed=i) for i in range(4)]
    sink = _StopAfterFirstAnswer()
    worker = make_worker(sqlite_db, engine, sink, max_jobs=2)
    sink.worker = worker
    summary = worker.run()

    states = job_states(sqlite_db)
    assert summary.stopped_by == "test"
    assert all(states[j][0] in ("queued", "done") for j in jobs), states
    unfinished = [j for j in jobs if states[j][0] == "queued"]
    assert unfinished and all(states[j][1] == 0 for j in unfinished)  # release is no attempt
    with sqlite_db.read() as conn:
        saved = conn.execute(select(func.count(Answer.id))).scalar_one()
        owners = conn.execute(select(Job.lease_owner).where(Job.lease_owner.is_not(None))).all()
    assert saved == sink.answers == summary.questions and owners == []

    make_worker(sqlite_db, engine).run()  # another worker finishes the rest, keeping what was saved
    assert {s[0] for s in job_states(sqlite_db).values()} == {"done"}
    with sqlite_db.read() as conn:
        assert conn.execute(select(func.count(Answer.id))).scalar_one() == 16


class _CancelOnFirstAnswer(ProgressSink):
    def __init__(self, db, job_id: int) -> None:
        self.db, self.job_id, self.done = db, job_id, False

    def answered(self, claim, answer_tokens: int) -> None:
        if not self.done:
            self.done = True
            cancel_job(self.db, self.job_id)


def test_a_job_cancelled_while_running_stays_cancelled(sqlite_db, add_job, engine):
    job = add_job(sqlite_db, DOC, [f"Question {k}?" for k in range(6)], max_new_tokens=8)
    summary = make_worker(sqlite_db, engine, _CancelOnFirstAnswer(sqlite_db, job)).run()
    assert job_states(sqlite_db)[job][0] == "cancelled"
    assert summary.count("done") == 0


def test_run_once_json_summary(sqlite_path, sqlite_db, add_job):
    from ppqa.cli.app import app

    job = add_job(sqlite_db, DOC, ["How many piers?", "Who is the harbor master?"],
                  max_new_tokens=4)
    result = CliRunner().invoke(app, ["--db", str(sqlite_path), "run", "--once", "--json",
                                      "--device", "cpu", "--model", MODEL])
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["jobs_done"], summary["questions_answered"]) == (1, 2)
    assert summary["jobs"][0]["job_id"] == job and summary["jobs"][0]["report"]["questions"] == 2
    assert f"job {job} done" in result.stderr  # log lines, since stderr is not a terminal


def test_run_with_streams_auto_lets_the_cost_model_pick_p(sqlite_path, sqlite_db, add_job):
    from ppqa.cli.app import app

    add_job(sqlite_db, DOC, [f"Question {i}?" for i in range(6)], max_new_tokens=3)
    result = CliRunner().invoke(app, ["--db", str(sqlite_path), "run", "--once", "--json",
                                      "--device", "cpu", "--model", MODEL, "--mode", "parallel",
                                      "--streams", "auto"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)["jobs"][0]["report"]
    assert report["mode"] == "parallel" and 1 <= report["streams"] <= 6
    # The pool options reach the engine: a pool too small for the document fails the job alone.
    add_job(sqlite_db, DOC * 4, ["Question?"], max_new_tokens=3)
    small = CliRunner().invoke(app, ["--db", str(sqlite_path), "run", "--once", "--json",
                                     "--device", "cpu", "--model", MODEL, "--kv-tokens", "64"])
    assert small.exit_code == 0, small.stderr
    assert "KV pool" in json.dumps(json.loads(small.stdout))
    assert report["questions"] == 6


def test_after_an_engine_failure_the_next_batches_are_smaller(sqlite_db, add_job):
    from ppqa.engine.engine import Engine

    class SmallDeviceEngine(Engine):
        """The real engine on a device that runs out of memory above two questions in flight
        (a GPU condition that cannot be produced on this CPU)."""

        def session(self, *args, **kwargs):
            session = super().session(*args, **kwargs)
            step = session.step

            def small_step():
                held = session.open_questions
                if held > 2:
                    self.sizes.append(held)
                    raise RuntimeError("CUDA out of memory (simulated)")
                return step()

            session.step = small_step
            return session

    for i in range(4):
        add_job(sqlite_db, DOC, [f"Q{i}a?", f"Q{i}b?"], max_new_tokens=3, seed=i)
    engine = SmallDeviceEngine(MODEL, device="cpu")
    engine.sizes = []
    summary = make_worker(sqlite_db, engine, max_jobs=4, max_attempts=10).run()

    assert engine.sizes[:2] == [8, 4]  # halved after each failure until the work fits
    assert {s[0] for s in job_states(sqlite_db).values()} == {"done"}
    with sqlite_db.read() as conn:
        assert conn.execute(select(func.count(Answer.id))).scalar_one() == 8
    assert summary.count("done") == 4 and summary.count("queued") > 0  # retried, not lost


def test_answers_delivered_before_an_engine_failure_are_kept(sqlite_db, add_job):
    """An engine step that fails after delivering answers (the step read back, then the next
    launch ran out of memory): those answers are written, a job they complete is done, and
    the retry computes only what is still unanswered: no question is answered twice."""
    from ppqa.engine.engine import Engine

    class FailingOnceEngine(Engine):
        def session(self, *args, on_answer=None, **kwargs):
            def counted(req, answer):
                self.delivered.append(req.key)
                on_answer(req, answer)

            session = super().session(*args, on_answer=counted, **kwargs)
            step = session.step

            def step_that_fails_once():
                before = len(self.delivered)
                out = step()
                if len(self.delivered) > before and not self.failed:
                    self.failed = True
                    raise RuntimeError("CUDA out of memory (simulated)")
                return out

            session.step = step_that_fails_once
            return session

    short = add_job(sqlite_db, DOC, ["Q1?"], max_new_tokens=1, seed=1)
    long = add_job(sqlite_db, "Another harbor. " + DOC, ["Q2?", "Q3?"], max_new_tokens=6, seed=2)
    engine = FailingOnceEngine(MODEL, device="cpu")
    engine.delivered, engine.failed = [], False
    summary = make_worker(sqlite_db, engine, max_attempts=3).run()

    assert engine.failed
    assert {job: status for job, (status, *_) in job_states(sqlite_db).items()} == {
        short: "done", long: "done"}
    with sqlite_db.read() as conn:
        assert conn.execute(select(func.count(Answer.id))).scalar_one() == 3
    assert len(engine.delivered) == len(set(engine.delivered)) == 3  # none computed twice
    assert summary.count("done") == 2
