"""extend_attention against its float64 reference on engine-shaped parallel-prompting steps:
document prefill, packed question prefill, then four decode steps of P tokens per request; and
the same steps with the document in one run of slots, read through doc_start/doc_len."""

import math

import pytest
import torch
from checks import DEVICE, DTYPES, HEADS, ON_GPU, assert_close_to_ref, case_id, poisoned
from contig_inputs import junk_document, plan_takes
from kernel_inputs import Pool, parallel_step

from ppqa.kernels._arch import Tiles
from ppqa.kernels.extend_attention import extend_attention, extend_attention_ref

# (document tokens, streams per request, requests)
LAYOUTS = [(37, 1, 1), (300, 5, 3), (1000, 64, 1)] + ([(1000, 16, 4)] if ON_GPU else [])
PHASES = ["doc", "questions", 1, 2, 3, 4]


def run_step(batch, pool, dtype, sm_scale, what, kernel_table=None, **kwargs):
    """The kernel (on kernel_table if given, else the batch's table) against the reference on
    the batch's table."""
    o = poisoned(batch.q.shape, dtype)
    lse = poisoned(batch.q.shape[:2])
    table = kernel_table if kernel_table is not None else batch.req_to_token
    extend_attention(
        batch.q, batch.k_new, batch.v_new, o, pool.k, pool.v, table,
        batch.req_indices, batch.kv_start, batch.prefix_lens, batch.qo_indptr, batch.q_sid,
        batch.slot_sid, batch.max_extend_len, sm_scale, lse=lse,
        max_prefix_len=int(batch.prefix_lens.max()), **kwargs,
    )
    ref_o, ref_lse = extend_attention_ref(
        batch.q, batch.k_new, batch.v_new, pool.k, pool.v, batch.req_to_token,
        batch.req_indices, batch.kv_start, batch.prefix_lens, batch.qo_indptr, batch.q_sid,
        batch.slot_sid, sm_scale,
    )
    assert_close_to_ref(o, ref_o, dtype, f"{what} o")
    assert_close_to_ref(lse, ref_lse, torch.float32 if dtype == torch.float32 else dtype,
                        f"{what} lse")


# Every layout x heads x dtype on a GPU; under the slow CPU interpreter fp16 skips the largest
# layout (fp32 and bf16 cover it, fp16 the smaller ones).
CASES = [(layout, heads, dtype) for layout in LAYOUTS for heads in HEADS for dtype in DTYPES
         if ON_GPU or layout[1] < 64 or dtype != torch.float16]


@pytest.mark.parametrize(("layout", "heads", "dtype"), CASES, ids=case_id)
def test_extend_matches_reference(layout, heads, dtype):
    doc_len, streams, requests = layout
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(doc_len * 131 + streams)
    question_lens = [torch.randint(1, 10, (streams,), generator=gen).tolist()
                     for _ in range(requests)]
    for phase in PHASES:
        pool = Pool(doc_len + requests * streams * 14 + 64, num_kv_heads, head_dim, dtype,
                    DEVICE, gen)
        batch = parallel_step(pool, doc_len, question_lens, phase, num_heads, head_dim, gen, DEVICE)
        run_step(batch, pool, dtype, 1 / math.sqrt(head_dim), f"{layout} {phase}")


def test_extend_forced_splits_match_one_split():
    """Many splits (more than the row has tiles, so some are empty) give the same answer."""
    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim = HEADS[1]
    pool = Pool(600, num_kv_heads, head_dim, torch.float32, DEVICE, gen)
    batch = parallel_step(pool, 300, [[3, 1, 4], [1, 5, 9]], 2, num_heads, head_dim, gen, DEVICE)
    for splits in (1, 3, 17):
        run_step(batch, pool, torch.float32, 0.25, f"splits={splits}", num_splits=splits)


