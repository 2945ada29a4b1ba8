"""`ppqa run`: the worker command. Checks its setup, then drains the queue with the engine.

One worker per process: `--gpu N` / `--device D` (one device), or `--tensor-parallel N` with N
devices from `--gpus` (one model split over them, engine/parallel/). `--gpus 0,1` with more
devices than one worker takes starts one child `ppqa run` per GPU (per N GPUs with
`--tensor-parallel N`) and shows their progress and summary as one (`ppqa/worker/pool.py`).

Order matters: the store is opened, the device checked and the model loaded BEFORE any job is
claimed, so a wrong --model, a missing --gpu or an unreachable --db exits 2 with one line and
leaves the queue untouched. Then `ppqa.worker.loop.Worker` runs with a progress renderer from
`run_progress.py` on stderr; `--json` prints the summary on stdout at the end.

Signals: the first SIGINT or SIGTERM asks the worker to stop (finished answers are already
saved; unfinished jobs are released for other workers at once); a second one exits at once,
and the leases of that worker's jobs then expire as after a crash. Exit codes: 0 when the
queue is drained or after SIGTERM, 130 after SIGINT, 1 when the engine keeps failing, 2 for bad
options or setup.
"""

import os
import signal
import sys
import time
from typing import Annotated

import typer

from ppqa.cli.common import MAX_ID, fail, open_store, print_json, say
from ppqa.modes import check_mode
from ppqa.worker.options import WorkerOptions

app = typer.Typer()


EXAMPLES = """

Examples:

  ppqa run --once --device cpu

  ppqa run --gpu 1 --follow --mode parallel --streams 32

  ppqa run --gpus all --follow

  ppqa run --gpus 0,1 --tensor-parallel 2 --model ./Llama-3-70B-Instruct

  ppqa --db postgresql+psycopg://ppqa@db-host/ppqa run --gpu 0 --follow --json
"""


