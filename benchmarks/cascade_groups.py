"""One decode step's attention, one layer, with several documents and few questions each.

`benchmarks/layer_kernels.py` measures one document with many questions (the paper's grid). The
real-data workloads decode another shape: `loogle` is documents of ~19.9k tokens with 18
questions each, several documents per step, and as answers end at their budgets a document
keeps a few requests or one. This measures that shape per layer, stock against cascade
(through `TritonBackend.forward`, the K/V write included, each step captured as a CUDA graph and
its replays timed, as the engine runs decode), the cascade document kernel alone, and what the
cost model (`engine/runtime/cost_model.py`) predicts for each, so the model's constants can be
checked against the kernels at this shape. Cascade runs with the step's own maxima and with
the bounds an engine's CUDA graph plans for (`BOUNDS`), each through the stream-K document
kernel and through the split one (`KERNELS`; contiguous documents only: gathered ones have the
split kernel alone); `auto_kernel` says which of the two the backend takes by itself;
`--stream-tiles` times the stream kernel's document part at other tiles too.

Each case is a list of group sizes: "18x6" is six documents of 18 requests, "18,9,4,2,1,1" a
step late in a run. Every request has `--own` tokens of its own (question and answer so far)
after its document; the documents are one slot run each, as the engine's allocator lays them
out (`--gather`: through req_to_token instead).

    python3 benchmarks/cascade_groups.py --model qwen2.5-7b --doc-tokens 19904 \
        --cases 18,18x3,18x6,18,9,4,2,1,1 --out cascade_groups.json

(`--cases` separates cases by spaces or semicolons: "18x6;18,9,4,2,1,1".) `--smoke` runs tiny
shapes on the CPU under TRITON_INTERPRET=1, checking the plumbing and that cascade's output
matches stock's.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from types import SimpleNamespace

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ppqa.engine.attention.metadata import CascadeMetadata, ForwardMetadata  # noqa: E402
from ppqa.engine.attention.triton_backend import TritonBackend  # noqa: E402
from ppqa.engine.loading.presets import preset_config  # noqa: E402
from ppqa.engine.runtime import cost_model  # noqa: E402
from ppqa.engine.runtime.graph_runner import length_bucket, pow2  # noqa: E402
from ppqa.kernels._arch import Tiles  # noqa: E402
from ppqa.kernels.cascade_stream import launch_stream_prefix  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# How a cascade step's maxima are set (Step.meta): as an eager step, as graphs were keyed before
# (powers of two), as the graph runner keys them now (whole query tiles).
BOUNDS = ("exact", "pow2", "tiles")
# The document kernel: split per document for the step's plan, or stream-K over the whole GPU.
KERNELS = ("split", "stream")
I32 = dict(device=DEV, dtype=torch.int32)


def parse_case(text: str) -> list[int]:
    """'18x3,5,1' -> [18, 18, 18, 5, 1]."""
    sizes = []
    for part in text.split(","):
        n, _, times = part.partition("x")
        sizes += [int(n)] * int(times or 1)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"a case is group sizes >= 1, e.g. 18x6 or 18,9,1; got {text!r}")
    return sizes


class Step:
    """A pool holding len(sizes) documents of doc_len tokens, then each request's own tokens
    (the last one is this step's token), and a decode step over all requests."""

    def __init__(self, cfg, doc_len: int, sizes: list[int], own: int, dtype, gather: bool,
                 gen: torch.Generator):
        self.cfg, self.doc_len, self.sizes, self.own, self.gather = cfg, doc_len, sizes, own, gather
        heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        groups, batch = len(sizes), sum(sizes)
        self.batch = batch
        slots = 1 + groups * doc_len + batch * own
        self.k = torch.randn((slots, kv_heads, dim), generator=gen).to(dtype).to(DEV)
        self.v = torch.randn((slots, kv_heads, dim), generator=gen).to(dtype).to(DEV)
        self.group_of = torch.repeat_interleave(torch.arange(groups), torch.tensor(sizes))
        self.doc_first = 1 + self.group_of * doc_len  # each request's document run
        own_slots = 1 + groups * doc_len + torch.arange(batch * own).view(batch, own)
        docs = self.doc_first[:, None] + torch.arange(doc_len)
        self.table = torch.cat([docs, own_slots], dim=1).to(**I32)
        self.out_slots = own_slots[:, -1].to(DEV)
        self.q = torch.randn((batch, heads, dim), generator=gen).to(dtype).to(DEV)
        self.k_new = torch.randn((batch, kv_heads, dim), generator=gen).to(dtype).to(DEV)
        self.v_new = torch.randn((batch, kv_heads, dim), generator=gen).to(dtype).to(DEV)
        self.backend = TritonBackend(
            SimpleNamespace(k_buffers=[self.k], v_buffers=[self.v],
                            slot_sid=torch.full((slots,), -1, **I32)),
            heads, kv_heads, dim, 1 / math.sqrt(dim))

    def meta(self, cascade: bool, bounds: str = "exact") -> ForwardMetadata:
        """The step's metadata; cascade with `bounds` as a CUDA graph of the engine holds them:
        "exact" (the step's own maxima, as an eager step), "pow2" (groups padded with empty
        ones and the largest group rounded to powers of two, the document to its length
        bucket) or "tiles" (the same, the group size by the backend's cascade_group_bound)."""
        batch, prefix = self.batch, self.doc_len + self.own - 1
        casc, max_prefix = None, prefix
        if cascade:
            groups = len(self.sizes)
            padded = groups if bounds == "exact" else pow2(groups)
            ends = list(torch.tensor(self.sizes).cumsum(0))
            indptr = torch.tensor([0] + ends + ends[-1:] * (padded - groups), **I32)
            starts = (1 + torch.arange(groups) * self.doc_len).tolist() + [0] * (padded - groups)
            size, doc_bound = max(self.sizes), self.doc_len
            if bounds != "exact":
                doc_bound = length_bucket(self.doc_len)
                max_prefix = length_bucket(prefix + 1) - 1
                size = (pow2(size) if bounds == "pow2" else
                        self.backend.cascade_group_bound(size, not self.gather))
            casc = CascadeMetadata(
                group_req_indptr=indptr, doc_req_indices=indptr[:-1].clone(),
                doc_lens=torch.tensor([self.doc_len] * groups + [0] * (padded - groups), **I32),
                max_group_size=size, max_doc_len=doc_bound,
                doc_starts=torch.tensor(starts, **I32),
                contiguous=not self.gather,
                doc_groups=groups if bounds == "exact" else pow2(groups))
        hints = not cascade and not self.gather  # stock rows read their document runs
        return ForwardMetadata(
            kind="decode", positions=torch.zeros(batch, dtype=torch.int64, device=DEV),
            out_slots=self.out_slots.long(), q_sid=torch.zeros(batch, **I32),
            qo_indptr=torch.arange(batch + 1, **I32), req_indices=torch.arange(batch, **I32),
            kv_start=torch.full((batch,), self.doc_len if cascade else 0, **I32),
            prefix_lens=torch.full((batch,), prefix, **I32), req_to_token=self.table,
            logit_indices=torch.arange(batch, device=DEV), max_extend_len=1,
            max_prefix_len=max_prefix, cascade=casc,
            doc_start=self.doc_first.to(**I32) if hints else None,
            doc_len=torch.full((batch,), self.doc_len, **I32) if hints else None)

    def forward(self, meta: ForwardMetadata) -> torch.Tensor:
        return self.backend.forward(0, self.q, self.k_new, self.v_new, meta)


def timed(fn, graphs: bool) -> float:
    """Median ms: replays of fn captured as a CUDA graph (eagerly on the CPU, once)."""
    if DEV == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    fn()  # compiles outside the capture
    if not graphs:
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=60, return_mode="median")


