"""What a worker reads of the store between two engine steps stays bounded as the queue grows:
the claim reads no table whole (SQLite's query plans, which follow the indexes whatever the
tables hold), and the answers still waiting are read from the jobs' rows, matching a count
question by question on every backend."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import event, select, update

from ppqa.store import lookups, queue
from ppqa.store.jobs import cancel_job, retry_job
from ppqa.store.models import QUEUED, RUNNING, Answer, Job, Question
from ppqa.store.views import queue_status

REPORT = dict(device="cpu", model="tiny", mode="stock", wall_seconds=1.0, questions=1,
              prompt_tokens=10, answer_tokens=3)


def answers_wanted(db, statuses, model=None) -> int:
    """The reference: for each question of a job in `statuses`, its samples less its answers."""
    with db.read() as conn:
        jobs = {r.id: r for r in conn.execute(
            select(Job.id, Job.status, Job.samples, Job.model))}
        have: dict[int, int] = {}
        for (qid,) in conn.execute(select(Answer.question_id)):
            have[qid] = have.get(qid, 0) + 1
        questions = conn.execute(select(Question.id, Question.job_id)).all()
    total = 0
    for qid, job_id in questions:
        job = jobs[job_id]
        if job.status in statuses and (model is None or job.model in (None, model)):
            total += max(0, job.samples - have.get(qid, 0))
    return total


def varied_queue(db, add_job) -> dict[str, int]:
    """Jobs in every state a worker meets, several with answers: untouched, partly answered
    and released, sampled, running with answers, expired, done, cancelled, retried, and
    jobs of two models."""
    ids = {
        "untouched": add_job(db, "Doc one.", ("A?", "B?", "C?"), name="one"),
        "released": add_job(db, "Doc two.", ("A?", "B?", "C?", "D?"), name="two"),
        "sampled": add_job(db, "Doc three.", ("A?", "B?"), name="three", samples=3,
                           temperature=0.7),
        "running": add_job(db, "Doc four.", ("A?", "B?", "C?"), name="four"),
        "done": add_job(db, "Doc five.", ("A?",), name="five"),
        "cancelled": add_job(db, "Doc six.", ("A?", "B?"), name="six"),
        "retried": add_job(db, "Doc seven.", ("A?", "B?"), name="seven"),
        "other model": add_job(db, "Doc eight.", ("A?", "B?"), name="eight", model="m2"),
        "this model": add_job(db, "Doc nine.", ("A?",), name="nine", model="m1"),
    }
    by_job = {}
    while claims := queue.claim_jobs(db, "w1", 600, max_jobs=64):
        by_job.update({c.job_id: c for c in claims})

    def answer(key, questions, sample=0):
        for q in by_job[ids[key]].questions[:questions]:
            queue.record_answer(db, q.id, "x", 1, "stop", worker_id="w1", sample=sample)

    answer("released", 2)
    queue.release_jobs(db, "w1", [ids["released"]])
    answer("sampled", 2, sample=0)
    answer("sampled", 1, sample=2)
    queue.release_jobs(db, "w1", [ids["sampled"]])
    answer("running", 1)
    answer("done", 1)
    queue.finish_job(db, ids["done"], "w1", REPORT)
    answer("cancelled", 1)
    cancel_job(db, ids["cancelled"])
    answer("retried", 1)
    queue.fail_job(db, ids["retried"], "w1", "boom", retry=False)
    retry_job(db, ids["retried"])
    answer("other model", 1)
    queue.release_jobs(db, "w1", [ids["other model"]])
    queue.release_jobs(db, "w1", [ids["this model"], ids["untouched"]])
    with db.write() as conn:  # "running" stays leased; one more job's lease runs out
        conn.execute(update(Job).where(Job.id == ids["running"])
                     .values(lease_expires_at=db.now(conn) - timedelta(seconds=5)))
    return ids


def test_waiting_questions_counts_each_answer_still_wanted(any_db, add_job):
    varied_queue(any_db, add_job)
    for statuses in ((QUEUED,), (QUEUED, RUNNING), (RUNNING,), ("cancelled",)):
        for model in (None, "m1", "m2"):
            assert lookups.waiting_questions(any_db, model, statuses) == \
                answers_wanted(any_db, statuses, model), (statuses, model)
    # By hand: untouched 3, released 4 - 2, sampled 2 x 3 - 3, retried 2 - 1, other model 2 - 1,
    # this model 1; running (expired lease, still running) 3 - 1.
    assert lookups.waiting_questions(any_db) == 3 + 2 + 3 + 1 + 1 + 1
    assert lookups.waiting_questions(any_db, "m1") == 3 + 2 + 3 + 1 + 1
    assert lookups.waiting_questions(any_db, None, (QUEUED, RUNNING)) == 11 + 2


def vm_steps(db, work) -> int:
    """SQLite virtual-machine instructions (in tens) that `work()` runs through `db`: the
    rows a statement reads, counted the same way on every machine and at any load."""
    steps, attached = [0], set()

    def tick():
        steps[0] += 1
        return 0

    def attach(conn, cursor, statement, parameters, context, executemany):
        raw = conn.connection.dbapi_connection
        if id(raw) not in {id(r) for r in attached}:
            raw.set_progress_handler(tick, 10)
            attached.add(raw)

    event.listen(db.engine, "before_cursor_execute", attach)
    try:
        work()
    finally:
        event.remove(db.engine, "before_cursor_execute", attach)
        for raw in attached:
            raw.set_progress_handler(None, 0)
    return steps[0]


def queue_documents(db, add_job, count: int, questions: int = 1, start: int = 0) -> None:
    for i in range(start, start + count):
        add_job(db, f"Queued document {i}.", [f"Q{j}?" for j in range(questions)],
                name=f"q{i}")


def claim_and_release(db, worker: str, model=None) -> None:
    claims = queue.claim_jobs(db, worker, 600, max_jobs=64, max_questions=256, model=model,
                              whole_within=(64, 256))
    assert claims
    queue.release_jobs(db, worker, [c.job_id for c in claims])


@pytest.mark.parametrize("model", [None, "m1"])
def test_a_claim_reads_as_much_of_a_long_queue_as_of_a_short_one(sqlite_db, add_job, model):
    """With documents held by this worker (every job of theirs claimed, so its first look finds
    nothing) and by another, a claim runs as many SQLite instructions over 440 queued jobs as
    over 40: it reads the held documents and the head of the queue, not the queue."""
    varied_queue(sqlite_db, add_job)  # w1 holds documents; leases run out
    queue.claim_jobs(sqlite_db, "w2", 600)  # another worker holds one
    queue_documents(sqlite_db, add_job, 40)
    short = vm_steps(sqlite_db, lambda: claim_and_release(sqlite_db, "w1", model))
    queue_documents(sqlite_db, add_job, 400, start=40)
    long = vm_steps(sqlite_db, lambda: claim_and_release(sqlite_db, "w1", model))
    assert short > 0 and long < 1.5 * short, (short, long)


def test_the_waiting_count_reads_the_jobs_not_their_questions(sqlite_db, add_job):
    """Answers still wanted come from the jobs' rows: 40 queued jobs of 30 questions each cost
    as many SQLite instructions as 40 of one question (the count question by question read
    every queued question)."""
    queue_documents(sqlite_db, add_job, 40)
    few = vm_steps(sqlite_db, lambda: lookups.waiting_questions(sqlite_db))
    with sqlite_db.write() as conn:
        conn.execute(update(Job).values(status="done"))
    queue_documents(sqlite_db, add_job, 40, questions=30, start=40)
    many = vm_steps(sqlite_db, lambda: lookups.waiting_questions(sqlite_db))
    assert lookups.waiting_questions(sqlite_db) == 40 * 30
    assert few > 0 and many < 1.5 * few, (few, many)


def test_the_claim_order_holds_with_held_documents_and_expired_leases(any_db, add_job):
    """The claim's looks, each read apart: a document this worker holds first, then the
    oldest no other worker holds, then one another holds; a job whose lease ran out is
    claimable in its place in that order; a higher priority goes first whatever else."""
    old = add_job(any_db, "Old document.", name="old")
    held_by_other = add_job(any_db, "Other's document.", name="other")
    mine = add_job(any_db, "My document.", name="mine")
    assert [c.job_id for c in queue.claim_jobs(any_db, "w2", 600, max_jobs=1)] == [old]
    queue.claim_jobs(any_db, "w2", 600, max_jobs=1)  # w2 holds "other" too
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 600, max_jobs=1)] == [mine]
    more_mine = add_job(any_db, "My document.", ("Again?",), name="mine")
    fresh = add_job(any_db, "Fresh document.", name="fresh")
    more_other = add_job(any_db, "Other's document.", ("Again?",), name="other")
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 600)] == [more_mine]
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 600)] == [fresh]
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 600)] == [more_other]
    with any_db.write() as conn:  # w2 died: its oldest job's lease ran out
        conn.execute(update(Job).where(Job.id == old)
                     .values(lease_expires_at=any_db.now(conn) - timedelta(seconds=5)))
    urgent = add_job(any_db, "Urgent document.", name="urgent", priority=3)
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 600)] == [urgent]
    assert [c.job_id for c in queue.claim_jobs(any_db, "w1", 600)] == [old]
    assert queue.claim_jobs(any_db, "w1", 600) == []
    assert held_by_other  # still w2's, its lease alive
    with any_db.read() as conn:
        owner = conn.execute(select(Job.lease_owner).where(Job.id == held_by_other)).scalar()
    assert owner == "w2"


@pytest.mark.parametrize("model, expected", [(None, "m2"), ("m1", None)])
def test_a_claim_for_a_model_takes_only_its_jobs_and_unnamed_ones(sqlite_db, add_job, model,
                                                                  expected):
    add_job(sqlite_db, "For m2.", name="m2", model="m2")
    claims = queue.claim_jobs(sqlite_db, "w1", 600, model=model)
    assert [c.params.model for c in claims] == ([] if expected is None else [expected])


def test_a_top_job_of_a_document_another_worker_holds_is_claimed_before_lower_ones(
        sqlite_db, add_job):
    """The only open job of the top priority belongs to a document another worker runs: a
    claim takes it (before any lower priority), and reads as little of 440 lower jobs as of 40."""
    held = add_job(sqlite_db, "Held document.", name="held", priority=5)
    assert [c.job_id for c in queue.claim_jobs(sqlite_db, "w2", 600)] == [held]
    queue_documents(sqlite_db, add_job, 40)
    steps = []
    for more in (0, 400):
        queue_documents(sqlite_db, add_job, more, start=40)
        later = add_job(sqlite_db, "Held document.", (f"Later {more}?",), name="held", priority=5)

        def claim():
            claims = queue.claim_jobs(sqlite_db, "w1", 600)
            assert [c.job_id for c in claims] == [later]
            queue.release_jobs(sqlite_db, "w1", [later])
            cancel_job(sqlite_db, later)

        steps.append(vm_steps(sqlite_db, claim))
    assert steps[0] > 0 and steps[1] < 1.5 * steps[0], steps


def test_the_status_view_counts_answered_questions_as_one_by_one(any_db, add_job):
    """`ppqa status` reads answered questions from the jobs' rows (a done job is all answered,
    a job never claimed has none, the others counted question by question): per document
    and in all, the same as counting every question's answers against its samples."""
    ids = varied_queue(any_db, add_job)
    queue.claim_jobs(any_db, "w3", 600)  # one more claimed, nothing answered yet
    add_job(any_db, "Doc one.", ("E?",), name="one")  # a document of two jobs
    with any_db.read() as conn:
        samples = dict(conn.execute(select(Job.id, Job.samples)).all())
        document = dict(conn.execute(select(Job.id, Job.document_id)).all())
        have: dict[int, int] = {}
        for (qid,) in conn.execute(select(Answer.question_id)):
            have[qid] = have.get(qid, 0) + 1
        questions = conn.execute(select(Question.id, Question.job_id)).all()
    expected: dict[int, int] = {}
    for qid, job_id in questions:
        expected.setdefault(document[job_id], 0)
        expected[document[job_id]] += have.get(qid, 0) >= samples[job_id]
    status = queue_status(any_db)
    assert {d["document"]: d["answered"] for d in status["documents"]} == expected
    assert status["totals"]["answered"] == sum(expected.values()) > 0
    assert expected[document[ids["done"]]] == 1 and expected[document[ids["untouched"]]] == 0


