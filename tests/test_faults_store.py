"""Faults of the store under real `ppqa` processes: a PostgreSQL server restarted (twice: a fast
shutdown and a crash) under `ppqa run --follow`, which must ride it out and lose nothing; and
the disk filling up (a 1 MiB tmpfs) during `ppqa export` and during answer writes: the old export
intact, the store consistent, one line of error, and a clean finish once there is room.

Workers are forked from the `zygote` fixture (tests/faults.py); each test prints its figures on
one `fault figures:` line (`pytest -s` shows them).
"""

from __future__ import annotations

import os
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

from ppqa.store.db import open_db
from tests.faults import WAIT_S, fault_env, print_figures, queue_jobs, store_figures, worker_args
from tests.helpers import process_alive


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
    pid, err = zygote.run(worker_args("--follow", "--lease-seconds", "3", "--max-jobs", "2"),
                          fault_env(tmp_path, url), name="pg-follow")
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
    print_figures("postgres restart", restarts=[m for m, _ in restarts],
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
                          env=fault_env(tmp_path, db), cwd=tmp_path, timeout=WAIT_S)


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
    print_figures("disk full during export", old_export_bytes=len(old), exit_code=full.returncode,
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
    env = fault_env(tmp_path, str(store))
    pid, err = zygote.run(worker_args("--max-jobs", "1", "--lease-seconds", "1"), env,
                          name="disk-full")
    code = zygote.reap(pid)
    during = store_figures(str(store))
    with sqlite3.connect(store) as conn:
        integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
    stderr = err.read_text()
    last = stderr.strip().splitlines()[-1]
    filler.unlink()  # room again: another worker finishes the queue
    time.sleep(1.2)  # once the first worker's leases ran out
    pid, err_again = zygote.run(worker_args(), env, name="disk-free")
    code_again = zygote.reap(pid)
    after = store_figures(str(store))
    print_figures("disk full during answer writes", exit_code=code, last_line=last,
             answers_when_full=during["answers"], questions=during["questions"],
             integrity=integrity, lost_after_retry=after["lost"],
             duplicated=after["duplicated"], jobs=jobs, jobs_done=after["status"].get("done", 0))
    assert code == 2 and "Traceback" not in stderr
    assert last.startswith("error: database ") and "full" in last, stderr[-2000:]
    assert integrity == "ok" and during["duplicated"] == 0
    assert 0 < during["answers"] < during["questions"]  # some written, then the disk was full
    assert code_again == 0, err_again.read_text()[-2000:]
    assert after["status"] == {"done": jobs} and after["lost"] == after["duplicated"] == 0
