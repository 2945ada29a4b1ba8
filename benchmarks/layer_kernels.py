"""Per-layer attention time of one decode step on the GPU: stock vs parallel vs cascade (ours,
through TritonBackend.forward, the K/V write included) and torch SDPA as a reference point.

Workload (the paper's grid): a document of L tokens, Q questions of 16 tokens, 128 answer
tokens already generated, so this step is answer token 129. All modes read the same KV slots:
  stock     Q requests, row [doc][q_i][a_i], one new token each (decode kernel);
  parallel  Q/P requests of P streams, row [doc][q..][a1_1..a1_P]..., P new tokens (extend);
  cascade   the stock rows, document once per step for all Q queries + per-request suffix
            (cascade_serial: the two launches one after the other, no side stream).
For each: the median time (triton.testing.do_bench, L2 flushed between runs), the floor
max(unique KV bytes / 4.3 TB/s, useful FLOPs / 790 TFLOP/s), the bytes the kernel reads
(repeats counted: L2 may serve some) and the achieved rates. Writes JSON after every cell and
prints a table last. Usage: python benchmarks/layer_kernels.py [--out PATH] [--quick]

--sweep-prefix / --sweep-extend / --sweep-decode / --sweep-prefill (instead of the grid): the
contiguous-document variants over their tiles and split counts at 16k/256 or --cell; and
--sweep-cascade: cascade's decode step over its variants (benchmarks/kernel_sweeps.py).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ppqa.engine.attention.metadata import CascadeMetadata, ForwardMetadata  # noqa: E402
from ppqa.engine.attention.triton_backend import TritonBackend  # noqa: E402
from ppqa.kernels._arch import Tiles  # noqa: E402
from ppqa.kernels.cascade import launch_shared_prefix  # noqa: E402
from ppqa.kernels.decode_attention import decode_attention  # noqa: E402
from ppqa.kernels.extend_attention import extend_attention  # noqa: E402

COPY_BW, MATMUL = 4.3e12, 790e12  # measured on this H200 (KINDS.md); re-measured below
MODELS = {"codellama-7b": (32, 32, 128), "qwen2.5-7b": (28, 4, 128)}
Q_TOKENS, ANSWERED = 16, 128
DTYPE = torch.bfloat16
# --smoke runs tiny shapes on the CPU under TRITON_INTERPRET=1 to check this script's plumbing.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
GRAPHS = False  # --graphs
GATHER = False  # --gather: no contiguous-document hints


def bench(fn, warmup: int = 10, rep: int = 60) -> float:
    if DEV == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def bench_replay(fn, warmup: int = 5, rep: int = 20) -> float:
    """Median ms of replays of a CUDA graph of fn: eager timing of a 0.1-0.2 ms launch pair
    counts Python's launch time (the same config measured 0.13 to 0.28 ms eagerly)."""
    if DEV == "cpu":
        return bench(fn)
    fn()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench(graph.replay, warmup, rep)


def calibrate() -> dict:
    if DEV == "cpu":
        return {}
    x = torch.empty(1 << 29, dtype=torch.uint8, device=DEV)  # 512 MiB
    y = torch.empty_like(x)
    copy_ms = bench(lambda: y.copy_(x))
    a = torch.randn(8192, 8192, dtype=DTYPE, device=DEV)
    mm_ms = bench(lambda: a @ a)
    return {"copy_TBps": 2 * x.numel() / copy_ms / 1e9, "bf16_matmul_TFLOPs": 2 * 8192 ** 3 / mm_ms / 1e9}