def test_the_status_view_reads_the_jobs_not_their_questions(tmp_path, add_job):
    """40 done jobs of 30 questions each cost `queue_status` as many SQLite instructions as 40
    of one question: a done job's answered questions are its question count."""
    from ppqa.store.db import open_db

    steps = []
    for questions in (1, 30):
        db = open_db(str(tmp_path / f"{questions}.db"))
        queue_documents(db, add_job, 40, questions=questions)
        while claims := queue.claim_jobs(db, "w1", 600, max_jobs=64):
            for claim in claims:
                queue.record_answers(db, [(q.id, "x", 1, "stop", 0.1) for q in claim.questions],
                                     worker_id="w1")
                queue.finish_job(db, claim.job_id, "w1", REPORT)
        assert queue_status(db)["totals"]["answered"] == 40 * questions
        steps.append(vm_steps(db, lambda: queue_status(db)))
        db.close()
    assert steps[0] > 0 and steps[1] < 1.5 * steps[0], steps


def test_a_claim_of_one_model_reads_past_no_queued_job_of_another(sqlite_db, add_job):
    """Older queued jobs of another model do not lengthen a claim of a worker of one model:
    it reads its model's jobs and those of no model as ranges of the index by model, the same
    SQLite instructions behind 400 jobs of model m2 as behind 40."""
    steps = []
    for start, count in ((0, 40), (40, 360)):
        for i in range(start, start + count):
            add_job(sqlite_db, f"For m2, {i}.", ("Q?",), name=f"m2-{i}", model="m2")
        mine = add_job(sqlite_db, f"For m1, {start}.", ("Q?",), name=f"m1-{start}", model="m1")

        def claim():
            claims = queue.claim_jobs(sqlite_db, "w1", 600, model="m1")
            assert [c.job_id for c in claims] == [mine]
            queue.release_jobs(sqlite_db, "w1", [mine])
            cancel_job(sqlite_db, mine)

        steps.append(vm_steps(sqlite_db, claim))
    assert steps[0] > 0 and steps[1] < 1.5 * steps[0], steps
