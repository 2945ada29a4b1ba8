"""Where prefill time goes on a GPU: a document alone, then its questions against it, by part.

For each model and document length, on one engine (`dummy:<preset>[+bpe]`, bf16):
  1. the document's prefill, chunk by chunk as the session runs it (`Scheduler.document_chunk`
     -> `ModelRunner.run`), timed with CUDA events;
  2. its questions' prefill (Q questions of `--question-tokens` tokens each), as the session
     runs it for width-1 requests: one grouped (cascade) extend against the document;
  3. with --profile, every case again under torch.profiler: device time per kernel category
     (GEMMs, attention, norms/rope/activations, KV writes, copies) and the host gap (wall minus
     kernels), for the whole prefill and for the question part alone;
  4. each part against its own floor: matrix FLOPs and attention FLOPs at `--peak-tflops`.
Then, per document length, the document's causal attention alone (one layer, the longest
chunk against everything before it): our extend kernel against torch's fused attention
(FlashAttention and cuDNN backends), and the GEMMs alone at the chunk's M.

    python3 benchmarks/profile_prefill.py --models dummy:codellama-7b+bpe,dummy:qwen2.5-7b+bpe \
        --doc-tokens 2048,8192,16384,20480 --questions 18,64,256 --out /tmp/prefill.json

Writes every number to --out (JSON, `prefill_floor_ratio` per case) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from collections import defaultdict

import torch

from ppqa import Engine, SamplingParams
from ppqa.config import EngineConfig
from ppqa.engine.runtime.request import Stream

CATEGORIES = (("_extend", "attn extend"), ("shared_prefix", "attn doc product"),
              ("prefix", "attn doc product"), ("merge", "attn merge"), ("flash", "attn sdpa"),
              ("fmha", "attn sdpa"), ("cudnn", "attn sdpa"), ("_store", "kv store"),
              ("rms", "norm"), ("rope", "rope"), ("silu", "activation"),
              ("gemm", "gemm"), ("sm90", "gemm"), ("cutlass", "gemm"), ("nvjet", "gemm"),
              ("cublas", "gemm"), ("index", "index/gather"), ("gather", "index/gather"),
              ("scatter", "index/gather"), ("copy", "copies"), ("memcpy", "copies"),
              ("memset", "copies"), ("fill", "copies"))


def category(name: str) -> str:
    low = name.lower()
    for key, label in CATEGORIES:
        if key in low:
            return label
    return "other"


def matmul_flops_per_token(cfg) -> float:
    """2 x the parameters of every layer's projections (embedding lookups are free)."""
    return 2.0 * cfg.projection_params_per_layer() * cfg.num_layers


def attention_flops(cfg, pairs: float) -> float:
    """QK^T and PV over `pairs` (query, key) pairs of every head and layer."""
    return 4.0 * pairs * cfg.num_heads * cfg.head_dim * cfg.num_layers


def causal_pairs(start: int, end: int) -> float:
    """Pairs of a chunk [start, end) attending causally to [0, t]: the sum of t + 1 over it."""
    return (end - start) * (start + end + 1) / 2


