"""The torch attention backend against a float64 reference written with plain loops.

A small pool holds two documents shared by several request rows (MHA and GQA). The extend kind is
checked on a parallel decode step (stream masks over cached and new keys) and a question prefill;
the decode kind and the cascade split (document part per group + suffix part, merged by LSE) on a
stock-like step, where cascade must equal plain decode.
"""

from __future__ import annotations

import pytest
import torch

from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable
from ppqa.engine.runtime.layout import StepLayout
from ppqa.engine.runtime.runner import ModelRunner, StepInputs
from ppqa.engine.attention.torch_backend import TorchBackend, merge_two_states

CPU = torch.device("cpu")
DIM = 8


def reference(q, keys, values, allowed, scale) -> torch.Tensor:
    """q [H, D], keys/values [m, KVH, D], allowed [m] -> [H, D] in float64."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    out = []
    for h in range(heads):
        kv = h // (heads // kv_heads)
        scores = (keys[:, kv].double() @ q[h].double()) * scale
        scores[~allowed] = float("-inf")
        out.append(torch.softmax(scores, 0) @ values[:, kv].double())
    return torch.stack(out)


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 results against the float64 reference."""
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)


class Setup:
    def __init__(self, heads: int, kv_heads: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.gen, self.heads, self.kv_heads = gen, heads, kv_heads
        self.pool = KVPool(200, 2, kv_heads, DIM, dtype=torch.float32, device=CPU)
        self.pool.kv.normal_(generator=gen)
        self.table = ReqToTokenTable(4, 100, CPU)
        self.backend = TorchBackend(self.pool, heads, kv_heads, DIM, DIM ** -0.5)
        self.runner = ModelRunner(None, self.pool, self.table, self.backend, CPU)
        doc_a, doc_b = torch.arange(1, 38), torch.arange(40, 60)  # 37 and 20 tokens
        self.docs = {1: doc_a, 2: doc_a, 3: doc_b}  # rows 1 and 2 share document A
        # Row 2's own slots are fragmented (three runs), as in a fragmented pool.
        own = {1: torch.arange(70, 85),
               2: torch.cat([torch.arange(90, 94), torch.arange(150, 155), torch.arange(96, 98)]),
               3: torch.arange(110, 130)}
        for row in (1, 2, 3):
            self.table.write(row, 0, torch.cat([self.docs[row], own[row]]))
        self.pool.slot_sid[1:60] = -1

    def new_qkv(self, tokens: int):
        q = torch.randn(tokens, self.heads, DIM, generator=self.gen)
        k = torch.randn(tokens, self.kv_heads, DIM, generator=self.gen)
        v = torch.randn(tokens, self.kv_heads, DIM, generator=self.gen)
        return q, k, v

    def row_kv(self, layer: int, row: int, start: int, end: int):
        slots = self.table.table[row, start:end].long()
        return (self.pool.k_buffers[layer][slots], self.pool.v_buffers[layer][slots],
                self.pool.slot_sid[slots])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (3, 1)])
