"""The queue API (claim, heartbeat, record_answer, finish/fail/release, expiry) on SQLite and
PostgreSQL: the contract the worker relies on."""

from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from ppqa.store import queue
from ppqa.store.errors import StoreError
from ppqa.store.jobs import cancel_job
from ppqa.store.models import Answer, Job, Report

REPORT = dict(device="cpu", model="tiny", mode="stock", wall_seconds=2.0, questions=2,
              prompt_tokens=100, answer_tokens=40)


def job_row(db, job_id):
    with db.read() as conn:
        return conn.execute(select(Job).where(Job.id == job_id)).one()._mapping


def expire(db, job_id):
    """Move a job's lease into the past, as if its worker had died."""
    with db.write() as conn:
        conn.execute(update(Job).where(Job.id == job_id)
                     .values(lease_expires_at=db.now(conn) - timedelta(seconds=5)))


def answer_all(db, claim, worker="w1"):
    for q in claim.questions:
        assert queue.record_answer(db, q.id, f"answer to {q.text}", 3, "stop", worker_id=worker)


def test_claim_takes_one_document_by_priority_then_age(any_db, add_job):
    a1 = add_job(any_db, "Document A.", name="a")
    b1 = add_job(any_db, "Document B.", name="b", priority=5)
    a2 = add_job(any_db, "Document A.", ("Third?",), name="a")
    b2 = add_job(any_db, "Document B.", ("Other?",), name="b")
    first = queue.claim_jobs(any_db, "w1", 60)
    # The highest-priority job picks the document; every claimable job of it comes along.
    assert [c.job_id for c in first] == [b1, b2]
    assert {c.document_text for c in first} == {"Document B."}
    second = queue.claim_jobs(any_db, "w2", 60)
    assert [c.job_id for c in second] == [a1, a2]
    assert queue.claim_jobs(any_db, "w3", 60) == []
    c = second[0]
    assert c.document_name == "a" and c.attempts == 1 and c.question_count == 2
    assert [(q.index, q.custom_id, q.text) for q in c.questions] == [(0, "1", "First?"),
                                                                      (1, "2", "Second?")]
    row = job_row(any_db, a1)
    assert row["status"] == "running" and row["lease_owner"] == "w2" and row["attempts"] == 1
    assert row["lease_expires_at"] > row["started_at"]


def test_claim_limits_jobs_and_questions(any_db, add_job):
    ids = [add_job(any_db, "Same doc.", [f"Q{i}-{k}?" for k in range(3)]) for i in range(4)]
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 60, max_jobs=2)] == ids[:2]
    # 3 questions per job: a limit of 4 admits one job; the first job is taken even if too big.
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 60, max_questions=4)] == [ids[2]]
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 60, max_questions=1)] == [ids[3]]


def test_a_document_that_fits_the_workers_limits_is_claimed_whole_or_not_yet(any_db, add_job):
    ids = [add_job(any_db, "Same doc.", [f"Q{i}-{k}?" for k in range(3)]) for i in range(4)]
    other = add_job(any_db, "Other doc.")
    # Room for 2 of its 4 jobs now, for all of them once the worker has room: nothing yet, and
    # nothing of the next document either (it waits its turn).
    waiting = queue.claim_jobs(any_db, "w1", 60, max_jobs=2, whole_within=(8, None))
    assert waiting == [] and waiting.deferred
    assert queue.claim_jobs(any_db, "w1", 60, max_questions=9, whole_within=(8, 100)) == []
    assert all(job_row(any_db, i)["status"] == "queued" for i in ids + [other])
    # Room for all 12 questions: the whole document.
    whole = queue.claim_jobs(any_db, "w1", 60, max_questions=12, whole_within=(8, 100))
    assert [c.job_id for c in whole] == ids
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 60)] == [other]
    empty = queue.claim_jobs(any_db, "w1", 60, whole_within=(8, 100))
    assert empty == [] and not empty.deferred  # nothing left to claim: not a wait
    # A document larger than the limits themselves is claimed in parts, as without them.
    more = [add_job(any_db, "Long doc.", [f"L{i}?"]) for i in range(5)]
    assert [c.job_id for c in queue.claim_jobs(any_db, "w2", 60, max_jobs=2,
                                               whole_within=(3, None))] == more[:2]


def test_claim_filters_by_model(any_db, add_job):
    other = add_job(any_db, "Doc.", model="big-model")
    anyone = add_job(any_db, "Doc 2.")
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 60, model="tiny")] == [anyone]
    assert queue.claim_jobs(any_db, "w1", 60, model="tiny") == []
    claimed = queue.claim_jobs(any_db, "w2", 60, model="big-model")
    assert [c.job_id for c in claimed] == [other] and claimed[0].params.model == "big-model"


