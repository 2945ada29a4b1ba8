"""Whether a decode step's GEMMs and its attention reads overlap on one GPU: two halves of a
batch on two streams, one half's layer GEMMs beside the other half's layer attention.

A decode step runs each layer's GEMMs (compute-bound at a few hundred rows) and then its
attention (memory-bound: the documents' and every request's own K/V), one after the other, so
a step costs about their sum, where the e2e floor (`ppqa/bench/floor.py`) takes the larger of
the decode's FLOPs and bytes (benchmarks/NOTES.md, end of session 44). This measures, for one
half-batch's shapes and `--layers` layers:
    gemm       the layers' q/k/v, o, gate/up and down GEMMs of `rows` rows, random weights;
    attention  the layers' cascade attention of the other half (`cascade_groups.Step`: the
               backend's forward, K/V write included, documents as one slot run each);
    serial     both, one after the other on one stream (how a step runs them now);
    overlap    the GEMMs on one stream and the attention on another, joined at the end;
    overlap_carveout_N  the same with cuBLAS told to leave N SMs free
               (`torch._C._set_sm_carveout_experimental`, where this torch has it);
    whole        a step of both halves as the engine runs it now: each layer's GEMMs over all
               rows at once (the weights read once), and one attention over both halves' groups;
    pair_serial  two halves' layers (q/k/v, attention, o, gate/up, down, in that order each),
               one half after the other on one stream (a whole step's work as now);
    pair_streams the two halves on two streams, each in its own order, nothing between them;
    pair_alternate  the same with their attentions taking turns (half B's attention of a layer
               after half A's, A's next after B's), so that one half's attention runs while
               the other computes its GEMMs: the schedule an engine of two interleaved
               half-steps would capture (and pair_alternate_carveout_N).
Each is captured as one CUDA graph and its replays timed (median ms, `cascade_groups.timed`).
What an engine of two interleaved half-steps would gain is whole - pair_alternate: on an H100
it is negative, the GEMMs beside the attention at 0.96-0.98x of serial and the pair at 1.09x the
whole step (results/h100/overlap_probe_s45c1.json).

    python3 benchmarks/overlap_probe.py --model codellama-7b --doc-tokens 16384 \
        --cases 256;128x2 --own 95 --out overlap_probe.json

`--smoke` runs tiny shapes on the CPU under TRITON_INTERPRET=1 (one stream, eager, each once):
the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from cascade_groups import Step, parse_case, timed  # noqa: E402

from ppqa.engine.loading.presets import preset_config  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def layer_weights(cfg, dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """One layer's projection matrices, [out, in] as nn.Linear holds them (q/k/v fused, gate/up
    fused), small random values."""
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    shapes = [(q + 2 * kv, h), (h, q), (2 * cfg.intermediate_size, h),
              (h, cfg.intermediate_size)]
    return [(torch.randn(s, generator=gen) * 0.02).to(dtype).to(DEV) for s in shapes]


def before_attention(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    """One layer's GEMM before its attention: `x` [rows, hidden] through q/k/v."""
    torch.nn.functional.linear(x, weights[0])


def after_attention(x: torch.Tensor, mid: torch.Tensor, weights: list[torch.Tensor]) -> None:
    """One layer's GEMMs after its attention: `x` through o and gate/up, `mid` [rows,
    intermediate] through down; outputs discarded (the shapes of a forward)."""
    _, wo, wgu, wdown = weights
    torch.nn.functional.linear(x, wo)
    torch.nn.functional.linear(x, wgu)
    torch.nn.functional.linear(mid, wdown)