class EventTimer:
    """Device time of a region (CUDA events), or host time on the CPU."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def __enter__(self):
        if self.cuda:
            self.begin.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self.end.record()
        self.t1 = time.perf_counter()

    def seconds(self) -> float:
        if not self.cuda:
            return self.t1 - self.t0
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1e3


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_requests(engine: Engine, doc_tokens: int, questions: int, question_tokens: int,
                  rng: random.Random, mode: str = "cascade"):
    vocab = engine.model_config.vocab_size
    doc_ids = [rng.randrange(3, vocab) for _ in range(doc_tokens)]
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    streams = [Stream(key=i, suffix_ids=[rng.randrange(3, vocab) for _ in range(question_tokens)],
                      sampling=sampling, seed=i, prompt_tokens=doc_tokens + question_tokens)
               for i in range(questions)]
    from ppqa.engine import prepare

    session = engine.session()
    return session, prepare.make_requests(engine, doc_ids, streams, mode, 1)


def prefill_once(engine: Engine, doc_tokens: int, questions: int, question_tokens: int,
                 rng: random.Random, around_questions=None) -> dict:
    """Document chunks and the grouped question extend of one fresh document, event-timed.
    around_questions: a context manager entered for the question part alone (a profiler)."""
    session, requests = make_requests(engine, doc_tokens, questions, question_tokens, rng)
    sched, runner = session.sched, engine.parts.runner
    for req in requests:
        sched.add(req)
    sync()
    wall0 = time.perf_counter()
    doc_s, chunks = 0.0, []
    while sched.waiting:
        sched.admit()
    while sched.pending_documents():
        for doc in sched.pending_documents():
            inputs = sched.document_chunk(doc)
            with EventTimer() as t:
                runner.run(inputs)
            chunks.append((inputs.num_tokens, t))
    doc_wall = time.perf_counter() - wall0
    q_s, q_tokens = 0.0, 0
    sync()
    with around_questions or contextlib.nullcontext():
        while True:
            ready = sched.questions_ready()
            if not ready:
                break
            for step in session._question_steps(ready):
                with EventTimer() as t:
                    runner.run(step.inputs)
                q_s += t.seconds()
                q_tokens += step.inputs.num_tokens
        sync()
    wall = time.perf_counter() - wall0
    doc_s = sum(t.seconds() for _, t in chunks)
    session.close()
    return {"doc_s": doc_s, "doc_chunks": [n for n, _ in chunks], "doc_host_wall_s": doc_wall,
            "questions_s": q_s, "question_tokens": q_tokens, "wall_s": wall}


def chunk_paths(engine: Engine, doc_tokens: int, questions: int, question_tokens: int,
                rng: random.Random) -> dict:
    """The same document length twice before the timed case: its later chunks through the
    extend kernel (cuDNN's chunk path off), then through cuDNN meeting the shapes first."""
    backend = engine.parts.backend
    saved = getattr(backend, "_chunk_ok", None)
    backend._chunk_ok = False
    try:
        kernel = prefill_once(engine, doc_tokens, questions, question_tokens, rng)
    finally:
        backend._chunk_ok = saved
    first = prefill_once(engine, doc_tokens, questions, question_tokens, rng)
    return {"extend_kernel_doc_s": kernel["doc_s"], "cudnn_first_doc_s": first["doc_s"],
            "chunk_ok": getattr(backend, "_chunk_ok", None)}


def kernel_profile(engine: Engine, doc_tokens: int, questions: int, question_tokens: int,
                   rng: random.Random) -> dict:
    """Device time by kernel category over a whole prefill (document and questions), then over
    the question part alone of another fresh document of the same shape."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]  # the CPU: ops' time

    def kinds(prof) -> tuple[dict[str, float], list]:
        per_cat: dict[str, float] = defaultdict(float)
        top = []
        for evt in prof.key_averages():
            us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
            if us > 0:
                per_cat[category(evt.key)] += us / 1e6
                top.append((evt.key[:100], us / 1e6))
        top.sort(key=lambda kv: -kv[1])
        return dict(per_cat), top[:15]

    with profile(activities=activities) as prof:
        out = prefill_once(engine, doc_tokens, questions, question_tokens, rng)
    per_cat, top = kinds(prof)
    kernels = sum(per_cat.values())
    q_prof = profile(activities=activities)
    q_out = prefill_once(engine, doc_tokens, questions, question_tokens, rng,
                         around_questions=q_prof)
    q_cat, q_top = kinds(q_prof)
    return {"categories_s": per_cat, "kernels_s": kernels,
            "host_gap_s": max(out["wall_s"] - kernels, 0.0), "top_kernels_s": top,
            "questions_s": q_out["questions_s"], "questions_categories_s": q_cat,
            "questions_top_kernels_s": q_top}


def bench_ms(fn, reps: int = 10) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=max(50, reps * 10), return_mode="median")


def attention_alone(engine: Engine, doc_tokens: int, chunk: int) -> dict:
    """One layer's causal attention of the document's last chunk against the whole document:
    our extend kernel (through the pool, as prefill runs it) against torch SDPA backends."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    cfg = engine.model_config
    dev, dt = engine.device, engine.dtype
    h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    start = max(0, doc_tokens - chunk)
    n = doc_tokens - start
    q = torch.randn(1, h, n, d, device=dev, dtype=dt)
    k = torch.randn(1, hk, doc_tokens, d, device=dev, dtype=dt)
    v = torch.randn(1, hk, doc_tokens, d, device=dev, dtype=dt)
    flops = attention_flops(cfg, causal_pairs(start, doc_tokens)) / cfg.num_layers
    out = {"chunk_tokens": n, "keys": doc_tokens, "flops": flops}
    mask = causal_lower_right(n, doc_tokens)
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                def fn():
                    return torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask if n != doc_tokens else None,
                        is_causal=n == doc_tokens, enable_gqa=h != hk)
                fn()
                ms = bench_ms(fn)
            out[name] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as exc:  # noqa: BLE001 - a backend that refuses the shape says why
            out[name] = {"error": f"{type(exc).__name__}: {str(exc)[:160]}"}
    # Ours: the extend kernel exactly as a document chunk runs it (pool, scratch row).
    from ppqa.kernels.extend_attention import extend_attention

    parts = engine.parts
    pool, table = parts.pool, parts.table
    slots = pool.allocator.alloc(doc_tokens)
    try:
        row = table.scratch_row
        table.write(row, 0, slots)
        kb, vb = pool.k_buffers[0], pool.v_buffers[0]
        kb[slots.to(dev)] = k[0].transpose(0, 1)
        vb[slots.to(dev)] = v[0].transpose(0, 1)
        qq = q[0].transpose(0, 1).contiguous()
        kn, vn = kb[slots[start:].to(dev)].clone(), vb[slots[start:].to(dev)].clone()
        o = torch.empty_like(qq)
        i32 = dict(dtype=torch.int32, device=dev)
        args = (qq, kn, vn, o, kb, vb, table.table, torch.tensor([row], **i32),
                torch.zeros(1, **i32), torch.tensor([start], **i32), torch.tensor([0, n], **i32),
                torch.full((n,), -1, **i32), pool.slot_sid, n, d ** -0.5)
        from ppqa.kernels.extend_attention import extend_splits

        backend = parts.backend
        splits = extend_splits(dev, dt, 1, n, h, hk, d, n, start, backend.scratch)

        def ours():
            extend_attention(*args, num_splits=splits, scratch=backend.scratch)
        ours()
        ms = bench_ms(ours)
        out["ours_extend"] = {"ms": ms, "tflops": flops / ms / 1e9, "splits": splits}
        run = bool((slots.diff() == 1).all())
        if run:
            hint = (torch.tensor([int(slots[0])], **i32), torch.tensor([start], **i32))
            splits_c = extend_splits(dev, dt, 1, n, h, hk, d, n, start, backend.scratch, True)

            def ours_contig():
                extend_attention(*args, num_splits=splits_c, scratch=backend.scratch,
                                 doc_start=hint[0], doc_len=hint[1])
            ours_contig()
            ms = bench_ms(ours_contig)
            out["ours_extend_doc_hint"] = {"ms": ms, "tflops": flops / ms / 1e9,
                                           "splits": splits_c}
    finally:
        pool.allocator.free(slots)
    return out