@app.command(help="Answer queued jobs with a local model: a worker that drains the queue." + EXAMPLES)
def run(
    ctx: typer.Context,
    gpu: Annotated[int | None, typer.Option(
        "--gpu", min=0, max=1023, show_default=False, envvar="PPQA_GPU",
        help="GPU index to run on, e.g. --gpu 1. Default: GPU 0 if there is one, else the CPU.")] = None,
    device: Annotated[str | None, typer.Option(
        "--device", show_default=False,
        help="torch device instead of --gpu: cpu, cuda or cuda:N, e.g. --device cpu.")] = None,
    gpus: Annotated[str | None, typer.Option(
        "--gpus", show_default=False, metavar="LIST|all",
        help="A worker per GPU, one progress display and one summary: GPU indices, e.g. --gpus "
             "0,1, or 'all' (every visible GPU). With --tensor-parallel N, a worker per N "
             "GPUs.")] = None,
    tensor_parallel: Annotated[int, typer.Option(
        "--tensor-parallel", min=1, max=64,
        help="Split the model over N GPUs (for models too large for one): its heads must "
             "divide by N, e.g. --gpus 0,1 --tensor-parallel 2.")] = 1,
    devices: Annotated[str | None, typer.Option(
        "--devices", hidden=True,
        help="torch devices instead of --gpus, e.g. cpu,cpu (tests).")] = None,
    peers: Annotated[int, typer.Option(
        "--peers", min=1, max=MAX_ID,
        help="Workers sharing this queue, e.g. --peers 4 for a worker on each of 4 hosts: "
             "each claims while its questions in flight are below an even share of those "
             "left, so the first one ready does not take a short queue. --gpus sets it for "
             "its workers.")] = 1,
    progress_events: Annotated[bool, typer.Option(
        "--progress-events", hidden=True,
        help="Progress as JSON lines on stdout, for the parent of --gpus.")] = False,
    model: Annotated[str, typer.Option(
        "--model", envvar="PPQA_MODEL",
        help="Model name (smollm2, dummy:<preset>), Hugging Face folder or .gguf file, "
             "e.g. --model ./SmolLM2-135M-Instruct.Q4_1.gguf.")] = "smollm2",
    mode: Annotated[str, typer.Option(
        help="Engine mode: auto (each job's own, else the engine's choice), parallel, stock or "
             "cascade, e.g. --mode parallel.")] = "auto",
    streams: Annotated[str | None, typer.Option(
        show_default=False, metavar="P|auto",
        help="Questions per request in parallel mode (P), e.g. --streams 16, or 'auto' to let "
             "the cost model pick P for the workload. Default: the engine's (32), or the cost "
             "model's choice when --mode auto picks parallel.")] = None,
    max_jobs: Annotated[int, typer.Option(
        min=1, max=MAX_ID,
        help="Most jobs taken at once, over one or more documents, e.g. --max-jobs 4; claims "
             "also stop while a batch of requests waits for room.")] = WorkerOptions.max_jobs,
    max_questions: Annotated[int, typer.Option(
        min=1, max=MAX_ID,
        help="Most unanswered questions taken at once (a bigger single job is still taken "
             "whole), e.g. --max-questions 256.")] = WorkerOptions.max_questions,
    follow: Annotated[bool, typer.Option(
        "--follow/--once",
        help="--once (the default) drains what is queued and exits; --follow keeps waiting for "
             "new jobs until stopped, e.g. a worker per GPU: ppqa run --gpu 0 --follow.")] = False,
    lease_seconds: Annotated[float, typer.Option(
        min=1.0, max=86400.0,
        help="Lease of a claimed job, renewed every third of it while the worker lives; after "
             "a crash others take the job when it expires, e.g. --lease-seconds 30.")] = 60.0,
    max_attempts: Annotated[int, typer.Option(
        min=1, max=MAX_ID,
        help="A job that fails (or whose worker dies) this many times is marked failed with its "
             "last error, e.g. --max-attempts 5.")] = 3,
    mem_fraction: Annotated[float | None, typer.Option(
        min=0.01, max=1.0, show_default=False,
        help="GPU: fraction of the memory free after loading the model that the KV pool takes, "
             "e.g. --mem-fraction 0.5 on a shared GPU. Default 0.85.")] = None,
    kv_tokens: Annotated[int | None, typer.Option(
        min=16, max=2**40, show_default=False,
        help="CPU: KV pool size in tokens (all requests together), e.g. --kv-tokens 16384 to "
             "use less memory. Default 65536.")] = None,
    json_out: Annotated[bool, typer.Option(
        "--json", help="At the end, print a JSON summary of every job this worker ran on "
                       "stdout (progress stays on stderr).")] = False,
    warmup: Annotated[str, typer.Option(
        "--warmup", envvar="PPQA_WARMUP", metavar="always|cold",
        help="GPU: when to run the warm-up, synthetic work before the first claim that "
             "compiles the kernels and captures decode graphs for its own step shapes. 'cold' "
             "(default): only where this machine's Triton cache lacks the model's kernels "
             "(after compile helpers that all finished well, it holds them); a warm start goes "
             "straight to work and captures graphs as its jobs' step shapes recur (~2 s "
             "sooner done on the H200). 'always': every start, e.g. so that the "
             "first job's speed report includes no first use of the GPU libraries.")] = "cold",
) -> None:
    from ppqa.engine import precompile  # no torch: helpers start before it loads
    from ppqa.worker.loop import Worker, WorkerError
    from ppqa.store.lookups import has_claimable, waiting_questions
    from ppqa.worker.report import WorkerSummary
    from ppqa.worker.setup import (SetupError, check_device_flags, device_groups, load_engine,
                                   load_parallel_engine, process_age, resolve_device)

    try:
        check_mode(mode, "--mode")
    except ValueError as exc:
        fail(str(exc))
    if warmup not in ("always", "cold"):
        fail(f"--warmup must be 'always' or 'cold', got {warmup!r}")
    if streams is not None and streams != "auto" and (not streams.isdigit() or int(streams) < 1):
        fail(f"--streams must be a whole number >= 1 or 'auto', got {streams!r}")
    from_env = getattr(ctx.get_parameter_source("gpu"), "name", "") == "ENVIRONMENT"
    if (gpus is not None or devices is not None) and from_env:
        gpu = None  # PPQA_GPU names one worker's GPU; --gpus on the line wins
    try:  # options that contradict each other are refused before the queue is read
        check_device_flags(gpus, devices, tensor_parallel, gpu=gpu, device=device)
    except SetupError as exc:
        fail(str(exc))
    db = open_store(ctx, create=True)  # unreachable or corrupt: exit 2 before anything loads
    if not follow and not has_claimable(db, model):
        # Nothing to do: say so, and why where jobs are open, without loading torch or the model.
        say(f"no jobs to run for {model} in {db.description}{_why_none(db, model)}")
        if json_out:
            print_json(WorkerSummary(worker_id="-", model=model,
                                     device=device or ("auto" if gpu is None else f"cuda:{gpu}"))
                       .to_dict())
        return
    pool = {k: v for k, v in (("mem_fraction", mem_fraction),
                              ("kv_token_budget", kv_tokens)) if v is not None}
    ranks = None
    try:
        began = time.perf_counter()
        groups = device_groups(gpus, devices, tensor_parallel, gpu=gpu, device=device)
        if groups is not None and len(groups) > 1:
            return _run_pool(db, model, _pool_children(groups, tensor_parallel, ctx.params),
                             json_out)
        split = groups is not None and len(groups[0]) > 1  # tensor parallelism
        if not split:  # on a GPU whose Triton cache lacks the kernels: compile in parallel
            precompile.start(model, groups[0][0] if groups else
                             f"cuda:{gpu}" if gpu is not None else device, pool)
        device_name = ("+".join(groups[0]) if split else
                       resolve_device(gpu, device) if groups is None else
                       resolve_device(None, groups[0][0]))
        say(f"loading {model} on {device_name} ...")
        loaded = time.perf_counter()
        if split:
            engine, ranks = load_parallel_engine(model, groups[0], **pool)
        else:
            engine = load_engine(model, device_name, **pool)
        built = time.perf_counter()
        skipped = warmup == "cold" and engine.kernels_cached()
        warm = engine.warmup() if engine.device.type == "cuda" and not skipped else 0.0
    except SetupError as exc:
        precompile.stop()
        fail(str(exc))
    age = process_age()
    helped = precompile.last_wait
    beside = sum(engine.parts.first_use.seconds.values())
    notes = ([f"of which {helped[2]:.1f} s waiting for {helped[1]} compile helpers, "
              f"{helped[0]} finished"] if helped else []) + (
        [f"the GPU libraries' first use {beside:.1f} s beside it"] if beside else [])
    say((f"ready after {age:.1f} s: " if age is not None else "ready: ")
        + f"torch and the device {loaded - began:.1f} s, model and KV pool {built - loaded:.1f} s"
        + (f" ({'; '.join(notes)})" if notes else "")
        + (f", kernels compiled and graphs captured {warm:.1f} s" if warm else "")
        + (", no warm-up (the Triton cache holds the model's kernels)" if skipped else ""))
    if streams is not None and streams != "auto":
        streams = int(streams)
    options = WorkerOptions(model=model, device=device_name, mode=mode, streams=streams,
                            max_jobs=max_jobs, max_questions=max_questions, peers=peers,
                            follow=follow,
                            lease_seconds=lease_seconds, max_attempts=max_attempts)
    if progress_events:
        from ppqa.worker.events import EventSink

        progress = EventSink(sys.stdout)
    else:
        from ppqa.cli.run_progress import make_progress

        progress = make_progress(lambda: waiting_questions(db, model))
    worker = Worker(db, engine, options, progress)
    previous = _stop_on_signals(worker, progress)
    try:
        summary = worker.run()
    except WorkerError as exc:
        say(f"error: {exc}")
        raise typer.Exit(1)
    finally:  # the command may run inside a longer-lived process (tests, a notebook)
        if ranks is not None:
            ranks.close()
        if worker.stop_reason not in _SIGNAL_NAMES:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        # else: stopped by a signal, the process is on its way out; a second Ctrl-C while it
        # exits must still quit at once, not raise KeyboardInterrupt in the middle of exiting.
    if engine.device.type == "cuda":
        say(f"{engine.captured_graphs} decode step shapes captured as CUDA graphs")
    if json_out:
        print_json(summary.to_dict())
    if summary.stopped_by == "SIGINT":
        raise typer.Exit(130)


