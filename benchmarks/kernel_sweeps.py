"""The contiguous-document sweeps of `benchmarks/layer_kernels.py` (--sweep-prefix, --sweep-extend,
--sweep-decode, --sweep-prefill).

For one cell (16k/256 on the H200), the document read at affine addresses
(launch_shared_prefix(doc_starts=...), extend_attention / decode_attention(doc_start=, doc_len=))
over CONTIG_SWEEP tiles x CONTIG_SPLITS, against the gather variant at its defaults and SDPA
(its shared read; per question for the decode); each timed as CUDA graph replays with its
merge, each checked against the gather output.
layer_kernels.py builds the cell (its Grid) and writes the JSON; benchmarks/compile_check.py --sweep
compiles the same tiles.
"""

from __future__ import annotations

import torch

from ppqa.kernels._arch import Tiles
from ppqa.kernels.cascade import launch_shared_prefix, prefix_splits
from ppqa.kernels.decode_attention import decode_attention
from ppqa.kernels.extend_attention import extend_attention
from ppqa.kernels.merge import merge_partials

# --sweep-prefix / --sweep-extend: tiles (block_m, block_n, num_warps, num_stages) of the
# contiguous-document variants (None: the launcher's own choice) and split counts (None: the
# planner's); every pair is timed. benchmarks/compile_check.py --sweep compiles these tiles.
# A config may carry a fifth element, launcher options: {"tma": False} reads the document's
# whole tiles with pointer loads rather than the default tensor descriptors (sm_90).
PTR = {"tma": False}
CONTIG_SWEEP = {
    # the default (128, 64, 8, 3) and (64, 64, 4, 3), at the planned and 2 splits, TMA against
    # pointer loads (RESULTS.md, "TMA against pointer loads")
    "prefix": [(128, 64, 8, 3), (128, 64, 8, 3, PTR), (64, 64, 4, 3), (64, 64, 4, 4),
               (64, 32, 4, 3),
               # longer key tiles
               (128, 128, 8, 2)],
    "extend": [(64, 64, 4, 3), (64, 64, 4, 3, PTR), (64, 32, 4, 3), (64, 32, 4, 3, PTR),
               (32, 64, 4, 3), (64, 64, 4, 4)],
    # the stock decode (one query per question): one warp x 32 keys x 3 stages with TMA is the
    # fastest measured (RESULTS.md, "TMA against pointer loads"); here tiles under TMA
    "decode": [(16, 32, 1, 3), (16, 32, 1, 3, PTR), (16, 16, 1, 4), (16, 64, 1, 3),
               (16, 32, 1, 4), (16, 64, 1, 2), (16, 32, 2, 3), (16, 64, 2, 3)],
    # parallel's question prefill (P streams x PREFILL_TOKENS new tokens a request, against the
    # document): (64, 64, 4, 3), the decode steps' tile, is the default (RESULTS.md,
    # "Parallel's question prefill tile")
    "prefill": [(64, 64, 8, 2), (64, 64, 8, 2, PTR), (128, 64, 8, 3), (128, 64, 8, 2),
                (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 3), (128, 64, 4, 3)],
}
CONTIG_SPLITS = {"prefix": [None, 2], "extend": [None, 2], "decode": [None, 8], "prefill": [None]}
PREFILL_STREAMS, PREFILL_TOKENS = 32, 61  # a bench question is 60-61 tokens of the qa template