def gemms_alone(engine: Engine, m: int) -> dict:
    cfg = engine.model_config
    dev, dt = engine.device, engine.dtype
    h, d = cfg.hidden_size, cfg.head_dim
    shapes = {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h), "o": (h, cfg.num_heads * d),
              "gate_up": (2 * cfg.intermediate_size, h), "down": (h, cfg.intermediate_size)}
    out = {}
    for name, (n_out, k_in) in shapes.items():
        x = torch.randn(m, k_in, device=dev, dtype=dt)
        w = torch.randn(n_out, k_in, device=dev, dtype=dt) * 0.02
        ms = bench_ms(lambda: torch.nn.functional.linear(x, w))
        out[name] = {"ms": ms, "tflops": 2 * m * n_out * k_in / ms / 1e9}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dummy:codellama-7b+bpe,dummy:qwen2.5-7b+bpe")
    ap.add_argument("--doc-tokens", default="2048,8192,16384,20480")
    ap.add_argument("--questions", default="18,64,256")
    ap.add_argument("--question-tokens", default="20,90",
                    help="tokens per question (~20 BPE, ~90 byte tokens)")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--max-prefill-tokens", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="torch.profiler per case (slower)")
    ap.add_argument("--alone", action="store_true", help="attention and GEMMs alone per length")
    ap.add_argument("--chunk-paths", action="store_true",
                    help="per case, a document's later chunks through the extend kernel, then "
                         "through cuDNN (TritonBackend._fused_chunk) on a length it has not met, "
                         "then again on that length")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="prefill_profile.json")
    args = ap.parse_args()
    peak = args.peak_tflops * 1e12
    rng = random.Random(0)
    results = {"peak_tflops": args.peak_tflops, "cases": [], "alone": []}
    for model in args.models.split(","):
        fields = {}
        if args.max_prefill_tokens:
            fields["max_prefill_tokens"] = args.max_prefill_tokens
        t0 = time.perf_counter()
        engine = Engine(model, device=args.device, config=EngineConfig(**fields))
        results.setdefault("engine_build_s", {})[model] = time.perf_counter() - t0
        cfg = engine.model_config
        mm = matmul_flops_per_token(cfg)
        engine.warmup()  # compile the prefill kernels (a document over two chunks included)
        prefill_once(engine, 2048, 16, 20, rng)
        for doc_tokens in map(int, args.doc_tokens.split(",")):
            for questions in map(int, args.questions.split(",")):
                for q_tokens in map(int, args.question_tokens.split(",")):
                    if args.chunk_paths:
                        paths = chunk_paths(engine, doc_tokens, questions, q_tokens, rng)
                    case = prefill_once(engine, doc_tokens, questions, q_tokens, rng)
                    if args.chunk_paths:
                        case["chunk_paths"] = paths
                        print(f"  later chunks: extend kernel {paths['extend_kernel_doc_s']*1e3:.1f} ms, "
                              f"cuDNN first {paths['cudnn_first_doc_s']*1e3:.1f} ms, "
                              f"again {case['doc_s']*1e3:.1f} ms", flush=True)
                    doc_floor = (doc_tokens * mm + attention_flops(cfg, causal_pairs(0, doc_tokens))) / peak
                    q_total = questions * q_tokens
                    q_pairs = q_total * doc_tokens + questions * q_tokens * (q_tokens + 1) / 2
                    q_floor = (q_total * mm + attention_flops(cfg, q_pairs)
                               + 2.0 * questions * cfg.vocab_size * cfg.hidden_size) / peak
                    case.update(model=model, doc_tokens=doc_tokens, questions=questions,
                                question_tokens_each=q_tokens, doc_floor_s=doc_floor,
                                questions_floor_s=q_floor,
                                doc_floor_ratio=case["doc_s"] / doc_floor,
                                questions_floor_ratio=case["questions_s"] / q_floor,
                                prefill_floor_ratio=(case["doc_s"] + case["questions_s"])
                                / (doc_floor + q_floor),
                                doc_tflops=doc_floor * args.peak_tflops / case["doc_s"],
                                questions_tflops=q_floor * args.peak_tflops / case["questions_s"])
                    if args.profile:
                        case["profile"] = kernel_profile(engine, doc_tokens, questions, q_tokens, rng)
                    results["cases"].append(case)
                    print(f"{model:26s} doc {doc_tokens:6d} Q {questions:4d}x{q_tokens:3d}: "
                          f"doc {case['doc_s']*1e3:7.1f} ms ({case['doc_floor_ratio']:.2f}x floor, "
                          f"{case['doc_tflops']:.0f} TF/s)  questions {case['questions_s']*1e3:7.1f} ms "
                          f"({case['questions_floor_ratio']:.2f}x, {case['questions_tflops']:.0f} TF/s)",
                          flush=True)
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=1)
            if args.alone:
                chunk = engine.config.max_prefill_tokens
                alone = {"model": model, "doc_tokens": doc_tokens,
                         "attention": attention_alone(engine, doc_tokens, chunk),
                         "gemms": gemms_alone(engine, min(doc_tokens, chunk))}
                results["alone"].append(alone)
                a = alone["attention"]
                print("   attention alone: " + "  ".join(
                    f"{k} {v['ms']:.2f} ms {v['tflops']:.0f} TF/s" if "ms" in v else f"{k} {v['error'][:60]}"
                    for k, v in a.items() if isinstance(v, dict)), flush=True)
                print("   gemms alone: " + "  ".join(f"{k} {v['tflops']:.0f} TF/s"
                                                     for k, v in alone["gemms"].items()), flush=True)
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
        engine.close()  # its memory back before the next model's pool is sized
    for c in results["cases"]:
        if "profile" in c:
            p = c["profile"]
            cats = sorted(p["categories_s"].items(), key=lambda kv: -kv[1])
            print(f"{c['model']} {c['doc_tokens']}/{c['questions']}x{c['question_tokens_each']}: "
                  f"kernels {p['kernels_s']*1e3:.0f} ms, host gap {p['host_gap_s']*1e3:.0f} ms; " +
                  ", ".join(f"{k} {v*1e3:.0f}" for k, v in cats))
            q_cats = sorted(p["questions_categories_s"].items(), key=lambda kv: -kv[1])
            print(f"   questions alone {p['questions_s']*1e3:.1f} ms: " +
                  ", ".join(f"{k} {v*1e3:.1f}" for k, v in q_cats))


if __name__ == "__main__":
    main()