_SIGNAL_NAMES = ("SIGINT", "SIGTERM")


def _why_none(db, model: str) -> str:
    """What `ppqa run --once` adds to 'no jobs to run' when jobs are open: queued for other
    models, or running under other workers' leases."""
    from ppqa.store.lookups import unclaimable_work

    others, leased, left = unclaimable_work(db, model)
    parts = []
    if others:
        counts = ", ".join(f"{name}: {n}" for name, n in others.items())
        parts.append(f"queued jobs ask for other models ({counts}; run those with --model)")
    if leased:
        parts.append(f"{leased} job{'s' * (leased != 1)} running under other workers' leases "
                     f"(the first expires in {left:.0f} s; a worker that died leaves its jobs "
                     "to be taken over then)")
    return "; " + "; ".join(parts) if parts else ""


def _stop_on_signals(worker, progress) -> dict:
    """Install the handlers described in the module doc; return the previous ones."""
    def handle(signum, _frame) -> None:
        name = signal.Signals(signum).name
        if worker.stopping:  # the second signal: leave now; the leases will simply expire
            os._exit(128 + signum)
        worker.request_stop(name)
        progress.message(f"{name}: stopping - saving finished answers and releasing unfinished "
                         "jobs (press Ctrl-C again to quit at once)")

    previous = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, handle)
    return previous


