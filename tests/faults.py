"""What the fault tests share (tests/test_faults.py, tests/test_faults_store.py): the store's
figures after a fault, queued jobs, and the zygote that forks real `ppqa run` workers.

Registered as a pytest plugin in tests/conftest.py, so the `zygote` fixture is one process for
the whole session: every fault test forks its workers from the same preloaded interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import func, select

from ppqa.files.inputs import QuestionInput
from ppqa.store.db import open_db
from ppqa.store.jobs import IngestRequest, ingest
from ppqa.store.models import Answer, Job, Question, Report
from ppqa.store.params import GenerationParams

REPO = Path(__file__).resolve().parents[1]
MODEL = "dummy:tiny-mha"
WAIT_S = 120  # bound on any single wait, so that a hang fails instead of blocking CI


def fault_env(tmp_path: Path, db: str, **extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PPQA_HOME": str(tmp_path / "home"),
            "PPQA_DB": db, "PPQA_LOG_INTERVAL": "1", **extra}


def print_figures(name: str, **figures) -> None:
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


@pytest.fixture(scope="session")
def zygote(tmp_path_factory):
    z = Zygote(tmp_path_factory.mktemp("zygote"))
    yield z
    z.close()


def worker_args(*extra: str) -> list[str]:
    return ["run", "--device", "cpu", "--model", MODEL, "--json", *extra]
