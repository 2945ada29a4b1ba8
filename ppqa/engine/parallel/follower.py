"""A tensor-parallel follower's life: repeat rank 0's session calls (see lockstep.py).

`follow(engine)` receives each batch of calls rank 0's sessions recorded and makes them on
sessions of its own, on its shard of the model, until rank 0's `Engine.shutdown()` says "exit".
Rejections are the leader's to report: a follower's sessions ignore them, or raise exactly
where the leader's raised (then the follower goes on, as the leader's caller does).
"""

from __future__ import annotations

from ppqa.engine.parallel.lockstep import FollowerSession, replaying_predicate


def _ignore(_request, _error) -> None:
    """A follower's rejections: the leader reports them; the follower only keeps in step."""


def follow(engine) -> None:
    """A follower's life: repeat the leader's session calls until it shuts the engine down."""
    lockstep = engine.parts.lockstep
    if lockstep is None or lockstep.is_leader:
        raise ValueError("follow() runs on a tensor-parallel rank other than 0")
    sessions: dict[int, FollowerSession] = {}
    while True:
        for op, *args in lockstep.receive():
            if op == "exit":
                for session in sessions.values():
                    session.close()
                lockstep.closed = True
                return
            sid, rest = args[0], args[1:]
            if op == "open":
                sessions[sid] = FollowerSession(engine, None, _ignore if rest[0] else None)
                continue
            session = sessions[sid]
            if op == "submit":
                try:
                    session.submit(rest[0], mode=rest[1], streams=rest[2])
                except Exception:  # noqa: BLE001 - the leader raised the same error to its caller
                    pass
            elif op == "cancel":
                session.cancel(replaying_predicate(rest[0]))
            elif op == "step":
                session.step()
            elif op == "prefill_ahead":
                session.prefill_ahead()
            elif op == "flush":
                session.flush()
            elif op == "close":
                sessions.pop(sid).close()
            else:
                raise ValueError(f"unknown lockstep command {op!r}")
