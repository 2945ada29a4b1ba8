"""What the merge kernel's states-per-loop-step (`BLOCK_S`) costs at the shapes decode meets (GPU).

`merge_partials` reads a (token, head) row's partial states `block_states` at a time. A fixed
value compiles one variant for every state count; the state count's next power of two (one loop
step, one variant per count class) was the earlier choice. This times one merge launch per
(rows, states) shape for several fixed values and for the next power of two (CUDA events over
launches replayed from a CUDA graph), so that the decode step's cost of the fixed value can be
read off: cascade's full 16k/256 step merges 256 x 32 rows of 2-4 states in each of 32 layers.

    python3 benchmarks/merge_states.py --out /tmp/merge_states.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from ppqa.kernels.merge import MERGE_STATES, merge_partials

SHAPES = [  # (what, tokens, heads)
    ("codellama 256 requests", 256, 32),
    ("qwen 108 requests", 108, 28),
    ("qwen 18 requests", 18, 28),
    ("qwen 1 request", 1, 28),
]
STATES = [2, 3, 4, 8, 17, 64, 128]
BLOCKS = [2, 4, 8, 16, 32]


def time_launch(part_o, part_lse, out, lse, block: int, reps: int) -> float:
    """GPU microseconds per launch: `reps` launches captured in a CUDA graph, replayed (as
    decode replays them), so that host launch overhead does not hide the kernel's time."""
    for _ in range(3):
        merge_partials(part_o, part_lse, out, lse, block_states=block)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            merge_partials(part_o, part_lse, out, lse, block_states=block)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default="merge_states.json")
    args = ap.parse_args()
    rows = []
    print(f"merge launch, us (fixed block_states {MERGE_STATES} is the default)")
    print(f"{'shape':24s} {'states':>6s} " + " ".join(f"{'b' + str(b):>7s}" for b in BLOCKS)
          + f" {'pow2':>7s}")
    for what, tokens, heads in SHAPES:
        for states in STATES:
            part_o = torch.randn(tokens, heads, states, 128, device="cuda")
            part_lse = torch.randn(tokens, heads, states, device="cuda")
            out = torch.empty(tokens, heads, 128, device="cuda", dtype=torch.bfloat16)
            times = {b: time_launch(part_o, part_lse, out, None, b, args.reps) for b in BLOCKS}
            pow2 = max(2, triton.next_power_of_2(states))
            times["pow2"] = time_launch(part_o, part_lse, out, None, pow2, args.reps)
            rows.append({"shape": what, "tokens": tokens, "heads": heads, "states": states,
                         "us": {str(k): v for k, v in times.items()}})
            print(f"{what:24s} {states:6d} " + " ".join(f"{times[b]:7.2f}" for b in BLOCKS)
                  + f" {times['pow2']:7.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"kind": "merge_states", "default": MERGE_STATES, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