def contig_sweep(kernel: str, grid, model: str, bench_replay, smoke: bool = False) -> list[dict]:
    """"prefix": the cascade document part (all questions against the document, one group);
    "extend": the parallel P=32 step; "decode": the stock step (one request per question, the
    document hints as the engine passes them); "prefill": parallel's question prefill, requests
    of PREFILL_STREAMS streams of PREFILL_TOKENS new tokens each, stream-major, against the
    document. `grid`: layer_kernels.py's Grid of one cell, which puts the document at slots 1..L
    (doc_start = 1); bench_replay times a CUDA graph replay. doc_TFLOPs counts the document
    part's useful FLOPs only (the prefill's: also each stream's causal own part); splits None =
    the planner's."""
    doc_len, questions, dev = grid.doc_len, grid.questions, grid.q.device
    heads, i32 = (grid.num_heads, grid.num_kv_heads, grid.head_dim), dict(device=dev, dtype=torch.int32)
    flops = 4 * grid.head_dim * grid.num_heads * questions * doc_len
    # the interpreter (smoke) runs the first and last configs at two split counts
    sweep = CONTIG_SWEEP[kernel]
    configs = [(t, n) for t in ([sweep[0], sweep[-1]] if smoke else sweep)
               for n in CONTIG_SPLITS[kernel][:2 if smoke else None]]
    o, rows, gathered = torch.empty_like(grid.q), [], []
    if kernel == "prefix":
        backend, meta = grid.stock(cascade=True)
        casc, doc_starts = meta.cascade, torch.ones(1, **i32)

        def run(splits, tiles=None, contiguous=False, **options):
            splits = splits or prefix_splits(dev, grid.q.dtype, questions, *heads, 1, questions, doc_len,
                                              contiguous=contiguous)
            part = [torch.empty(questions, grid.num_heads, splits, *d, device=dev)
                    for d in ((grid.head_dim,), ())]
            launch_shared_prefix(grid.q, grid.k, grid.v, meta.req_to_token, casc.group_req_indptr,
                                 casc.doc_req_indices, casc.doc_lens, questions, backend.sm_scale,
                                 splits, *part, tiles=tiles,
                                 doc_starts=doc_starts if contiguous else None, **options)
            merge_partials(*part, o)
            return o
    elif kernel == "decode":
        backend, meta = grid.stock()
        doc = dict(doc_start=torch.ones(questions, **i32),
                   doc_len=torch.full((questions,), doc_len, **i32))
        flops = 4 * grid.head_dim * grid.num_heads * questions * meta.max_prefix_len

        def run(splits, tiles=None, contiguous=False, **options):
            decode_attention(grid.q, o, grid.k, grid.v, meta.req_to_token, meta.req_indices,
                             meta.kv_start, meta.prefix_lens, backend.sm_scale,
                             max_seq_len=meta.max_prefix_len + 1, num_splits=splits,
                             scratch=backend.scratch, seq_len_offset=1, tiles=tiles,
                             **(doc if contiguous else {}), **options)
            return o
    elif kernel == "prefill":
        p, n = min(PREFILL_STREAMS, questions), PREFILL_TOKENS
        batch, tokens = questions // p, questions * n
        new = lambda: torch.randn(tokens, grid.num_kv_heads, grid.head_dim,  # noqa: E731
                                  device=dev, dtype=grid.q.dtype)
        q = torch.randn(tokens, grid.num_heads, grid.head_dim, device=dev, dtype=grid.q.dtype)
        k_new, v_new, o = new(), new(), torch.empty_like(q)
        table = grid.doc.expand(batch, -1).contiguous()
        qo_indptr = torch.arange(0, tokens + 1, p * n, **i32)
        q_sid = (torch.arange(tokens, device=dev) // n % p).to(torch.int32)
        slot_sid = torch.full((grid.k.shape[0],), -1, **i32)
        zeros, lens = torch.zeros(batch, **i32), torch.full((batch,), doc_len, **i32)
        doc = dict(doc_start=torch.ones(batch, **i32), doc_len=lens)
        flops = 4 * grid.head_dim * grid.num_heads * questions * n * (doc_len + (n + 1) / 2)

        def run(splits, tiles=None, contiguous=False, **options):
            extend_attention(q, k_new, v_new, o, grid.k, grid.v, table, torch.arange(batch, **i32),
                             zeros, lens, qo_indptr, q_sid, slot_sid, p * n, 1 / grid.head_dim ** 0.5,
                             max_prefix_len=doc_len, num_splits=splits, tiles=tiles,
                             **(doc if contiguous else {}), **options)
            return o
    else:
        backend, meta = grid.parallel(32)
        doc = dict(doc_start=torch.ones(meta.batch_size, **i32),
                   doc_len=torch.full((meta.batch_size,), doc_len, **i32))

        def run(splits, tiles=None, contiguous=False, **options):
            extend_attention(grid.q, grid.k_new, grid.v_new, o, grid.k, grid.v, meta.req_to_token,
                             meta.req_indices, meta.kv_start, meta.prefix_lens, meta.qo_indptr,
                             meta.q_sid, backend.pool.slot_sid, meta.max_extend_len,
                             backend.sm_scale, max_prefix_len=meta.max_prefix_len,
                             num_splits=splits, tiles=tiles, **(doc if contiguous else {}),
                             **options)
            return o

    for variant, config, splits in [("gather", None, None)] + [("contiguous", *c) for c in configs]:
        tiles, options = None, {}
        if config is not None:
            tiles, options = config[:4], (config[4] if len(config) > 4 else {})
        row = {"mode": f"contig_{kernel}", "variant": variant, "tiles": tiles, "splits": splits,
               "options": options}
        fn = lambda: run(splits, tiles and Tiles(*tiles), variant == "contiguous",  # noqa: E731
                         **options)
        try:
            ms = bench_replay(fn)
            out = fn().float()
            gathered += [out] if variant == "gather" else []  # the others must agree with it
            row |= {"ms": round(ms, 4), "doc_TFLOPs": round(flops / ms / 1e9, 1)}
            if gathered:
                row["max_abs_diff_vs_gather"] = round(float((out - gathered[0]).abs().max()), 5)
        except Exception as e:  # a variant that does not compile or fit is a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append(row)
    if kernel != "prefill":  # the prefill's stream mask has no SDPA counterpart here
        shared = kernel != "decode"  # the stock decode's SDPA counterpart reads per question
        try:
            row = {"ms": round(grid.sdpa(shared=shared, timer=bench_replay), 4)}
        except (RuntimeError, torch.OutOfMemoryError) as e:
            row = {"error": str(e)[:160]}
        rows.append({"mode": f"contig_{kernel}",
                     "variant": "sdpa_shared" if shared else "sdpa_per_question"} | row)
    for row in rows:
        row.update(model=model, doc_tokens=doc_len, questions=questions)
    return rows


def print_contig(rows: list[dict]) -> None:
    gather = {(r["model"], r["mode"]): r.get("ms") for r in rows if r["variant"] == "gather"}
    print(f"{'model':13} {'kernel':14} {'variant':11} {'tiles':>17} {'options':>20} "
          f"{'splits':>6} {'ms':>8} {'x gather':>8} {'TFLOP/s':>8} diff")
    for r in rows:
        base, ms = gather.get((r["model"], r["mode"])), r.get("ms")
        splits = "" if r["variant"].startswith("sdpa") else r.get("splits") or "plan"
        options = ",".join(f"{k}={v}" for k, v in (r.get("options") or {}).items())
        print(f"{r['model']:13} {r['mode']:14} {r['variant']:11} {str(r.get('tiles') or ''):>17} "
              f"{options:>20} {splits:>6} {ms or r.get('error'):>8} {base / ms if ms and base else '':>8.4} "
              f"{r.get('doc_TFLOPs', ''):>8} {r.get('max_abs_diff_vs_gather', '')}")


# --sweep-cascade: cascade's whole decode step of attention (TritonBackend.forward: K/V store,
# the document part beside or before the suffix, the merge) over variants of the document
# part's tile, its TMA switch, its split count and the side stream's priority; and each part
# alone. (label, tiles or None = _arch's, tma (None = _arch.use_tma), overlap, document splits
# (None = planned), side stream priority)
CASCADE_VARIANTS = [
    ("now", None, None, True, None, -1),
    ("serial", None, None, False, None, -1),
    ("128x64x8x3 ptr", (128, 64, 8, 3), False, True, None, -1),
    ("64x64x4x3 ptr", (64, 64, 4, 3), False, True, None, -1),
    ("64x64x4x3 tma", (64, 64, 4, 3), True, True, None, -1),
    ("64x64x4x3 serial", (64, 64, 4, 3), None, False, None, -1),
    ("128x128x8x2 serial", (128, 128, 8, 2), None, False, None, -1),
]
ALONE = ("now", "64x64x4x3 tma", "128x128x8x2 serial")


def cascade_step_sweep(grid, model: str, bench_replay, smoke: bool = False) -> list[dict]:
    """The cascade decode step's attention (one layer) over CASCADE_VARIANTS, each checked
    against the first; then the document part alone and the suffix part alone at the planned
    splits (no merge). `grid`: layer_kernels.py's Grid, whose Q_TOKENS / ANSWERED set the suffix."""
    import contextlib

    from ppqa.kernels import _arch
    from ppqa.kernels.decode_attention import launch_decode

    rows, reference = [], None
    variants = CASCADE_VARIANTS[:2] if smoke else CASCADE_VARIANTS

    @contextlib.contextmanager
    def patched(tiles, tma):
        saved = _arch.contig_prefix_tiles, _arch.use_tma
        if tiles is not None:
            _arch.contig_prefix_tiles = lambda *a, **k: Tiles(*tiles)
        if tma is not None:
            _arch.use_tma = lambda device: tma
        try:
            yield
        finally:
            _arch.contig_prefix_tiles, _arch.use_tma = saved

    for label, tiles, tma, overlap, doc_splits, priority in variants:
        row = {"mode": "cascade_step", "variant": label, "tiles": tiles, "tma": tma,
               "overlap": overlap, "doc_splits": doc_splits, "priority": priority}
        with patched(tiles, tma):
            backend, meta = grid.stock(cascade=True)
            backend.overlap = overlap
            if backend._side is not None and priority != -1:
                backend._side = torch.cuda.Stream(grid.q.device, priority=priority)
            plan = backend.plan(meta)
            if doc_splits is not None:
                plan.prefix_splits = doc_splits
            backend.plan = lambda meta, plan=plan: plan
            row["plan"] = [plan.splits, plan.prefix_splits]
            step = lambda: backend.forward(0, grid.q, grid.k_new, grid.v_new, meta)  # noqa: E731
            try:
                row["ms"] = round(bench_replay(step), 4)
                out = step().float()
                reference = out if reference is None else reference
                row["max_abs_diff"] = round(float((out - reference).abs().max()), 5)
            except Exception as e:  # a variant that does not compile or fit is a result too
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
            if label in ALONE:  # its parts alone, as planned
                casc = meta.cascade
                states = plan.splits + plan.prefix_splits
                part = backend.scratch.views(grid.questions, grid.num_heads, states,
                                             grid.head_dim)
                row["doc_alone_ms"] = round(bench_replay(lambda: launch_shared_prefix(
                    grid.q, grid.k, grid.v, meta.req_to_token, casc.group_req_indptr,
                    casc.doc_req_indices, casc.doc_lens, casc.max_group_size, backend.sm_scale,
                    plan.prefix_splits, *part, state_offset=plan.splits,
                    doc_starts=backend._doc_starts(casc))), 4)
                row["suffix_alone_ms"] = round(bench_replay(lambda: launch_decode(
                    grid.q, grid.k, grid.v, meta.req_to_token, meta.req_indices, meta.kv_start,
                    meta.prefix_lens, backend.sm_scale, plan.splits, part_o=part[0],
                    part_lse=part[1], seq_len_offset=1)), 4)
        rows.append(row)
    for row in rows:
        row.update(model=model, doc_tokens=grid.doc_len, questions=grid.questions)
    return rows


def print_cascade(rows: list[dict]) -> None:
    print(f"{'model':13} {'variant':26} {'plan':>9} {'ms':>8} {'doc alone':>9} "
          f"{'suffix alone':>12} diff")
    for r in rows:
        print(f"{r['model']:13} {r['variant']:26} {str(r.get('plan')):>9} "
              f"{r.get('ms', r.get('error'))!s:>8} {r.get('doc_alone_ms', ''):>9} "
              f"{r.get('suffix_alone_ms', ''):>12} {r.get('max_abs_diff', '')}")