def test_extend_applies_the_stream_rule(heads: int, kv_heads: int) -> None:
    s = Setup(heads, kv_heads, seed=heads)
    # Rows 1 and 3 already hold 3 streams' tokens after their documents (sids as a parallel row).
    cached = {1: 37 + 9, 3: 20 + 6}
    s.pool.slot_sid[s.table.table[1, 37:46].long()] = torch.tensor([0, 0, 1, 2, 2, 2, 0, 1, 2],
                                                                   dtype=torch.int32)
    s.pool.slot_sid[s.table.table[3, 20:26].long()] = torch.tensor([0, 1, 1, 2, 0, 2],
                                                                   dtype=torch.int32)
    # The step: 3 stream tokens for row 1 (stream 1 finished -> sink), 5 question tokens for row 3.
    q_sid = torch.tensor([0, 1, 2, 0, 0, 1, 2, 2], dtype=torch.int32)
    row_pos = torch.tensor([46, -1, 47, 26, 27, 28, 29, 30])
    layout = StepLayout(torch.arange(8), q_sid, row_pos)
    step = StepInputs(kind="extend", input_ids=torch.zeros(8, dtype=torch.int64), layout=layout,
                      qo_indptr=torch.tensor([0, 3, 8]), req_rows=torch.tensor([1, 3]),
                      kv_start=torch.tensor([0, 0]), prefix_lens=torch.tensor([46, 26]),
                      logit_indices=torch.arange(8))
    _, meta = s.runner.prepare(step)
    assert meta.out_slots[1] == 0 and int(meta.out_slots[0]) == int(s.table.table[1, 46])
    q, k, v = s.new_qkv(8)
    out = s.backend.forward(1, q, k, v, meta)
    for b, (row, first, end) in enumerate([(1, 0, 3), (3, 3, 8)]):
        ck, cv, csid = s.row_kv(1, row, 0, cached[row])
        for t in range(first, end):
            keys = torch.cat([ck, k[first:end]])
            values = torch.cat([cv, v[first:end]])
            sids = torch.cat([csid, q_sid[first:end]])
            causal = torch.cat([torch.ones(len(ck), dtype=torch.bool),
                                torch.arange(first, end) <= t])
            allowed = causal & ((sids == -1) | (sids == q_sid[t]))
            close(out[t], reference(q[t], keys, values, allowed, DIM ** -0.5))
    # K/V of live tokens landed in their slots.
    assert torch.equal(s.pool.k_buffers[1][meta.out_slots[2]], k[2])


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_decode_and_cascade_match_reference_and_each_other(heads: int, kv_heads: int) -> None:
    s = Setup(heads, kv_heads, seed=10 + heads)
    lens = {1: 37 + 5, 2: 37 + 11, 3: 20 + 2}  # row tokens before the step (stock rows, sid 0)
    for row, n in lens.items():
        doc_len = len(s.docs[row])
        s.pool.slot_sid[s.table.table[row, doc_len:n + 1].long()] = 0
    rows = [1, 2, 3]
    q, k, v = s.new_qkv(3)
    outs = {}
    for cascade in (False, True):
        step = StepInputs(kind="decode", input_ids=torch.zeros(3, dtype=torch.int64),
                          layout=StepLayout(torch.tensor([lens[r] for r in rows]),
                                            torch.zeros(3, dtype=torch.int32),
                                            torch.tensor([lens[r] for r in rows])),
                          qo_indptr=torch.arange(4), req_rows=torch.tensor(rows),
                          kv_start=torch.tensor([37, 37, 20] if cascade else [0, 0, 0]),
                          prefix_lens=torch.tensor([lens[r] for r in rows]),
                          logit_indices=torch.arange(3),
                          cascade_groups=[(0, 2, 37, -1), (2, 3, 20, -1)] if cascade else None)
        _, meta = s.runner.prepare(step)
        if cascade:
            assert meta.cascade.doc_groups == 2
        outs[cascade] = s.backend.forward(0, q, k, v, meta)
    for b, row in enumerate(rows):
        keys, values, _ = s.row_kv(0, row, 0, lens[row] + 1)  # includes the token just written
        expected = reference(q[b], keys, values, torch.ones(len(keys), dtype=torch.bool), DIM ** -0.5)
        close(outs[False][b], expected)
        close(outs[True][b], expected)


def test_padded_cascade_step_counts_only_groups_with_a_document() -> None:
    """A decode step padded for a CUDA graph ends in a group of dummies (row 0, no document):
    the metadata tells the backend's planner how many groups have one."""
    s = Setup(4, 4, seed=3)
    step = StepInputs(kind="decode", input_ids=torch.zeros(3, dtype=torch.int64),
                      layout=StepLayout(torch.tensor([42, 48, 0]), torch.zeros(3, dtype=torch.int32),
                                        torch.tensor([42, 48, -1])),
                      qo_indptr=torch.arange(4), req_rows=torch.tensor([1, 2, 0]),
                      kv_start=torch.tensor([37, 37, 0]), prefix_lens=torch.tensor([42, 48, 0]),
                      logit_indices=torch.arange(3),
                      cascade_groups=[(0, 2, 37, -1), (2, 3, 0, 0)])
    _, meta = s.runner.prepare(step)
    assert meta.cascade.doc_req_indices.shape[0] == 2
    assert meta.cascade.doc_groups == 1
    assert meta.cascade.doc_lens.tolist() == [37, 0]


