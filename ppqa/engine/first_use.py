"""The GPU libraries' first use in a process, on a thread beside the model's loading.

A process's first Triton launch sets up Triton's runtime (its driver module, the backend, the
launcher), its first GEMM loads cuBLAS, its first fused attention cuDNN.
Where the Triton cache already holds the model's kernels, `ppqa run` runs no warm-up, so these
costs fell inside the first job's prefill while the GPU waited: ~0.48 s at the first Triton
kernel, ~0.10 s at the first GEMM, in the first pass of a fresh worker
(results/h200/gprof_labeling_auto_first_s25c1.json, `long_idle_gaps`). `start` makes each of
these first uses on a thread while the main thread builds the model, and launches the small
torch ops a step's inputs go through (int64 index arithmetic, a table write, the greedy argmax
over float32 logits, an add in the model's dtype): with CUDA's lazy loading each kernel
function loads at its first launch, 5-19 ms apiece, ~70 ms in all in a fresh worker's first
prefill (results/h200/gprof_labeling_auto_first_s25c2.json, `long_idle_gaps`: `clamp`,
`index_copy_`, `to`, `ge`, `argmax`, `add`, `arange`), and a function loaded on one thread
serves them all. `join` waits for the thread before the KV pool is sized from the memory then
free. Each library's setup is process-wide; torch keeps cuBLAS's and cuDNN's handles in
per-device pools, to which a thread's handles return when it ends, so the main thread's first
call takes one from there. What the thread does never reaches the model: it launches on
tensors of its own, and a failure there is kept (`FirstUse.errors`) and otherwise ignored,
since the same call on the main thread raises it where it matters.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass
class FirstUse:
    """Seconds each library's first use took on the thread, and what failed."""

    seconds: dict[str, float] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    thread: threading.Thread | None = None

    def join(self) -> FirstUse:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        return self


def triton_key() -> str | None:
    """Triton's own cache key (a hash of its compiler's sources and of libtriton, ~0.3 s of
    reading and hashing that releases the GIL; results/h100/startup_warm_prof_s33c3.json),
    which Triton computes once per process, before its first kernel's cache lookup, and keeps;
    None where this Triton has no such function where this looks for it."""
    for module in ("triton.runtime.cache", "triton.compiler.compiler"):
        try:
            key = getattr(importlib.import_module(module), "triton_key", None)
        except ImportError:
            continue
        if key is not None:
            return key()
    return None


def prepare(device: torch.device) -> threading.Thread | None:
    """On a CUDA device, start computing `triton_key` on a thread now, before the model's
    configuration is known and `start` can run: the hashing then overlaps the loading of the
    tokenizer and weights, where it would otherwise lead the first-use thread's first Triton
    launch, on which the main thread waits (`FirstUse.join`). None elsewhere."""
    if device.type != "cuda":
        return None

    def run():
        try:
            triton_key()
        except Exception:  # noqa: BLE001 - the first launch computes it again and reports
            pass

    thread = threading.Thread(target=run, name="ppqa-triton-key", daemon=True)
    thread.start()
    return thread


def step_ops(device: torch.device, dtype: torch.dtype, vocab: int) -> torch.Tensor:
    """The ops of a step's input preparation and greedy pick (engine/runtime/runner.py,
    runtime/kv_cache.py, runtime/sampling.py) on a few elements of the same dtypes, so that
    their kernels are loaded before a step needs them; returns a result to read back."""
    ids = torch.arange(8, device=device)  # int64, as the runner's packed inputs
    src = torch.where(ids >= 0, ids[ids.clamp(min=0)], torch.zeros_like(ids))
    table = torch.zeros(16, dtype=torch.int32, device=device)
    table.index_copy_(0, src, src.to(torch.int32))
    table[ids] = ids.to(torch.int32)
    logits = torch.ones(2, vocab, device=device)  # float32, as the runner's
    hidden = torch.ones(2, 8, device=device, dtype=dtype)
    return logits.argmax(dim=-1) + (hidden + hidden).float().sum().long() + table[:2].long()


def start(device: torch.device, dtype: torch.dtype, hidden: int, num_heads: int,
          head_dim: int, eps: float, vocab: int,
          prepared: threading.Thread | None = None) -> FirstUse:
    """Start the thread on a CUDA device (elsewhere nothing to set up: an empty `FirstUse`).
    cuDNN only in bf16/fp16, where the attention backend calls it (it takes no other dtype,
    and torch warns of each it refuses). The Triton launch is the model's
    own RMSNorm variant (its hidden size and dtype), which a warm Triton cache holds, so the
    thread loads it rather than compiling a new one; it waits for `prepared` (`prepare`'s
    thread) first, so that Triton's key is computed once."""
    first = FirstUse()
    if device.type != "cuda":
        return first

    def step(name, fn):
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the main thread's own call reports it
            first.errors[name] = f"{type(exc).__name__}: {exc}"
        first.seconds[name] = time.perf_counter() - t0

    def triton_kernel():
        from ppqa.kernels.fused import rms_norm

        if prepared is not None:
            prepared.join()
        rms_norm(torch.ones(2, hidden, device=device, dtype=dtype),
                 torch.ones(hidden, device=device, dtype=dtype), eps)

    def gemm():
        a = torch.ones(16, hidden, device=device, dtype=dtype)
        torch.mm(a, a.t())

    def attention(backend_name):
        def run():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q = torch.ones(1, num_heads, 16, head_dim, device=device, dtype=dtype)
            with sdpa_kernel(getattr(SDPBackend, backend_name)):
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return run

    def run():
        with torch.cuda.device(device):
            step("cublas", gemm)
            step("torch_ops", lambda: step_ops(device, dtype, vocab))
            if dtype in (torch.bfloat16, torch.float16):  # the fused kernels' dtypes
                step("cudnn", attention("CUDNN_ATTENTION"))
            step("triton", triton_kernel)  # last: `prepared` has the longest to hash
            torch.cuda.synchronize(device)

    first.thread = threading.Thread(target=run, name="ppqa-first-use", daemon=True)
    first.thread.start()
    return first