def test_answers_are_unique_per_question(any_db, add_job):
    add_job(any_db)
    claim = queue.claim_jobs(any_db, "w1", 60)[0]
    qid = claim.questions[0].id
    assert queue.record_answer(any_db, qid, "first", 2, "stop", total_seconds=0.5,
                               worker_id="w1") is True
    assert queue.record_answer(any_db, qid, "second", 9, "length", worker_id="w2") is False
    with any_db.read() as conn:
        rows = conn.execute(select(Answer.text, Answer.worker).where(Answer.question_id == qid)).all()
    assert [tuple(r) for r in rows] == [("first", "w1")]
    with pytest.raises(StoreError, match="no question 999999"):
        queue.record_answer(any_db, 999999, "x", 1, "stop")


def test_finish_marks_done_only_when_every_question_is_answered(any_db, add_job):
    job = add_job(any_db)
    claim = queue.claim_jobs(any_db, "w1", 60)[0]
    queue.record_answer(any_db, claim.questions[0].id, "one", 1, "stop")
    # A run that left a question unanswered puts the job back for the rest.
    assert queue.finish_job(any_db, job, "w1", REPORT) == "queued"
    again = queue.claim_jobs(any_db, "w2", 60)[0]
    assert [q.custom_id for q in again.questions] == ["2"] and again.attempts == 2
    queue.record_answer(any_db, again.questions[0].id, "two", 1, "stop")
    assert queue.finish_job(any_db, job, "w2", queue.JobReport(**REPORT, streams=2)) == "done"
    row = job_row(any_db, job)
    assert row["status"] == "done" and row["lease_owner"] is None and row["finished_at"]
    with any_db.read() as conn:
        reports = conn.execute(select(Report.worker, Report.tokens_per_second, Report.streams)
                               .order_by(Report.id)).all()
    assert [tuple(r) for r in reports] == [("w1", 20.0, None), ("w2", 20.0, 2)]


def test_fail_requeues_until_max_attempts(any_db, add_job):
    job = add_job(any_db)
    for attempt in (1, 2):
        assert queue.claim_jobs(any_db, "w1", 60)[0].attempts == attempt
        assert queue.fail_job(any_db, job, "w1", f"boom {attempt}", max_attempts=3) == "queued"
    queue.claim_jobs(any_db, "w1", 60)
    assert queue.fail_job(any_db, job, "w1", "boom 3", max_attempts=3) == "failed"
    row = job_row(any_db, job)
    assert row["status"] == "failed" and row["error"] == "boom 3" and row["attempts"] == 3
    assert queue.claim_jobs(any_db, "w1", 60) == []
    other = add_job(any_db, "Too long a document.")
    queue.claim_jobs(any_db, "w1", 60)
    assert queue.fail_job(any_db, other, "w1", "does not fit", retry=False) == "failed"


def test_release_gives_jobs_back_without_counting_an_attempt(any_db, add_job):
    job = add_job(any_db)
    queue.claim_jobs(any_db, "w1", 60)
    assert queue.release_jobs(any_db, "w2", [job]) == []  # not w2's to release
    assert queue.release_jobs(any_db, "w1", [job]) == [job]
    row = job_row(any_db, job)
    assert row["status"] == "queued" and row["attempts"] == 0 and row["lease_owner"] is None
    assert [c.job_id for c in queue.claim_jobs(any_db, "w2", 60)] == [job]


def test_heartbeat_extends_own_leases_and_reports_lost_ones(any_db, add_job):
    mine, cancelled = add_job(any_db, "D1."), add_job(any_db, "D2.")
    queue.claim_jobs(any_db, "w1", 60)
    queue.claim_jobs(any_db, "w1", 60)
    before = job_row(any_db, mine)["lease_expires_at"]
    cancel_job(any_db, cancelled)
    assert queue.heartbeat(any_db, "w1", [mine, cancelled], 600) == [cancelled]
    assert job_row(any_db, mine)["lease_expires_at"] > before + timedelta(seconds=300)
    assert queue.heartbeat(any_db, "someone-else", [mine], 600) == [mine]
    assert queue.heartbeat(any_db, "w1", [], 600) == []


def test_expired_lease_is_taken_over_with_only_unanswered_questions(any_db, add_job):
    job = add_job(any_db, questions=("A?", "B?", "C?"))
    dead = queue.claim_jobs(any_db, "dead", 60)[0]
    queue.record_answer(any_db, dead.questions[0].id, "a", 1, "stop", worker_id="dead")
    assert queue.claim_jobs(any_db, "w2", 60) == []  # lease still valid
    expire(any_db, job)
    taken = queue.claim_jobs(any_db, "w2", 60)[0]
    assert [q.custom_id for q in taken.questions] == ["2", "3"] and taken.attempts == 2
    # The dead worker, if it comes back, learns it lost the job and cannot finish it.
    assert queue.heartbeat(any_db, "dead", [job], 60) == [job]
    assert queue.record_answer(any_db, dead.questions[0].id, "again", 1, "stop") is False
    assert queue.finish_job(any_db, job, "dead", REPORT) == "running"
    assert queue.fail_job(any_db, job, "dead", "late") == "running"
    answer_all(any_db, taken, "w2")
    assert queue.finish_job(any_db, job, "w2", REPORT) == "done"
    with any_db.read() as conn:
        count = conn.execute(select(func.count(Answer.id))).scalar_one()
    assert count == 3