def test_merge_two_states_equals_attention_over_the_union() -> None:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(5, 30, generator=gen)
    values = torch.randn(30, 4, generator=gen)

    def part(lo, hi):
        lse = torch.logsumexp(scores[:, lo:hi], -1)
        return torch.softmax(scores[:, lo:hi], -1) @ values[lo:hi], lse

    out, lse = merge_two_states(*part(0, 12), *part(12, 30))
    torch.testing.assert_close(out, torch.softmax(scores, -1) @ values)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))
    empty = torch.full((5,), float("-inf"))  # an empty part (document of 0 tokens) changes nothing
    out2, _ = merge_two_states(torch.zeros(5, 4), empty, *part(0, 30))
    torch.testing.assert_close(out2, torch.softmax(scores, -1) @ values)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_cascade_question_prefill_equals_plain_extend(heads: int, kv_heads: int) -> None:
    """Questions of rows 1, 2 (document A) and 3 (document B): the cascade split (each group's
    question tokens against its document at once, the rest from kv_start = doc_len) equals the
    plain extend over the whole row."""
    s = Setup(heads, kv_heads, seed=20 + heads)
    counts = [3, 4, 2]  # question tokens of rows 1, 2, 3 (one stream each)
    rows, doc_lens = [1, 2, 3], [37, 37, 20]
    positions = torch.cat([torch.arange(n) + d for n, d in zip(counts, doc_lens)])
    layout = StepLayout(positions, torch.zeros(sum(counts), dtype=torch.int32), positions.clone())
    q, k, v = s.new_qkv(sum(counts))
    outs = {}
    for cascade in (False, True):
        step = StepInputs(kind="extend", input_ids=torch.zeros(sum(counts), dtype=torch.int64),
                          layout=layout, qo_indptr=torch.tensor([0, 3, 7, 9]),
                          req_rows=torch.tensor(rows),
                          kv_start=torch.tensor(doc_lens if cascade else [0, 0, 0]),
                          prefix_lens=torch.tensor(doc_lens), logit_indices=torch.tensor([2, 6, 8]),
                          cascade_groups=[(0, 2, 37, 1), (2, 3, 20, 40)] if cascade else None)
        _, meta = s.runner.prepare(step)
        if cascade:  # the groups' rows count tokens in an extend step
            assert meta.cascade.group_req_indptr.tolist() == [0, 7, 9]
            assert meta.cascade.max_group_size == 7 and meta.cascade.contiguous
        outs[cascade] = s.backend.forward(0, q, k, v, meta)
    close(outs[True], outs[False].double())
    # And the plain extend itself against the reference, for the last token of row 2.
    keys, values, _ = s.row_kv(0, 2, 0, 37 + 4)
    expected = reference(q[6], keys, values, torch.ones(len(keys), dtype=torch.bool), DIM ** -0.5)
    close(outs[False][6], expected)


def test_paged_kv_table_packs_each_rows_prefix() -> None:
    from ppqa.engine.attention.flashinfer_backend import paged_kv_table

    table = torch.arange(5 * 12, dtype=torch.int32).view(5, 12)
    rows, lens = torch.tensor([3, 1, 4], dtype=torch.int32), torch.tensor([5, 1, 12])
    indptr, indices = paged_kv_table(table, rows, lens, 12)
    assert indptr.tolist() == [0, 5, 6, 18] and indptr.dtype == torch.int32
    expected = torch.cat([table[3, :5], table[1, :1], table[4, :12]])
    assert indices[:18].tolist() == expected.tolist() and indices.numel() == 19


