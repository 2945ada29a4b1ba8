"""Fault tests of the worker, the way trusted queues run them: real `ppqa run` processes on a
real store, loopback only, each test bounded in time and count.

- kill -9 of a worker at random points of its loop, at least 50 times over one queue (SQLite
  and PostgreSQL), then every question must have exactly one answer and every job be done;
- four workers and four ingesting processes on one SQLite file: no double claim, nothing lost,
  no "database is locked" reaching anyone.

The store's own faults (a PostgreSQL restart, a full disk) are in tests/test_faults_store.py.
Workers run the real command line (`ppqa run`, tiny random model `dummy:tiny-mha`, fp32 on the
CPU), forked from `tests/worker_zygote.py` (the `zygote` fixture, tests/faults.py), which has
torch and the engine loaded already. Each test prints its figures on one `fault figures:` line
(`pytest -s` shows them). PPQA_FAULT_SECONDS lengthens the concurrency test (default 20 s).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

from ppqa.store.db import open_db
from tests.faults import WAIT_S, fault_env, print_figures, queue_jobs, store_figures, worker_args
from tests.helpers import process_alive

KILLS = 50


# ---- kill -9, 50 times -------------------------------------------------------------------


def test_kill_9_at_random_points_loses_and_duplicates_nothing(db_location, tmp_path, zygote):
    rng = random.Random(20)
    # Answer budgets from 4 to 48 tokens: a victim finishes some answers and dies in the middle
    # of others (only finished answers are written; the rest is redone by a later worker).
    # The queue is topped up whenever it runs low (below 300 open questions, some of them held by
    # dead victims' leases), so that every victim has work to die in.
    jobs = queue_jobs(db_location, documents=6, jobs_per_document=4, questions=5,
                      budgets=(4, 16, 48))
    next_document = 6
    env = fault_env(tmp_path, db_location)
    args = worker_args("--lease-seconds", "1", "--max-attempts", "1000", "--max-jobs", "2",
                        "--kv-tokens", "8192")
    # Two victims at a time. A third of them die at a random moment from their start (start-up,
    # the first claim); the others at a random moment after their first claim (prefill, decode,
    # an answer's write, a settle, the next claim), where a worker spends little time: the
    # tiny model answers a job in a tenth of a second.
    victims: dict[int, dict] = {}
    kills, kills_after_claim, exited_first, answers_at_kill = 0, 0, 0, []
    started = time.monotonic()
    try:
        while kills < KILLS:
            assert time.monotonic() - started < 4 * WAIT_S, "the kill loop took too long"
            while len(victims) < 2:
                pid, err = zygote.run(args, env)
                victims[pid] = {"err": err, "after_claim": rng.random() > 1 / 3,
                                "kill_at": None, "delay": rng.uniform(0.0, 0.5)}
                if not victims[pid]["after_claim"]:
                    victims[pid]["kill_at"] = time.monotonic() + rng.uniform(0.02, 0.6)
            time.sleep(0.005)
            for pid, victim in list(victims.items()):
                claimed = victim["err"].exists() and "claimed" in victim["err"].read_text()
                if victim["kill_at"] is None and claimed:
                    victim["kill_at"] = time.monotonic() + victim["delay"]
                if not process_alive(pid):
                    exited_first += 1
                elif victim["kill_at"] is not None and time.monotonic() >= victim["kill_at"]:
                    os.kill(pid, signal.SIGKILL)
                    kills += 1
                    kills_after_claim += claimed
                    now = store_figures(db_location)
                    answers_at_kill.append(now["answers"])
                    if now["questions"] - now["answers"] < 300:
                        jobs += queue_jobs(db_location, documents=4, jobs_per_document=4,
                                           questions=5, budgets=(4, 16, 48), start=next_document)
                        next_document += 4
                else:
                    continue
                zygote.reap(pid)
                del victims[pid]
    finally:  # also when the loop fails: no victim outlives the test
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
            zygote.reap(pid)
    kills += len(victims)
    killed_for = time.monotonic() - started
    before = store_figures(db_location)
    time.sleep(1.2)  # the last victims' 1 s leases run out
    pid, err = zygote.run(worker_args("--lease-seconds", "1", "--max-attempts", "1000"), env,
                          name="final")
    assert zygote.reap(pid) == 0, err.read_text()[-3000:]
    after = store_figures(db_location)
    print_figures("kill -9", backend="postgresql" if "://" in db_location else "sqlite",
             kills=kills, kills_after_a_claim=kills_after_claim,
             workers_that_exited_before_their_kill=exited_first,
             answers_when_the_kills_ended=before["answers"], questions=after["questions"],
             lost=after["lost"], duplicated=after["duplicated"], jobs=jobs,
             jobs_done=after["status"].get("done", 0), max_attempts=after["max_attempts"],
             kill_phase_seconds=round(killed_for, 1))
    assert kills >= KILLS and kills_after_claim >= KILLS // 2
    # The kills landed while work was under way: answers were written between them.
    assert answers_at_kill[-1] > answers_at_kill[0] and before["answers"] < after["questions"]
    assert exited_first <= KILLS // 5  # nearly every victim was killed, not out of work
    assert after["status"] == {"done": jobs}
    assert after["lost"] == after["duplicated"] == 0
    assert after["answers"] == after["questions"]


# ---- four workers and four ingesters on one SQLite file ------------------------------------


# One ingesting process: `ppqa ingest` run again and again in the same interpreter (the real
# command, through Typer), for `seconds`; prints each job id, or the failure, a line each.
INGESTER = """
import random, sys, time, traceback
from pathlib import Path
from ppqa.cli.app import app
n, seconds, folder = int(sys.argv[1]), float(sys.argv[2]), Path(sys.argv[3])
rng, end, k = random.Random(n), time.monotonic() + seconds, 0
while time.monotonic() < end:
    k += 1
    (folder / "d.txt").write_text(f"Ingester {n} document {k}: " + "word " * rng.randint(5, 60))
    (folder / "q.txt").write_text("".join(f"Question {i} of {k}?\\n"
                                          for i in range(rng.randint(1, 4))))
    args = ["ingest", str(folder / "d.txt"), str(folder / "q.txt"),
            "--max-new-tokens", str(rng.choice((1, 4, 12)))]
    try:
        code = app(args=args, prog_name="ppqa", standalone_mode=False)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = "exception"
    if code not in (0, None):
        print(f"failed: {code}", flush=True)
