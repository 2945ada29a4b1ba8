"""`ppqa run --gpus`: a worker process per device, one display and one summary, stopped as one.

The processes are real (`ppqa run` children on the CPU through the hidden `--devices cpu,cpu`,
which stands in for `--gpus 0,1`): two workers on one SQLite file answer every question exactly
once and report one summary; SIGTERM to the parent releases every job its children held and
leaves no child running; a tensor-parallel worker (`--tensor-parallel 2` over two CPU ranks)
answers as one device does and refuses a model whose heads do not divide. The device lists, the
refusals of the options and the progress events are checked in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import func, select
from typer.testing import CliRunner

from ppqa.cli.app import app
from ppqa.files.inputs import QuestionInput
from ppqa.store.db import open_db
from ppqa.store.jobs import IngestRequest, ingest
from ppqa.store.models import Answer, Job, Question
from ppqa.store.params import GenerationParams
from ppqa.worker.setup import SetupError, device_groups
from tests.helpers import process_alive

REPO = Path(__file__).resolve().parents[1]
MODEL = "dummy:tiny-mha"
WAIT_S = 120  # bound on any wait, so that a hang fails instead of blocking CI


def _document(d: int) -> str:
    return f"Document {d}. " + " ".join(f"Fact {i} is {(d + i) % 9}." for i in range(8))


def _queue(db_location: str, documents: int, questions: int, max_new_tokens: int,
           model: str = MODEL) -> None:
    requests = [IngestRequest(_document(d), f"doc-{d}",
                              [QuestionInput(f"q{k}", f"What is fact {k}?", "t")
                               for k in range(questions)],
                              GenerationParams(max_new_tokens=max_new_tokens, seed=d, model=model))
                for d in range(documents)]
    db = open_db(db_location, create=True)
    try:
        ingest(db, requests)
    finally:
        db.close()


def _store(db_location: str) -> dict:
    """Jobs by status, the holders of running jobs, and every answer (one per question at
    most: the store's unique constraint) by question id."""
    db = open_db(db_location)
    try:
        with db.read() as conn:
            return {
                "status": dict(conn.execute(select(Job.status, func.count())
                                            .group_by(Job.status)).all()),
                "questions": conn.execute(select(func.count(Question.id))).scalar_one(),
                "owners": conn.execute(select(Job.lease_owner).where(
                    Job.status == "running")).scalars().all(),
                "answers": dict(conn.execute(select(Answer.question_id, Answer.text)).all()),
            }
    finally:
        db.close()


def _ppqa(tmp_path: Path, db: str, *args: str, **env_vars: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PPQA_HOME": str(tmp_path / "home"),
           "PPQA_DB": db, "PPQA_LOG_INTERVAL": "1", "OMP_NUM_THREADS": "1", **env_vars}
    return subprocess.Popen([sys.executable, "-m", "ppqa", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _split_run(tmp_path: Path, db: str, model: str) -> tuple[int, str]:
    """`ppqa run` of `model` split over two CPU ranks: (exit code, stderr)."""
    proc = _ppqa(tmp_path, db, "run", "--devices", "cpu,cpu", "--tensor-parallel", "2",
                 "--model", model)
    _, err = proc.communicate(timeout=WAIT_S)
    return proc.returncode, err


def test_two_workers_answer_every_question_once_with_one_summary(tmp_path: Path) -> None:
    db = str(tmp_path / "jobs.db")
    _queue(db, documents=6, questions=3, max_new_tokens=12)
    # A PPQA_GPU left in the environment names one worker's GPU: --gpus on the line wins, and
    # the children do not inherit it.
    proc = _ppqa(tmp_path, db, "run", "--devices", "cpu,cpu", "--model", MODEL,
                 "--max-jobs", "1", "--json", PPQA_GPU="0")
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    summary = json.loads(out)  # ONE summary on stdout, merged from both workers
    assert summary["device"] == "cpu#0,cpu#1" and "(2 workers)" in summary["worker"]
    assert sorted(j["job_id"] for j in summary["jobs"]) == list(range(1, 7))
    assert {j["status"] for j in summary["jobs"]} == {"done"}
    assert summary["questions_answered"] == 18
    assert err.count("started on cpu") == 2  # both children ran a worker ...
    assert err.count("jobs done") == 1  # ... and the parent printed one summary line
    store = _store(db)
    assert store["status"] == {"done": 6} and len(store["answers"]) == store["questions"] == 18


def _both_holding(tmp_path: Path, db: str) -> subprocess.Popen:
    """`ppqa run --follow` with two CPU workers, once each holds a job of a long queue."""
    _queue(db, documents=8, questions=4, max_new_tokens=3000)
    proc = _ppqa(tmp_path, db, "run", "--devices", "cpu,cpu", "--model", MODEL, "--follow",
                 "--max-jobs", "1", "--json")
    deadline = time.monotonic() + WAIT_S
    while len(set(_store(db)["owners"])) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.2)
    return proc


def _children(stderr: str) -> list[int]:
    """The workers' pids, from their "worker HOST:PID:TAG started" lines."""
    return [int(line.split("worker ", 1)[1].split(":")[1]) for line in stderr.splitlines()
            if "started on cpu" in line]


def test_sigterm_to_the_parent_releases_every_job_and_ends_every_child(tmp_path: Path) -> None:
    db = str(tmp_path / "jobs.db")
    proc = _both_holding(tmp_path, db)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    summary = json.loads(out)
    assert summary["stopped_by"] == "SIGTERM" and summary["jobs_released"] >= 2
    children = _children(err)
    assert len(children) == 2 and not any(process_alive(pid) for pid in children)
    store = _store(db)
    assert "running" not in store["status"] and store["owners"] == []  # nothing left held
    assert store["status"].get("queued", 0) >= 2


def test_every_stop_signal_reaches_every_child_and_the_second_ends_the_parent(
        tmp_path: Path, monkeypatch) -> None:
    from ppqa.worker import pool as pool_module
    from ppqa.worker.pool import Child, WorkerPool
    from ppqa.worker.report import ProgressSink

    # Children that note each SIGINT they get in a file and go on (a worker would stop, then
    # exit at once on the second); the parent's own exit is noted instead of taken.
    counter = ("import signal, sys, time\n"
               "signal.signal(signal.SIGINT, lambda *_: open(sys.argv[1], 'a').write('x'))\n"
               "open(sys.argv[1] + '.ready', 'w').close()\n"
               "time.sleep(60)\n")
    pool = WorkerPool([Child(f"cpu#{i}", []) for i in range(2)], "jobs.db", ProgressSink(), MODEL)
    notes = [tmp_path / f"child{i}" for i in range(2)]
    for child, note in zip(pool.children, notes):
        child.process = subprocess.Popen([sys.executable, "-c", counter, str(note)])
    exits = []
    monkeypatch.setattr(pool_module.os, "_exit", exits.append)
    try:
        deadline = time.monotonic() + WAIT_S
        while not all(Path(f"{note}.ready").exists() for note in notes):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for signals in (1, 2):  # a second Ctrl-C after the first has landed, as a person's would
            pool.request_stop(signal.SIGINT)
            assert pool.stop_reason == "SIGINT"
            assert exits == ([] if signals == 1 else [128 + signal.SIGINT])
            while any(not note.exists() or len(note.read_text()) < signals for note in notes):
                assert time.monotonic() < deadline, [n.read_text() for n in notes if n.exists()]
                time.sleep(0.05)
        assert [note.read_text() for note in notes] == ["xx", "xx"]
    finally:
        for child in pool.children:
            child.process.kill()
            child.process.wait()


def test_a_tensor_parallel_worker_answers_as_one_device(tmp_path: Path) -> None:
    from ppqa import Engine, SamplingParams

    db = str(tmp_path / "jobs.db")
    _queue(db, documents=2, questions=3, max_new_tokens=10, model="dummy:tiny-gqa")
    code, err = _split_run(tmp_path, db, "dummy:tiny-gqa")
    assert code == 0, err
    assert "loading dummy:tiny-gqa on cpu+cpu" in err
    one = Engine("dummy:tiny-gqa", device="cpu")  # the worker's engine, unsplit
    expected = [a.text for d in range(2) for a in one.answer(
        _document(d), [f"What is fact {k}?" for k in range(3)], mode="stock",
        sampling=SamplingParams(max_new_tokens=10, seed=d))]
    answers = _store(db)["answers"]
    assert [answers[q] for q in sorted(answers)] == expected


def test_a_model_whose_heads_do_not_divide_is_refused_in_one_line(tmp_path: Path) -> None:
    db = str(tmp_path / "jobs.db")
    _queue(db, documents=1, questions=1, max_new_tokens=4, model="dummy:tiny-odd")
    code, err = _split_run(tmp_path, db, "dummy:tiny-odd")
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("error: cannot load model 'dummy:tiny-odd'")
    assert "3 attention heads, 1 KV heads" in err and "Traceback" not in err
    assert _store(db)["status"] == {"queued": 1}  # nothing claimed


def test_a_worker_per_group_gets_its_devices() -> None:
    from ppqa.cli.run import _device_args

    assert _device_args(["cuda:2"], 1) == ["--device", "cuda:2"]
    assert _device_args(["cuda:2", "cuda:3"], 2) == ["--devices", "cuda:2,cuda:3",
                                                     "--tensor-parallel", "2"]


def test_the_children_of_gpus_each_know_how_many_they_are() -> None:
    from ppqa.cli.run import _pool_children

    params = {"model": "dummy:tiny-mha", "max_jobs": 8, "follow": True}
    children = _pool_children([["cpu"], ["cpu"], ["cpu"]], 1, params)
    assert [c.label for c in children] == ["cpu#0", "cpu#1", "cpu#2"]
    for child in children:
        argv = child.argv
        assert argv[argv.index("--peers") + 1] == "3"
        assert argv[argv.index("--max-jobs") + 1] == "8" and "--follow" in argv


def test_device_groups() -> None:
    assert device_groups(None, None) is None
    assert device_groups("0,1", None) == [["cuda:0"], ["cuda:1"]]
    assert device_groups("0,1,2,3", None, 2) == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    assert device_groups(None, None, 2) == [["cuda:0", "cuda:1"]]
    assert device_groups(None, "cpu,cpu") == [["cpu"], ["cpu"]]
    for args, kwargs, message in [
            (("0,1", None), {"gpu": 0}, "not both"),
            (("0,x", None), {}, "GPU indices separated by commas"),
            (("0,0", None), {}, "each device once"),
            (("0,1,2", None, 2), {}, "multiple of 2"),
            ((None, None, 2), {"gpu": 1}, "name them with --gpus")]:
        with pytest.raises(SetupError, match=message):
            device_groups(*args, **kwargs)


def test_gpus_all_without_cuda_is_one_line(sqlite_path: Path, monkeypatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    sqlite_path = str(sqlite_path)
    _queue(sqlite_path, documents=1, questions=1, max_new_tokens=4)
    result = CliRunner().invoke(app, ["--db", sqlite_path, "run", "--gpus", "all",
                                      "--model", MODEL])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: --gpus all: no CUDA device is visible on this machine"
    both = CliRunner().invoke(app, ["--db", sqlite_path, "run", "--gpus", "0", "--gpu", "0",
                                    "--model", MODEL])
    assert both.exit_code == 2 and "not both" in both.stderr


def test_contradictory_device_options_are_refused_before_the_queue_is_read(tmp_path: Path) -> None:
    """An empty queue ends `ppqa run` early, but not before its options are checked: a user
    learns of a wrong command line at once, not on the day work arrives."""
    db = str(tmp_path / "empty.db")
    for args, message in [(["--gpus", "0,1", "--gpu", "0"], "not both"),
                          (["--gpus", "0", "--devices", "cpu"], "not both"),
                          (["--tensor-parallel", "2", "--gpu", "1"], "name them with --gpus"),
                          (["--streams", "x"], "--streams must be")]:
        result = CliRunner().invoke(app, ["--db", db, "run", *args, "--model", MODEL])
        assert result.exit_code == 2, args
        assert message in result.stderr and "no jobs" not in result.stderr
    ok = CliRunner().invoke(app, ["--db", db, "run", "--model", MODEL])
    assert ok.exit_code == 0 and "no jobs to run" in ok.stderr


def test_progress_events_replay_on_one_display() -> None:
    import io

    from ppqa.worker.events import ClaimView, EventSink, replay, summary_of
    from ppqa.worker.report import JobOutcome, ProgressSink, WorkerSummary

    class Recorder(ProgressSink):
        def __init__(self):
            self.calls = []

        def claimed(self, claims):
            self.calls.append(("claimed", claims))

        def answered(self, claim, tokens):
            self.calls.append(("answered", claim.document_id, tokens))

        def settled(self, outcome):
            self.calls.append(("settled", outcome))

        def message(self, text):
            self.calls.append(("message", text))

    stream = io.StringIO()
    sink = EventSink(stream)
    claim = ClaimView(7, 3, "doc", range(4), 8)  # 4 questions, 2 samples each
    outcome = JobOutcome(7, 3, "doc", "done", 4, 4, 20, None, {"questions": 4})
    sink.claimed([claim])
    sink.answered(claim, 5)
    sink.settled(outcome)
    sink.message("hello")
    sink.finished(WorkerSummary("w", MODEL, "cpu", [outcome], 1.5, "SIGTERM"))
    recorder = Recorder()
    events = [replay(line, recorder, "cuda:1") for line in stream.getvalue().splitlines()]
    assert recorder.calls == [("claimed", [claim]), ("answered", 3, 5), ("settled", outcome),
                              ("message", "[cuda:1] hello")]
    merged = summary_of(events[-1])
    assert merged.jobs == [outcome] and merged.stopped_by == "SIGTERM"
    replay("a stray line\n", recorder, "cuda:1")
    assert recorder.calls[-1] == ("message", "[cuda:1] a stray line")


@pytest.mark.parametrize("codes,stop,expected", [
    ((0, 0), None, 0), ((0, 2), None, 2), ((1, 0), None, 1), ((-9, 0), None, 1),
    ((-15, 0), "SIGTERM", 0),  # a child stopped by the forwarded SIGTERM before its handlers
    ((0, 0), "SIGINT", 130), ((1, 0), "SIGINT", 130)])
def test_the_parent_exit_code(codes, stop, expected) -> None:
    from ppqa.worker.pool import Child, WorkerPool
    from ppqa.worker.report import ProgressSink

    pool = WorkerPool([Child(f"cuda:{i}", []) for i in range(2)], "jobs.db", ProgressSink(),
                      MODEL)
    for child, code in zip(pool.children, codes):
        child.code = code
    pool.stop_reason = stop
    assert pool._exit_code() == expected
