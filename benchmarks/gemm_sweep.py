"""The decode step's GEMMs on their own: cuBLAS (torch's F.linear, both BLAS backends) against a
plain Triton TMA matmul over a few tiles, at the step's token counts.

Run 5's eager profile (NOTES.md) put a cascade step's GEMMs at ~7.6 ms of a 14.2 ms replay at
16k/256 (256 tokens: ~445 TFLOP/s, against 788 measured on 8192^3 products); this script asked
how much of that a better kernel choice could win. Run 7's answer: none (cuBLAS 5.15 ms a step,
610-690 TFLOP/s on the wide kinds; no Triton tile within 15%), and in the replay the GEMMs take
5.0 ms, not 7.6. Each GEMM kind is timed as the step runs it: 32 launches on 32 layers' distinct weights
(so L2 does not keep a weight between launches), captured in one CUDA graph and replayed.

    python3 benchmarks/gemm_sweep.py --model dummy:codellama-7b --tokens 256,128 --out gemm.json

Under TRITON_INTERPRET=1 on a CPU (`--smoke`) it only checks the Triton kernel on small shapes.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from ppqa.engine.presets import preset_config


@triton.jit
def _mm_kernel(X_desc, W_desc, Y, M, N, K, stride_ys, stride_ym,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr,
               SWAP: tl.constexpr):
    """Y[split] (+)= X[M, K] @ W[N, K]^T over this program's K range; split-K partials in float32.
    SWAP: the product is computed as W @ X^T (the weight as the wide operand)."""
    m_tiles = tl.cdiv(M, BM)
    pid = tl.program_id(0)
    n_t = pid // m_tiles
    m_t = pid % m_tiles  # the m tiles of one weight tile run side by side: L2 serves the repeat
    split = tl.program_id(1)
    k_steps = tl.cdiv(K, BK)
    per = tl.cdiv(k_steps, SPLIT)
    k0 = split * per * BK
    k1 = tl.minimum(k0 + per * BK, K)
    if SWAP:
        acc = tl.zeros([BN, BM], tl.float32)
    else:
        acc = tl.zeros([BM, BN], tl.float32)
    for k in range(k0, k1, BK):
        x = X_desc.load([m_t * BM, k])
        w = W_desc.load([n_t * BN, k])
        if SWAP:
            acc = tl.dot(w, x.T, acc)
        else:
            acc = tl.dot(x, w.T, acc)
    if SWAP:
        acc = acc.T
    rows = m_t * BM + tl.arange(0, BM)
    cols = n_t * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    ptr = Y + split * stride_ys + rows[:, None] * stride_ym + cols[None, :]
    tl.store(ptr, acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _sum_kernel(P, Y, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(SPLIT):
        acc += tl.load(P + s * numel + offs, mask=ok, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


class TritonLinear:
    """y = x @ w.T with fixed tiles; descriptors and buffers made once (graph capture)."""

    def __init__(self, x: torch.Tensor, ws: list[torch.Tensor], cfg: tuple) -> None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        self.bm, self.bn, self.bk, self.warps, self.stages, self.split, self.swap = cfg
        self.x, self.m, self.k = x, x.shape[0], x.shape[1]
        self.n = ws[0].shape[0]
        self.x_desc = TensorDescriptor.from_tensor(x, [self.bm, self.bk])
        self.w_descs = [TensorDescriptor.from_tensor(w, [self.bn, self.bk]) for w in ws]
        self.y = torch.empty(self.m, self.n, dtype=x.dtype, device=x.device)
        self.part = (torch.empty(self.split, self.m, self.n, dtype=torch.float32, device=x.device)
                     if self.split > 1 else None)
        self.grid = (triton.cdiv(self.m, self.bm) * triton.cdiv(self.n, self.bn), self.split)

    def __call__(self, layer: int) -> torch.Tensor:
        out = self.part if self.part is not None else self.y
        stride_s = out.stride(0) if self.part is not None else 0
        stride_m = out.stride(-2)
        _mm_kernel[self.grid](self.x_desc, self.w_descs[layer], out, self.m, self.n, self.k,
                              stride_s, stride_m, BM=self.bm, BN=self.bn, BK=self.bk,
                              SPLIT=self.split, SWAP=self.swap, num_warps=self.warps,
                              num_stages=self.stages)
        if self.part is not None:
            numel = self.m * self.n
            _sum_kernel[(triton.cdiv(numel, 1024),)](self.part, self.y, numel, SPLIT=self.split,
                                                     BLOCK=1024)
        return self.y


CONFIGS = [  # (BM, BN, BK, warps, stages, split-K, swap)
    (128, 128, 64, 4, 4, 1, False), (128, 256, 64, 8, 3, 1, False),
    (256, 128, 64, 8, 3, 1, False), (128, 64, 64, 4, 5, 1, False),
    (64, 128, 64, 4, 5, 1, False), (256, 64, 64, 8, 4, 1, False),
    (128, 128, 64, 8, 4, 1, False), (64, 256, 64, 8, 4, 1, False),
    # the weight as the wide operand: tiles of 64-128 output features x all tokens
    (256, 64, 64, 4, 4, 1, True), (256, 128, 64, 8, 4, 1, True), (128, 128, 64, 4, 4, 1, True),
    (128, 64, 64, 4, 5, 1, True),
    # split-K for the narrow GEMMs
    (128, 128, 64, 4, 4, 2, False), (256, 128, 64, 8, 3, 2, False), (128, 128, 64, 4, 4, 4, False),
    (256, 64, 64, 4, 4, 2, True),
]


def gemm_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(N, K) of each GEMM kind of a decoder layer, nn.Linear's weight being [N, K]."""
    h, hd = cfg.hidden_size, cfg.head_dim
    return {"qkv": ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, h),
            "o": (h, cfg.num_heads * hd),
            "gate_up": (2 * cfg.intermediate_size, h),
            "down": (h, cfg.intermediate_size)}