# The options a child of --gpus repeats as they were given (by their parameter names).
_CHILD_OPTIONS = ("model", "mode", "streams", "max_jobs", "max_questions", "lease_seconds",
                  "max_attempts", "mem_fraction", "kv_tokens", "warmup")


def _child_options(params: dict) -> list[str]:
    args = []
    for name in _CHILD_OPTIONS:
        if params.get(name) is not None:
            args += [f"--{name.replace('_', '-')}", str(params[name])]
    return args + ["--follow" if params["follow"] else "--once", "--progress-events"]


def _pool_children(groups: list[list[str]], tensor_parallel: int, params: dict) -> list:
    """The `ppqa run` children of --gpus: one a device group, each told how many they are."""
    from ppqa.worker.pool import Child

    options = _child_options(params) + ["--peers", str(len(groups))]
    labels = ["+".join(g) for g in groups]
    if len(set(labels)) < len(labels):  # the same device twice (--devices cpu,cpu)
        labels = [f"{label}#{i}" for i, label in enumerate(labels)]
    return [Child(label, ["run", *_device_args(g, tensor_parallel), *options])
            for label, g in zip(labels, groups)]


def _device_args(group: list[str], tensor_parallel: int) -> list[str]:
    if len(group) == 1:
        return ["--device", group[0]]
    return ["--devices", ",".join(group), "--tensor-parallel", str(tensor_parallel)]


def _run_pool(db, model: str, children, json_out: bool) -> None:
    """A worker process per device group (worker/pool.py), shown as one."""
    from ppqa.cli.run_progress import make_progress
    from ppqa.store.lookups import waiting_questions
    from ppqa.worker.pool import STOP_SIGNALS, WorkerPool

    progress = make_progress(lambda: waiting_questions(db, model))
    pool = WorkerPool(children, db.url, progress, model)
    previous = {s: signal.signal(s, lambda signum, _frame: pool.request_stop(signum))
                for s in STOP_SIGNALS}
    try:
        summary, code = pool.run()
    finally:
        if pool.stop_reason is None:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    if json_out:
        print_json(summary.to_dict())
    if code:
        raise typer.Exit(code)
