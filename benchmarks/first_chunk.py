"""A document's first prefill chunk, one layer's causal attention, by each path the engine has
(GPU, bf16): our Triton kernel (`kernels/causal_prefill.py`) under several tile shapes and with
and without tensor descriptors, against torch's FlashAttention (heads-first copies in and out,
as the engine called it before our kernel) and cuDNN as the engine calls it
(`fused_chunks.chunk_attention`: its rows padded to a multiple of 512), cuDNN's first call at
each length (its plan) apart. Inputs are views split from one packed qkv row per token, as a layer's projection
gives them. Times are CUDA events over repeated calls after one untimed call.

    python3 benchmarks/first_chunk.py --out /tmp/first_chunk.json
    python3 benchmarks/first_chunk.py --smoke      # tiny shapes, any device (CPU: interpreter)

Prints a table of ms and TFLOP/s (causal FLOPs: 2 x T^2 x H x D) and writes every number,
with ours' largest difference from FlashAttention, to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from dataclasses import astuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ppqa.engine.attention import fused_chunks
from ppqa.kernels import _arch
from ppqa.kernels.causal_prefill import causal_attention, causal_attention_ref, causal_tiles

MODELS = {"codellama-7b": (32, 32, 128), "qwen2.5-7b": (28, 4, 128)}
TILES = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3),
         (128, 32, 8, 3), (64, 64, 4, 3), (64, 128, 4, 2)]


def packed(tokens: int, heads, device, dtype):
    num_heads, kv_heads, dim = heads
    rows = torch.randn(tokens, (num_heads + 2 * kv_heads) * dim, device=device, dtype=dtype)
    q = rows[:, :num_heads * dim].view(tokens, num_heads, dim)
    k = rows[:, num_heads * dim:(num_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = rows[:, (num_heads + kv_heads) * dim:].view(tokens, kv_heads, dim)
    return q, k, v


def timed_ms(fn, device, reps: int) -> float:
    """Median over three groups of `reps` calls, after one untimed call."""
    fn()
    if device.type != "cuda":
        began = time.perf_counter()
        fn()
        return (time.perf_counter() - began) * 1e3
    groups = []
    for _ in range(3):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        groups.append(start.elapsed_time(end) / reps)
    return statistics.median(groups)


def first_call_ms(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - began) * 1e3


def run_case(model: str, heads, tokens: int, device, dtype, tiles_list, reps: int) -> dict:
    num_heads, _, dim = heads
    q, k, v = packed(tokens, heads, device, dtype)
    scale = dim ** -0.5
    flops = 2.0 * tokens * tokens * num_heads * dim
    case = {"model": model, "tokens": tokens, "heads": list(heads), "flops": flops, "paths": []}

    def add(name, ms, **extra):
        case["paths"].append({"path": name, "ms": ms,
                              "tflops": flops / (ms * 1e-3) / 1e12 if ms else None, **extra})

    truth = None
    if device.type == "cuda":
        o_flash, o_cudnn = torch.empty_like(q), torch.empty_like(q)

        def flash():
            qh, kh, vh = (x.unsqueeze(0).transpose(1, 2).contiguous() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qh, kh, vh, is_causal=True, scale=scale, enable_gqa=qh.shape[1] != kh.shape[1])
            o_flash.copy_(out[0].transpose(0, 1))

        def cudnn():
            fused_chunks.chunk_attention(q, k, v, k[:0], v[:0], o_cudnn, scale)

        add("flash", timed_ms(flash, device, reps))
        truth = o_flash.float()
        try:
            first = first_call_ms(cudnn, device)
            add("cudnn padded (engine's call)", timed_ms(cudnn, device, reps),
                first_call_ms=first)
        except RuntimeError as error:
            add("cudnn padded (engine's call)", None, error=str(error)[:200])
    else:
        truth = causal_attention_ref(q, k, v, scale).float()
    for shape in tiles_list:
        tiles = _arch.Tiles(*shape)
        for tma in ([True, False] if shape == TILES[0] and _arch.use_tma(device) else [None]):
            o = torch.empty_like(q)
            name = f"ours {'x'.join(map(str, shape))}" + ("" if tma is None else
                                                         (" tma" if tma else " pointers"))
            try:
                ms = timed_ms(lambda: causal_attention(q, k, v, o, scale, tiles=tiles, tma=tma),
                              device, reps)
            except Exception as error:  # noqa: BLE001 - a tile that does not compile or fit
                add(name, None, error=f"{type(error).__name__}: {str(error)[:200]}")
                continue
            diff = float((o.float() - truth).abs().max())
            add(name, ms, max_abs_diff=diff)
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="2048,5696,8192,16384")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape, one tile, on whatever device there is")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                  "first_chunk.json"))
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    lengths = [int(x) for x in args.lengths.split(",")]
    tiles_list, models = TILES, {m: MODELS[m] for m in args.models.split(",")}
    if args.smoke:
        lengths, tiles_list, args.reps = [40], [astuple(causal_tiles(device, dtype))], 1
        if device.type != "cuda":
            models = {"tiny": (4, 2, 32)}
    cases = []
    for model, heads in models.items():
        for tokens in lengths:
            case = run_case(model, heads, tokens, device, dtype, tiles_list, args.reps)
            cases.append(case)
            for p in case["paths"]:
                rate = f"{p['tflops']:.0f}" if p.get("tflops") else "-"
                ms = f"{p['ms']:.3f}" if p.get("ms") else p.get("error", "-")[:60]
                print(f"| {model} | {tokens} | {p['path']} | {ms} | {rate} |"
                      f" {p.get('max_abs_diff', '')} | {p.get('first_call_ms', '')} |", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    out = {"what": "a first prefill chunk's causal attention, one layer, by path",
           "command": "benchmarks/first_chunk.py " + " ".join(
               f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
           "commit": commit, "device": torch.cuda.get_device_name() if device.type == "cuda"
           else "cpu", "torch": torch.__version__, "cases": cases}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
