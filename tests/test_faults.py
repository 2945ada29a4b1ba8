"""Fault tests, the way trusted queues run them: real `ppqa` processes on a real
store, loopback only, each test bounded in time and count.

- kill -9 of a worker at random points of its loop, at least 50 times over one queue (SQLite
  and PostgreSQL), then every question must have exactly one answer and every job be done;
- a PostgreSQL server restarted (twice: a fast shutdown and a crash) under `ppqa run --follow`,
  which must ride it out and lose nothing;
- the disk filling up (a 1 MiB tmpfs) during `ppqa export` and during answer writes: the old
  export intact, the store consistent, one line of error, and a clean finish once there is room;
- four workers and four ingesting processes on one SQLite file: no double claim, nothing lost,
  no "database is locked" reaching anyone.

Workers run the real command line (`ppqa run`, tiny random model `dummy:tiny-mha`, fp32 on the
CPU). Where a test starts many of them they are forked from `tests/worker_zygote.py`, which has
torch and the engine loaded already. Each test prints its figures on one `fault figures:` line
(`pytest -s` shows them). PPQA_FAULT_SECONDS lengthens the concurrency test (default 20 s).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select

from ppqa.files.inputs import QuestionInput
from ppqa.store.db import open_db
from ppqa.store.jobs import IngestRequest, ingest
from ppqa.store.models import Answer, Job, Question, Report
from ppqa.store.params import GenerationParams
from tests.helpers import process_alive

REPO = Path(__file__).resolve().parents[1]
MODEL = "dummy:tiny-mha"
WAIT_S = 120  # bound on any single wait, so that a hang fails instead of blocking CI
KILLS = 50


def _env(tmp_path: Path, db: str, **extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PPQA_HOME": str(tmp_path / "home"),
            "PPQA_DB": db, "PPQA_LOG_INTERVAL": "1", **extra}


def _figures(name: str, **figures) -> None:
    print(f"fault figures: {name}: {json.dumps(figures, sort_keys=True)}")


def queue_jobs(db_location: str, documents: int, jobs_per_document: int, questions: int,
               budgets=(4, 16, 32), start: int = 0) -> int:
    requests = []
    for d in range(start, start + documents):
        text = f"Document {d}. " + " ".join(f"Fact {i} is {(d * 7 + i) % 13}." for i in range(6))
        for j in range(jobs_per_document):
            qs = [QuestionInput(f"q{k}", f"What is fact {(j + k) % 6} of {d}?", "t")
                  for k in range(questions)]
            requests.append(IngestRequest(text, f"doc-{d}", qs, GenerationParams(
                max_new_tokens=budgets[(d + j) % len(budgets)], seed=j)))
    db = open_db(db_location)
    try:
        ingest(db, requests, force=True)
    finally:
        db.close()
    return len(requests)


def store_figures(db_location: str) -> dict:
    """What the store holds: jobs by status, questions, answers, questions without an answer
    and with more than one, and jobs answered by more than one worker or reported twice."""
    db = open_db(db_location)
    try:
        with db.read() as conn:
            per_question = (select(Question.id, func.count(Answer.id).label("n"))
                            .outerjoin(Answer, Answer.question_id == Question.id)
                            .group_by(Question.id).subquery())
            workers_per_job = (select(Question.job_id)
                               .join(Answer, Answer.question_id == Question.id)
                               .group_by(Question.job_id)
                               .having(func.count(func.distinct(Answer.worker)) > 1).subquery())
            reports_per_job = (select(Report.job_id).group_by(Report.job_id)
                               .having(func.count() > 1).subquery())
            def count(query):
                return conn.execute(select(func.count()).select_from(query)).scalar_one()

            return {
                "status": dict(conn.execute(select(Job.status, func.count())
                                            .group_by(Job.status)).all()),
                "questions": conn.execute(select(func.count(Question.id))).scalar_one(),
                "answers": conn.execute(select(func.count(Answer.id))).scalar_one(),
                "lost": count(select(per_question).where(per_question.c.n == 0).subquery()),
                "duplicated": count(select(per_question).where(per_question.c.n > 1).subquery()),
                "jobs_by_two_workers": count(workers_per_job),
                "jobs_reported_twice": count(reports_per_job),
                "max_attempts": conn.execute(select(func.max(Job.attempts))).scalar_one(),
            }
    finally:
        db.close()


# ---- a pool of pre-loaded workers --------------------------------------------------------


class Zygote:
    """The test's end of tests/worker_zygote.py (see its docstring)."""

    def __init__(self, tmp_dir: Path) -> None:
        self.tmp_dir = tmp_dir
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "worker_zygote.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_dir)
        assert self._line() == "ready"
        self.count = 0

    def _line(self) -> str:
        line = self.proc.stdout.readline().strip()
        assert line, "the worker zygote died"
        return line

    def run(self, argv: list[str], env: dict, name: str | None = None) -> tuple[int, Path]:
        self.count += 1
        name = name or f"w{self.count}"
        err = self.tmp_dir / f"{name}.err"
        spec = {"argv": argv, "env": env, "stdout": str(self.tmp_dir / f"{name}.out"),
                "stderr": str(err)}
        self.proc.stdin.write(f"run {json.dumps(spec)}\n")
        self.proc.stdin.flush()
        return int(self._line()), err

    def reap(self, pid: int) -> int:
        self.proc.stdin.write(f"reap {pid}\n")
        self.proc.stdin.flush()
        return int(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


def _worker_args(*extra: str) -> list[str]:
    return ["run", "--device", "cpu", "--model", MODEL, "--json", *extra]


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
    env = _env(tmp_path, db_location)
    args = _worker_args("--lease-seconds", "1", "--max-attempts", "1000", "--max-jobs", "2",
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
    pid, err = zygote.run(_worker_args("--lease-seconds", "1", "--max-attempts", "1000"), env,
                          name="final")
    assert zygote.reap(pid) == 0, err.read_text()[-3000:]
    after = store_figures(db_location)
    _figures("kill -9", backend="postgresql" if "://" in db_location else "sqlite",
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


# ---- a PostgreSQL server restarted under a --follow worker --------------------------------


def _pg_bin() -> Path | None:
    for tool in ("pg_config",):
        found = shutil.which(tool)
        if found:
            out = subprocess.run([found, "--bindir"], capture_output=True, text=True)
            if out.returncode == 0 and (Path(out.stdout.strip()) / "initdb").exists():
                return Path(out.stdout.strip())
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return candidates[-1].parent if candidates else None


class PrivateServer:
    """A PostgreSQL server of the test's own (initdb in a temporary folder, a free loopback
    port): restarting it disturbs nobody else's tests on the shared server at :5432."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="ppqa-pg-", dir="/tmp"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.run_as: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root: run the server as the postgres user
            import pwd

            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self.run_as = ["runuser", "-u", "postgres", "--"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._pg("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _pg(self, tool: str, *args: str) -> None:
        out = subprocess.run([*self.run_as, str(self.bindir / tool), *args], capture_output=True,
                             text=True, timeout=WAIT_S, cwd=self.root)
        assert out.returncode == 0, f"{tool} failed: {out.stderr[-2000:]}"

    def ctl(self, action: str, *args: str) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c full_page_writes=off")
        self._pg("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                 "-o", options, action, *args)

    def remove(self) -> None:
        subprocess.run([*self.run_as, str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m",
                        "immediate", "-w", "stop"], capture_output=True, timeout=WAIT_S)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def private_pg():
    bindir = _pg_bin()
    if bindir is None or not shutil.which("pg_ctl", path=str(bindir)):
        pytest.skip("PostgreSQL's initdb and pg_ctl are not installed (postgresql-NN package)")
    if os.geteuid() == 0 and not shutil.which("runuser"):
        pytest.skip("running as root without runuser: cannot start a server as postgres")
    try:
        server = PrivateServer(bindir)
        server.ctl("start")
    except (AssertionError, KeyError, OSError) as exc:
        pytest.skip(f"cannot start a private PostgreSQL server: {exc}")
    yield server
    server.remove()


OUTAGE_S = 1.5


@pytest.mark.postgres
def test_postgres_restarts_under_a_following_worker(private_pg, tmp_path, zygote):
    url = private_pg.url
    # Enough work that both restarts find the worker busy: with 54 answers of 16-32 tokens a
    # loaded CI machine's worker had answered all before the first restart, which then went
    # unnoticed.
    jobs = queue_jobs(url, documents=10, jobs_per_document=3, questions=3, budgets=(32, 64))
    pid, err = zygote.run(_worker_args("--follow", "--lease-seconds", "3", "--max-jobs", "2"),
                          _env(tmp_path, url), name="pg-follow")
    restarts = []
    try:
        for mode in ("fast", "immediate"):  # a clean restart, then a crash and its recovery
            _wait_for(lambda: store_figures(url)["answers"] > len(restarts) * 10, pid)
            restarts.append((mode, store_figures(url)["answers"]))
            # Down for longer than a heartbeat's interval (a third of the 3 s lease), so that a
            # beat of the busy worker meets the outage: a bare restart could fall between two
            # store calls and go unnoticed (pooled connections are pinged before use).
            private_pg.ctl("stop", "-m", mode)
            time.sleep(OUTAGE_S)
            private_pg.ctl("start")
        jobs += queue_jobs(url, documents=2, jobs_per_document=2, questions=3, start=100)
        _wait_for(lambda: store_figures(url)["status"] == {"done": jobs}, pid)
        assert process_alive(pid), "the --follow worker exited"
    finally:
        os.kill(pid, signal.SIGTERM)
        code = zygote.reap(pid)
    stderr = err.read_text()
    figures = store_figures(url)
    noticed = sum("retrying" in line or "not saved yet" in line or "could not update" in line
                  for line in stderr.splitlines())
    _figures("postgres restart", restarts=[m for m, _ in restarts],
             answers_at_restart=[n for _, n in restarts], questions=figures["questions"],
             lost=figures["lost"], duplicated=figures["duplicated"], jobs=jobs,
             jobs_done=figures["status"].get("done", 0), store_error_lines=noticed,
             exit_code_after_sigterm=code)
    assert code == 0, stderr[-3000:]
    assert figures["lost"] == figures["duplicated"] == 0
    assert figures["answers"] == figures["questions"]
    assert "Traceback" not in stderr
    assert noticed > 0, "the restarts should have been noticed (and ridden out)"


def _wait_for(condition, pid: int, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except Exception:  # noqa: BLE001 - the server may be restarting
            pass
        assert process_alive(pid), "the worker exited"
        time.sleep(0.1)
    raise AssertionError("timed out")


# ---- the disk filling up ------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, or a skip saying why there is none."""
    mount = tmp_path / "small"
    mount.mkdir()
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {out.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(folder: Path, leave_bytes: int) -> Path:
    """Fill `folder`'s file system until about `leave_bytes` are free."""
    filler = folder / "filler"
    free = shutil.disk_usage(folder).free
    with open(filler, "wb") as f:
        f.write(b"\0" * max(free - leave_bytes, 0))
    return filler


def _cli(tmp_path: Path, db: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ppqa", *args], capture_output=True, text=True,
                          env=_env(tmp_path, db), cwd=tmp_path, timeout=WAIT_S)


def test_disk_full_during_export_keeps_the_old_file(small_disk, tmp_path, sqlite_path, add_job):
    db = open_db(sqlite_path)
    for i in range(4):
        add_job(db, f"Document {i}: " + "long text " * 40,
                [f"Question {k} " * 20 for k in range(30)], name=f"d{i}")
    db.close()
    target = small_disk / "answers.csv"
    first = _cli(tmp_path, str(sqlite_path), "export", str(target), "--job", "1")
    assert first.returncode == 0, first.stderr
    old = target.read_bytes()
    _fill(small_disk, 16 * 1024)
    full = _cli(tmp_path, str(sqlite_path), "export", str(target), "--all")
    _figures("disk full during export", old_export_bytes=len(old), exit_code=full.returncode,
             message=full.stderr.strip())
    assert full.returncode == 2
    assert full.stderr == (f"error: {target}: cannot write it (No space left on device) "
                           "(the file there is unchanged)\n")
    assert target.read_bytes() == old
    assert sorted(p.name for p in small_disk.iterdir()) == ["answers.csv", "filler"]


def test_disk_full_during_answer_writes(small_disk, tmp_path, zygote):
    store = small_disk / "store.db"
    jobs = queue_jobs(str(store), documents=2, jobs_per_document=2, questions=60, budgets=(60,))
    # Room for some answers (and the WAL), not all: the worker writes a step's answers in one
    # transaction, so the answers themselves, not per-answer pages, have to outgrow the disk.
    filler = _fill(small_disk, 160 * 1024)
    env = _env(tmp_path, str(store))
    pid, err = zygote.run(_worker_args("--max-jobs", "1", "--lease-seconds", "1"), env,
                          name="disk-full")
    code = zygote.reap(pid)
    during = store_figures(str(store))
    with sqlite3.connect(store) as conn:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    stderr = err.read_text()
    last = stderr.strip().splitlines()[-1]
    filler.unlink()  # room again: another worker finishes the queue
    time.sleep(1.2)  # once the first worker's leases ran out
    pid, err_again = zygote.run(_worker_args(), env, name="disk-free")
    code_again = zygote.reap(pid)
    after = store_figures(str(store))
    _figures("disk full during answer writes", exit_code=code, last_line=last,
             answers_when_full=during["answers"], questions=during["questions"],
             integrity=integrity, lost_after_retry=after["lost"],
             duplicated=after["duplicated"], jobs=jobs, jobs_done=after["status"].get("done", 0))
    assert code == 2 and "Traceback" not in stderr
    assert last.startswith("error: database ") and "full" in last, stderr[-2000:]
    assert integrity == "ok" and during["duplicated"] == 0
    assert 0 < during["answers"] < during["questions"]  # some written, then the disk was full
    assert code_again == 0, err_again.read_text()[-2000:]
    assert after["status"] == {"done": jobs} and after["lost"] == after["duplicated"] == 0


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
    env = _env(tmp_path, url)
    workers = [zygote.run(_worker_args("--follow", "--max-jobs", "4", "--lease-seconds", "20"),
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
    _figures("4 workers + 4 ingesters on SQLite", seconds=seconds, jobs_ingested=len(ingested),
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
