"""The document part of one cascade decode step, ours against torch's fused attention.

One document of L contiguous tokens in a KV pool, Q requests decoding one token each (the
batch rows of one cascade group). Ours: `shared_prefix_attention` with `doc_starts` (the
engine's contiguous path: TMA tiles on sm_90, wave-filling splits, then `merge_partials`).
Torch's: `_scaled_dot_product_cudnn_attention` and `_scaled_dot_product_flash_attention`,
both of which return the log-sum-exp a cascade merge needs, over the same pool slots. A
grouped-query model folds each KV head's query heads into rows (rows = Q x group), as our
kernel does. `pieces` > 1 splits the document into that many equal runs of keys, one batch
entry each (the queries repeated), and merges the pieces' states by log-sum-exp in torch:
with one KV head's rows in one or two query tiles, that is how a fused kernel without a
split-KV forward fills the GPU.

Each variant is timed as CUDA-graph replays (`triton.testing.do_bench`, L2 flushed), checked
against ours (max |diff| of o), and reported in TFLOP/s of the product's useful work
(4 x rows x L x D per KV head and layer). Usage:
  python benchmarks/doc_product.py [--out PATH] [--cells codellama-7b:16384:256,...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from ppqa.kernels.cascade import shared_prefix_attention  # noqa: E402

MODELS = {"codellama-7b": (32, 32, 128), "qwen2.5-7b": (28, 4, 128)}
CELLS = "codellama-7b:16384:256,codellama-7b:8192:64,qwen2.5-7b:20480:18,qwen2.5-7b:16384:256"
DTYPE = torch.bfloat16


def replay_ms(fn) -> float | str:
    """Median ms of graph replays of fn, or the error that stopped its capture."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return triton.testing.do_bench(graph.replay, warmup=10, rep=100, return_mode="median")
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        return f"{type(error).__name__}: {str(error)[:160]}"


def merge_pieces(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """o [P, H, R, D], lse [P, H, R] (natural log) -> [H, R, D]: the pieces' states merged."""
    weights = torch.softmax(lse.float(), dim=0).unsqueeze(-1)
    return (o.float() * weights).sum(0)


def cell(model: str, doc_len: int, questions: int, gen: torch.Generator) -> list[dict]:
    heads, kv_heads, dim = MODELS[model]
    group = heads // kv_heads
    scale = 1 / math.sqrt(dim)
    slots = 1 + doc_len
    k_pool = torch.randn(slots, kv_heads, dim, generator=gen).to(DTYPE).cuda()
    v_pool = torch.randn(slots, kv_heads, dim, generator=gen).to(DTYPE).cuda()
    q = torch.randn(questions, heads, dim, generator=gen).to(DTYPE).cuda()
    i32 = dict(device="cuda", dtype=torch.int32)
    table = torch.arange(slots, **i32).unsqueeze(0)
    indptr = torch.tensor([0, questions], **i32)
    out = torch.empty_like(q)
    lse = torch.empty(questions, heads, dtype=torch.float32, device="cuda")
    rows = questions * group
    flops = 4 * rows * doc_len * dim * kv_heads

    doc_req, doc_lens, doc_starts = (torch.tensor([x], **i32) for x in (0, doc_len, 1))

    def ours():
        shared_prefix_attention(q, out, lse, k_pool, v_pool, table, indptr, doc_req, doc_lens,
                                questions, doc_len, scale, doc_starts=doc_starts)

    ours()
    reference = out.float().clone()
    results = [{"variant": "ours", "ms": replay_ms(ours)}]

    # [Q, Hkv * group, D] -> [1, Hkv, Q * group, D]: row = request * group + query head
    folded = q.view(questions, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(
        1, kv_heads, rows, dim)

    def unfold(o: torch.Tensor) -> torch.Tensor:  # [Hkv, R, D] -> [Q, H, D]
        return o.reshape(kv_heads, questions, group, dim).permute(1, 0, 2, 3).reshape(
            questions, heads, dim)

    def attend(kind: str, pieces: int, strided: bool, merged: bool = True):
        length = doc_len // pieces * pieces  # the variants cover whole pieces only
        keys = k_pool[1:1 + length].view(pieces, length // pieces, kv_heads, dim)
        values = v_pool[1:1 + length].view(pieces, length // pieces, kv_heads, dim)
        kh, vh = keys.transpose(1, 2), values.transpose(1, 2)
        if not strided:
            kh, vh = kh.contiguous(), vh.contiguous()
        qh = folded.expand(pieces, -1, -1, -1).contiguous()

        def run():
            if kind == "cudnn":
                res = torch.ops.aten._scaled_dot_product_cudnn_attention(
                    qh, kh, vh, None, True, 0.0, False, False, scale=scale)
            else:
                res = torch.ops.aten._scaled_dot_product_flash_attention(
                    qh, kh, vh, 0.0, False, False, scale=scale)
            o, piece_lse = res[0], res[1].reshape(pieces, kv_heads, rows)
            if not merged:
                return o, piece_lse
            return merge_pieces(o, piece_lse) if pieces > 1 else o[0].float()
        return run, length

    for kind in ("cudnn", "flash"):
        for pieces in (1, 2, 4, 8):
            for strided in (True, False):
                if doc_len % pieces:
                    continue
                entry = {"variant": kind, "pieces": pieces, "strided_pool_view": strided}
                try:
                    run, length = attend(kind, pieces, strided)
                    got = unfold(run())
                    entry["max_abs_diff"] = float((got - reference).abs().max())
                    entry["ms"] = replay_ms(run)
                except Exception as error:  # noqa: BLE001 - reported, not hidden
                    entry["error"] = f"{type(error).__name__}: {str(error)[:160]}"
                results.append(entry)
    for pieces in (2, 3, 4):  # the fused kernel alone: what a merge in our kernel would add to
        if doc_len % pieces == 0:
            run, _ = attend("cudnn", pieces, True, merged=False)
            results.append({"variant": "cudnn_unmerged", "pieces": pieces,
                            "strided_pool_view": True, "ms": replay_ms(run)})
    for entry in results:
        entry.update(model=model, doc_len=doc_len, questions=questions, rows_per_kv_head=rows)
        if isinstance(entry.get("ms"), float):
            entry["tflops"] = flops / entry["ms"] / 1e9
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--cells", default=CELLS, help="model:L:Q,... (default %(default)s)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    results = []
    for spec in args.cells.split(","):
        model, doc_len, questions = spec.split(":")
        results += cell(model, int(doc_len), int(questions), gen)
    print(f"{'cell':<26} {'variant':<7} {'pieces':>6} {'strided':>7} {'ms':>8} {'TFLOP/s':>8} "
          f"{'max|d|':>8}")
    for e in results:
        name = f"{e['model']}:{e['doc_len']}:{e['questions']}"
        ms = e.get("ms", e.get("error", ""))
        shown = f"{ms:8.3f}" if isinstance(ms, float) else str(ms)[:60]
        print(f"{name:<26} {e['variant']:<7} {e.get('pieces', ''):>6} "
              f"{str(e.get('strided_pool_view', '')):>7} {shown} "
              f"{e.get('tflops', 0):8.0f} {e.get('max_abs_diff', 0):8.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
