"""`ppqa run --gpus 0,1`: one worker process per GPU (or per tensor-parallel group) on one store.

    parent (no torch, no engine)                    child i: `ppqa run --device cuda:i
      starts every child, in its own session            --progress-events ...` (the
      reads each child's stdout (JSON events,            ordinary single-GPU worker)
      worker/events.py) and stderr (its lines)  <----    claims, answers, settles in the
      replays them on ONE progress display               same store as every other child
      merges the children's summaries into ONE

Children share nothing but the store: each claims with its own worker id, and a claim takes
every claimable job of one document at once (`store/queue.claim_jobs`), so a document's
questions, and its KV, stay with the one worker that prefilled it.

Stopping: the parent forwards SIGINT/SIGTERM to every child (which stops admitting, saves what is
finished and releases the rest, as `ppqa run` does) and waits for them; a second signal is
forwarded too (each child then exits at once, leaving its leases to expire) and the parent exits
at once. Children run in their own sessions, so a Ctrl-C at the terminal reaches them only
through the parent, once, and they get SIGTERM if the parent dies (Linux's parent-death signal).
"""

from __future__ import annotations

import os
import queue as threadsafe
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from ppqa.worker.events import replay, summary_of
from ppqa.worker.report import ProgressSink, WorkerSummary
from ppqa.worker.setup import default_worker_id

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class Child:
    label: str  # its devices, e.g. "cuda:0" or "cuda:0+cuda:1"
    argv: list[str]
    process: subprocess.Popen | None = None
    summary: WorkerSummary | None = None
    open_streams: int = 2
    code: int | None = None


def _parent_death_signal() -> None:
    """In the child before exec: SIGTERM when the parent dies, so that it stops cleanly."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class WorkerPool:
    """The children of one `ppqa run --gpus`; `run()` returns (merged summary, exit code)."""

    def __init__(self, children: list[Child], db_url: str, progress: ProgressSink,
                 model: str) -> None:
        self.children, self.db_url, self.progress, self.model = children, db_url, progress, model
        self.stop_reason: str | None = None
        self._events: threadsafe.SimpleQueue = threadsafe.SimpleQueue()

    def request_stop(self, signum: int) -> None:
        """Forward a stop to every child; the second one also ends the parent at once."""
        second = self.stop_reason is not None
        if not second:
            self.stop_reason = signal.Signals(signum).name
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                try:
                    child.process.send_signal(signum)
                except ProcessLookupError:
                    pass
        if second:
            os._exit(128 + signum)

    def start(self) -> None:
        # Each child gets its device on its command line, not from the parent's PPQA_GPU.
        env = {k: v for k, v in os.environ.items() if k != "PPQA_GPU"} | {"PPQA_DB": self.db_url}
        for child in self.children:
            child.process = subprocess.Popen(
                [sys.executable, "-m", "ppqa", *child.argv], env=env, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, encoding="utf-8",
                errors="replace", start_new_session=True, preexec_fn=_parent_death_signal)
        for index, child in enumerate(self.children):
            for stream in (child.process.stdout, child.process.stderr):
                threading.Thread(target=self._read, args=(index, stream), daemon=True).start()

    def _read(self, index: int, stream) -> None:
        err = stream is self.children[index].process.stderr
        for line in stream:
            self._events.put((index, err, line))
        self._events.put((index, err, None))

    def run(self) -> tuple[WorkerSummary, int]:
        began = time.perf_counter()
        self.progress.message(f"ppqa run: {len(self.children)} workers on "
                              f"{', '.join(c.label for c in self.children)}, model {self.model}")
        self.start()
        while any(c.open_streams for c in self.children):
            try:
                index, err, line = self._events.get(timeout=0.5)
            except threadsafe.Empty:
                continue
            child = self.children[index]
            if line is None:
                child.open_streams -= 1
            elif err:
                self.progress.message(f"[{child.label}] {line.rstrip()}")
            else:
                event = replay(line, self.progress, child.label)
                if event is not None and event["event"] == "waiting":
                    self.progress.waiting()
                elif event is not None and event["event"] == "finished":
                    child.summary = summary_of(event)
        for child in self.children:
            child.code = child.process.wait()
        summary = self._merge(time.perf_counter() - began)
        self.progress.finished(summary)
        return summary, self._exit_code()

    def _merge(self, wall: float) -> WorkerSummary:
        done = [c.summary for c in self.children if c.summary is not None]
        # The workers run side by side: the longest one's running time (after its start-up, as
        # one worker counts it); the parent's whole time only if none reported.
        merged = WorkerSummary(worker_id=f"{default_worker_id()} ({len(self.children)} workers)",
                               model=self.model, device=",".join(c.label for c in self.children),
                               jobs=[job for s in done for job in s.jobs],
                               wall_seconds=max((s.wall_seconds for s in done), default=wall))
        merged.stopped_by = self.stop_reason or next((s.stopped_by for s in done if s.stopped_by),
                                                     None)
        merged.last_error = next((s.last_error for s in done if s.last_error), None)
        return merged

    def _exit_code(self) -> int:
        """130 after SIGINT; else the worst child's code (a child killed by a signal: 1, unless
        it was the stop the parent forwarded, e.g. SIGTERM before its handlers were set)."""
        if self.stop_reason == "SIGINT":
            return 130
        stopped = {0, 130} | ({-s for s in STOP_SIGNALS} if self.stop_reason else set())
        failures = [c.code if c.code >= 0 else 1 for c in self.children if c.code not in stopped]
        return max(failures, default=0)
