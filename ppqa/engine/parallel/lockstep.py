"""Tensor-parallel ranks in lockstep: rank 0 decides, the others repeat its session's calls.

Every rank keeps a full copy of the bookkeeping (scheduler, KV slot allocator, req_to_token
table, document cache) and runs it on its own shard of the model. The scheduler is
deterministic: given the same calls in the same order and the same sampled tokens, every rank
plans the same steps, so the ranks meet at each collective with the same shapes. Rank 0 (the
leader) therefore sends no step plans, only what its sessions were asked to do:

    leader:   LeaderSession.submit / cancel / flush / close  -> recorded (`post`)
              LeaderSession.step                            -> recorded, and everything recorded
                                                               since the last step goes to the
                                                               followers in ONE broadcast (`send`)
    follower: `follower.follow(engine)` receives each batch and makes the same calls on its
              FollowerSessions.

A cancel is sent as the positions at which the leader's predicate said yes (the scheduler asks
it about its streams in a fixed order), because the predicate itself (a closure over job ids)
cannot travel. The tokens each step samples are broadcast from rank 0 (`share_tokens`, a tiny
collective on the device, no host wait), so that followers can never drift from the leader even
if two ranks' logits differed in the last bit. Commands travel pickled over a gloo group;
`Engine.shutdown()` sends "exit", which ends `follow`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from ppqa.engine.parallel.tensor_parallel import TensorParallel
from ppqa.engine.runtime.sampling import FILL
from ppqa.engine.session import EngineSession


class Lockstep:
    """The leader's record of session calls, and both ends of their broadcast."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self._pending: list[tuple] = []
        self._session_ids = itertools.count()
        self.closed = False

    @property
    def is_leader(self) -> bool:
        return self.tp.is_leader

    def open_session(self, has_on_error: bool) -> int:
        sid = next(self._session_ids)
        self.post("open", sid, has_on_error)
        return sid

    def post(self, *command) -> None:
        """Record one session call (leader); it leaves with the next `send`."""
        self._pending.append(command)

    def send(self) -> None:
        """Broadcast what was recorded since the last send (leader)."""
        import torch.distributed as dist

        if self.closed:  # the followers have left: a broadcast would wait for no one
            raise RuntimeError("this tensor-parallel engine was shut down (Engine.shutdown)")
        batch, self._pending = self._pending, []
        dist.broadcast_object_list([batch], src=0, group=self.tp.control)

    def receive(self) -> list[tuple]:
        """The leader's next batch of calls (follower)."""
        import torch.distributed as dist

        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.tp.control)
        return box[0]

    def share_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every rank ends with rank 0's sampled tokens."""
        import torch.distributed as dist

        dist.broadcast(tokens, src=0, group=self.tp.group)
        return tokens

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (e.g. KV slots: every pool must be the same)."""
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
        return int(t.item())


def recording_predicate(doomed: Callable[[object], bool]
                        ) -> tuple[Callable[[object], bool], list[int]]:
    """`doomed`, wrapped to note the positions (in call order) at which it said yes."""
    calls, hits = itertools.count(), []

    def pick(key) -> bool:
        position = next(calls)
        if doomed(key):
            hits.append(position)
            return True
        return False

    return pick, hits


def replaying_predicate(hits: list[int]) -> Callable[[object], bool]:
    """Says yes at the positions a leader's `recording_predicate` noted."""
    calls, chosen = itertools.count(), set(hits)
    return lambda _key: next(calls) in chosen


class LeaderSession(EngineSession):
    """Rank 0's session: records each public call for the followers (see the module doc)."""

    def __init__(self, engine, on_answer=None, on_error=None) -> None:
        super().__init__(engine, on_answer, on_error)
        self._lockstep: Lockstep = engine.parts.lockstep
        self._sid = self._lockstep.open_session(on_error is not None)

    def submit(self, requests, *, mode: str = "auto", streams=None, background: bool = False
               ) -> int:
        # Tokenized at once: every rank queues the questions at the same step.
        self._lockstep.post("submit", self._sid, list(requests), mode, streams)
        return super().submit(requests, mode=mode, streams=streams)

    def cancel(self, doomed) -> int:
        doomed, hits = recording_predicate(doomed)
        dropped = super().cancel(doomed)
        self._lockstep.post("cancel", self._sid, hits)
        return dropped

    def step(self) -> bool:
        self._lockstep.post("step", self._sid)
        self._lockstep.send()
        return super().step()

    def prefill_ahead(self) -> bool:
        self._lockstep.post("prefill_ahead", self._sid)
        self._lockstep.send()
        return super().prefill_ahead()

    def flush(self) -> None:
        self._lockstep.post("flush", self._sid)
        super().flush()

    def close(self):
        if not self._lockstep.closed:
            self._lockstep.post("close", self._sid)
        return super().close()

    defer_masks = False  # every rank samples at the same point of the step

    def _sample(self, logits, step, bitmask=FILL) -> torch.Tensor:
        return self._lockstep.share_tokens(super()._sample(logits, step, bitmask))


class FollowerSession(EngineSession):
    """Another rank's session: driven by `follower.follow`, sampling rank 0's tokens."""

    defer_masks = False

    def _sample(self, logits, step, bitmask=FILL) -> torch.Tensor:
        return self._parts.lockstep.share_tokens(super()._sample(logits, step, bitmask))
