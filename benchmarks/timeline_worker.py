"""The worker path of `session_timeline.py`: the workload ingested into a fresh SQLite store by
the CLI (`ppqa ingest --batch`), all at once or over time by a feeding thread, then
`ppqa.worker.loop.Worker.run` in this process on the benchmark's warm engine, its loop's phases
tallied with `timeline_probes`.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from ppqa import Engine
from timeline_probes import Tally, phased, sync, wrap


def ingest(db_path: Path, batch: Path) -> None:
    subprocess.run([sys.executable, "-m", "ppqa", "--db", str(db_path), "ingest", "--batch",
                    str(batch)], check=True, capture_output=True, text=True)


def feed(worker, db_path: Path, jobs, folder: Path, seconds: float, log: dict) -> None:
    """Ingest `jobs` into the store over `seconds` (a tick's jobs in one `ppqa ingest`, as
    `ppqa bench --e2e arrivals` does), then stop `worker` once every job has settled."""
    from ppqa.bench.e2e_report import all_settled
    from ppqa.bench.workloads import write_batch

    total, sent, tick = len(jobs.jobs), 0, 0
    due_at = seconds / max(1, total)
    t0 = time.perf_counter()
    try:
        while sent < total and not worker.stopping:
            due = min(total, int((time.perf_counter() - t0) / due_at) + 1)
            if due > sent:
                batch = write_batch(jobs, folder, jobs.jobs[sent:due], f"tick-{tick}.jsonl")
                ingest(db_path, batch)
                log["ticks"].append((round(time.perf_counter() - log["t0"], 3), due - sent))
                sent, tick = due, tick + 1
            time.sleep(max(0.0, min(1.0, sent * due_at - (time.perf_counter() - t0))))
        while not worker.stopping and not all_settled(db_path, total):
            time.sleep(0.1)
    finally:
        worker.request_stop("every job settled")


def worker_pass(engine: Engine, workload, jobs, mode: str, folder: Path, instrument, answers,
                tally: Tally, prof=None, clock: dict | None = None,
                arrival_seconds: float | None = None):
    """The workload ingested into a fresh store by the CLI, then `Worker.run` in this process
    on `engine`, with the CLI's progress sink; the worker loop's phases join `tally`. With
    `arrival_seconds`, the worker follows the store and a thread ingests the jobs over that
    time (`feed`)."""
    import threading

    from ppqa.bench.workloads import write_batch
    from ppqa.cli.run_progress import make_progress
    from ppqa.store.db import open_db
    from ppqa.store.lookups import waiting_questions
    from ppqa.worker import loop

    # A folder per workload and seed, whose stores and batch files a later pass leaves alone.
    folder = folder / f"{workload.name}-seed-{workload.seed}"
    folder.mkdir(parents=True, exist_ok=True)
    db_path = folder / f"worker-{workload.seed}.db"
    db_path.unlink(missing_ok=True)
    t_ingest = time.perf_counter()
    if arrival_seconds is None:
        ingest(db_path, write_batch(jobs, folder, name=f"batch-{workload.seed}.jsonl"))
    else:
        open_db(str(db_path)).close()
    ingest_s = time.perf_counter() - t_ingest
    db = open_db(str(db_path))
    model = engine.model_name
    options = loop.WorkerOptions(model=model, device=str(engine.device), mode=mode,
                                 follow=arrival_seconds is not None)
    progress = make_progress(lambda: waiting_questions(db, model))
    worker = loop.Worker(db, engine, options, progress)
    new_session = worker._new_session
    worker._new_session = lambda: instrument(new_session())
    for name in ("_claim_if_room", "_write_and_settle", "_drop_lost"):
        if prof is not None:
            phased(worker, name, prof, name.strip("_"))
        wrap(worker, name, tally, f"worker{name}")
    restore: list = []
    if prof is not None:  # store transactions and device waits, within the phases above
        from ppqa.store import queue as store_queue

        for owner, name, label in ((store_queue, "claim_jobs", "claim_sql"),
                                   (store_queue, "record_answers", "answers_sql"),
                                   (store_queue, "finish_job", "finish_sql"),
                                   (torch.cuda, "synchronize", "sync")):
            restore.append((owner, name, getattr(owner, name)))
            phased(owner, name, prof, label)
    on_answer = worker._on_answer

    def answered(req, answer):
        answers.append(time.perf_counter())
        on_answer(req, answer)

    worker._on_answer = answered
    sync(engine)
    t0 = time.perf_counter()
    if clock is not None:
        clock["t0"] = t0
    arrivals = {"t0": t0, "ticks": []}
    if arrival_seconds is not None:
        threading.Thread(target=feed, args=(worker, db_path, jobs, folder, arrival_seconds,
                                            arrivals), daemon=True).start()
    try:
        summary = worker.run()
    finally:
        for owner, name, original in restore:
            setattr(owner, name, original)
    sync(engine)
    wall = time.perf_counter() - t0
    session = worker._session
    stats = session.stats
    done = sum(1 for j in summary.jobs if j.status == "done")
    if not done:
        failed = [j.error for j in summary.jobs if j.error]
        raise SystemExit(f"no job of the pass was answered ({len(summary.jobs)} claimed); "
                         f"first error: {failed[0] if failed else 'none reported'}")
    extra = {"ingest_s": ingest_s, "jobs_done": done, "jobs": len(summary.jobs),
             "worker_wall_s": summary.wall_seconds, "questions_answered": summary.questions}
    if arrival_seconds is not None:
        extra["arrival_ticks"] = arrivals["ticks"]
        extra["last_answer_s"] = (answers[-1] - t0) if answers else None
    return t0, tally.calls["decode"], wall, stats, extra