class Grid:
    """One (model, L, Q) cell: the pool and every mode's tables over the same slots."""

    def __init__(self, heads, doc_len: int, questions: int, gen: torch.Generator):
        self.num_heads, self.num_kv_heads, self.head_dim = heads
        self.doc_len, self.questions = doc_len, questions
        own = Q_TOKENS + ANSWERED + 1  # question, answers, this step's token
        num_slots = 1 + doc_len + questions * own
        shape = (num_slots, self.num_kv_heads, self.head_dim)
        self.k = torch.randn(shape, generator=gen).to(DTYPE).to(DEV)
        self.v = torch.randn(shape, generator=gen).to(DTYPE).to(DEV)
        self.doc = torch.arange(1, doc_len + 1, device=DEV, dtype=torch.int32)
        # own[i] = question i's slots: [q (16)][a_1 .. a_128][a_129 = this step]
        self.own = (1 + doc_len + torch.arange(questions * own, device=DEV, dtype=torch.int32)
                    ).view(questions, own)
        self.q = torch.randn(questions, self.num_heads, self.head_dim, generator=gen).to(DTYPE).to(DEV)
        self.k_new = torch.randn(questions, self.num_kv_heads, self.head_dim, generator=gen).to(DTYPE).to(DEV)
        self.v_new = torch.randn_like(self.k_new)
        self.kv_token_bytes = 2 * self.num_kv_heads * self.head_dim * 2

    def backend(self, slot_sid) -> TritonBackend:
        pool = SimpleNamespace(k_buffers=[self.k], v_buffers=[self.v], slot_sid=slot_sid)
        return TritonBackend(pool, self.num_heads, self.num_kv_heads, self.head_dim,
                             1 / math.sqrt(self.head_dim))

    def _meta(self, kind, table, prefix, qo_indptr, q_sid, out_slots, kv_start, cascade=None):
        i32 = dict(device=DEV, dtype=torch.int32)
        batch = table.shape[0]
        return ForwardMetadata(
            kind=kind, positions=torch.zeros(out_slots.numel(), dtype=torch.int64, device=DEV),
            out_slots=out_slots.long(), q_sid=q_sid, qo_indptr=qo_indptr,
            req_indices=torch.arange(batch, **i32), kv_start=torch.full((batch,), kv_start, **i32),
            prefix_lens=torch.full((batch,), prefix, **i32), req_to_token=table,
            logit_indices=torch.arange(out_slots.numel(), device=DEV),
            max_extend_len=int(qo_indptr.diff().max()), max_prefix_len=prefix, cascade=cascade,
            # The document fills slots 1..L in one piece, as the engine's allocator lays it out; the
            # engine passes these hints (--gather: without them, every slot through the table).
            doc_start=None if GATHER else torch.ones(batch, **i32),
            doc_len=None if GATHER else torch.full((batch,), self.doc_len, **i32))

    def stock(self, cascade: bool = False):
        rows = torch.cat([self.doc.expand(self.questions, -1), self.own], dim=1).contiguous()
        prefix = self.doc_len + Q_TOKENS + ANSWERED
        i32 = dict(device=DEV, dtype=torch.int32)
        casc = None
        if cascade:
            casc = CascadeMetadata(torch.tensor([0, self.questions], **i32),
                                   torch.zeros(1, **i32), torch.tensor([self.doc_len], **i32),
                                   max_group_size=self.questions, max_doc_len=self.doc_len,
                                   doc_starts=torch.ones(1, **i32), contiguous=not GATHER)
        meta = self._meta("decode", rows, prefix, torch.arange(self.questions + 1, **i32),
                          torch.zeros(self.questions, **i32), self.own[:, -1],
                          self.doc_len if cascade else 0, casc)
        return self.backend(torch.full((self.k.shape[0],), -1, **i32)), meta

    def parallel(self, streams: int):
        requests = self.questions // streams
        own = self.own.view(requests, streams, -1)
        questions = own[:, :, :Q_TOKENS].reshape(requests, -1)
        answers = own[:, :, Q_TOKENS:].transpose(1, 2).reshape(requests, -1)  # step-major
        rows = torch.cat([self.doc.expand(requests, -1), questions, answers], dim=1).contiguous()
        sid = torch.full((self.k.shape[0],), -1, device=DEV, dtype=torch.int32)
        stream_of = torch.arange(self.questions, device=DEV, dtype=torch.int32) % streams
        sid[self.own.long()] = stream_of[:, None].expand_as(self.own)
        i32 = dict(device=DEV, dtype=torch.int32)
        meta = self._meta("extend", rows, self.doc_len + (Q_TOKENS + ANSWERED) * streams,
                          torch.arange(0, self.questions + 1, streams, **i32), stream_of,
                          own[:, :, -1].reshape(-1), 0)
        return self.backend(sid), meta

    def run(self, backend, meta) -> tuple[float, torch.Tensor]:
        """(median ms, the output): every mode attends each question to the same keys.
        With GRAPHS the step is captured once and its replays are timed, as the engine's decode
        steps run; eagerly, Python launch gaps count in short steps."""
        step = lambda: backend.forward(0, self.q, self.k_new, self.v_new, meta)  # noqa: E731
        out = step().float()
        if not GRAPHS:
            return bench(step), out
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        return bench(graph.replay), out

    def sdpa(self, shared: bool, timer=bench) -> float:
        """Shared: all Q queries against the document once. Per question: each query against
        its own row (document + 145), the document expanded without a copy."""
        f = torch.nn.functional.scaled_dot_product_attention
        length = self.doc_len if shared else self.doc_len + Q_TOKENS + ANSWERED + 1
        k = self.k[1:1 + length].transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hkv, N, D]
        v = self.v[1:1 + length].transpose(0, 1).unsqueeze(0).contiguous()
        gqa = self.num_heads != self.num_kv_heads
        if shared:
            q = self.q.transpose(0, 1).unsqueeze(0).contiguous()  # [1, Hq, Q, D]
        else:
            q = self.q.unsqueeze(2)  # [Q, Hq, 1, D]
            k, v = k.expand(self.questions, -1, -1, -1), v.expand(self.questions, -1, -1, -1)
        return timer(lambda: f(q, k, v, enable_gqa=gqa))


