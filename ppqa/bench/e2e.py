"""`ppqa bench --e2e`: the main job timed as users run it, one fresh store per mode and pass.

For each workload (workloads.py) the jobs are drawn with the model's own tokenizer and written
as an ingest batch; then for each pass (modes in the given order, then reversed) and mode:
    python -m ppqa --db RUN.db ingest --batch batch.jsonl      (a subprocess: the CLI)
    python -m ppqa --db RUN.db run --once --mode MODE --model MODEL --gpu 0 --json
    python -m ppqa --db RUN.db export answers.jsonl --all
Process wall is the run subprocess's start to its exit; run wall is the worker's own
`wall_seconds` (its `--json` summary, whose other fields are kept too); the rest comes from the
store (e2e_report.py). Worker time = run wall - (prefill + decode), i.e. the worker's claims,
settling and reports plus engine host work outside the prefill and decode timers. The `arrivals`
workload instead starts `ppqa run --follow` first, ingests its jobs at a steady rate (one
`ingest --batch` subprocess per tick), and stops the worker with SIGINT once every job is done.
Answers are compared with stock's of the same pass, question by question. The JSON is rewritten
after every run, so a cut-off benchmark keeps what it measured; runs too long for one call can
be split over calls (`first_pass`, or some modes per call) and merged (e2e_report.merge).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ppqa.bench import e2e_report
from ppqa.bench.floor import floor_seconds, workload_documents
from ppqa.bench.workloads import Jobs, describe, get_workload, make_jobs, write_batch
from ppqa.store.status import FAILED

E2E_MODES = ("stock", "auto", "cascade", "parallel")
TICK_SECONDS = 1.0  # arrivals: the longest wait between looks at the clock
# The line `ppqa run` logs once its engine is loaded (cli/run_progress.py, `started`): arrivals
# begin then, so that latencies measure a serving worker, not its start-up.
READY_LINE = "ppqa run: worker"


class BenchError(RuntimeError):
    """A step of the benchmark that cannot go on (a failed ingest, a worker that never ends)."""


@dataclass
class E2EOptions:
    workloads: list[str]
    modes: list[str] = field(default_factory=lambda: list(E2E_MODES))
    model: str | None = None  # None: each workload's own
    device: str | None = None  # "cpu", "cuda:N"; None: --gpu 0
    passes: int = 2
    first_pass: int = 0  # number of the first pass (odd: modes reversed), to split passes over calls
    run_args: list[str] = field(default_factory=list)  # extra `ppqa run` options
    work_dir: Path | None = None  # keep stores, batches, exports and logs here (default: a temp dir)
    arrival_seconds: float = 60.0
    max_docs: int | None = None  # per document group (quick trials)
    python: str = sys.executable

    def __post_init__(self) -> None:
        for name in self.workloads:
            get_workload(name)
        unknown = [m for m in self.modes if m not in E2E_MODES]
        if not self.modes or unknown or len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes must be some of {', '.join(E2E_MODES)} (each once; stock "
                             f"is the baseline); got {','.join(self.modes)}")
        if self.passes < 1 or self.first_pass < 0 or self.arrival_seconds <= 0:
            raise ValueError("passes must be >= 1, first_pass >= 0 and arrival_seconds > 0")


def _utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)  # the store's naive UTC


class Runner:
    """Runs the CLI subprocesses of one workload in one folder; see the module doc."""

    def __init__(self, opts: E2EOptions, folder: Path, model: str, log: Callable[[str], None]):
        self.opts, self.folder, self.model, self.log = opts, folder, model, log
        # The subprocesses run the ppqa this bench runs (not another one installed in the venv).
        source = str(Path(__file__).resolve().parents[2])
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [source, os.environ.get("PYTHONPATH")]))}

    def cli(self, db: Path, *args: str) -> list[str]:
        return [self.opts.python, "-m", "ppqa", "--db", str(db), *args]

    def worker_args(self, mode: str, follow: bool) -> list[str]:
        dev = self.opts.device
        where = ["--device", dev] if dev and not dev.startswith("cuda") else \
            ["--gpu", dev.partition(":")[2] or "0"] if dev else ["--gpu", "0"]
        if any(a.split("=")[0] in ("--gpus", "--devices") for a in self.opts.run_args):
            where = []  # --run-args '--gpus 0,1 [--tensor-parallel 2]' names the devices
        return ["run", "--follow" if follow else "--once", "--mode", mode, "--model", self.model,
                "--json", *where, *self.opts.run_args]

    def step(self, db: Path, *args: str, what: str) -> float:
        """Run a short CLI command; its seconds, or BenchError with its last lines."""
        t0 = time.perf_counter()
        proc = subprocess.run(self.cli(db, *args), capture_output=True, text=True, env=self.env)
        if proc.returncode != 0:
            raise BenchError(f"{what} failed (exit {proc.returncode}): {_tail(proc.stderr)}")
        return time.perf_counter() - t0

    def run_once(self, tag: str, mode: str, batch: Path) -> dict:
        db, log_path = self.folder / f"{tag}.db", self.folder / f"{tag}.log"
        record = {"ingest_s": self.step(db, "ingest", "--batch", str(batch), what="ingest")}
        started = _utc_now()
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.run(self.cli(db, *self.worker_args(mode, follow=False)),
                                  stdout=subprocess.PIPE, stderr=log, text=True, env=self.env)
        record["process_s"] = time.perf_counter() - t0
        return self._finish(record, proc.returncode, proc.stdout, db, log_path, started, {0},
                            arrivals=False)

    def run_arrivals(self, tag: str, mode: str, jobs: Jobs) -> dict:
        db, log_path = self.folder / f"{tag}.db", self.folder / f"{tag}.log"
        # The worker and the ingests share it; `status` refuses a missing store, so it is made here.
        from ppqa.store.db import open_db

        open_db(db).close()
        total, due_at = len(jobs.jobs), self.opts.arrival_seconds / max(1, len(jobs.jobs))
        started = _utc_now()
        t0 = time.perf_counter()
        log = open(log_path, "w")
        proc = subprocess.Popen(self.cli(db, *self.worker_args(mode, follow=True)),
                                stdout=subprocess.PIPE, stderr=log, text=True, env=self.env)
        sent, ingest_s, tick, ready_s = 0, 0.0, 0, None
        try:
            while proc.poll() is None and READY_LINE not in log_path.read_text():
                time.sleep(0.2)
            ready_s = time.perf_counter() - t0
            self.log(f"    worker ready after {ready_s:.1f} s; ingesting {total} jobs over "
                     f"{self.opts.arrival_seconds:g} s")
            while sent < total and proc.poll() is None:
                now = time.perf_counter() - t0 - ready_s
                due = min(total, int(now / due_at) + 1)
                if due > sent:
                    batch = write_batch(jobs, self.folder, jobs.jobs[sent:due], f"{tag}-{tick}.jsonl")
                    ingest_s += self.step(db, "ingest", "--batch", str(batch), what="ingest")
                    sent, tick = due, tick + 1
                time.sleep(max(0.0, min(TICK_SECONDS,
                                        sent * due_at - (time.perf_counter() - t0 - ready_s))))
            while proc.poll() is None and not e2e_report.all_settled(db, total):
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)  # the worker saves, releases and prints its summary
            try:
                stdout, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, _ = proc.communicate()
            log.close()
        record = {"ingest_s": ingest_s, "ingest_ticks": tick, "ready_s": ready_s,
                  "process_s": time.perf_counter() - t0}
        return self._finish(record, proc.returncode, stdout, db, log_path, started, {0, 130},
                            arrivals=True)

    def _finish(self, record: dict, rc: int, stdout: str, db: Path, log_path: Path,
                started: datetime, ok: set[int], arrivals: bool) -> dict:
        record["rc"] = rc
        # The worker's own account of its start-up ("ready after ...: torch ..., model ...,
        # graphs ...") and of its graphs, as `ppqa run` logs them (cli/run.py).
        record["worker_notes"] = [line for line in log_path.read_text().splitlines()
                                  if line.startswith("ready") or "CUDA graphs" in line]
        if rc not in ok:
            record["error"] = f"ppqa run exited {rc}: {_tail(log_path.read_text())}"
            return record
        try:
            summary = json.loads(stdout)
        except ValueError:
            summary = {}
        record["worker_summary"] = {k: v for k, v in summary.items() if k != "jobs"}
        record["run_s"] = summary.get("wall_seconds")
        figures = e2e_report.store_figures(db, started)
        if arrivals:  # its first claim waits for the first arrival: start-up is the ready line
            figures["startup_s"] = record["ready_s"]
        else:  # ingest-to-answer latency means something only while jobs arrive
            figures = {k: v for k, v in figures.items() if not k.startswith(("latency", "span"))}
        record.update(figures)
        failed = figures["jobs_by_status"].get(FAILED, 0)
        if failed:  # fewer answers than the other modes': its times compare with nothing
            record["error"] = (f"{failed} of {figures['jobs']} jobs failed, e.g. "
                               f"{figures['first_failure']}")
        if record["run_s"] is not None:
            record["setup_s"] = record["process_s"] - record["run_s"]
            record["worker_s"] = record["run_s"] - record["engine_s"]
            record["answers_per_s_run"] = record["questions"] / record["run_s"] if record["run_s"] else None
        record["answers_per_s"] = record["questions"] / record["process_s"]
        if record.get("span_s"):
            record["throughput_answers_per_s"] = record["questions"] / record["span_s"]
        export = db.with_suffix(".answers.jsonl")
        record["export_s"] = self.step(db, "export", str(export), "--all", what="export")
        return record


def exported_answers(db: Path) -> dict[str, str | None]:
    """A run's exported answers by "job/question id" (the stores of one workload number their
    jobs alike: one ingest of the same batch, or the same ticks)."""
    export = db.with_suffix(".answers.jsonl")
    if not export.exists():
        return {}
    return {f"{row['job']}/{row['question_id']}": row["answer"]
            for row in map(json.loads, export.read_text().splitlines())}


def _tail(text: str, lines: int = 5) -> str:
    return " | ".join(line for line in text.strip().splitlines()[-lines:]) or "(no output)"


def _compare(runs: list[dict], answers: dict[str, dict]) -> None:
    """Per run of one pass, how many of its answers equal stock's, question by question."""
    base = answers.get("stock")
    for r in runs:
        if r["mode"] != "stock" and base and not r.get("error"):
            mine = answers.get(r["mode"], {})
            r["answers_compared"] = len(base)
            r["answers_match_stock"] = sum(1 for k, v in base.items() if mine.get(k) == v)


