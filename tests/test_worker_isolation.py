"""One job's bad input fails that job alone, a user template is kept with its job, and a
cancelled job's questions leave the engine.

In process, with the real engine on the tiny random model `dummy:tiny-mha` on the CPU, as in
test_worker.py. Jobs with input that only fails at run time are written the way they reach a
worker: a template whose failure depends on the document (ingest's sample renders), or a seed
stored by a ppqa that did not check its range yet.
"""

from __future__ import annotations

import pytest
from sqlalchemy import func, select, update

from ppqa.config import SamplingParams
from ppqa.files.inputs import QuestionInput
from ppqa.store.errors import InputError
from ppqa.store.jobs import IngestRequest, cancel_job, ingest
from ppqa.store.models import Answer, Job, Question
from ppqa.store.params import GenerationParams
from tests.helpers import make_worker
from ppqa.worker.report import ProgressSink

MODEL = "dummy:tiny-mha"
DOC = "The harbor of Velm opened in 1901. It has three piers and a red lighthouse."
# Renders ingest's short sample document, fails (TypeError: no loader) on a real one.
FRAGILE = ("{% block prefix %}{% if document | length > 40 %}{% include 'x' %}{% endif %}"
           "{{ document }}{% endblock %}{% block question %}Q: {{ question }}{% endblock %}")
PLAIN = ("{% block prefix %}Read: {{ document }}{% endblock %}"
         "{% block question %}\nAsk: {{ question }}\nSay:{% endblock %}")


@pytest.fixture(scope="module")
def engine():
    from ppqa.engine.engine import Engine

    return Engine(MODEL, device="cpu")


def _jobs(db) -> dict[int, tuple]:
    with db.read() as conn:
        return {r.id: (r.status, r.attempts, r.error) for r in conn.execute(
            select(Job.id, Job.status, Job.attempts, Job.error))}


def _answers(db, job_id: int) -> list[str]:
    with db.read() as conn:
        return list(conn.execute(
            select(Answer.text).join(Question, Question.id == Answer.question_id)
            .where(Question.job_id == job_id).order_by(Question.position)).scalars())


def _request(document, questions, template_path=None, **params) -> IngestRequest:
    qs = [QuestionInput(str(i + 1), q, "t") for i, q in enumerate(questions)]
    if template_path is not None:
        params["template"] = str(template_path)
    return IngestRequest(document, "doc", qs, GenerationParams(max_new_tokens=4, **params))


def test_bad_jobs_fail_alone_and_the_worker_goes_on(sqlite_db, engine, tmp_path):
    fragile = tmp_path / "fragile.jinja"
    fragile.write_text(FRAGILE)
    # All on one document, so that every job is claimed and run in the same engine call.
    good, bad_template, bad_seed, good_too = (r.job_id for r in ingest(sqlite_db, [
        _request(DOC, ["How many piers?"]),
        _request(DOC, ["When?"], fragile),
        _request(DOC, ["What colour?"], seed=5),
        _request(DOC, ["Where?", "Why?"], seed=7)]))
    with sqlite_db.write() as conn:  # a seed a past ppqa accepted at ingest
        params = {**GenerationParams(max_new_tokens=4).to_dict(), "seed": 99999999999999999999999}
        conn.execute(update(Job).where(Job.id == bad_seed).values(params=params))
    summary = make_worker(sqlite_db, engine, max_attempts=3, follow=False).run()

    jobs = _jobs(sqlite_db)
    assert jobs[good][0] == jobs[good_too][0] == "done"
    # Failed at once (attempt 1): the same input would fail again.
    assert jobs[bad_template][:2] == ("failed", 1) and "TypeError" in jobs[bad_template][2]
    # The stored seed is refused when the job is claimed, before it reaches the worker.
    assert jobs[bad_seed][:2] == ("failed", 1)
    assert "invalid job parameters: seed" in jobs[bad_seed][2]
    assert summary.count("done") == 2 and summary.count("failed") == 1
    expected = engine.answer(DOC, ["Where?", "Why?"],
                             sampling=SamplingParams(max_new_tokens=4, seed=7))
    assert _answers(sqlite_db, good_too) == [a.text for a in expected]


def test_engine_routes_one_groups_failure_to_on_error(engine, tmp_path):
    from ppqa.engine.outputs import QuestionRequest

    requests = [QuestionRequest(("bad", 0), DOC, "When?", SamplingParams(max_new_tokens=3),
                                template="fragile", template_source=FRAGILE),
                QuestionRequest(("good", 0), DOC, "When?", SamplingParams(max_new_tokens=3))]
    answers, errors = {}, {}
    stats = engine.run(requests, on_answer=lambda r, a: answers.setdefault(r.key, a),
                       on_error=lambda r, e: errors.setdefault(r.key, e))
    assert set(answers) == {("good", 0)} and set(errors) == {("bad", 0)}
    assert isinstance(errors[("bad", 0)], ValueError) and "TypeError" in str(errors[("bad", 0)])
    assert stats.errors == 1