def test_expired_too_often_fails_and_requeue_expired(any_db, add_job):
    slow = add_job(any_db, "D1.")
    queue.claim_jobs(any_db, "w", 60)
    flaky = add_job(any_db, "D2.")
    for _ in range(2):
        assert [c.job_id for c in queue.claim_jobs(any_db, "w", 60)] == [flaky]
        expire(any_db, flaky)
    expire(any_db, slow)
    assert queue.requeue_expired(any_db, max_attempts=2) == {"requeued": [slow], "failed": [flaky]}
    assert job_row(any_db, flaky)["status"] == "failed"
    assert "lease expired after 2 attempts" in job_row(any_db, flaky)["error"]
    assert job_row(any_db, slow)["status"] == "queued"
    # A claim does the same to a job whose lease expired max_attempts times.
    assert [c.job_id for c in queue.claim_jobs(any_db, "w", 60)] == [slow]
    expire(any_db, slow)
    assert queue.claim_jobs(any_db, "w", 60, max_attempts=2) == []
    assert job_row(any_db, slow)["status"] == "failed" and job_row(any_db, slow)["attempts"] == 2


def test_claim_finishes_a_job_whose_answers_are_all_in(any_db, add_job):
    job = add_job(any_db)
    claim = queue.claim_jobs(any_db, "dead", 60)[0]
    answer_all(any_db, claim, "dead")
    expire(any_db, job)  # died between its last answer and finish_job
    assert queue.claim_jobs(any_db, "w2", 60) == []
    assert job_row(any_db, job)["status"] == "done"


def test_answered_job_is_done_even_at_its_last_attempt_and_the_next_document_is_claimed(
        any_db, add_job):
    """The finishing step lost on a job's last allowed attempt: done, not failed; and the claim
    goes on to the next document instead of returning nothing."""
    job = add_job(any_db, "D1.")
    claim = queue.claim_jobs(any_db, "dead", 60, max_attempts=1)[0]
    answer_all(any_db, claim, "dead")
    expire(any_db, job)
    other = add_job(any_db, "D2.")
    assert [c.job_id for c in queue.claim_jobs(any_db, "w2", 60, max_attempts=1)] == [other]
    assert job_row(any_db, job)["status"] == "done" and job_row(any_db, job)["error"] is None


def test_job_report_is_checked():
    with pytest.raises(ValueError, match="wall_seconds"):
        queue.JobReport(**{**REPORT, "wall_seconds": -1.0})
    with pytest.raises(ValueError, match="unknown report field"):
        queue.JobReport.from_dict({**REPORT, "speed": 3})
    assert queue.JobReport(**{**REPORT, "wall_seconds": 0.0}).tokens_per_second == 0.0


def test_claims_keep_a_document_with_the_worker_running_it(any_db, add_job):
    a1 = add_job(any_db, "Document A.", name="a")
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 60)] == [a1]  # w1 holds A's KV
    b = add_job(any_db, "Document B.", name="b")
    a2 = add_job(any_db, "Document A.", ("Later?",), name="a")
    # w1 takes A's new job first, though B was queued before it;
    assert [j.job_id for j in queue.claim_jobs(any_db, "w1", 60)] == [a2]
    a3 = add_job(any_db, "Document A.", ("Last?",), name="a")
    c = add_job(any_db, "Document C.", name="c")
    assert [j.job_id for j in queue.claim_jobs(any_db, "w2", 60)] == [b]
    # w2 passes over A (w1 runs it) for a free document, though A's job is older than C's;
    assert [j.job_id for j in queue.claim_jobs(any_db, "w2", 60)] == [c]
    # with nothing else left, a document another worker runs is still taken (no one idles).
    assert [j.job_id for j in queue.claim_jobs(any_db, "w2", 60)] == [a3]


def test_priority_still_comes_before_the_document_a_worker_runs(any_db, add_job):
    add_job(any_db, "Document A.", name="a")
    queue.claim_jobs(any_db, "w1", 60)
    add_job(any_db, "Document A.", ("Later?",), name="a")
    urgent = add_job(any_db, "Document B.", name="b", priority=9)
    assert [j.job_id for j in queue.claim_jobs(any_db, "w1", 60)] == [urgent]