def bench_workload(name: str, opts: E2EOptions, folder: Path, log: Callable[[str], None],
                   on_run: Callable[[dict], None] = lambda payload: None) -> dict:
    """Every mode and pass of one workload; returns its part of the results JSON."""
    from ppqa.config import EngineConfig
    from ppqa.engine.loading.loader import load_model

    workload = get_workload(name)
    model = opts.model or workload.model
    loaded = load_model(model)  # weights stay unread (LazyWeights)
    tokenizer = loaded.tokenizer
    jobs = make_jobs(workload, tokenizer, opts.max_docs)
    info = describe(workload, jobs, tokenizer)
    info["floor"] = floor_seconds(loaded.config, workload_documents(jobs, tokenizer),
                                  max_batch=EngineConfig().max_batch_requests)
    log(f"e2e {name}: {info['documents']} documents, {info['jobs']} jobs, {info['questions']} "
        f"questions on {model}")
    batch = write_batch(jobs, folder)
    runner = Runner(opts, folder, model, log)
    payload = {"workload": info, "model": model, "modes": opts.modes, "runs": [], "summary": {}}
    for p in range(opts.first_pass, opts.first_pass + opts.passes):
        pass_runs, answers = [], {}
        for mode in opts.modes if p % 2 == 0 else list(reversed(opts.modes)):
            tag = f"{name}-p{p}-{mode}"
            try:
                run = (runner.run_arrivals(tag, mode, jobs) if workload.arrivals
                       else runner.run_once(tag, mode, batch))
            except BenchError as exc:
                run = {"error": str(exc)}
            run = {"mode": mode, "pass": p, **run}
            answers[mode] = exported_answers(folder / f"{tag}.db")
            pass_runs.append(run)
            log(f"  pass {p} {mode:8s} " + (f"failed: {run['error']}" if run.get("error") else
                f"process {run['process_s']:.1f} s, run {run.get('run_s') or 0:.1f} s, "
                f"start-up {run.get('startup_s') or 0:.1f} s, {run['questions']} answers"))
            payload["runs"].append(run)
            on_run(payload)
        _compare(pass_runs, answers)
        payload["summary"] = e2e_report.summarize(payload["runs"], opts.modes,
                                                  info["floor"]["total_s"])
        on_run(payload)
    return payload


