"""decode_attention (stock) and the cascade kernels against their float64 references, on
engine-shaped decode steps: requests whose rows are [doc][own question + answers][new token]."""

import math

import pytest
import torch
from checks import DEVICE, DTYPES, HEADS, ON_GPU, assert_close_to_ref, poisoned
from kernel_inputs import Pool, decode_step

from ppqa.kernels.cascade import shared_prefix_attention, shared_prefix_attention_ref
from ppqa.kernels.decode_attention import decode_attention, decode_attention_ref
from ppqa.kernels._ref import combine_states_ref
from ppqa.kernels.merge import MERGE_STATES, merge_attention_states, merge_partials

# (document lengths of the batch's groups, requests per group)
CASES = [((37,), 1), ((300,), 5), ((1000, 37), 3)] + ([((1000, 300), 64)] if ON_GPU else [])


def _suffixes(gen, docs, per_doc):
    return [torch.randint(1, 40, (per_doc,), generator=gen).tolist() for _ in docs]


def _setup(docs, per_doc, heads, dtype, seed, cascade):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(seed)
    pool = Pool(sum(docs) + len(docs) * per_doc * 45 + 16, num_kv_heads, head_dim, dtype,
                DEVICE, gen)
    batch, indptr, doc_rows = decode_step(pool, docs, _suffixes(gen, docs, per_doc), num_heads,
                                          head_dim, gen, DEVICE, cascade=cascade)
    return pool, batch, indptr, doc_rows


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"docs{'-'.join(map(str, c[0]))}x{c[1]}")
def test_decode_matches_reference(case, heads, dtype):
    docs, per_doc = case
    pool, batch, _, _ = _setup(docs, per_doc, heads, dtype, sum(docs) + per_doc, cascade=False)
    seq_lens = batch.prefix_lens + 1  # the new token is already in its slot
    scale = 1 / math.sqrt(heads[2])
    ref = decode_attention_ref(batch.q, pool.k, pool.v, batch.req_to_token, batch.req_indices,
                               batch.kv_start, seq_lens, scale)
    # Forced split counts, some with empty splits; the interpreter is slow, so fewer on the CPU.
    forced = (1, 5, 64) if ON_GPU else ((3,) if dtype == torch.float32 else ())
    for splits in (None, *forced):
        o, lse = poisoned(batch.q.shape, dtype), poisoned(batch.q.shape[:2])
        used = decode_attention(batch.q, o, pool.k, pool.v, batch.req_to_token,
                                batch.req_indices, batch.kv_start, batch.prefix_lens, scale,
                                lse=lse, num_splits=splits, seq_len_offset=1,
                                max_seq_len=int(seq_lens.max()))
        assert_close_to_ref(o, ref[0], dtype, f"{case} splits={used} o")
        assert_close_to_ref(lse, ref[1], max(dtype, torch.float32, key=DTYPES.index),
                            f"{case} splits={used} lse")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"docs{'-'.join(map(str, c[0]))}x{c[1]}")
def test_cascade_equals_full_attention(case, heads, dtype):
    """Document part + suffix part merged by lse = attention over the whole row."""
    docs, per_doc = case
    pool, batch, indptr, doc_rows = _setup(docs, per_doc, heads, dtype, 5 + sum(docs),
                                           cascade=True)
    scale = 1 / math.sqrt(heads[2])
    to = dict(device=DEVICE, dtype=torch.int32)
    group_indptr, doc_req = torch.tensor(indptr, **to), torch.tensor(doc_rows, **to)
    doc_lens = torch.tensor(docs, **to)
    shape = batch.q.shape
    doc_o, doc_lse = poisoned(shape, torch.float32), poisoned(shape[:2])
    shared_prefix_attention(batch.q, doc_o, doc_lse, pool.k, pool.v, batch.req_to_token,
                            group_indptr, doc_req, doc_lens, per_doc, max(docs), scale)
    ref_doc = shared_prefix_attention_ref(batch.q, pool.k, pool.v, batch.req_to_token,
                                          group_indptr, doc_req, doc_lens, scale)
    assert_close_to_ref(doc_o, ref_doc[0], dtype, f"{case} document o")
    assert_close_to_ref(doc_lse, ref_doc[1], max(dtype, torch.float32, key=DTYPES.index),
                        f"{case} document lse")

    suffix_o, suffix_lse = poisoned(shape, torch.float32), poisoned(shape[:2])
    decode_attention(batch.q, suffix_o, pool.k, pool.v, batch.req_to_token, batch.req_indices,
                     batch.kv_start, batch.prefix_lens, scale, lse=suffix_lse, seq_len_offset=1)
    out = poisoned(shape, dtype)
    merge_attention_states(doc_o, doc_lse, suffix_o, suffix_lse, out)
    full = decode_attention_ref(batch.q, pool.k, pool.v, batch.req_to_token, batch.req_indices,
                                torch.zeros_like(batch.kv_start), batch.prefix_lens + 1, scale)
    assert_close_to_ref(out, full[0], dtype, f"{case} cascade o")


def test_merge_handles_empty_states():
    """An empty side (lse = -inf) contributes nothing; two empty sides give 0 and -inf."""
    gen = torch.Generator().manual_seed(3)
    o_a, o_b = (torch.randn(5, 3, 16, generator=gen).to(DEVICE) for _ in range(2))
    lse_a, lse_b = (torch.randn(5, 3, generator=gen).to(DEVICE) for _ in range(2))
    lse_b[0] = float("-inf")
    lse_a[1], lse_b[1] = float("-inf"), float("-inf")
    out, lse = poisoned(o_a.shape), poisoned(lse_a.shape)
    merge_attention_states(o_a, lse_a, o_b, lse_b, out, lse)
    ref_o, ref_lse = combine_states_ref([(o_a.cpu(), lse_a.cpu()), (o_b.cpu(), lse_b.cpu())])
    ref_o[1] = 0.0
    assert_close_to_ref(out, ref_o, torch.float32, "merge o")
    assert_close_to_ref(lse, ref_lse, torch.float32, "merge lse")
    assert torch.equal(out[0].cpu(), o_a[0].cpu())


@pytest.mark.parametrize("states", [1, 3, MERGE_STATES, MERGE_STATES + 1, 3 * MERGE_STATES + 5])
def test_merge_partials_reads_any_state_count(states):
    """Split-KV and cascade steps merge from one to hundreds of states; the kernel reads them
    MERGE_STATES at a time, so counts at, below and past a loop step (empty states among
    them, and whole rows of empty states) must all give the float64 log-sum-exp merge."""
    gen = torch.Generator().manual_seed(states)
    tokens, heads, head_dim = 3, 5, 16
    part_o = torch.randn(tokens, heads, states, head_dim, generator=gen)
    part_lse = 4 * torch.randn(tokens, heads, states, generator=gen)
    part_lse[0, :, ::2] = float("-inf")  # every other state of a token saw no key
    part_lse[1, 2] = float("-inf")  # one (token, head) row saw none at all
    out, lse = poisoned((tokens, heads, head_dim)), poisoned((tokens, heads))
    merge_partials(part_o.to(DEVICE), part_lse.to(DEVICE), out, lse)
    ref_o, ref_lse = combine_states_ref([(part_o[:, :, i], part_lse[:, :, i])
                                         for i in range(states)])
    assert_close_to_ref(out, ref_o, torch.float32, f"merge of {states} states, o")
    assert_close_to_ref(lse, ref_lse, torch.float32, f"merge of {states} states, lse")
    assert torch.equal(out[1, 2].cpu(), torch.zeros(head_dim))