def test_extend_hides_other_streams():
    """Changing another stream's K/V must not change a stream's output (the mask is real)."""
    gen = torch.Generator().manual_seed(11)
    num_heads, num_kv_heads, head_dim = HEADS[0]
    pool = Pool(400, num_kv_heads, head_dim, torch.float32, DEVICE, gen)
    batch = parallel_step(pool, 37, [[2, 3, 2, 4]], 3, num_heads, head_dim, gen, DEVICE)
    args = lambda o: (batch.q, batch.k_new, batch.v_new, o, pool.k, pool.v, batch.req_to_token,
                      batch.req_indices, batch.kv_start, batch.prefix_lens, batch.qo_indptr,
                      batch.q_sid, batch.slot_sid, batch.max_extend_len, 0.25)
    before = poisoned(batch.q.shape)
    extend_attention(*args(before))
    other = (pool.slot_sid == 2).to(DEVICE)  # stream 2's cached slots
    pool.k[other] += 3.0
    pool.v[other] -= 2.0
    after = poisoned(batch.q.shape)
    extend_attention(*args(after))
    stream2 = (batch.q_sid == 2)
    assert torch.equal(before[~stream2], after[~stream2])
    assert not torch.allclose(before[stream2], after[stream2])


# (document tokens, streams per request, requests); under the interpreter fp32 and bf16 only.
CONTIG_LAYOUTS = [(37, 3, 3), (300, 5, 3)] + ([(1000, 16, 4)] if ON_GPU else [])
CONTIG_DTYPES = DTYPES if ON_GPU else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", CONTIG_DTYPES, ids=case_id)
@pytest.mark.parametrize("heads", HEADS, ids=case_id)
@pytest.mark.parametrize("layout", CONTIG_LAYOUTS, ids=case_id)
def test_extend_contiguous_document_matches_reference(layout, heads, dtype):
    """The document in one run of slots, questions and answers scattered. Request 0 declares
    its whole document, request 1 none (doc_len 0: all gathered), request 2 only a part that
    ends mid-tile; their req_to_token entries for the declared part point at the sink, so the
    contiguous path must not read them. Question prefill and a decode step, several splits."""
    doc_len, streams, requests = layout
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(doc_len * 7 + streams)
    question_lens = [torch.randint(1, 10, (streams,), generator=gen).tolist()
                     for _ in range(requests)]
    declared = [doc_len, 0, doc_len // 2 + 1, doc_len][:requests]
    to = dict(device=DEVICE, dtype=torch.int32)
    for phase in ("questions", 2):
        pool = Pool(doc_len + requests * streams * 14 + 64, num_kv_heads, head_dim, dtype,
                    DEVICE, gen)
        (start,) = plan_takes(pool, [(doc_len, True)], gen)
        batch = parallel_step(pool, doc_len, question_lens, phase, num_heads, head_dim, gen, DEVICE)
        table = junk_document(batch.req_to_token, range(requests), declared)
        doc = dict(doc_start=torch.full((requests,), start, **to),
                   doc_len=torch.tensor(declared, **to), kernel_table=table)
        # the default copy path, then each of the two paths forced
        for splits, tma in ((None, None), (3, False), (3, True)):
            run_step(batch, pool, dtype, 1 / math.sqrt(head_dim),
                     f"{layout} {phase} contiguous tma={tma}", num_splits=splits, tma=tma, **doc)
        if dtype == torch.float32:  # short key tiles: the document ends inside many splits
            for tma in (False, True):
                run_step(batch, pool, dtype, 1 / math.sqrt(head_dim),
                         f"{layout} {phase} 16x32 tma={tma}", num_splits=7,
                         tiles=Tiles(16, 32, 4, 1), tma=tma, **doc)


def test_extend_doc_arguments_come_together():
    gen = torch.Generator().manual_seed(2)
    pool = Pool(100, 2, 16, torch.float32, DEVICE, gen)
    batch = parallel_step(pool, 37, [[2, 3]], 1, 2, 16, gen, DEVICE)
    with pytest.raises(ValueError, match="together"):
        run_step(batch, pool, torch.float32, 0.25, "doc_start alone",
                 doc_start=torch.ones(1, device=DEVICE, dtype=torch.int32))