def run_e2e(opts: E2EOptions, out: Path, command: str, log: Callable[[str], None]) -> dict:
    """Every workload of `opts`; the results JSON at `out` (rewritten after every run)."""
    from ppqa.bench.grid import git_commit

    results = {"kind": "e2e", "commit": git_commit(), "command": command, "host": host_info(opts),
               "workloads": []}
    host = results["host"]
    log(f"host: {host['cpu_model']}, {host['cpus']} CPUs, Python probe "
        f"{host['python_probe_s'] * 1000:.0f} ms (rows from hosts whose probes differ do not "
        f"compare)")
    temp = None
    if opts.work_dir is None:
        temp = tempfile.mkdtemp(prefix="ppqa-e2e-")
    root = Path(opts.work_dir or temp)
    try:
        for name in opts.workloads:
            folder = root / name
            folder.mkdir(parents=True, exist_ok=True)
            results["workloads"].append(None)

            def save(payload: dict) -> None:
                results["workloads"][-1] = payload
                write_json(out, results)

            save(bench_workload(name, opts, folder, log, save))
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    return results


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, default=str))
    tmp.replace(path)


def host_info(opts: E2EOptions) -> dict:
    """The machine, without touching CUDA in this process (the worker's GPU memory is its own)."""
    gpu = "cpu" if opts.device == "cpu" else "unknown"
    if gpu != "cpu" and shutil.which("nvidia-smi"):
        index = (opts.device or "cuda:0").partition(":")[2] or "0"
        try:
            gpu = subprocess.run(["nvidia-smi", "-i", index, "--query-gpu=name",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30).stdout.strip() or gpu
        except (OSError, subprocess.TimeoutExpired):
            pass
    cache = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return {"gpu": gpu, "cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "python": sys.version.split()[0], "python_probe_s": python_probe_s(),
            "triton_cache_entries_at_start": len(list(cache.iterdir())) if cache.is_dir() else 0}


def cpu_model() -> str:
    """The CPU's model name (Linux), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def python_probe_s(rounds: int = 3) -> float:
    """Seconds for a fixed piece of pure-Python work (best of `rounds`). Start-up, claims and
    the per-step host work scale with the host's single-core speed, so rows measured on two
    machines compare only where this agrees."""
    best = float("inf")
    for _ in range(rounds):
        began = time.perf_counter()
        table: dict[int, int] = {}
        for i in range(300_000):
            table[i % 1009] = table.get(i % 1009, 0) + (i * 7 >> 3)
        best = min(best, time.perf_counter() - began)
    return best