def test_a_user_template_is_kept_with_its_job(sqlite_db, engine, tmp_path):
    path = tmp_path / "mine.jinja"
    path.write_text(PLAIN)
    job = ingest(sqlite_db, [_request(DOC, ["How many piers?"], path)])[0].job_id
    path.write_text("{% block prefix %}changed{% endblock %}")  # edited, then deleted
    path.unlink()
    make_worker(sqlite_db, engine).run()

    assert _jobs(sqlite_db)[job][0] == "done"
    with sqlite_db.read() as conn:
        stored = conn.execute(select(Job.template_source, Job.params).where(Job.id == job)).one()
    assert stored.template_source == PLAIN and stored.params["template"] == str(path)
    assert _answers(sqlite_db, job) == [_answer_with(engine, PLAIN, "How many piers?")]


def _answer_with(engine, template_source: str, question: str) -> str:
    """The engine's answer to `question` about DOC rendered from `template_source`, with the
    sampling parameters the worker gives a job of max_new_tokens=4."""
    from ppqa.engine.outputs import QuestionRequest

    got = {}
    engine.run([QuestionRequest("q", DOC, question, SamplingParams(max_new_tokens=4, seed=0),
                                template="t", template_source=template_source)],
               on_answer=lambda r, a: got.setdefault("text", a.text))
    return got["text"]


@pytest.mark.parametrize("template, message", [
    ("{% block prefix %}{% include 'x' %}{% endblock %}{% block question %}q{% endblock %}",
     "TypeError"),
    ("{% block prefix %}{{ document }}{% endblock %}", "missing: question"),
    ("{% block prefix %}{{ document {% endblock %}", "line 1"),
])
def test_ingest_checks_a_user_template(sqlite_db, tmp_path, template, message):
    path = tmp_path / "t.jinja"
    path.write_text(template)
    with pytest.raises(InputError, match=message):
        ingest(sqlite_db, [_request(DOC, ["Q?"], path)])
    with sqlite_db.read() as conn:
        assert conn.execute(select(func.count(Job.id))).scalar_one() == 0


class _CancelOnFirstAnswer(ProgressSink):
    def __init__(self, db, job_id: int) -> None:
        self.db, self.job_id, self.cancelled = db, job_id, False

    def answered(self, claim, answer_tokens: int) -> None:
        if not self.cancelled and claim.job_id == self.job_id:
            self.cancelled = True
            cancel_job(self.db, self.job_id)


def test_a_cancelled_jobs_questions_leave_the_engine(sqlite_db, add_job, engine):
    from ppqa.engine.engine import Engine

    class Recording(Engine):
        def session(self, *args, **kwargs):
            self.last_session = super().session(*args, **kwargs)
            return self.last_session

    recording = Recording.__new__(Recording)
    recording.__dict__.update(engine.__dict__)
    # Long answers (up to 1,500 tokens): the run would take seconds were nothing dropped.
    cancelled = add_job(sqlite_db, DOC, [f"Question {k}?" for k in range(12)],
                        max_new_tokens=1500, mode="stock")
    other = add_job(sqlite_db, DOC, ["Another?"], max_new_tokens=4, mode="stock")
    # A heartbeat every 0.05 s, so the cancel is seen within a few decode steps.
    summary = make_worker(sqlite_db, recording, _CancelOnFirstAnswer(sqlite_db, cancelled),
                      lease_seconds=0.15).run()

    stats = recording.last_session.stats
    saved = len(_answers(sqlite_db, cancelled))
    assert _jobs(sqlite_db)[cancelled][0] == "cancelled" and _jobs(sqlite_db)[other][0] == "done"
    assert stats.cancelled > 0  # questions left the engine unanswered
    assert stats.questions + stats.cancelled == 13  # every question answered or dropped
    assert saved < 12 and [o.status for o in summary.jobs if o.job_id == cancelled] == ["lost"]


def test_a_document_too_big_for_any_prompt_is_refused_before_tokenizing(engine, monkeypatch):
    from ppqa.engine.outputs import PromptTooLongError, QuestionRequest

    context = engine.model_config.max_position_embeddings
    huge = "x" * (4 * engine.tokenizer.max_token_bytes * context + 1)
    tokenized = []
    real_encode_many = engine.tokenizer.encode_many
    monkeypatch.setattr(engine.tokenizer, "encode_many",
                        lambda texts: tokenized.append(list(texts)) or real_encode_many(texts))
    errors, answers = [], []
    engine.run([QuestionRequest("huge", huge, "Q?", SamplingParams(max_new_tokens=2)),
                QuestionRequest("ok", DOC, "Q?", SamplingParams(max_new_tokens=2))],
               on_answer=lambda r, a: answers.append(r.key),
               on_error=lambda r, e: errors.append((r.key, e)))
    assert answers == ["ok"]
    (texts,) = tokenized  # the huge one was never tokenized: one call, for the other document
    assert DOC in texts[0] and all(len(t) < len(huge) for t in texts)
    (key, error), = errors
    assert key == "huge" and isinstance(error, PromptTooLongError)
    assert f"cannot fit the model's context of {context} tokens" in str(error)
