"""The engine session's records of work on its way (engine/session.py).

    Launched: a step on the device, its sampled tokens copied to pinned host memory behind
        it; `read` waits for that step alone.
    Prefilled / PrefillTimer: a prefill launched and not yet read, its device time (CUDA
        events, or the host's on the CPU) and the streams charged for it.
    Tokenizing: a background submit, its rendered groups and the tokenizer thread's future.
    charge_streams: device seconds shared equally between streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ppqa.engine.prepare import RenderedGroup
from ppqa.engine.runtime.request import Stream
from ppqa.engine.runtime.steps import PlannedStep


class Tokenizing:
    """A background submit: its rendered groups and the tokenizer thread's encoding of their
    texts (`RenderedGroup.texts.all` of each, in order)."""

    def __init__(self, groups: list[RenderedGroup], future: Future, mode: str,
                 streams: int | str | None, due: int) -> None:
        self.groups, self.future, self.mode, self.streams = groups, future, mode, streams
        self.due = due  # the session's iteration from which it joins the queue


class PrefillTimer:
    """A prefill launch's device time: CUDA events around it (read once it has run), or on
    the CPU, where the launch runs synchronously, the host's."""

    def __init__(self, cuda: bool) -> None:
        self._begin_s = time.perf_counter()
        self._events = None
        self._seconds = 0.0
        if cuda:
            self._events = (torch.cuda.Event(enable_timing=True),
                            torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> PrefillTimer:
        if self._events is None:
            self._seconds = time.perf_counter() - self._begin_s
        else:
            self._events[1].record()
        return self

    def seconds(self) -> float:
        """Waits for the launch to end on the device."""
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        return self._seconds


class Prefilled:
    """Prefill launched and not yet waited for: its timer, the streams charged for it with
    their weights, and the launched question prefill step whose tokens are still to be read
    (None for a document chunk)."""

    def __init__(self, timer: PrefillTimer, streams: list[tuple[Stream, float]],
                 launched: Launched | None = None) -> None:
        self.timer, self.streams, self.launched = timer, streams, launched
        self.iteration = 0  # the session's iteration that launched it


def charge_streams(streams: list[Stream], field: str, seconds: float) -> None:
    """Share `seconds` of device work equally between `streams`."""
    if streams:
        share = seconds / len(streams)
        for s in streams:
            setattr(s, field, getattr(s, field) + share)


class Launched:
    """A step on its way: its sampled tokens on the device, copied to pinned host memory
    behind the step (no wait); `read` waits for this step alone."""

    def __init__(self, step: PlannedStep, tokens: torch.Tensor | None, launched_at: float,
                 began: torch.cuda.Event | None = None,
                 later: Callable[[], torch.Tensor] | None = None) -> None:
        """launched_at: the host's perf_counter at the launch; began (GPU): a timing event
        recorded before the step's first kernel."""
        self.step, self.tokens, self.launched_at, self._began = step, tokens, launched_at, began
        self._event = None
        self._later = later  # samples the step, once its masks are filled (tokens None till then)
        if tokens is not None:
            self._copy()

    def _copy(self) -> None:
        if self.tokens.is_cuda:
            self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self._host.copy_(self.tokens, non_blocking=True)
            self._event = torch.cuda.Event(enable_timing=self._began is not None)
            self._event.record()

    def complete(self) -> None:
        """Sample a step whose masks were filling (a no-op once sampled)."""
        if self._later is not None:
            later, self._later = self._later, None
            self.tokens = later()
            self._copy()

    def read(self) -> list[int]:
        self.complete()
        if self._event is None:
            return self.tokens.tolist()
        self._event.synchronize()
        return self._host.tolist()

    def device_seconds(self) -> float | None:
        """Once read: the device's time from the step's first kernel to its tokens' copy;
        None without a timing event (the CPU)."""
        if self._began is None or self._event is None:
            return None
        return self._began.elapsed_time(self._event) / 1e3