"""


def test_four_workers_and_four_ingesters_share_one_sqlite_file(tmp_path, zygote):
    seconds = float(os.environ.get("PPQA_FAULT_SECONDS", "20"))
    url = str(tmp_path / "shared.db")
    open_db(url).close()
    env = fault_env(tmp_path, url)
    workers = [zygote.run(worker_args("--follow", "--max-jobs", "4", "--lease-seconds", "20"),
                          env, name=f"worker{i}") for i in range(4)]
    ingesters = []
    for n in range(4):
        folder = tmp_path / f"in{n}"
        folder.mkdir()
        ingesters.append(subprocess.Popen(
            [sys.executable, "-c", INGESTER, str(n), str(seconds), str(folder)], env=env,
            cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=seconds + WAIT_S) for p in ingesters]
    ingested = [int(line) for out, _ in outputs for line in out.split() if line.isdigit()]
    failures = [line for out, _ in outputs for line in out.splitlines()
                if line.startswith("failed")]
    ingest_errors = [err for _, err in outputs]
    deadline = time.monotonic() + WAIT_S
    while store_figures(url)["status"] != {"done": len(ingested)}:
        assert time.monotonic() < deadline, store_figures(url)
        assert all(process_alive(pid) for pid, _ in workers), "a worker exited"
        time.sleep(0.2)
    for pid, _ in workers:
        os.kill(pid, signal.SIGTERM)
    codes = [zygote.reap(pid) for pid, _ in workers]
    errors = [err.read_text() for _, err in workers]
    figures = store_figures(url)
    print_figures("4 workers + 4 ingesters on SQLite", seconds=seconds, jobs_ingested=len(ingested),
             ingest_failures=len(failures), questions=figures["questions"],
             lost=figures["lost"], duplicated=figures["duplicated"],
             double_claims=figures["jobs_by_two_workers"] + figures["jobs_reported_twice"],
             max_attempts=figures["max_attempts"],
             locked_messages=sum(e.count("locked") for e in errors + ingest_errors),
             worker_exit_codes=codes)
    assert [p.returncode for p in ingesters] == [0, 0, 0, 0]
    assert failures == [] and len(ingested) == len(set(ingested)) > 0
    assert not any("locked" in e or "Traceback" in e for e in errors + ingest_errors)
    assert codes == [0, 0, 0, 0], errors
    assert figures["lost"] == figures["duplicated"] == 0
    assert figures["jobs_by_two_workers"] == figures["jobs_reported_twice"] == 0
    assert figures["max_attempts"] == 1  # no job was ever claimed twice
