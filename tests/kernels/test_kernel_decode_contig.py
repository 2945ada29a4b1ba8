"""decode_attention (stock) reading contiguous documents at affine addresses (doc_start/doc_len)
against the float64 reference: documents of one slot run each, questions and answers scattered,
one group's document left to the gather path (doc_len 0), splits forced. The contiguous rows'
document entries in req_to_token point at the sink, so only the affine path can pass."""

import math

import pytest
import torch
from checks import DEVICE, HEADS, ON_GPU, assert_close_to_ref, poisoned
from contig_inputs import junk_document, plan_takes
from kernel_inputs import Pool, decode_step

from ppqa.kernels.decode_attention import decode_attention, decode_attention_ref

DTYPES = [torch.float32, torch.bfloat16]
CASES = [((37, 300), 3), ((300, 37), 2)] + ([((1000, 16000), 32)] if ON_GPU else [])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"h{h[0]}kv{h[1]}d{h[2]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"docs{'-'.join(map(str, c[0]))}x{c[1]}")
def test_decode_reads_contiguous_documents(case, heads, dtype):
    docs, per_doc = case
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(sum(docs) + per_doc + num_heads)
    suffixes = [torch.randint(1, 40, (per_doc,), generator=gen).tolist() for _ in docs]
    pool = Pool(sum(docs) + len(docs) * per_doc * 45 + 64, num_kv_heads, head_dim, dtype, DEVICE,
                gen)
    # Documents as one run each (the engine's allocator), every suffix scattered.
    takes = [t for doc, lens in zip(docs, suffixes) for t in [(doc, True)] + [(n + 1, False) for n in lens]]
    starts = plan_takes(pool, takes, gen)
    batch, indptr, _ = decode_step(pool, docs, suffixes, num_heads, head_dim, gen, DEVICE)
    scale = 1 / math.sqrt(head_dim)
    seq_lens = batch.prefix_lens + 1
    ref = decode_attention_ref(batch.q, pool.k, pool.v, batch.req_to_token, batch.req_indices,
                               batch.kv_start, seq_lens, scale)
    # Group 0's document goes through the affine path; group 1's is left to the gather path.
    i32 = dict(dtype=torch.int32, device=DEVICE)
    doc_start = torch.zeros(indptr[-1], **i32)
    doc_len = torch.zeros(indptr[-1], **i32)
    doc_start[indptr[0]:indptr[1]], doc_len[indptr[0]:indptr[1]] = starts[0], docs[0]
    rows = batch.req_indices[indptr[0]:indptr[1]].tolist()
    table = junk_document(batch.req_to_token, rows, [docs[0]] * len(rows))
    # the default copy path, then each of the two paths forced
    for splits, tma in ((None, None), (1, False), (3, False), (1, True), (3, True)):
        o, lse = poisoned(batch.q.shape, dtype), poisoned(batch.q.shape[:2])
        used = decode_attention(batch.q, o, pool.k, pool.v, table, batch.req_indices,
                                batch.kv_start, batch.prefix_lens, scale, lse=lse,
                                num_splits=splits, seq_len_offset=1,
                                max_seq_len=int(seq_lens.max()), doc_start=doc_start,
                                doc_len=doc_len, tma=tma)
        what = f"{case} splits={used} tma={tma}"
        assert_close_to_ref(o, ref[0], dtype, f"{what} o")
        assert_close_to_ref(lse, ref[1], torch.float32, f"{what} lse")


def test_doc_start_and_doc_len_go_together():
    q = torch.zeros(1, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="together"):
        decode_attention(q, q.clone(), torch.zeros(4, 2, 16, device=DEVICE),
                         torch.zeros(4, 2, 16, device=DEVICE),
                         torch.zeros(1, 4, dtype=torch.int32, device=DEVICE),
                         *(torch.zeros(1, dtype=torch.int32, device=DEVICE),) * 3, 1.0,
                         doc_start=torch.zeros(1, dtype=torch.int32, device=DEVICE))
