"""Python's cycle collector kept off a serving process's hot loop.

CPython's full (generation-2) collection stops every thread and walks each object the
collector tracks. A process that has imported torch and Triton and built an engine tracks
hundreds of thousands of them (~220k and ~126 ms a full collection on the CPU test machine,
`python benchmarks/gc_pauses.py`); nearly all live as long as the process. A full collection
comes when enough young objects have survived, at whatever line allocates next: in `ppqa run`
that is often between two engine steps, and the GPU idles for the whole walk once its queued
work ends.

`freeze_long_lived()` collects once and then moves every object alive at that moment into the
permanent generation (`gc.freeze`), which later collections skip: they walk only what came
after. The worker calls it once its first GPU work is queued, so that the one collection runs
beside it. Frozen objects are still freed by reference counting; only cycles among them wait
for `thaw()`, which `Engine.close` calls first, so that a closed engine's parts (which refer to
each other) go at once. vLLM and SGLang freeze their serving processes' heaps after start-up
for the same reason.
"""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_frozen = False


def freeze_long_lived() -> bool:
    """Collect, then freeze everything alive; once per process until `thaw`. True if it ran."""
    global _frozen
    with _lock:
        if _frozen:
            return False
        _frozen = True
    gc.collect()  # cyclic garbage first, or the freeze would keep it for good
    gc.freeze()
    return True


def thaw() -> None:
    """Return the frozen objects to the collector (the next collection may free their cycles);
    a later `freeze_long_lived` freezes again."""
    global _frozen
    with _lock:
        gc.unfreeze()
        _frozen = False


def frozen() -> bool:
    """Whether `freeze_long_lived` has run since the last `thaw`."""
    return _frozen