def predicted_ms(cfg, doc_len: int, sizes: list[int], own: int, mode: str) -> float:
    """The cost model's attention time for this step, one layer: its per-document formula
    summed over the groups (auto decides per document group)."""
    rates = cost_model.DeviceRates.for_device("cuda")
    total = 0.0
    for n in sizes:  # own = question + answer so far; the model charges q + max_new / 2
        w = cost_model.Workload(doc_tokens=doc_len, questions=n, question_tokens=own,
                                max_new_tokens=0)
        total += cost_model.attention_seconds(cfg, w, mode, 1, rates)
    return total / cfg.num_layers * 1e3


def floor_ms(cfg, doc_len: int, sizes: list[int], own: int, mode: str) -> float:
    """max(unique bytes / 4.3 TB/s, useful FLOPs / 790 TFLOP/s), one layer."""
    kv = 2 * cfg.num_kv_heads * cfg.head_dim * 2
    flops = 4 * cfg.head_dim * cfg.num_heads * sum(sizes) * (doc_len + own)
    unique = (len(sizes) * doc_len + sum(sizes) * own) * kv
    if mode == "document":
        flops = 4 * cfg.head_dim * cfg.num_heads * sum(sizes) * doc_len
        unique = len(sizes) * doc_len * kv
    return max(unique / 4.3e12, flops / 790e12) * 1e3


def columns(gather: bool) -> list[tuple[str, str]]:
    return [(b, k) for b in BOUNDS for k in KERNELS if not (gather and k == "stream")]


