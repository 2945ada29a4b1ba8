"""The probes `session_timeline.py` puts on an engine session and a worker: call tallies and
phase marks wrapped around methods, the step trace's summary, the caching allocator's counters,
the synchronising CUDA calls by site, host timings of cuDNN attention calls, and Python's garbage
collections.

Each probe replaces an attribute (a method of an instance or a class, a module's function) with
a wrapper that records and then calls the original; the numbers go to the caller's dicts and
counters, which `session_timeline.py` writes to its JSON.
"""

from __future__ import annotations

import gc
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from ppqa import Engine


class Tally:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: Counter = Counter()


def wrap(owner, name: str, tally: Tally, label: str, on_result=None, phase=None):
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        if phase is not None:
            phase["now"] = label
        out = original(*args, **kwargs)
        if phase is not None:
            phase["now"] = "other"
        tally.seconds[label] += time.perf_counter() - t0
        tally.calls[label] += 1
        if on_result is not None:
            on_result(args, out)
        return out

    setattr(owner, name, timed)
    return original


def phased(owner, name: str, prof, label: str) -> None:
    """Launches from owner.name count for `label` in prof's GPU time (gpu_time.py)."""
    original = getattr(owner, name)

    def inner(*args, **kwargs):
        with prof.phase(label):
            return original(*args, **kwargs)

    setattr(owner, name, inner)


def trace_summary(trace: list[tuple], wall: float, parts: int = 8) -> dict:
    """The pass cut into `parts` equal spans of its wall time: per span the decode steps,
    their mean rows and padded rows and documents, and the document chunks (with their
    tokens); and over the whole pass, the decode steps by padded rows."""
    span = max(wall, 1e-9) / parts
    spans = [{"steps": 0, "rows": 0, "padded": 0, "docs": 0, "chunks": 0, "chunk_tokens": 0}
             for _ in range(parts)]
    padded: Counter = Counter()
    for t, what, rows, pad, docs in trace:
        cell = spans[min(parts - 1, int(t / span))]
        if what == "decode":
            cell["steps"] += 1
            cell["rows"] += rows
            cell["padded"] += pad
            cell["docs"] += docs
            padded[pad] += 1
        else:
            cell["chunks"] += 1
            cell["chunk_tokens"] += rows
    for cell in spans:
        n = max(cell["steps"], 1)
        for k in ("rows", "padded", "docs"):
            cell[k] = round(cell[k] / n, 1)
    steps = sum(padded.values())
    rows = sum(r for _, what, r, _, _ in trace if what == "decode")
    return {"span_s": round(span, 3), "spans": spans, "steps_by_padded_rows": dict(padded),
            "decode_steps": steps, "mean_rows": round(rows / max(steps, 1), 1),
            "mean_padded": round(sum(p * c for p, c in padded.items()) / max(steps, 1), 1)}


ALLOCATOR_COUNTS = ("num_alloc_retries", "num_device_alloc", "num_device_free",
                    "num_sync_all_streams", "num_ooms")


def allocator_counts(engine: Engine) -> dict[str, int]:
    """The caching allocator's cumulative counters that cost the host a device call."""
    if engine.device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(engine.device)
    return {k: stats.get(k, 0) for k in ALLOCATOR_COUNTS}


def graph_keys(engine: Engine) -> list:
    cache = engine._parts.runner.graphs
    return list(cache.graphs) if cache is not None else []


class SyncLog:
    """Every synchronising CUDA call (torch's sync debug mode, 'warn') while active, counted
    by the innermost ppqa frames that made it: the session's loop should wait for the GPU
    only where it reads tokens back, so any other site is a stall to remove."""

    def __init__(self) -> None:
        self.sites: Counter = Counter()

    def __enter__(self):
        import traceback
        import warnings

        self._old_show = warnings.showwarning
        self._filters = warnings.filters[:]
        warnings.simplefilter("always")

        def show(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" not in str(message):
                return self._old_show(message, category, filename, lineno, file, line)
            frames = [f for f in traceback.extract_stack()[:-1] if "/ppqa/" in f.filename]
            site = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                              for f in reversed(frames[-3:]))
            self.sites[site or "(outside ppqa)"] += 1

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        import warnings

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._old_show
        warnings.filters[:] = self._filters


class GcLog:
    """Python's garbage collections inside a block, from `gc.callbacks`: each one's start
    (perf_counter), generation, milliseconds and objects freed. A full (generation-2) one stops
    the host for its whole walk (benchmarks/gc_pauses.py prices one)."""

    def __enter__(self) -> GcLog:
        self.events: list[tuple[float, int, float, int]] = []
        self._start: float | None = None
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        elif self._start is not None:
            self.events.append((self._start, info["generation"], (now - self._start) * 1e3,
                                info["collected"]))
            self._start = None

    def summary(self, t0: float) -> dict:
        """Counts and milliseconds by generation, and each full collection as [s after t0, ms,
        objects freed]; the heap's frozen objects at the end."""
        count: Counter = Counter()
        ms: dict[int, float] = defaultdict(float)
        for _, gen, took, _ in self.events:
            count[gen] += 1
            ms[gen] += took
        return {"collections": dict(count), "ms": {g: round(v, 2) for g, v in ms.items()},
                "full": [[round(at - t0, 3), round(took, 2), freed]
                         for at, gen, took, freed in self.events if gen == 2],
                "frozen_objects": gc.get_freeze_count()}


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def trace_cudnn(calls: list[list]) -> None:
    """Wrap the engine's two ways into cuDNN attention (torch's SDPA for a first chunk, the
    backend's `fused_chunks.cudnn_attention` for a later chunk) to record [kind, host seconds, key met
    before in this process, key]: the key is what cuDNN's plan cache is keyed by (shapes,
    strides, causal)."""
    import torch.nn.functional as F

    from ppqa.engine.attention import fused_chunks

    seen: set = set()

    def timed(kind, fn):
        def call(q, k, v, *a, **kw):
            key = (kind, tuple(q.shape), q.stride(), tuple(k.shape), k.stride(),
                   bool(kw.get("is_causal", kw.get("causal", False))))
            t0 = time.perf_counter()
            out = fn(q, k, v, *a, **kw)
            calls.append([kind, time.perf_counter() - t0, key in seen, str(key)])
            seen.add(key)
            return out
        return call

    F.scaled_dot_product_attention = timed("sdpa", F.scaled_dot_product_attention)
    fused_chunks.cudnn_attention = timed("chunk", fused_chunks.cudnn_attention)
