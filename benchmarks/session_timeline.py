"""Where an engine session's wall time goes on a workload of many documents (no store, no worker).

Submits every job of an e2e workload (`ppqa/bench/workloads.py`) to one `EngineSession` at once,
as the worker would over time, and steps it to the end, timing each iteration's phases: the
prefill (document chunks and question prefill, host wall including its synchronisation) and the
decode (launch, and the read-back of the step before). It counts decode steps by kind and batch
size, which of them replayed a CUDA graph and which ran eagerly, and the Triton compilations
(and their seconds) that happened inside the run. Against the run's floors, this says how much
of `ppqa run`'s time is the engine's own loop. The phases are host wall time: a prefill chunk
launched while others decode is not waited for, so its device time shows in the decode
read-back after it; the pass's wall time is exact.

`--paths session,worker,session` runs the passes alternately through a bare session and through
the real worker (`ppqa.worker.loop.Worker` over a fresh SQLite store that `ppqa ingest --batch`
filled, with the CLI's log progress), in one process on one warm engine: the same tallies, plus
the worker loop's own phases (claims, writes and settling, lost leases), so the two paths'
difference is measured rather than inferred from separate processes. An `arrivals` pass is a
worker pass that follows the store while a thread ingests the jobs over `--arrival-seconds` (as
`ppqa bench --e2e arrivals` does, one `ppqa ingest` a tick), stopped once every job settled.

Every pass records a step trace (`trace`): each decode step's time, rows and padded rows and its
documents, and each document chunk, so that a pass's steps can be laid out over time
(`trace_summary`: rows per step in each eighth of the pass, and the chunks).

The probes it wraps around the session and the worker are in `timeline_probes.py`, the worker
and arrivals passes in `timeline_worker.py`.

    python3 benchmarks/session_timeline.py --workload paper --mode auto --out timeline.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path


from ppqa import Engine
from ppqa.config import EngineConfig
from ppqa.bench.workloads import get_workload, make_jobs, question_requests
from ppqa.engine.runtime.graph_runner import GraphCache

sys.path.insert(0, str(Path(__file__).parent))
# Sibling files, not a package.
from gpu_time import Profile, print_summary  # noqa: E402
from timeline_probes import (  # noqa: E402
    GcLog, SyncLog, Tally, allocator_counts, graph_keys, phased, sync, trace_cudnn, trace_summary,
    wrap,
)
from timeline_worker import worker_pass  # noqa: E402


def run_pass(engine: Engine, workload, mode: str, max_docs: int | None, phase: dict,
             compiles: dict, path: str = "session", folder: Path | None = None,
             prof=None, arrival_seconds: float = 6.0) -> dict:
    """One pass over the whole workload (drawn from workload.seed), through a bare session
    stepped to the end, or through the worker over a store that holds the workload (`worker`)
    or that receives it over `arrival_seconds` (`arrivals`); `prof`
    (a gpu_time.Profile around the pass) gets the session's prefill and decode marked."""
    jobs = make_jobs(workload, engine.tokenizer, max_docs)
    tally = Tally()
    graph_use: Counter = Counter()

    key_use: Counter = Counter()

    replays_by_phase: Counter = Counter()  # graph replays by the session phase they ran in

    def graph_result(call_args, out):
        graph_use["replayed" if out is not None else "eager"] += 1
        if out is not None:
            replays_by_phase[phase["now"]] += 1
        key_use[repr(call_args[0].key(call_args[2]))] += 1

    restore = wrap(GraphCache, "run", tally, "graph_run", graph_result)
    captured_before = set(map(repr, graph_keys(engine)))
    compiled_before = (compiles["count"], compiles["seconds"])
    allocator_before = allocator_counts(engine)
    answers: list[float] = []
    batch_sizes: Counter = Counter()
    sessions: list = []
    # (seconds since the pass began, "decode" or "chunk", rows (a chunk's: its tokens), padded
    # rows, documents): decode steps and document chunks as the host built them.
    trace: list[tuple] = []
    clock = {"t0": time.perf_counter()}

    def instrument(session):
        if prof is not None:
            phased(session, "_prefill", prof, "prefill")
            phased(session, "_decode", prof, "decode")
            # Inner phases, for the GPU's idle time by what the host was doing.
            for name, label in (("_run", "forward"), ("_finish", "read"), ("submit", "submit")):
                phased(session, name, prof, label)
            for name, label in (("admit", "admit"), ("decode_step", "build"),
                                ("document_chunk", "chunk"), ("prefill_step", "build")):
                phased(session.sched, name, prof, label)
        wrap(session, "_prefill", tally, "prefill", phase=phase)
        wrap(session, "_decode", tally, "decode", phase=phase)
        sched = session.sched
        original_decode_step = sched.decode_step

        def decode_step(batch, **kw):
            step = original_decode_step(batch, **kw)
            kinds = "+".join(sorted({r.mode for r in batch}))
            batch_sizes[f"{kinds}:{len(batch)}"] += 1
            trace.append((round(time.perf_counter() - clock["t0"], 4), "decode", len(batch),
                          max(len(batch), kw.get("pad_to") or 0),
                          len({r.doc_key for r in batch})))
            return step

        original_chunk = sched.document_chunk

        def document_chunk(doc):
            inputs = original_chunk(doc)
            trace.append((round(time.perf_counter() - clock["t0"], 4), "chunk",
                          int(inputs.input_ids.numel()), 0, 1))
            return inputs

        sched.decode_step = decode_step
        sched.document_chunk = document_chunk
        sessions.append(session)
        return session

    extra: dict = {}
    if path == "session":
        requests = question_requests(jobs)
        session = instrument(engine.session(
            on_answer=lambda req, ans: answers.append(time.perf_counter())))
        sync(engine)
        t0 = clock["t0"] = time.perf_counter()
        session.submit(requests, mode=mode)
        extra["submit_s"] = time.perf_counter() - t0
        iterations = 0
        while session.has_work():
            session.step()
            iterations += 1
        session.flush()
        sync(engine)
        wall = time.perf_counter() - t0
        stats = session.close()
    else:
        t0, iterations, wall, stats, extra = worker_pass(
            engine, workload, jobs, mode, folder, instrument, answers, tally, prof, clock,
            arrival_seconds if path == "arrivals" else None)
    GraphCache.run = restore
    return {
        "path": path, "seed": workload.seed,
        "questions": sum(len(j.questions) for j in jobs.jobs), "documents": len(jobs.documents),
        "wall_s": wall, "iterations": iterations, **extra,
        "phase_s": dict(tally.seconds), "phase_calls": dict(tally.calls),
        "graph_use": dict(graph_use), "graph_replays_by_phase": dict(replays_by_phase),
        "decode_steps_by_batch": dict(batch_sizes),
        "trace_summary": trace_summary(trace, wall), "trace": trace,
        "compiles": compiles["count"] - compiled_before[0],
        "compile_s": compiles["seconds"] - compiled_before[1],
        "stats": {k: v for k, v in vars(stats).items()},
        "captured_graphs": engine.captured_graphs,
        # Decode step shapes (GraphCache keys) this pass used, with its steps of each, and
        # which of them it captured (a capture idles the GPU for its eager run and
        # instantiation).
        "graph_keys": dict(key_use.most_common()),
        "captured_keys": sorted(set(map(repr, graph_keys(engine))) - captured_before),
        "first_answer_s": (answers[0] - t0) if answers else None,
        "t0": t0,  # perf_counter at the pass's start (main() turns GcLog times relative to it)
        # The caching allocator's device calls in this pass: a failed cudaMalloc frees the
        # cached blocks (a device-wide sync) and retries.
        "allocator": {k: v - allocator_before.get(k, 0)
                      for k, v in allocator_counts(engine).items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="paper")
    ap.add_argument("--model", default=None)
    ap.add_argument("--mode", default="auto")
    ap.add_argument("--max-docs", type=int, default=None)
    ap.add_argument("--passes", type=int, default=1,
                    help="passes over fresh documents (seed + pass): later passes show the "
                         "steady state, kernels compiled and graphs captured")
    ap.add_argument("--max-batch-requests", type=int, default=None,
                    help="EngineConfig.max_batch_requests (requests decoded together)")
    ap.add_argument("--max-wide-requests", type=int, default=None,
                    help="EngineConfig.max_wide_requests (past max_batch_requests, for whole "
                         "large cascade groups; equal to it: never past it)")
    ap.add_argument("--paths", default=None,
                    help="comma-separated 'session', 'worker' or 'arrivals', one per pass "
                         "(default: session for every pass); a worker pass runs ppqa's worker "
                         "over a fresh store, an arrivals pass feeds that store while it runs")
    ap.add_argument("--arrival-seconds", type=float, default=6.0,
                    help="arrivals passes: the jobs are ingested over this many seconds")
    ap.add_argument("--profile-pass", type=int, default=None, metavar="N",
                    help="run pass N (from 0) under torch.profiler: GPU seconds by kernel kind "
                         "for the prefill and the decode, and the GPU's busy share "
                         "(benchmarks/gpu_time.py; the profiler lengthens host time)")
    ap.add_argument("--trace-cudnn", action="store_true",
                    help="time every cuDNN attention call on the host (a first chunk's causal "
                         "call, a later chunk's two) with its shapes and strides, and whether "
                         "that key came before in the process: which calls stall the host")
    ap.add_argument("--sync-check", type=int, default=None, metavar="N",
                    help="count the synchronising CUDA calls of pass N by where they are made "
                         "(torch's sync debug mode; slows the pass)")
    ap.add_argument("--warmup", choices=("always", "cold"), default="always",
                    help="'cold' runs no Engine.warmup where the Triton cache holds the model's "
                         "kernels, as `ppqa run` does by default: pass 0 then shows a fresh "
                         "process's first use of the GPU libraries")
    ap.add_argument("--folder", default="timeline_work", help="where worker passes keep stores")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="timeline.json")
    args = ap.parse_args()
    workload = get_workload(args.workload)
    fields = {name: value for name, value in (("max_batch_requests", args.max_batch_requests),
                                              ("max_wide_requests", args.max_wide_requests))
              if value is not None}
    engine = Engine(args.model or workload.model, device=args.device, config=EngineConfig(**fields))
    skipped = args.warmup == "cold" and engine.kernels_cached()
    warm_s = 0.0 if skipped else engine.warmup()
    compiles = {"count": 0, "seconds": 0.0, "by_phase_s": defaultdict(float), "kernels": []}
    phase = {"now": "other"}
    try:
        from triton.runtime.jit import JITFunction

        original_compile = JITFunction._do_compile

        def counted_compile(self, *a, **k):
            t0 = time.perf_counter()
            out = original_compile(self, *a, **k)
            seconds = time.perf_counter() - t0
            compiles["count"] += 1
            compiles["seconds"] += seconds
            compiles["by_phase_s"][phase["now"]] += seconds
            compiles["kernels"].append([phase["now"], getattr(self, "__name__", str(self)),
                                        round(seconds, 3), str(a[3])[:300]])
            return out

        JITFunction._do_compile = counted_compile
    except ImportError:
        pass
    result = {"workload": args.workload, "model": engine.model_name, "mode": args.mode,
              "max_batch_requests": engine.config.max_batch_requests,
              "max_wide_requests": engine.config.wide_requests, "warmup_s": warm_s,
              "passes": []}
    cudnn_calls: list[list] = []
    if args.trace_cudnn:
        trace_cudnn(cudnn_calls)
    paths = args.paths.split(",") if args.paths else ["session"] * args.passes
    if any(p not in ("session", "worker", "arrivals") for p in paths):
        ap.error(f"--paths takes 'session', 'worker' and 'arrivals', got {args.paths!r}")
    for p, path in enumerate(paths):
        prof = Profile() if p == args.profile_pass else contextlib.nullcontext()
        syncs = SyncLog() if p == args.sync_check else contextlib.nullcontext()
        with prof, syncs, GcLog() as collections:
            run = run_pass(engine, dataclasses.replace(workload, seed=workload.seed + p),
                           args.mode, args.max_docs, phase, compiles, path, Path(args.folder),
                           prof=prof if p == args.profile_pass else None,
                           arrival_seconds=args.arrival_seconds)
        run["gc"] = collections.summary(run.pop("t0"))
        full = run["gc"]["full"]
        print(f"  garbage collections {run['gc']['collections']}, ms {run['gc']['ms']}; full ones "
              f"(s, ms, freed): {full[:8]}; frozen objects {run['gc']['frozen_objects']}")
        if p == args.profile_pass:
            run["gpu_time"] = prof.summary()
        if p == args.sync_check:
            run["syncs"] = dict(syncs.sites.most_common())
            print(f"  synchronising calls: {sum(syncs.sites.values())} at {len(syncs.sites)} sites")
            for site, count in syncs.sites.most_common(15):
                print(f"    {count:6d}  {site}")
        if run["captured_keys"]:
            print(f"  graphs captured in this pass: {len(run['captured_keys'])}")
            for key in run["captured_keys"][:12]:
                print(f"    {run['graph_keys'].get(key, 0):4d} steps  {key}")
        if args.trace_cudnn:
            run["cudnn_calls"], cudnn_calls[:] = list(cudnn_calls), []
            slow = [c for c in run["cudnn_calls"] if c[1] > 0.005]
            print(f"  cuDNN calls: {len(run['cudnn_calls'])}, over 5 ms on the host: {len(slow)} "
                  f"({sum(c[1] for c in slow):.3f} s), of which keys met before: "
                  f"{sum(1 for c in slow if c[2])}")
            for c in slow[:12]:
                print(f"    {c[0]:6s} {c[1] * 1e3:6.1f} ms seen={c[2]} {c[3]}")
        result["passes"].append(run)
        result["compiles"] = compiles
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        stats = run["stats"]
        print(f"{args.workload} {args.mode} pass {p} ({path}): wall {run['wall_s']:.2f} s, "
              f"{run['iterations']} iterations; prefill {run['phase_s'].get('prefill', 0):.2f} s, "
              f"decode {run['phase_s'].get('decode', 0):.2f} s; graph steps {run['graph_use']}; "
              f"Triton compiles {run['compiles']} ({run['compile_s']:.1f} s); first answer "
              f"{run['first_answer_s']:.2f} s; steps {stats['steps']}, max batch "
              f"{stats['max_batch_requests']}", flush=True)
        print("  decode steps by batch:", Counter(run["decode_steps_by_batch"]).most_common(8))
        ts = run["trace_summary"]
        print(f"  decode steps {ts['decode_steps']}, mean rows {ts['mean_rows']} "
              f"(padded {ts['mean_padded']}); by padded rows {ts['steps_by_padded_rows']}")
        for i, cell in enumerate(ts["spans"]):
            print(f"    {i * ts['span_s']:6.2f} s: {cell}")
        print("  allocator:", run["allocator"])
        if "gpu_time" in run:
            print_summary(run["gpu_time"])
        print("  phases:", {k: round(v, 2) for k, v in run["phase_s"].items()},
              {k: v for k, v in run.items() if k.endswith("_s") and k not in ("wall_s", "phase_s")})
    print("compiles by phase:", dict(compiles["by_phase_s"]))
    for phase_name, name, seconds, key in compiles["kernels"][:30]:
        print(f"  {phase_name:8s} {name:28s} {seconds:6.2f} s  {key[:110]}")


if __name__ == "__main__":
    main()