def figures(grid: Grid, name: str, ms: float, streams: int | None = None) -> dict:
    """Bytes and FLOPs of one mode in one cell, and the rates its time gives."""
    L, Q, per = grid.doc_len, grid.questions, Q_TOKENS + ANSWERED + 1
    flop_per_key = 4 * grid.head_dim * grid.num_heads
    unique = (L + Q * per) * grid.kv_token_bytes
    useful = Q * (L + per) * flop_per_key
    if name == "stock" or name == "sdpa_per_question":
        read = Q * (L + per) * grid.kv_token_bytes
    elif name == "parallel":
        read = (Q // streams) * (L + per * streams) * grid.kv_token_bytes
    elif name in ("cascade", "cascade_serial"):
        read = unique
    else:  # sdpa_shared / cascade_document: the document part only
        read = unique = L * grid.kv_token_bytes
        useful = Q * L * flop_per_key
    floor = max(unique / COPY_BW, useful / MATMUL) * 1e3
    return {"mode": name, "streams": streams, "ms": round(ms, 4), "floor_ms": round(floor, 4),
            "x_floor": round(ms / floor, 2), "bytes_unique": unique, "bytes_read": read,
            "read_TBps": round(read / ms / 1e9, 2), "unique_TBps": round(unique / ms / 1e9, 2),
            "useful_TFLOPs": round(useful / ms / 1e9, 1)}


def cell(model: str, doc_len: int, questions: int, gen) -> list[dict]:
    grid = Grid(MODELS[model], doc_len, questions, gen)
    out = []
    ms, reference = grid.run(*grid.stock())
    out.append(figures(grid, "stock", ms))

    def agrees(result: torch.Tensor) -> dict:
        return {"max_abs_diff_vs_stock": round(float((result - reference).abs().max()), 5)}

    for streams in sorted({16, 32, 64, questions}):
        ms, result = grid.run(*grid.parallel(streams))
        out.append(figures(grid, "parallel", ms, streams) | agrees(result))
    backend, meta = grid.stock(cascade=True)
    ms, result = grid.run(backend, meta)
    out.append(figures(grid, "cascade", ms) | agrees(result))
    backend.overlap = False  # the document part and the suffix one after the other
    ms, result = grid.run(backend, meta)
    out.append(figures(grid, "cascade_serial", ms) | agrees(result))
    backend.overlap = True
    plan = backend.plan(meta)
    part = backend.scratch.views(questions, grid.num_heads, plan.prefix_splits, grid.head_dim)
    doc_ms = bench(functools.partial(  # no closure over `grid`, which is deleted below
        backend.document_part, grid.q, grid.k, grid.v, meta, plan, *part))
    out.append(figures(grid, "cascade_document", doc_ms)
               | {"splits": plan.prefix_splits, "stream": plan.stream})
    for shared in (True, False):
        name = "sdpa_shared" if shared else "sdpa_per_question"
        try:
            out.append(figures(grid, name, grid.sdpa(shared)))
        except (RuntimeError, torch.OutOfMemoryError) as e:  # record, do not stop the grid
            out.append({"mode": name, "error": str(e)[:200]})
    for row in out:
        row.update(model=model, doc_tokens=doc_len, questions=questions)
    del grid
    torch.cuda.empty_cache()
    return out


SWEEP = {  # (block_m, block_n, num_warps, num_stages); the first of each is the default
    "decode_mha": [(16, 64, 4, 2), (1, 64, 4, 2), (16, 128, 8, 2), (16, 32, 4, 2)],
    "decode_gqa": [(16, 64, 4, 2), (16, 128, 8, 2)],
    "extend": [(32, 64, 8, 2), (16, 64, 8, 2), (32, 128, 8, 2), (32, 64, 4, 2)],
    "prefix": [(64, 64, 4, 2), (64, 128, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2)],
}


def sweep(model: str, doc_len: int, questions: int, gen) -> list[dict]:
    """Tile variants of each kernel on one cell, splits as the backend plans them."""
    grid = Grid(MODELS[model], doc_len, questions, gen)
    rows = []

    def record(kernel, tiles, fn):
        try:
            rows.append({"mode": f"sweep_{kernel}", "tiles": tiles, "ms": round(bench(fn), 4)})
        except Exception as e:  # a variant that does not compile is a result too
            rows.append({"mode": f"sweep_{kernel}", "tiles": tiles, "error": str(e)[:160]})

    backend, meta = grid.stock()
    o = torch.empty_like(grid.q)
    kind = "decode_mha" if grid.num_heads == grid.num_kv_heads else "decode_gqa"
    for t in SWEEP[kind]:
        record(kind, t, lambda t=t: decode_attention(
            grid.q, o, grid.k, grid.v, meta.req_to_token, meta.req_indices, meta.kv_start,
            meta.prefix_lens, backend.sm_scale, num_splits=backend.plan(meta).splits,
            scratch=backend.scratch, seq_len_offset=1, tiles=Tiles(*t)))
    backend, meta = grid.parallel(32)
    for t in SWEEP["extend"]:
        record("extend", t, lambda t=t: extend_attention(
            grid.q, grid.k_new, grid.v_new, o, grid.k, grid.v, meta.req_to_token,
            meta.req_indices, meta.kv_start, meta.prefix_lens, meta.qo_indptr, meta.q_sid,
            backend.pool.slot_sid, meta.max_extend_len, backend.sm_scale,
            max_prefix_len=meta.max_prefix_len, scratch=backend.scratch, tiles=Tiles(*t)))
    backend, meta = grid.stock(cascade=True)
    backend.stream_prefix = False  # the split kernel's tiles: its own plan
    casc, splits = meta.cascade, backend.plan(meta).prefix_splits
    part = backend.scratch.views(questions, grid.num_heads, splits, grid.head_dim)
    for t in SWEEP["prefix"]:
        record("prefix", t, lambda t=t: launch_shared_prefix(
            grid.q, grid.k, grid.v, meta.req_to_token, casc.group_req_indptr,
            casc.doc_req_indices, casc.doc_lens, casc.max_group_size, backend.sm_scale, splits,
            *part, tiles=Tiles(*t)))
    for row in rows:
        row.update(model=model, doc_tokens=doc_len, questions=questions)
    return rows


def main() -> None:
    global GRAPHS, GATHER, Q_TOKENS, ANSWERED
    parser = argparse.ArgumentParser()
    default_out = os.path.join(os.environ.get("OUT", "benchmarks/results"), "kernels_h200.json")
    parser.add_argument("--out", default=None, help=f"JSON path (default {default_out}, or "
                        "kernels_contig_sweep.json beside it with --sweep-prefix/-extend/-decode)")
    parser.add_argument("--quick", action="store_true", help="16k/256 cells only")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    parser.add_argument("--graphs", action="store_true",
                        help="time CUDA graph replays of each mode's step")
    parser.add_argument("--gather", action="store_true",
                        help="pass no contiguous-document hints: every kernel gathers its slots")
    parser.add_argument("--sweep-prefix", action="store_true",
                        help="only the contiguous shared-prefix sweep (16k/256)")
    parser.add_argument("--sweep-decode", action="store_true",
                        help="only the stock decode sweep, splits x tiles with the document hints (16k/256)")
    parser.add_argument("--cell", default=None, metavar="L/Q",
                        help="the --sweep-* cell, e.g. 8192/64 (default 16384/256)")
    parser.add_argument("--sweep-extend", action="store_true",
                        help="only the contiguous extend sweep (16k/256, P=32)")
    parser.add_argument("--sweep-prefill", action="store_true",
                        help="only parallel's question prefill sweep (16k/256, P=32)")
    parser.add_argument("--sweep-cascade", action="store_true",
                        help="only cascade's decode step over document tiles, TMA, splits and "
                        "overlap, and its parts alone (16k/256)")
    parser.add_argument("--q-tokens", type=int, default=Q_TOKENS,
                        help="tokens of each question (default %(default)s)")
    parser.add_argument("--answered", type=int, default=ANSWERED,
                        help="answer tokens already generated (default %(default)s)")
    args = parser.parse_args()
    contig = [k for k, on in (("prefix", args.sweep_prefix), ("extend", args.sweep_extend),
                              ("decode", args.sweep_decode), ("prefill", args.sweep_prefill)) if on]
    if args.out is None:
        name = ("kernels_contig_sweep.json" if contig or args.sweep_cascade
                else "kernels_h200.json")
        args.out = os.path.join(os.path.dirname(default_out), name)
    Q_TOKENS, ANSWERED = args.q_tokens, args.answered
    GRAPHS = args.graphs and DEV == "cuda"
    GATHER = args.gather
    if args.smoke:
        MODELS.update({"codellama-7b": (4, 4, 16), "qwen2.5-7b": (6, 2, 16)})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter)", "commit": commit or "unknown",
              "command": " ".join(["python benchmarks/layer_kernels.py", *sys.argv[1:]]),
              "graphs": GRAPHS, "contiguous_hints": not GATHER,
              "torch": torch.__version__, "triton": triton.__version__,
              "calibration": calibrate(), "rows": []}
    gen = torch.Generator().manual_seed(0)
    docs, qs = ([16384], [256]) if args.quick else ([8192, 16384], [64, 128, 256])
    if args.smoke:
        docs, qs = [300], [64]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    if args.sweep_cascade:
        from kernel_sweeps import cascade_step_sweep, print_cascade

        doc_len, questions = map(int, args.cell.split("/")) if args.cell else (docs[-1], qs[-1])
        for model in MODELS:
            grid = Grid(MODELS[model], doc_len, questions, gen)
            result["rows"] += cascade_step_sweep(grid, model, bench_replay, args.smoke)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
            del grid
        print(f"calibration: {result['calibration']}")
        print_cascade(result["rows"])
        return
    if contig:
        from kernel_sweeps import contig_sweep, print_contig  # this script's folder is on sys.path

        doc_len, questions = map(int, args.cell.split("/")) if args.cell else (docs[-1], qs[-1])
        for kernel in contig:
            for model in MODELS:
                grid = Grid(MODELS[model], doc_len, questions, gen)
                result["rows"] += contig_sweep(kernel, grid, model, bench_replay, args.smoke)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
        print(f"calibration: {result['calibration']}")
        print_contig(result["rows"])
        return
    if not args.no_sweep:
        for model in MODELS:
            result["rows"] += sweep(model, docs[-1], qs[-1], gen)
    for model in MODELS:
        for doc_len in docs:
            for questions in qs:
                result["rows"] += cell(model, doc_len, questions, gen)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    print(f"calibration: {result['calibration']}")
    print(f"{'model':13} {'L':>6} {'Q':>4} {'mode':17} {'P':>4} {'ms':>8} {'floor':>7} "
          f"{'x':>6} {'readTB/s':>9} {'TFLOP/s':>8} diff")
    for r in result["rows"]:
        if r["mode"].startswith("sweep_"):
            print(f"{r['model']:13} {r['doc_tokens']:6} {r['questions']:4} {r['mode']:17} "
                  f"{str(r['tiles']):>16} {r.get('ms', r.get('error'))}")
            continue
        if "error" in r:
            print(f"{r['model']:13} {r['doc_tokens']:6} {r['questions']:4} {r['mode']:17} error")
            continue
        print(f"{r['model']:13} {r['doc_tokens']:6} {r['questions']:4} {r['mode']:17} "
              f"{r['streams'] or '':>4} {r['ms']:8.3f} {r['floor_ms']:7.3f} {r['x_floor']:6.2f} "
              f"{r['read_TBps']:9.2f} {r['useful_TFLOPs']:8.1f} {r.get('max_abs_diff_vs_stock', '')}")


if __name__ == "__main__":
    main()
