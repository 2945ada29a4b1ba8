"""The long-lived heap out of the cycle collector's full walks (ppqa/engine/heap.py).

What is checked: a freeze collects the garbage cycles first (none is kept for good) and then
moves the live objects out of later collections, once until a thaw; objects frozen alive that
later form garbage cycles are freed only after a thaw; the worker freezes once it has work;
`Engine.close` after a freeze still frees the engine's parts at once.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from ppqa.engine import heap
from tests.helpers import make_worker

DOC = "The ferry to Velm leaves every hour from the north pier."


class Node:
    """A weak-referenceable object that can join a cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


def _cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_freeze_collects_first_then_keeps_live_objects_out_until_a_thaw():
    garbage = _cycle()  # unreachable already: the freeze's own collection must free it
    live_a, live_b = Node(), Node()
    live_a.other, live_b.other = live_b, live_a
    alive = weakref.ref(live_a)

    assert heap.freeze_long_lived() is True
    assert garbage() is None
    assert heap.frozen() and gc.get_freeze_count() > 0
    assert heap.freeze_long_lived() is False  # once per process until a thaw

    del live_a, live_b  # now a garbage cycle, but frozen: collections skip it
    gc.collect()
    assert alive() is not None
    heap.thaw()
    assert not heap.frozen() and gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None


def test_the_worker_freezes_the_heap_once_it_has_work(sqlite_db, add_job, tiny_engine):
    heap.thaw()
    assert not heap.frozen()
    job = add_job(sqlite_db, DOC, ["When does the ferry leave?"], max_new_tokens=3)
    summary = make_worker(sqlite_db, tiny_engine).run()
    assert [j.job_id for j in summary.jobs if j.status == "done"] == [job]
    assert heap.frozen() and gc.get_freeze_count() > 0


def test_a_worker_with_nothing_to_do_leaves_the_heap_alone(sqlite_db, tiny_engine):
    heap.thaw()
    make_worker(sqlite_db, tiny_engine).run()
    assert not heap.frozen()


def test_closing_an_engine_frees_its_parts_after_a_freeze():
    from ppqa.engine.engine import Engine

    engine = Engine("dummy:tiny-mha", device="cpu")
    engine.answer(DOC, ["When does the ferry leave?"])
    parts = engine.parts
    # Parts that refer to each other (on a GPU the graph cache, backend and model do): only
    # the cycle collector frees them, and it skips them while they are frozen.
    parts.model.engine_parts = parts
    gone = weakref.ref(parts)
    del parts
    heap.freeze_long_lived()
    engine.close()
    assert gone() is None


@pytest.fixture(scope="module")
def tiny_engine():
    from ppqa.engine.engine import Engine

    return Engine("dummy:tiny-mha", device="cpu")
