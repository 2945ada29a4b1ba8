"""Where an engine session's wall time goes on a workload of many documents (no store, no worker).

Submits every job of an e2e workload (`ppqa/bench/workloads.py`) to one `EngineSession` at once,
as the worker would over time, and steps it to the end, timing each iteration's phases: the
prefill (document chunks and question prefill, host wall including its synchronisation) and the
decode (launch, and the read-back of the step before). It counts decode steps by kind and batch
size, which of them replayed a CUDA graph and which ran eagerly, and the Triton compilations
(and their seconds) that happened inside the run. Against the run's floors, this says how much
of `ppqa run`'s time is the engine's own loop.

    python3 benchmarks/session_timeline.py --workload paper --mode auto --out timeline.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import Counter, defaultdict

import torch

from ppqa import Engine, QuestionRequest, SamplingParams
from ppqa.config import EngineConfig
from ppqa.bench.workloads import get_workload, make_jobs
from ppqa.engine.runtime.graph_runner import GraphCache


class Tally:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()


def wrap(owner, name: str, tally: Tally, label: str, on_result=None, phase=None):
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        if phase is not None:
            phase["now"] = label
        out = original(*args, **kwargs)
        if phase is not None:
            phase["now"] = "other"
        tally.seconds[label] += time.perf_counter() - t0
        tally.calls[label] += 1
        if on_result is not None:
            on_result(args, out)
        return out

    setattr(owner, name, timed)
    return original


def run_pass(engine: Engine, workload, mode: str, max_docs: int | None, phase: dict,
             compiles: dict) -> dict:
    """One session over the whole workload (drawn from workload.seed), stepped to the end."""
    jobs = make_jobs(workload, engine.tokenizer, max_docs)
    requests = []
    for job in jobs.jobs:
        sampling = SamplingParams(max_new_tokens=job.max_new_tokens, ignore_eos=True)
        requests += [QuestionRequest((job.name, qid), jobs.documents[job.document], q, sampling,
                                     template=job.template) for qid, q in job.questions]
    tally = Tally()
    graph_use: Counter = Counter()

    def graph_result(call_args, out):
        graph_use["replayed" if out is not None else "eager"] += 1

    restore = wrap(GraphCache, "run", tally, "graph_run", graph_result)
    compiled_before = (compiles["count"], compiles["seconds"])
    answers = []
    session = engine.session(on_answer=lambda req, ans: answers.append(time.perf_counter()))
    wrap(session, "_prefill", tally, "prefill", phase=phase)
    wrap(session, "_decode", tally, "decode", phase=phase)
    batch_sizes: Counter = Counter()
    sched = session.sched
    original_decode_step = sched.decode_step

    def decode_step(batch, **kw):
        step = original_decode_step(batch, **kw)
        kinds = "+".join(sorted({r.mode for r in batch}))
        batch_sizes[f"{kinds}:{len(batch)}"] += 1
        return step

    sched.decode_step = decode_step
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    session.submit(requests, mode=mode)
    submit_s = time.perf_counter() - t0
    iterations = 0
    while session.has_work():
        session.step()
        iterations += 1
    session.flush()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    stats = session.close()
    GraphCache.run = restore
    return {
        "seed": workload.seed, "questions": len(requests), "documents": len(jobs.documents),
        "wall_s": wall, "submit_s": submit_s, "iterations": iterations,
        "phase_s": dict(tally.seconds), "phase_calls": dict(tally.calls),
        "graph_use": dict(graph_use), "decode_steps_by_batch": dict(batch_sizes),
        "compiles": compiles["count"] - compiled_before[0],
        "compile_s": compiles["seconds"] - compiled_before[1],
        "stats": {k: v for k, v in vars(stats).items()},
        "captured_graphs": engine.captured_graphs,
        "first_answer_s": (answers[0] - t0) if answers else None,
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
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="timeline.json")
    args = ap.parse_args()
    workload = get_workload(args.workload)
    fields = {} if args.max_batch_requests is None else {"max_batch_requests": args.max_batch_requests}
    engine = Engine(args.model or workload.model, device=args.device, config=EngineConfig(**fields))
    warm_s = engine.warmup()
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
              "max_batch_requests": engine.config.max_batch_requests, "warmup_s": warm_s,
              "passes": []}
    for p in range(args.passes):
        run = run_pass(engine, dataclasses.replace(workload, seed=workload.seed + p), args.mode,
                       args.max_docs, phase, compiles)
        result["passes"].append(run)
        result["compiles"] = compiles
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        stats = run["stats"]
        print(f"{args.workload} {args.mode} pass {p}: wall {run['wall_s']:.2f} s, "
              f"{run['iterations']} iterations; prefill {run['phase_s'].get('prefill', 0):.2f} s, "
              f"decode {run['phase_s'].get('decode', 0):.2f} s; graph steps {run['graph_use']}; "
              f"Triton compiles {run['compiles']} ({run['compile_s']:.1f} s); first answer "
              f"{run['first_answer_s']:.2f} s; steps {stats['steps']}, max batch "
              f"{stats['max_batch_requests']}", flush=True)
        print("  decode steps by batch:", Counter(run["decode_steps_by_batch"]).most_common(8))
    print("compiles by phase:", dict(compiles["by_phase_s"]))
    for phase_name, name, seconds, key in compiles["kernels"][:30]:
        print(f"  {phase_name:8s} {name:28s} {seconds:6.2f} s  {key[:110]}")


if __name__ == "__main__":
    main()