def run_case(cfg, doc_len: int, sizes: list[int], own: int, layers: int, dtype,
             carveouts: list[int]) -> dict:
    gen = torch.Generator().manual_seed(0)
    step = Step(cfg, doc_len, sizes, own, dtype, False, gen)
    meta = step.meta(True, "tiles")
    rows = step.batch
    x = (torch.randn(rows, cfg.hidden_size, generator=gen) * 0.1).to(dtype).to(DEV)
    mid = (torch.randn(rows, cfg.intermediate_size, generator=gen) * 0.1).to(dtype).to(DEV)
    weights = layer_weights(cfg, dtype, gen)

    def attention() -> None:
        for _ in range(layers):
            step.forward(meta)

    def gemm() -> None:
        for _ in range(layers):
            before_attention(x, weights)
            after_attention(x, mid, weights)

    def serial() -> None:
        gemm()
        attention()

    side = torch.cuda.Stream() if DEV == "cuda" else None

    def overlap() -> None:
        if side is None:
            serial()
            return
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            attention()
        gemm()
        main.wait_stream(side)

    other = Step(cfg, doc_len, sizes, own, dtype, False, gen)
    other_meta = other.meta(True, "tiles")
    halves = [(step, meta, x, mid), (other, other_meta, x.clone(), mid.clone())]

    def half_layer(half, part: str, turn=None) -> None:
        """One layer of one half: its q/k/v GEMM and attention ("before"; the attention after
        event `turn` where given), or its o, gate/up and down GEMMs ("after")."""
        s, m, hx, hmid = half
        if part == "before":
            before_attention(hx, weights)
            if turn is not None:
                torch.cuda.current_stream().wait_event(turn)
            s.forward(m)
        else:
            after_attention(hx, hmid, weights)

    both = Step(cfg, doc_len, sizes + sizes, own, dtype, False, gen)  # one launch, all rows
    both_meta = both.meta(True, "tiles")
    both_x = torch.cat([x, x])
    both_mid = torch.cat([mid, mid])

    def whole() -> None:
        for _ in range(layers):
            before_attention(both_x, weights)
            both.forward(both_meta)
            after_attention(both_x, both_mid, weights)

    def pair_serial() -> None:
        for half in halves:
            for _ in range(layers):
                half_layer(half, "before")
                half_layer(half, "after")

    def pair(alternate: bool) -> None:
        if side is None:
            pair_serial()
            return
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        streams = [main, side]
        done = [None, None]  # each half's last attention, as an event on its stream
        for _ in range(layers):
            for i, half in enumerate(halves):
                with torch.cuda.stream(streams[i]):
                    half_layer(half, "before", done[1 - i] if alternate else None)
                    done[i] = torch.cuda.Event()
                    done[i].record(streams[i])
                    half_layer(half, "after")
        main.wait_stream(side)

    row = {"sizes": sizes, "rows": rows, "layers": layers,
           "gemm_ms": timed(gemm, True), "attention_ms": timed(attention, True),
           "serial_ms": timed(serial, True), "overlap_ms": timed(overlap, True),
           "whole_ms": timed(whole, True), "pair_serial_ms": timed(pair_serial, True),
           "pair_streams_ms": timed(lambda: pair(False), True),
           "pair_alternate_ms": timed(lambda: pair(True), True)}
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if setter is not None and DEV == "cuda":
        for n in carveouts:
            setter(n)
            try:
                row[f"overlap_carveout_{n}_ms"] = timed(overlap, True)
                row[f"gemm_carveout_{n}_ms"] = timed(gemm, True)
                row[f"pair_alternate_carveout_{n}_ms"] = timed(lambda: pair(True), True)
            finally:
                setter(None)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="codellama-7b", help="a dummy preset name (its shapes)")
    ap.add_argument("--doc-tokens", type=int, default=16384)
    ap.add_argument("--own", type=int, default=95,
                    help="tokens of each request's own after its document (question + answer)")
    ap.add_argument("--cases", default="256;128x2;64x4",
                    help="one half-batch's cascade group sizes per case, separated by ';'")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--carveouts", default="16,32",
                    help="SM counts cuBLAS leaves free in the overlap_carveout variants")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    ap.add_argument("--out", default="overlap_probe.json")
    args = ap.parse_args()
    cfg = preset_config("tiny-gqa" if args.smoke else args.model)[0]
    doc_len, own = (96, 9) if args.smoke else (args.doc_tokens, args.own)
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    cases = ["3"] if args.smoke else [c for c in args.cases.replace(" ", ";").split(";") if c]
    carveouts = [int(n) for n in args.carveouts.split(",") if n]
    rows = []
    print(f"{cfg.name}: document {doc_len} tokens, {own} own tokens a request, "
          f"{args.layers} layers, ms")
    for text in cases:
        row = run_case(cfg, doc_len, parse_case(text), own, args.layers, dtype, carveouts)
        row["case"] = text
        rows.append(row)
        extra = " ".join(f"{k[:-3]} {v:.3f}" for k, v in row.items()
                         if k.startswith(("overlap_carveout", "gemm_carveout", "whole", "pair_")))
        print(f"{text:>10} rows {row['rows']:4d}: gemm {row['gemm_ms']:.3f} attention "
              f"{row['attention_ms']:.3f} serial {row['serial_ms']:.3f} overlap "
              f"{row['overlap_ms']:.3f} {extra}", flush=True)
        with open(args.out, "w") as f:
            json.dump({"model": cfg.name, "doc_tokens": doc_len, "own": own, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
