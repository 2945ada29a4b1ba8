"""What each new shape of cuDNN attention costs a fresh process, and what a background thread
can pay for the main thread.

The engine's document prefill calls torch's cuDNN attention with its log-sum-exp
(`fused_chunks.cudnn_attention`): a first chunk as one causal square, a later chunk as a
causal part and an unmasked part over the earlier tokens. A profiled fresh `paper` process
showed two host stalls of ~775 ms and one of ~67 ms inside that call
(results/h100/gprof_paper_auto_first_s33c3.json), where a plan was thought to cost ~45 ms.
Each case runs the same sequence of calls (CodeLlama-7B's 32 heads of 128, bf16) in a fresh
process and times each on the host (synchronized):
  main:     the sequence on the main thread;
  prepaid:  the whole sequence on a background thread first, then on the main thread;
  tiny:     one 512-row causal and one 512 x 512 unmasked call on a background thread first,
            then the sequence on the main thread.

    python3 benchmarks/cudnn_plans.py --out cudnn_plans.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# (name, query rows, key rows, causal)
SEQUENCE = [
    ("causal 8192", 8192, 8192, True),
    ("causal 8192 again", 8192, 8192, True),
    ("unmasked 8192 x 8192", 8192, 8192, False),
    ("causal 16384", 16384, 16384, True),
    ("causal 4608", 4608, 4608, True),
    ("unmasked 8192 x 4096", 8192, 4096, False),
    ("unmasked 8192 x 4096 again", 8192, 4096, False),
]
TINY = [("tiny causal", 512, 512, True), ("tiny unmasked", 512, 512, False)]


def child(case: str) -> dict:
    import threading

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from ppqa.engine.attention.fused_chunks import cudnn_attention

    dev = torch.device("cuda")
    torch.zeros(1, device=dev)  # the CUDA context, as the engine has it by then
    torch.cuda.synchronize()
    gen = torch.Generator(device=dev).manual_seed(0)

    def call(rows: int, keys: int, causal: bool) -> float:
        q = torch.randn(1, 32, rows, 128, dtype=torch.bfloat16, device=dev, generator=gen)
        k = torch.randn(1, 32, keys, 128, dtype=torch.bfloat16, device=dev, generator=gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        cudnn_attention(q, k, k, causal=causal, scale=128 ** -0.5)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def run(calls) -> dict:
        return {name: round(call(rows, keys, causal), 4) for name, rows, keys, causal in calls}

    out = {"case": case}
    if case in ("prepaid", "tiny"):
        t0 = time.perf_counter()
        worker = threading.Thread(target=lambda: out.setdefault(
            "thread", run(SEQUENCE if case == "prepaid" else TINY)))
        worker.start()
        worker.join()
        out["thread_wall_s"] = round(time.perf_counter() - t0, 4)
    out["main"] = run(SEQUENCE)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="cudnn_plans.json")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    from cudnn_first_call import in_fresh_processes  # beside this script

    results = in_fresh_processes(__file__, ("main", "prepaid", "tiny"), args.repeats)
    with open(args.out, "w") as f:
        json.dump({"sequence": SEQUENCE, "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
