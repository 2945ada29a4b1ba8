"""What the worker's store calls cost as the queue grows (CPU; SQLite or PostgreSQL).

A worker runs its claims, heartbeats and progress reads on the engine's thread, between two
steps, while the step in flight runs on the device: a call that takes longer than a step (about
10 ms for a 7B model's decode step) idles the GPU for the rest. This builds a store of `--jobs`
queued jobs of `--questions` questions each (one document a job), leaves `--held` documents
claimed by this worker and as many by another (the running jobs a claim looks at), then times
each call `--repeats` times on that queue (a claim is released after it is timed, so each
meets the same queue):

    python benchmarks/store_scale.py --db /tmp/scale.db --jobs 20000 --questions 20 \
        --out benchmarks/results/cpu/store_scale.json

A store that already holds the jobs (a second run over the same --db) is timed as it is, so
two versions of the code can be timed on one queue. `--finished N` first answers and finishes
N of the jobs through the worker's calls (a store with history: answers and reports).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sqlalchemy import func, select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ppqa.files.inputs import QuestionInput  # noqa: E402
from ppqa.store import (IngestRequest, JobReport, claim_jobs, finish_job, heartbeat,  # noqa: E402
                        ingest, open_db, release_jobs)
from ppqa.store import lookups  # noqa: E402
from ppqa.store.models import QUEUED, RUNNING, Job  # noqa: E402
from ppqa.store.queue import record_answers  # noqa: E402

WORKER, OTHER = "scale-worker", "scale-other"
LEASE_S = 3600.0


def build(db, jobs: int, questions: int, seed: int) -> float:
    """Ingest `jobs` jobs (500 a transaction); returns the seconds it took."""
    rng = random.Random(seed)
    began = time.perf_counter()
    batch: list[IngestRequest] = []
    for j in range(jobs):
        text = f"Document {j}. " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(60))
        qs = [QuestionInput(str(i), f"Question {i} about document {j}?", f"scale:{j}:{i}")
              for i in range(questions)]
        batch.append(IngestRequest(text, f"doc{j}", qs))
        if len(batch) == 500 or j == jobs - 1:
            ingest(db, batch)
            batch = []
    return time.perf_counter() - began


def finish_some(db, count: int) -> None:
    """Claim, answer and finish `count` jobs as a worker does."""
    done = 0
    while done < count:
        claims = claim_jobs(db, "scale-history", LEASE_S, max_jobs=1)
        if not claims:
            return
        for job in claims:
            rows = [(q.id, f"answer {q.id}", 3, "stop", 0.01) for q in job.questions]
            record_answers(db, rows, worker_id="scale-history")
            finish_job(db, job.job_id, "scale-history",
                       JobReport("cpu", "scale", "stock", 1.0, len(rows), 100, 3 * len(rows)))
            done += 1


def hold(db, worker: str, documents: int) -> list[int]:
    """Claim `documents` documents' jobs for `worker` and keep them running."""
    held: list[int] = []
    for _ in range(documents):
        held += [c.job_id for c in claim_jobs(db, worker, LEASE_S, max_jobs=64)]
    return held


def timed(fn, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1e3)
    return {"median_ms": round(statistics.median(times), 2), "max_ms": round(max(times), 2),
            "repeats": repeats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", required=True, help="a SQLite file path or an SQLAlchemy URL")
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--questions", type=int, default=20)
    ap.add_argument("--finished", type=int, default=0)
    ap.add_argument("--held", type=int, default=4, help="documents held by each of two workers")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    db = open_db(args.db)
    with db.read() as conn:
        present = conn.execute(select(func.count(Job.id))).scalar_one()
    build_s = None
    if present == 0:
        build_s = build(db, args.jobs, args.questions, args.seed)
        finish_some(db, args.finished)
        hold(db, WORKER, args.held)
        hold(db, OTHER, args.held)
    with db.read() as conn:
        counts = dict(conn.execute(
            select(Job.status, func.count(Job.id)).group_by(Job.status)).all())
        mine = list(conn.execute(select(Job.id).where(
            Job.status == RUNNING, Job.lease_owner == WORKER)).scalars())

    def claim_and_release():
        claims = claim_jobs(db, WORKER, LEASE_S, max_jobs=64, max_questions=256,
                            whole_within=(64, 256))
        release_jobs(db, WORKER, [c.job_id for c in claims])

    def release_only():  # what claim_and_release spends apart from the claim
        claims = claim_jobs(db, WORKER, LEASE_S, max_jobs=64, max_questions=256,
                            whole_within=(64, 256))
        began = time.perf_counter()
        release_jobs(db, WORKER, [c.job_id for c in claims])
        return time.perf_counter() - began

    release_ms = statistics.median(release_only() for _ in range(5)) * 1e3
    calls = {
        "claim_jobs + release_jobs": timed(claim_and_release, args.repeats),
        "waiting_questions (queued)": timed(lambda: lookups.waiting_questions(db), args.repeats),
        "waiting_questions (queued, running)": timed(
            lambda: lookups.waiting_questions(db, statuses=(QUEUED, RUNNING)), args.repeats),
        "has_claimable": timed(lambda: lookups.has_claimable(db), args.repeats),
        "newest_job_id": timed(lambda: lookups.newest_job_id(db), args.repeats),
        "heartbeat (held jobs)": timed(lambda: heartbeat(db, WORKER, mine, LEASE_S),
                                       args.repeats),
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=Path(__file__).parent).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, cwd=Path(__file__).parent).stdout
    result = {
        "kind": "store_scale", "commit": commit + ("+changes" if dirty.strip() else ""),
        "command": " ".join(sys.argv), "dialect": db.dialect,
        "host": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "jobs_by_status": counts, "questions_per_job": args.questions, "build_s": build_s,
        "release_jobs_ms": round(release_ms, 2), "calls": calls,
        "waiting_questions": lookups.waiting_questions(db),
    }
    for name, t in calls.items():
        print(f"{name:40s} median {t['median_ms']:8.2f} ms   max {t['max_ms']:8.2f} ms")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