def run_case(cfg, doc_len: int, sizes: list[int], own: int, dtype, gather: bool,
             graphs: bool, stream_tiles: list[Tiles] = ()) -> dict:
    step = Step(cfg, doc_len, sizes, own, dtype, gather, torch.Generator().manual_seed(0))
    stock_meta = step.meta(False)
    stock_out = step.forward(stock_meta).float()
    row = {"sizes": sizes, "groups": len(sizes), "requests": step.batch,
           "stock_splits": step.backend.plan(stock_meta).splits,
           "stock_ms": timed(lambda: step.forward(stock_meta), graphs)}
    for bounds, kernel in columns(gather):
        step.backend.stream_prefix = kernel == "stream"
        meta = step.meta(True, bounds)
        diff = float((step.forward(meta).float() - stock_out).abs().max())
        plan = step.backend.plan(meta)
        casc = meta.cascade
        part = step.backend.scratch.views(step.batch, cfg.num_heads, plan.prefix_splits,
                                          cfg.head_dim)
        document = functools.partial(step.backend.document_part, step.q, step.k, step.v, meta,
                                     plan, *part)
        col = row[f"{bounds}/{kernel}"] = {
            "group_bound": casc.max_group_size, "splits": [plan.splits, plan.prefix_splits],
            "stream": plan.stream, "max_abs_diff": diff,
            "cascade_ms": timed(lambda: step.forward(meta), graphs),
            "document_ms": timed(document, graphs)}
        col["x"] = row["stock_ms"] / col["cascade_ms"]
    if stream_tiles and not gather:  # the stream kernel's document part at other tiles
        step.backend.stream_prefix = True
        meta = step.meta(True, "tiles")
        plan = step.backend.plan(meta)
        part = step.backend.scratch.views(step.batch, cfg.num_heads, plan.prefix_splits,
                                          cfg.head_dim)
        casc = meta.cascade
        row["stream_tiles"] = [{"tiles": list(dataclasses.astuple(t)), "document_ms": timed(
            functools.partial(launch_stream_prefix, step.q, step.k, step.v,
                              casc.group_req_indptr, casc.doc_lens, casc.doc_starts,
                              casc.max_group_size, step.backend.sm_scale, plan.prefix_splits,
                              *part, tiles=t), graphs)} for t in stream_tiles]
    step.backend.stream_prefix = None  # which the backend takes by itself, per bound
    row["auto_kernel"] = {b: "stream" if step.backend.plan(step.meta(True, b)).stream
                          else "split" for b in BOUNDS}
    for mode in ("stock", "cascade"):
        row[f"{mode}_predicted_ms"] = predicted_ms(cfg, doc_len, sizes, own, mode)
        row[f"{mode}_floor_ms"] = floor_ms(cfg, doc_len, sizes, own, mode)
    row["document_floor_ms"] = floor_ms(cfg, doc_len, sizes, own, "document")
    row["predicted_x"] = row["stock_predicted_ms"] / row["cascade_predicted_ms"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-7b", help="a dummy preset name (its shapes)")
    ap.add_argument("--doc-tokens", type=int, default=19904)
    ap.add_argument("--own", type=int, default=141,
                    help="tokens of each request's own after its document (question + answer)")
    ap.add_argument("--cases", default="18;18x3;18x6;18,9,4,2,1,1;2x6;1x6",
                    help="group sizes per case, cases separated by ';' or spaces")
    ap.add_argument("--gather", action="store_true", help="documents through req_to_token")
    ap.add_argument("--eager", action="store_true", help="time eager launches, not graph replays")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--stream-tiles", default="",
                    help="also the stream kernel's document part at these tiles, at the graph "
                         "bound: 'rows,keys,warps,stages;...' (e.g. 64,64,8,3;64,32,4,3)")
    ap.add_argument("--out", default="cascade_groups.json")
    args = ap.parse_args()
    cfg = preset_config("tiny-gqa" if args.smoke else args.model)[0]
    doc_len, own = (96, 9) if args.smoke else (args.doc_tokens, args.own)
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    cases = ["3;2,1"] if args.smoke else args.cases.replace(" ", ";").split(";")
    stream_tiles = [Tiles(*map(int, t.split(","))) for t in args.stream_tiles.split(";") if t]
    if args.smoke and not stream_tiles:
        stream_tiles = [Tiles(16, 16, 4, 1)]
    rows = []
    print(f"{cfg.name}: document {doc_len} tokens, {own} own tokens a request, "
          f"{'gathered' if args.gather else 'contiguous'} documents, one layer, ms")
    cols = columns(args.gather)
    print(f"{'groups':>20} {'stock':>6} | {'cascade':>7} {'doc':>6} {'x':>5} {'splits':>7} "
          f"per column {', '.join('/'.join(c) for c in cols)} | {'pred x':>6} "
          f"{'doc floor':>9}")
    for text in ";".join(cases).split(";"):
        if not text:
            continue
        row = run_case(cfg, doc_len, parse_case(text), own, dtype, args.gather, not args.eager,
                       stream_tiles)
        row["case"] = text
        rows.append(row)
        parts = " | ".join(f"{row[c]['cascade_ms']:7.3f} {row[c]['document_ms']:6.3f} "
                           f"{row[c]['x']:5.2f} {str(tuple(row[c]['splits'])):>7}"
                           for c in ("/".join(c) for c in cols))
        print(f"{text:>20} {row['stock_ms']:6.3f} | {parts} | {row['predicted_x']:6.2f} "
              f"{row['document_floor_ms']:9.4f}  diff "
              f"{max(row['/'.join(c)]['max_abs_diff'] for c in cols):.1e}  auto: "
              f"{'/'.join(row['auto_kernel'].values())}", flush=True)
        for t in row.get("stream_tiles", []):
            print(f"{'':>20} stream kernel at tiles {t['tiles']}: document {t['document_ms']:.3f}")
        with open(args.out, "w") as f:
            json.dump({"model": cfg.name, "doc_tokens": doc_len, "own": own,
                       "gather": args.gather, "graphs": not args.eager, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
