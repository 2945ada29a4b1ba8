"""FlashInfer against our kernels per layer: its paged decode as a second stock, or --doc-product.

Without --doc-product: FlashInfer's paged decode kernel as a second `stock` baseline beside ours.

Results: RESULTS.md, "FlashInfer's paged decode per layer" (FlashInfer 0.2.5, built from its
source release on the device by `benchmarks/flashinfer_device.sh`, agrees with ours to 5e-4).

The device machine reaches no network, so FlashInfer travels as its source release (the 0.7.x
wheel is 101 MB, over the 64 MiB a call may carry). Here:
    python3 -m pip download --no-deps --no-binary :all: flashinfer-python==0.2.5 -d .fi
    echo /.fi/ >> .git/info/exclude
On the GPU machine (carry .fi; its kernels compile with the machine's nvcc at first use, about
a minute a module): `bash benchmarks/flashinfer_device.sh [--cells 16384x256]`.

--doc-product (not yet run) times cascade's document part instead: our shared-prefix kernel
against FlashInfer's single prefill on its FA2 and FA3 (sm_90a) backends, the measurement the
decode step's floor gap needs (NOTES.md).

Cell: benchmarks/layer_kernels.py's Grid (Q requests whose rows are [document][16-token question]
[129 answer tokens]), our stock step through TritonBackend.forward (which first writes the new
token's K/V), then FlashInfer's BatchDecodeWithPagedKVCacheWrapper over the same slots with page
size 1 (our pool [slots, Hkv, D] viewed as NHD pages [slots, 1, Hkv, D]), with and without its
tensor-core path. Reports ms (CUDA graph replays are not used: FlashInfer's plan is eager) and
the largest difference from our output. Every failure is recorded, not raised.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))
from layer_kernels import DEV, MODELS, Grid, bench, bench_replay  # noqa: E402

from ppqa.kernels.merge import merge_partials  # noqa: E402


# Query heads per KV head that FlashInfer 0.2.5's CUDA-core decode compiles (DISPATCH_GQA_GROUP_SIZE).
CUDA_CORE_GROUPS = (1, 2, 3, 4, 8)


def flashinfer_decode(grid: Grid, meta, tensor_cores: bool):
    """A callable running FlashInfer's decode over the grid's stock rows (new token included)."""
    import flashinfer

    seq_len = meta.max_prefix_len + 1
    rows = meta.req_to_token[:, :seq_len]
    i32 = dict(device=DEV, dtype=torch.int32)
    indptr = torch.arange(0, rows.numel() + 1, seq_len, **i32)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
                                                            use_tensor_cores=tensor_cores)
    wrapper.plan(indptr, rows.reshape(-1).contiguous(), torch.ones(grid.questions, **i32),
                 grid.num_heads, grid.num_kv_heads, grid.head_dim, 1,
                 q_data_type=grid.q.dtype, kv_data_type=grid.k.dtype)
    cache = (grid.k.unsqueeze(1), grid.v.unsqueeze(1))
    return lambda: wrapper.run(grid.q, cache)


def cell(model: str, doc_len: int, questions: int) -> list[dict]:
    grid = Grid(MODELS[model], doc_len, questions, torch.Generator().manual_seed(0))
    backend, meta = grid.stock()
    ours_ms, ours = grid.run(backend, meta)  # also writes the new token's K/V into its slot
    rows = [{"model": model, "doc_tokens": doc_len, "questions": questions, "kernel": "ours",
             "ms": round(ours_ms, 4)}]
    for tensor_cores in (False, True):
        row = {"model": model, "doc_tokens": doc_len, "questions": questions,
               "kernel": f"flashinfer{' tensor-core' if tensor_cores else ''}"}
        group = grid.num_heads // grid.num_kv_heads
        if not tensor_cores and group not in CUDA_CORE_GROUPS:
            # plan() ends the process (no Python exception) on an undispatched group size
            row["error"] = f"not supported: its CUDA-core decode dispatches group sizes " \
                           f"{CUDA_CORE_GROUPS}, this model's is {group}"
            rows.append(row)
            continue
        try:
            run = flashinfer_decode(grid, meta, tensor_cores)
            out = run().float()
            row["max_abs_diff_vs_ours"] = round(float((out - ours).abs().max()), 5)
            row["ms"] = round(bench(run), 4)
        except Exception:  # noqa: BLE001: a failure to install, compile or run is the result
            row["error"] = traceback.format_exc(limit=3)[-600:]
        rows.append(row)
    return rows


def doc_product_cell(model: str, doc_len: int, questions: int) -> list[dict]:
    """Cascade's document part of a decode step (all Q queries against the document, o and lse)
    through our shared-prefix kernel (its planned splits and the merge) and through FlashInfer's
    single prefill (non-causal, lse returned) on its FlashAttention-2 and -3 (sm_90a, wgmma,
    warp-specialized) backends: what a FlashAttention-3-class kernel would take off the step
    (RESULTS.md, "The decode step": ours is 4.82 ms of the step, 1.7x its FLOP floor). CUDA
    graph replays where they capture, else eager."""
    grid = Grid(MODELS[model], doc_len, questions, torch.Generator().manual_seed(0))
    backend, meta = grid.stock(cascade=True)
    plan = backend.plan(meta)
    part = backend.scratch.views(questions, grid.num_heads, plan.prefix_splits, grid.head_dim)
    out = torch.empty_like(grid.q)

    def ours():
        backend.document_part(grid.q, grid.k, grid.v, meta, plan, *part)
        merge_partials(*part, out)
        return out

    flops = 4 * questions * doc_len * grid.num_heads * grid.head_dim
    base = {"model": model, "doc_tokens": doc_len, "questions": questions}
    reference = ours().float()
    rows = [base | {"kernel": "ours (document part)", "splits": plan.prefix_splits,
                    "ms": round(bench_replay(ours), 4)}]
    k, v = grid.k[1:1 + doc_len], grid.v[1:1 + doc_len]  # the document's slots, NHD
    for name in ("fa2", "fa3"):
        row = base | {"kernel": f"flashinfer single prefill {name}"}
        try:
            import flashinfer

            run = lambda name=name: flashinfer.single_prefill_with_kv_cache(  # noqa: E731
                grid.q, k, v, causal=False, sm_scale=backend.sm_scale, return_lse=True,
                backend=name)[0]
            row["max_abs_diff_vs_ours"] = round(float((run().float() - reference).abs().max()), 5)
            try:
                row["ms"] = round(bench_replay(run), 4)
            except Exception:  # noqa: BLE001: eager when its launch does not capture
                row["ms"], row["eager"] = round(bench(run), 4), True
        except Exception:  # noqa: BLE001: a failure to compile or run is the result
            row["error"] = traceback.format_exc(limit=3)[-600:]
        rows.append(row)
    for row in rows:
        if "ms" in row:
            row["TFLOPs"] = round(flops / row["ms"] / 1e9, 1)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="flashinfer_stock.json")
    parser.add_argument("--cells", default="16384x256,8192x64", help="LxQ,...")
    parser.add_argument("--doc-product", action="store_true",
                        help="time cascade's document part against FlashInfer's FA2/FA3 prefill "
                        "instead of the stock decode")
    args = parser.parse_args()
    result = {"torch": torch.__version__, "triton": triton.__version__, "rows": []}
    try:
        import flashinfer
        result["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
    except Exception:  # noqa: BLE001
        result["import_error"] = traceback.format_exc(limit=2)[-600:]
    if DEV != "cuda":
        result["error"] = "no CUDA device: nothing to compare"
    else:
        for spec in args.cells.split(","):
            doc_len, questions = map(int, spec.split("x"))
            for model in MODELS:
                result["rows"] += (doc_product_cell if args.doc_product else cell)(
                    model, doc_len, questions)
                with open(args.out, "w") as fh:
                    json.dump(result, fh, indent=1)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    for row in result["rows"]:
        print(f"{row['model']:13} {row['doc_tokens']:6} {row['questions']:4} {row['kernel']:32} "
              f"{row.get('ms', 'error'):>8} {row.get('TFLOPs', ''):>7} "
              f"{row.get('max_abs_diff_vs_ours', '')}")
        if "error" in row:
            print("   ", row["error"].strip().splitlines()[-1])
    for key in ("import_error", "error"):
        if key in result:
            print(key, result[key].strip().splitlines()[-1])


if __name__ == "__main__":
    main()