def test_flashinfer_backend_refuses_what_it_cannot_run() -> None:
    from ppqa import Engine, EngineConfig

    with pytest.raises(ValueError, match="needs a CUDA device"):
        Engine("dummy:tiny-hd128", device="cpu",
               config=EngineConfig(attention_backend="flashinfer"))
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(attention_backend="flashattention")


def test_a_first_chunk_row_class_goes_to_cudnn_once_ours_has_cost_a_plan(monkeypatch) -> None:
    """`triton_first` (our causal kernel or cuDNN for a document's first chunk): ours until
    what it has cost over cuDNN's rate on the class's padded rows reaches one cuDNN plan, then
    cuDNN for good. Documents of different lengths in one row class pay together; a 16k chunk
    of a 32-layer model gets there within its first two documents, a ~5.5k-token document of
    Qwen2.5-7B (28 layers) after several; a chunk whose padding costs cuDNN more than its rate
    gains runs ours."""
    from ppqa.engine.attention import fused_chunks as fc

    monkeypatch.setattr(fc, "_CAUSAL_TRITON_LOSS", {})

    def documents_on_ours(lengths, heads, head_dim, layers, limit=1000):
        """Documents of these lengths in turn, a call a layer: how many ran our kernel
        throughout before a call went to cuDNN (None if none did within `limit`)."""
        for n in range(limit):
            rows = lengths[n % len(lengths)]
            padded, loss = fc.first_chunk_class(rows, heads, head_dim)
            if not all(fc.triton_first(("test", padded, heads), loss) for _ in range(layers)):
                return n
        return None

    padded, loss = fc.first_chunk_class(16384, 32, 128)
    assert padded == 16384 and loss > 0
    assert documents_on_ours([16384], 32, 128, 32) <= 1
    assert not fc.triton_first(("test", 16384, 32), loss)  # and for good
    # Two lengths of one class (5,632 rows), alternating, pay one rent between them.
    assert {fc.first_chunk_class(n, 28, 128)[0] for n in (5300, 5600)} == {5632}
    alone = documents_on_ours([5300], 28, 128, 28)
    monkeypatch.setattr(fc, "_CAUSAL_TRITON_LOSS", {})
    both = documents_on_ours([5300, 5600], 28, 128, 28)
    assert alone is not None and both is not None and 2 <= both <= alone
    # 513 rows run as 1,024 on cuDNN: four times the work, more than its rate gains, even
    # in a class that has gone to cuDNN.
    padded, loss = fc.first_chunk_class(513, 32, 128)
    assert padded == 1024 and loss < 0
    assert documents_on_ours([513], 32, 128, 32, limit=200) is None
    monkeypatch.setattr(fc, "_CAUSAL_TRITON_LOSS", {("test", 1024, 32): None})
    assert fc.triton_first(("test", 1024, 32), loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_use_thread_step_ops_run_and_compute(dtype) -> None:
    """engine/first_use.py's `step_ops` (launched on a GPU to load those kernels beside the
    model's building) are valid ops of the runner's dtypes: here on the CPU, with their value."""
    from ppqa.engine import first_use

    out = first_use.step_ops(torch.device("cpu"), dtype, vocab=50)
    # argmax of equal logits 0, the dtype's add 2 x 8 x 2 = 32, the table's rows 0 and 1
    assert out.tolist() == [32, 33]
    assert first_use.start(torch.device("cpu"), dtype, 64, 4, 16, 1e-5, 50).seconds == {}


def test_the_triton_key_hashed_ahead_is_the_one_triton_keeps() -> None:
    """engine/first_use.py's `triton_key` finds the installed Triton's own key function, and
    what it computes is what Triton's next lookup gets from its cache (computed once, ahead of
    the first launch); `prepare` starts no thread off a GPU."""
    import triton

    from ppqa.engine import first_use

    assert first_use.prepare(torch.device("cpu")) is None
    key = first_use.triton_key()
    assert isinstance(key, str) and key.startswith(triton.__version__)
    from triton.runtime.cache import triton_key as tritons

    hits = tritons.cache_info().hits
    assert tritons() == key and tritons.cache_info().hits == hits + 1
