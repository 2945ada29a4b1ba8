"""The cascade step's suffix attention: each request's own tokens after the shared document.

In a cascade decode step, every request reads its own question and answer tokens (tens to a
few hundred, its own slots, gathered through req_to_token) beside the document kernel; that
read is the decode kernel (`launch_decode` from kv_start) with the tiles chosen for stock's
long rows (`_arch.decode_tiles`: one warp, 32 keys, 3 stages, tuned where the rows share a
document in L2). Here it is timed at the suffix's shapes with other tiles: B requests x
suffixes of S tokens (CodeLlama-7B's 32 KV heads of 128, MHA, and Qwen2.5-7B's 4 of 128 with
7 query heads each), each variant's output checked against the default's, bytes read against
the copy bandwidth.

    python3 benchmarks/suffix_tiles.py --out suffix_tiles.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from ppqa.kernels import _arch
from ppqa.kernels.decode_attention import launch_decode

VARIANTS = [(32, 1, 3), (32, 1, 2), (32, 1, 1), (32, 2, 2), (64, 1, 2), (64, 2, 2), (64, 4, 2),
            (128, 4, 2), (128, 4, 1), (128, 8, 2), (16, 1, 2)]


def case(batch: int, suffix: int, kv_heads: int, group: int, doc: int, device) -> dict:
    heads, dim = kv_heads * group, 128
    slots = 1 + doc + batch * (suffix + 8)
    k_pool = torch.randn(slots, kv_heads, dim, dtype=torch.bfloat16, device=device)
    v_pool = torch.randn_like(k_pool)
    table = torch.zeros(batch, doc + suffix + 8, dtype=torch.int32, device=device)
    table[:, :doc] = torch.arange(1, doc + 1, dtype=torch.int32, device=device)
    own = 1 + doc + torch.arange(batch * (suffix + 8), device=device).view(batch, -1)
    table[:, doc:] = own.to(torch.int32)
    rows = torch.arange(batch, dtype=torch.int32, device=device)
    lens = torch.randint(suffix // 2, suffix + 1, (batch,), device=device, dtype=torch.int32)
    kv_start = torch.full((batch,), doc, dtype=torch.int32, device=device)
    seq = (kv_start + lens - 1).to(torch.int32)  # launched with seq_len_offset 1, as the backend
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=device)
    scale = dim ** -0.5
    default = _arch.decode_tiles(device, torch.bfloat16, group)
    out = {"batch": batch, "suffix": suffix, "kv_heads": kv_heads, "group": group,
           "default": [default.block_m, default.block_n, default.num_warps, default.num_stages],
           "bytes": int(lens.sum()) * kv_heads * dim * 2 * 2, "variants": []}
    ref = None
    for block_n, warps, stages in VARIANTS:
        tiles = _arch.Tiles(default.block_m, block_n, warps, stages)
        o = torch.empty_like(q)
        lse = torch.empty(batch, heads, dtype=torch.float32, device=device)

        def run():
            launch_decode(q, k_pool, v_pool, table, rows, kv_start, seq, scale, 1, o=o,
                          lse=lse, seq_len_offset=1, tiles=tiles)
        try:
            run()
            torch.cuda.synchronize()
        except Exception as error:  # a tile the kernel cannot take (shared memory)
            out["variants"].append({"tiles": [block_n, warps, stages], "error": str(error)[:200]})
            continue
        if ref is None:
            ref = o.float().clone()
        ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
        out["variants"].append({"tiles": [block_n, warps, stages], "ms": ms,
                                "tb_per_s": out["bytes"] / ms / 1e9,
                                "max_diff": float((o.float() - ref).abs().max())})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="256,32")
    ap.add_argument("--suffixes", default="64,128,256")
    ap.add_argument("--out", default="suffix_tiles.json")
    args = ap.parse_args()
    device = torch.device("cuda")
    results = []
    for kv_heads, group in ((32, 1), (4, 7)):
        for batch in map(int, args.batches.split(",")):
            for suffix in map(int, args.suffixes.split(",")):
                c = case(batch, suffix, kv_heads, group, 2048, device)
                results.append(c)
                best = min((v for v in c["variants"] if "ms" in v), key=lambda v: v["ms"])
                first = c["variants"][0]
                print(f"kv {kv_heads:2d}x{group} B {batch:3d} S {suffix:3d}: default "
                      f"{first['ms'] * 1e3:7.1f} us ({first['tb_per_s']:.2f} TB/s); best "
                      f"{best['tiles']} {best['ms'] * 1e3:7.1f} us ({best['tb_per_s']:.2f} TB/s)"
                      f" diff {best['max_diff']:.1e}", flush=True)
                for v in c["variants"]:
                    if "ms" in v:
                        print(f"      {str(v['tiles']):14s} {v['ms'] * 1e3:7.1f} us "
                              f"{v['tb_per_s']:5.2f} TB/s")
    with open(args.out, "w") as f:
        json.dump({"cases": results}, f, indent=1)


if __name__ == "__main__":
    main()