def graph_ms(fn, layers: int, repeats: int = 10) -> float:
    """ms of `layers` back-to-back calls fn(0..layers-1), captured once and replayed."""
    for i in range(layers):
        fn(i)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        for i in range(layers):
            fn(i)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def smoke() -> None:
    torch.manual_seed(0)
    for m, n, k in ((5, 48, 64), (40, 96, 200)):
        x = torch.randn(m, k, dtype=torch.float32)
        w = torch.randn(n, k, dtype=torch.float32)
        for cfg in ((16, 16, 16, 4, 1, 1, False), (32, 16, 32, 4, 1, 2, True)):
            y = TritonLinear(x, [w], cfg)(0)
            torch.testing.assert_close(y, x @ w.T, atol=1e-3, rtol=1e-3)
    print("smoke ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:codellama-7b")
    parser.add_argument("--tokens", default="256")
    parser.add_argument("--out", default="gemm_sweep.json")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        smoke()
        return
    cfg = preset_config(args.model.removeprefix("dummy:"))[0]
    dev, dt = torch.device("cuda"), torch.bfloat16
    layers = cfg.num_layers
    rows, results = [], {"model": args.model, "gpu": torch.cuda.get_device_name(),
                         "torch": torch.__version__, "triton": triton.__version__, "cells": []}
    torch.manual_seed(0)
    for kind, (n, k) in gemm_shapes(cfg).items():
        ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(layers)]
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, k, dtype=dt, device=dev)
            ref = x.float() @ ws[0].float().T
            flops = 2 * m * n * k * layers
            cell = {"kind": kind, "m": m, "n": n, "k": k, "ms": {}}
            for lib in ("default", "cublaslt", "cublas"):
                prev = torch.backends.cuda.preferred_blas_library()
                try:
                    if lib != "default":
                        torch.backends.cuda.preferred_blas_library(lib)
                    cell["ms"][f"torch {lib}"] = graph_ms(
                        lambda i: torch.nn.functional.linear(x, ws[i]), layers)
                except Exception as e:  # noqa: BLE001 - a backend may be missing
                    cell["ms"][f"torch {lib}"] = None
                    print(f"  {lib}: {type(e).__name__}: {e}")
                finally:
                    torch.backends.cuda.preferred_blas_library(prev)
            for c in CONFIGS:
                name = "triton " + "x".join(map(str, c[:6])) + (" swap" if c[6] else "")
                try:
                    lin = TritonLinear(x, ws, c)
                    err = (lin(0).float() - ref).abs().max().item()
                    if err > 0.05 * ref.abs().max().item():
                        raise ValueError(f"max err {err}")
                    cell["ms"][name] = graph_ms(lin, layers)
                except Exception as e:  # noqa: BLE001 - a tile may not fit or compile
                    cell["ms"][name] = None
                    print(f"  {name}: {type(e).__name__}: {str(e)[:100]}")
            best = min((v, key) for key, v in cell["ms"].items() if v is not None)
            cell["best"] = best[1]
            cell["tflops"] = {key: flops / (v * 1e9) for key, v in cell["ms"].items() if v}
            results["cells"].append(cell)
            rows.append((kind, m, cell["ms"]["torch default"], best[0], best[1],
                         flops / (cell["ms"]["torch default"] * 1e9), flops / (best[0] * 1e9)))
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=1)
        del ws
        torch.cuda.empty_cache()
    print("\nkind      M   torch ms  TF/s   best ms  TF/s  best")
    for kind, m, t, b, name, tf, bf in rows:
        print(f"{kind:8s} {m:4d} {t:8.3f} {tf:5.0f} {b:8.3f} {bf:5.0f}  {name}")
    for m in sorted({r[1] for r in rows}):
        tot = sum(r[2] for r in rows if r[1] == m)
        best = sum(r[3] for r in rows if r[1] == m)
        print(f"M={m}: torch {tot:.3f} ms a step, best per kind {best:.3f} ms")


if __name__ == "__main__":
    main()
