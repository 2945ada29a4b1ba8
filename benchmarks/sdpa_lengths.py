"""What a new sequence length costs a document's first prefill chunk (GPU).

A document's first chunk runs through torch's fused causal attention (cuDNN, else
FlashAttention; `TritonBackend._fused_causal`). cuDNN builds an execution plan per shape, and
documents seldom share a length, so a workload of many documents may pay a plan per document.
This measures:
  1. torch SDPA alone (causal, bf16, one layer's heads of each model), per backend: the first
     call at each of several distinct lengths against a second call at the same length (wall
     time, synchronised); then the steady time at each length rounded up to a bucket
     (`--buckets`), against the unpadded length (CUDA events, several calls);
  2. through the engine (`dummy:<preset>+bpe`, after its warm-up): documents of distinct
     lengths answered one after another (one question, one token, stock), then documents of
     the same lengths with other words: the first set meets new lengths, the second does not;
     with the Triton variants each answer built, and the fused backend that took the chunks.

    python3 benchmarks/sdpa_lengths.py --out /tmp/sdpa_lengths.json

Writes every number to --out and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS = {"codellama-7b": (32, 32), "qwen2.5-7b": (28, 4)}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def sdpa(backend, q, k, v) -> torch.Tensor:
    with sdpa_kernel(BACKENDS[backend]):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def inputs(heads: int, kv_heads: int, length: int):
    q = torch.randn(1, heads, length, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, length, 128, device="cuda", dtype=torch.bfloat16)
    return q, k, torch.randn_like(k)


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


def steady_ms(fn, reps: int = 5) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def raw_sdpa(lengths: list[int], buckets: list[int]) -> list[dict]:
    rows = []
    for model, (h, hk) in HEADS.items():
        for backend in BACKENDS:
            for n in lengths:
                q, k, v = inputs(h, hk, n)
                try:
                    first = wall_ms(lambda: sdpa(backend, q, k, v))
                except RuntimeError as err:
                    rows.append({"part": "first", "model": model, "backend": backend,
                                 "length": n, "error": str(err)[:200]})
                    continue
                again = wall_ms(lambda: sdpa(backend, q, k, v))
                rows.append({"part": "first", "model": model, "backend": backend, "length": n,
                             "first_ms": first, "again_ms": again})
            for n in lengths:
                for b in buckets:
                    padded = -(-n // b) * b
                    q, k, v = inputs(h, hk, padded)
                    ms = steady_ms(lambda: sdpa(backend, q, k, v))
                    flops = 4.0 * h * 128 * n * n / 2  # the real rows' causal work
                    rows.append({"part": "padded", "model": model, "backend": backend,
                                 "length": n, "bucket": b, "padded": padded, "ms": ms,
                                 "tflops_real_rows": flops / ms / 1e9})
    return rows


def text_of(tokenizer, words: list[str], target: int, rng: random.Random) -> str:
    """Words drawn from `words` until the text is `target` tokens (within a word)."""
    out: list[str] = []
    while len(tokenizer.encode("".join(out))) < target:
        out.extend(rng.choice(words) for _ in range(max((target - len(tokenizer.encode(
            "".join(out)))) // 2, 1)))
    while len(tokenizer.encode("".join(out))) > target and out:
        out.pop()
    return "".join(out)


def count_compiles() -> list[float]:
    """Seconds of each Triton kernel variant built (or loaded from disk) from now on."""
    from triton.runtime.jit import JITFunction

    seconds: list[float] = []
    original = JITFunction._do_compile

    def timed(self, *args, **kwargs):
        began = time.perf_counter()
        out = original(self, *args, **kwargs)
        seconds.append(time.perf_counter() - began)
        return out

    JITFunction._do_compile = timed
    return seconds


def engine_part(model: str, lengths: list[int], seed: int) -> list[dict]:
    from ppqa import Engine, SamplingParams

    eng = Engine(model, device="cuda", dtype="bfloat16")
    warm = eng.warmup()
    compiles = count_compiles()
    rng = random.Random(seed)
    words = [f" {w}" for w in ("harbor ferry morning river council bridge market winter "
                               "garden letter station village captain orchard lantern "
                               "meadow quarry signal tower valley").split()]
    sampling = SamplingParams(max_new_tokens=1, ignore_eos=True)
    rows = []
    for attempt in ("new lengths", "same lengths"):
        times, got, compiled = [], [], []
        for n in lengths:
            doc = text_of(eng.tokenizer, words, n, rng)
            got.append(len(eng.tokenizer.encode(doc)))
            before = len(compiles), sum(compiles)
            times.append(wall_ms(lambda: eng.answer(doc, ["What is it about?"],
                                                    mode="stock", sampling=sampling)))
            compiled.append([len(compiles) - before[0], round(sum(compiles) - before[1], 3)])
        rows.append({"part": "engine", "model": model, "set": attempt,
                     "lengths": got, "ms": times, "mean_ms": statistics.mean(times),
                     "compiles": compiled})
    backends = [eng.parts.backend.causal_path]
    return [{"part": "engine-warmup", "model": model, "seconds": warm,
             "causal_backends": backends}] + rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1999,2011,2053,3001,5687,5701,5749,7919,8123")
    ap.add_argument("--buckets", default="1,256,512,1024")
    ap.add_argument("--no-raw", action="store_true", help="skip part 1 (SDPA alone)")
    ap.add_argument("--engine-model", default="dummy:qwen2.5-7b+bpe")
    ap.add_argument("--engine-lengths", default="5601,5655,5713,5780,5839,5902")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="/tmp/sdpa_lengths.json")
    args = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    rows = [] if args.no_raw else raw_sdpa(ints(args.lengths), ints(args.buckets))
    if args.engine_model:
        rows += engine_part(args.engine_model, ints(args.engine_lengths), args.seed)
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                   "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    for r in rows:
        if r["part"] == "first" and "first_ms" in r:
            print(f"{r['model']:13s} {r['backend']:5s} L={r['length']:5d} first {r['first_ms']:8.1f} ms"
                  f"  again {r['again_ms']:7.2f} ms")
        elif r["part"] == "padded":
            print(f"{r['model']:13s} {r['backend']:5s} L={r['length']:5d} bucket {r['bucket']:4d} "
                  f"-> {r['padded']:5d}: {r['ms']:6.2f} ms ({r['tflops_real_rows']:.0f} TFLOP/s real)")
        elif r["part"] == "engine":
            print(f"engine {r['set']:12s} mean {r['mean_ms']:7.1f} ms "
                  f"{[round(x) for x in r['ms']]} compiles {r['compiles']}")
        elif r["part"] == "first":
            print(f"{r['model']:13s} {r['backend']:5s} L={r['length']:5d} error {r['error'][:80]}")
        else:
            print(r)


if __name__ == "__main__":
    main()
