"""The stream layout against a dense reference of the rule: every stream sees what a lone request sees.

A parallel request (document of L tokens, P questions of unequal lengths) is driven through the
question prefill and several decode steps in which streams finish at different times. At each step
the positions, stream ids, slots (through the real runner's metadata building and KV pool) and the
mask the torch backend applies (`extend_mask` over the row's slot_sid) must equal the reference
built from token identities: a token of stream s, index i sits at position L + i and may attend
the document and the tokens of stream s with index <= i, nothing else.
"""

from __future__ import annotations

import random

import pytest
import torch

from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable
from ppqa.engine.runtime.layout import decode_layout, document_layout, extend_mask, question_layout
from ppqa.engine.runtime.runner import ModelRunner, StepInputs


def reference_mask(queries: list[tuple[int, int]], keys: list[tuple[int, int]]) -> torch.Tensor:
    """queries/keys as (stream, index in stream), stream -1 = document; the lone-request rule."""
    return torch.tensor([[ks == -1 or (ks == qs and ki <= qi) for ks, ki in keys]
                         for qs, qi in queries], dtype=torch.bool)


class RowHarness:
    """One request row in a real pool and table, driven through `ModelRunner.prepare`."""

    def __init__(self, doc_len: int, reserve: int, seed: int) -> None:
        slots = doc_len + reserve + 8
        self.pool = KVPool(slots + 1, 1, 1, 4, dtype=torch.float32, device=torch.device("cpu"))
        self.table = ReqToTokenTable(2, slots, torch.device("cpu"))
        self.runner = ModelRunner(None, self.pool, self.table, None, torch.device("cpu"))
        perm = torch.randperm(slots, generator=torch.Generator().manual_seed(seed)) + 1
        self.row = 1
        self.table.write(self.row, 0, perm[:doc_len + reserve])
        self.row_tokens: list[tuple[int, int]] = []  # identity of each cached row position

    def step(self, layout, input_ids, prefix_len) -> torch.Tensor:
        step = StepInputs(kind="extend", input_ids=input_ids, layout=layout,
                          qo_indptr=torch.tensor([0, input_ids.numel()]),
                          req_rows=torch.tensor([self.row]), kv_start=torch.tensor([0]),
                          prefix_lens=torch.tensor([prefix_len]),
                          logit_indices=torch.empty(0, dtype=torch.int64))
        _, meta = self.runner.prepare(step)
        return meta.out_slots

    def cached_sid(self, prefix_len: int) -> torch.Tensor:
        return self.pool.slot_sid[self.table.table[self.row, :prefix_len].long()]


CASES = [(0, 1), (1, 2), (37, 5), (300, 17), (37, 64), (1, 64), (300, 3)]


