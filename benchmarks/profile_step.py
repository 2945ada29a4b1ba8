"""Where a decode step's time goes on a GPU: host phases, pure graph replay, and kernels.

For each mode, on one engine and one seeded workload (`ppqa.bench.grid.make_workload`):
  1. an untimed run that caches the document and captures the CUDA graphs;
  2. a run with the engine's host phases wrapped in timers (step building, `prepare`, graph
     replay enqueue, the wait for a step's sampled tokens, postprocess);
  3. the captured decode graph replayed back to back: the GPU time of one step, no host;
  4. torch.profiler over a few eager steps: device time per kernel, grouped.
Prints a table per mode and writes everything to --out as JSON.

    python3 benchmarks/profile_step.py --model dummy:codellama-7b --doc-tokens 16384 \
        --questions 256 --tokens 32 --modes cascade,parallel --out /tmp/profile.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from collections import defaultdict

import torch

from ppqa import Engine, QuestionRequest, SamplingParams
from ppqa.bench.grid import make_workload
from ppqa.config import EngineConfig
from ppqa.engine import engine as engine_module
from ppqa.engine.runtime.graph_runner import GraphCache
from ppqa.engine.runtime.runner import ModelRunner
from ppqa.engine.runtime.scheduler import Scheduler

HOST_PHASES = {
    Scheduler: ("decode_step", "postprocess", "prefill_step", "admit"),
    ModelRunner: ("prepare",),
    GraphCache: ("run",),
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class PhaseTimer:
    """Wraps methods so every call adds its host time to a named total."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._saved: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, label: str | None = None) -> None:
        raw = inspect.getattr_static(owner, name)
        original = getattr(owner, name)
        label = label or f"{getattr(owner, '__name__', 'fn')}.{name}"

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            self.totals[label] += time.perf_counter() - t0
            self.calls[label] += 1
            return out

        self._saved.append((owner, name, raw))
        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)

    def restore(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def kernel_category(name: str) -> str:
    low = name.lower()
    for key, label in (("_decode", "attn decode (triton)"), ("prefix", "attn cascade doc (triton)"),
                       ("shared", "attn cascade doc (triton)"), ("merge", "attn merge (triton)"),
                       ("extend", "attn extend (triton)"), ("store", "kv store (triton)"),
                       ("gemm", "gemm"), ("sm90", "gemm"), ("cutlass", "gemm"), ("nvjet", "gemm"),
                       ("reduce", "reductions"), ("argmax", "reductions"), ("index", "index/gather"),
                       ("gather", "index/gather"), ("scatter", "index/gather"),
                       ("copy", "copies"), ("memcpy", "copies"), ("memset", "copies")):
        if key in low:
            return label
    return "elementwise/other"


def _kernel_times(engine: Engine, document: str, questions: list[str], mode: str, streams: int,
                  tokens: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    on_gpu = engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        engine.answer(document, questions, mode=mode, streams=streams, sampling=sampling)
        sync()
    return _per_kernel(prof, on_gpu)


def _per_kernel(prof, on_gpu: bool, runs: int = 1) -> dict[str, float]:
    """Microseconds per kernel name over a profile, divided by the runs it covered."""
    per_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        us = evt.self_device_time_total if on_gpu else evt.self_cpu_time_total
        if us > 0:
            per_kernel[evt.key] += us / runs
    return per_kernel


def _summary(per_kernel: dict[str, float], top: int) -> dict:
    """Microseconds per kernel category and the `top` kernels by time."""
    per_cat: dict[str, float] = defaultdict(float)
    for name, us in per_kernel.items():
        per_cat[kernel_category(name)] += us
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {"categories_us": dict(per_cat), "top_kernels_us": [[n[:120], us] for n, us in ranked]}


def profile_kernels(engine: Engine, document: str, questions: list[str], mode: str, streams: int,
                    steps: int) -> dict:
    """Eager decode steps under torch.profiler: device microseconds per step, per kernel name and
    per category; the prefill is removed by subtracting a one-token run from a (1 + steps) run."""
    runner = engine._parts.runner
    graphs, runner.graphs = runner.graphs, None
    try:
        base = _kernel_times(engine, document, questions, mode, streams, 1)
        full = _kernel_times(engine, document, questions, mode, streams, 1 + steps)
    finally:
        runner.graphs = graphs
    prefill_top = sorted(base.items(), key=lambda kv: -kv[1])[:12]
    per_kernel = {n: (us - base.get(n, 0.0)) / steps for n, us in full.items()}
    return {"steps_profiled": steps, "total_us_per_step": sum(per_kernel.values()),
            **_summary(per_kernel, 25), "prefill_us": sum(base.values()),
            "prefill_top_kernels_us": [[n[:120], us] for n, us in prefill_top]}


def replay_time(engine: Engine, repeats: int = 20) -> dict[str, float]:
    """Milliseconds per replay of each captured decode graph, back to back (GPU time, no host)."""
    graphs = engine._parts.runner.graphs
    out = {}
    if graphs is None:
        return out
    for key, step in graphs.graphs.items():
        step.graph.replay()
        sync()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            step.graph.replay()
        end.record()
        sync()
        out[str(key)] = start.elapsed_time(end) / repeats
    return out


def profile_replay(engine: Engine, repeats: int = 5) -> dict:
    """torch.profiler over replays of the largest captured decode graph: device microseconds per
    replay, per kernel category (kernels on the cascade side stream overlap the main stream's,
    so the categories can sum to more than the replay)."""
    from torch.profiler import ProfilerActivity, profile

    graphs = engine._parts.runner.graphs
    if graphs is None or not graphs.graphs:
        return {}
    # the steady step: the largest batch, and of those the fewest cascade groups (a padded
    # batch adds a group of dummies)
    key, step = max(graphs.graphs.items(),
                    key=lambda kv: (kv[0][1], -(kv[0][5][0] if kv[0][5] else 0)))
    step.graph.replay()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step.graph.replay()
        sync()
    per_kernel = _per_kernel(prof, on_gpu=True, runs=repeats)
    return {"graph": str(key), "total_us": sum(per_kernel.values()), **_summary(per_kernel, 30)}


def step_floor(engine: Engine, doc_tokens: int, questions: int, own_tokens: float = 0.0,
               copy_tbps: float = 4.16, tflops: float = 792.0) -> dict[str, float]:
    """The decode step's floor for a shared-document mode: the larger of the bytes it must move
    (the weights, the document's KV once, each question's own KV: its `own_tokens` of question
    and answer so far) over the copy bandwidth and its FLOPs over the matmul rate. The input
    embedding is neither read whole nor multiplied (a step looks up one row a token); the LM
    head is both."""
    cfg = engine.model_config
    model = engine._parts.model
    params = sum(p.numel() for p in model.parameters())
    if not cfg.tie_word_embeddings:
        params -= cfg.vocab_size * cfg.hidden_size
    dtype_bytes = engine.dtype.itemsize
    token_kv = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    kv_bytes = doc_tokens * token_kv
    own_bytes = questions * own_tokens * token_kv
    weight_bytes = params * dtype_bytes
    gemm_flops = 2 * params * questions
    attn_flops = (4 * questions * (doc_tokens + own_tokens) * cfg.num_heads * cfg.head_dim
                  * cfg.num_layers)
    mem_ms = (weight_bytes + kv_bytes + own_bytes) / (copy_tbps * 1e12) * 1e3
    flop_ms = (gemm_flops + attn_flops) / (tflops * 1e12) * 1e3
    return {"bytes_ms": mem_ms, "flops_ms": flop_ms, "floor_ms": max(mem_ms, flop_ms),
            "weight_gb": weight_bytes / 1e9, "doc_kv_gb": kv_bytes / 1e9,
            "own_kv_gb": own_bytes / 1e9, "own_tokens": own_tokens,
            "tflop": (gemm_flops + attn_flops) / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:codellama-7b")
    parser.add_argument("--doc-tokens", type=int, default=16384)
    parser.add_argument("--questions", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32, help="answer tokens of the timed run")
    parser.add_argument("--profile-tokens", type=int, default=4)
    parser.add_argument("--modes", default="cascade,parallel")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--out", default="profile_step.json")
    parser.add_argument("--serial-cascade", action="store_true",
                        help="cascade decode without the side stream (document part, then suffix)")
    parser.add_argument("--apart", action="store_true",
                        help="keep the questions' common opening per question "
                             "(EngineConfig.share_question_prefix=False, the workload before 2026-12-01)")
    args = parser.parse_args()

    t0 = time.perf_counter()
    engine = Engine(args.model, config=EngineConfig(cuda_graphs=torch.cuda.is_available(),
                                                    share_question_prefix=not args.apart,
                                                    overlap_cascade=not args.serial_cascade))
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    document, questions = make_workload(engine.tokenizer, args.doc_tokens, args.questions, seed=0)
    sampling = SamplingParams(max_new_tokens=args.tokens, ignore_eos=True)
    engine.answer(document, questions[:1], mode="stock",
                  sampling=SamplingParams(max_new_tokens=1, ignore_eos=True))
    # The floor of the last step of the timed run, whose graph state the replays below reuse:
    # the prompt's real prefix (instruction + document) and each question's tokens + answer.
    prompt = engine.tokenizer.prompt("qa", document, questions)
    if engine.config.share_question_prefix:  # as the engine splits it (engine._prepare)
        prompt = prompt.with_common_opening()
    own = sum(map(len, prompt.suffix_ids)) / len(questions) + args.tokens - 1
    results = {"args": vars(args), "modes": {},
               "floor": step_floor(engine, len(prompt.prefix_ids), args.questions, own)}
    for mode in args.modes.split(","):
        engine.answer(document, questions, mode=mode, streams=args.streams, sampling=sampling)
        timer = PhaseTimer()
        for owner, names in HOST_PHASES.items():
            for name in names:
                timer.wrap(owner, name, f"{owner.__name__}.{name}")
        timer.wrap(engine_module, "sample", "sample (enqueue)")
        timer.wrap(engine_module._Launched, "read", "read tokens (waits for the GPU)")
        sync()
        t1 = time.perf_counter()
        try:
            stats = engine.run(
                [QuestionRequest(i, document, q, sampling)
                 for i, q in enumerate(questions)], mode=mode, streams=args.streams)
        finally:
            timer.restore()
        sync()
        wall = time.perf_counter() - t1
        steps = max(1, args.tokens - 1)  # the first answer token comes from the prefill
        row = {"wall_s": wall, "decode_s": stats.decode_s, "prefill_s": stats.prefill_s,
               "steps": stats.steps, "streams": stats.streams,
               "decode_step_ms": 1e3 * stats.decode_s / steps,
               "host_ms_per_step": {k: 1e3 * v / max(1, timer.calls.get(k, steps))
                                    for k, v in timer.totals.items()},
               "host_calls": dict(timer.calls),
               "replay_ms": replay_time(engine),
               "replay_kernels": profile_replay(engine)}
        row["kernels"] = profile_kernels(engine, document, questions, mode, args.streams,
                                         args.profile_tokens)
        results["modes"][mode] = row
        print(f"\n== {mode} (P={stats.streams}): wall {wall:.3f} s, prefill {stats.prefill_s:.3f} s, "
              f"decode step {row['decode_step_ms']:.2f} ms")
        for k, v in sorted(row["host_ms_per_step"].items(), key=lambda kv: -kv[1]):
            print(f"   host {k:28s} {v:8.3f} ms/call")
        for k, v in row["replay_ms"].items():
            print(f"   replay {k}: {v:.3f} ms")
        rk = row["replay_kernels"]
        if rk:
            print(f"   kernels in a graph replay ({rk['graph'][:40]}...): {rk['total_us'] / 1e3:.3f} ms")
            for cat, us in sorted(rk["categories_us"].items(), key=lambda kv: -kv[1]):
                print(f"   replay {cat:28s} {us / 1e3:8.3f} ms/step")
        prof = row["kernels"]
        print(f"   kernels, eager, per decode step: {prof['total_us_per_step'] / 1e3:.3f} ms")
        for cat, us in sorted(prof["categories_us"].items(), key=lambda kv: -kv[1]):
            print(f"   kernels {cat:28s} {us / 1e3:8.3f} ms/step")
        for name, us in prof["top_kernels_us"][:12]:
            print(f"     {us / 1e3:8.3f} ms/step  {name[:90]}")
        print(f"   prefill (question prefill + 1 token, eager): {prof['prefill_us'] / 1e3:.1f} ms")
        for name, us in prof["prefill_top_kernels_us"][:6]:
            print(f"     {us / 1e3:8.3f} ms  {name[:90]}")
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)
    print("\nfloor:", {k: round(v, 3) for k, v in results["floor"].items()})


if __name__ == "__main__":
    main()