@pytest.mark.parametrize("doc_len,streams", CASES)
def test_parallel_layout_matches_lone_requests(doc_len: int, streams: int) -> None:
    rng = random.Random(doc_len * 100 + streams)
    q_lens = [rng.randint(1, 7) for _ in range(streams)]
    budgets = [rng.randint(1, 6) for _ in range(streams)]  # answer tokens each stream is fed
    h = RowHarness(doc_len, sum(q_lens) + sum(budgets), seed=streams)

    # Document prefill (in two chunks, as the engine chunks long documents).
    cut = doc_len // 2
    for start, end in ((0, cut), (cut, doc_len)):
        layout = document_layout(start, end)
        assert layout.positions.tolist() == list(range(start, end))
        slots = h.step(layout, torch.zeros(end - start, dtype=torch.int64), start)
        assert slots.tolist() == h.table.table[1, start:end].tolist()
    h.row_tokens = [(-1, i) for i in range(doc_len)]
    assert (h.cached_sid(doc_len) == -1).all()

    # Question prefill: one packed extend.
    layout, last = question_layout(doc_len, q_lens)
    new = [(s, i) for s in range(streams) for i in range(q_lens[s])]
    assert layout.positions.tolist() == [doc_len + i for _, i in new]
    assert layout.q_sid.tolist() == [s for s, _ in new]
    assert last.tolist() == [sum(q_lens[:s + 1]) - 1 for s in range(streams)]
    slots = h.step(layout, torch.zeros(len(new), dtype=torch.int64), doc_len)
    assert slots.tolist() == h.table.table[1, doc_len:doc_len + len(new)].tolist()
    mask = extend_mask(h.cached_sid(doc_len), layout.q_sid)
    assert torch.equal(mask, reference_mask(new, h.row_tokens + new))
    h.row_tokens += new
    prefix = doc_len + len(new)
    assert h.cached_sid(prefix).tolist() == [s for s, _ in h.row_tokens]

    # Decode steps: stream s is fed budgets[s] answer tokens, then finishes (sink, not in the row).
    fed = [0] * streams
    for _ in range(max(budgets) + 1):
        live = torch.tensor([[fed[s] < budgets[s] for s in range(streams)]])
        next_pos = torch.tensor([[doc_len + q_lens[s] + fed[s] for s in range(streams)]])
        layout, new_prefix = decode_layout(torch.tensor([prefix]), next_pos, live)
        slots = h.step(layout, torch.zeros(streams, dtype=torch.int64), prefix)
        assert layout.positions.tolist() == next_pos[0].tolist()
        assert layout.q_sid.tolist() == list(range(streams))
        n_live = int(live.sum())
        assert int(new_prefix) == prefix + n_live
        row_slots = h.table.table[1, prefix:prefix + n_live].tolist()
        assert [x for x, alive in zip(slots.tolist(), live[0]) if alive] == row_slots
        assert all(x == 0 for x, alive in zip(slots.tolist(), live[0]) if not alive)
        new = [(s, q_lens[s] + fed[s]) for s in range(streams)]
        mask = extend_mask(h.cached_sid(prefix), layout.q_sid)
        ref = reference_mask(new, h.row_tokens + new)
        alive = live[0]
        assert torch.equal(mask[alive], ref[alive])  # finished streams' outputs are discarded
        # Nobody alive ever sees a finished stream's sink token.
        dead_cols = torch.nonzero(~alive).flatten() + prefix
        assert not mask[alive][:, dead_cols].any()
        h.row_tokens += [t for t, a in zip(new, alive) if a]
        prefix = int(new_prefix)
        fed = [f + 1 if f < b else f for f, b in zip(fed, budgets)]
        assert h.cached_sid(prefix).tolist() == [s for s, _ in h.row_tokens]
    assert prefix == doc_len + sum(q_lens) + sum(budgets)


def test_decode_layout_batches_requests_independently() -> None:
    prefix = torch.tensor([10, 50])
    next_pos = torch.tensor([[7, 8, 9], [20, 21, 22]])
    live = torch.tensor([[True, False, True], [False, False, True]])
    layout, new_prefix = decode_layout(prefix, next_pos, live)
    assert layout.row_pos.tolist() == [10, -1, 11, -1, -1, 50]
    assert layout.positions.tolist() == [7, 8, 9, 20, 21, 22]
    assert layout.q_sid.tolist() == [0, 1, 2, 0, 1, 2]
    assert new_prefix.tolist() == [12, 51]


def test_question_layout_rejects_empty_question() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        question_layout(5, [3, 0])


@pytest.mark.parametrize("doc_len,n", [(0, 1), (37, 5), (2048, 23)])
def test_one_question_layout_is_the_packed_layouts_first_question(doc_len, n) -> None:
    """The one-question path (stock and cascade requests) gives what packing it first of two
    gives for its tokens; a question of no tokens is still refused."""
    one, last = question_layout(doc_len, [n])
    two, lasts = question_layout(doc_len, [n, 3])
    assert torch.equal(one.positions, two.positions[:n])
    assert torch.equal(one.q_sid, two.q_sid[:n]) and one.q_sid.dtype == torch.int32
    assert torch.equal(one.row_pos, two.row_pos[:n])
    assert last.tolist() == [lasts.tolist()[0]] == [n - 1]
    with pytest.raises(ValueError, match="at least one token"):
        question_layout(doc_len, [0])
