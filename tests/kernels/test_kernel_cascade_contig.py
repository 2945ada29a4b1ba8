"""The shared-prefix (cascade document) kernel with contiguous documents (doc_starts) against the
float64 reference, at the planned split count and forced ones (the planners' promises are
checked in test_split_plans.py)."""

import math

import pytest
import torch
from checks import DEVICE, DTYPES, HEADS, ON_GPU, assert_close_to_ref, case_id, poisoned
from contig_inputs import junk_document, plan_takes
from kernel_inputs import Pool, decode_step

from ppqa.kernels._arch import Tiles
from ppqa.kernels.cascade import shared_prefix_attention, shared_prefix_attention_ref

# (document lengths of the batch's groups, requests per group)
CASES = [((37,), 1), ((300,), 5), ((300, 37), 3)] + ([((1000, 300), 64)] if ON_GPU else [])
CONTIG_DTYPES = DTYPES if ON_GPU else [torch.float32, torch.bfloat16]


# (dtype, key scale): keys scaled by 64 give scores whose running maximum jumps far mid-row, so
# an exponent taken against a stale maximum would overflow (float32: the exact comparison).
SCALES = [(dtype, 1.0) for dtype in CONTIG_DTYPES] + [(torch.float32, 64.0)]


@pytest.mark.parametrize("dtype,sharp", SCALES, ids=lambda v: case_id(v) if v != 1.0 else "")
@pytest.mark.parametrize("heads", HEADS, ids=case_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"docs{'-'.join(map(str, c[0]))}x{c[1]}")
def test_contiguous_prefix_matches_reference(case, heads, dtype, sharp):
    """Each group's document in one run of slots (the suffixes scattered), every document entry
    of req_to_token pointing at the sink: the kernel must read the runs through doc_starts."""
    docs, per_doc = case
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(sum(docs) + per_doc)
    suffixes = [torch.randint(1, 40, (per_doc,), generator=gen).tolist() for _ in docs]
    pool = Pool(sum(docs) + len(docs) * per_doc * 45 + 64, num_kv_heads, head_dim, dtype, DEVICE,
                gen)
    takes = [take for n, lens in zip(docs, suffixes)
             for take in [(n, True)] + [(m + 1, False) for m in lens]]
    pool.k *= sharp
    starts = plan_takes(pool, takes, gen)
    batch, indptr, doc_rows = decode_step(pool, docs, suffixes, num_heads, head_dim, gen, DEVICE,
                                          cascade=True)
    to = dict(device=DEVICE, dtype=torch.int32)
    group_indptr, doc_req = torch.tensor(indptr, **to), torch.tensor(doc_rows, **to)
    doc_lens, doc_starts = torch.tensor(docs, **to), torch.tensor(starts, **to)
    scale = 1 / math.sqrt(head_dim)
    ref_o, ref_lse = shared_prefix_attention_ref(batch.q, pool.k, pool.v, batch.req_to_token,
                                                 group_indptr, doc_req, doc_lens, scale)
    table = junk_document(batch.req_to_token, range(batch.q.shape[0]),
                          [n for n, lens in zip(docs, suffixes) for _ in lens])
    # the pointer-load loop and the TMA loop, at several split counts
    runs = [(None, None, None), (3, None, False), (3, None, True), (2, None, False),
            (2, None, True)]
    if dtype == torch.float32:  # short key tiles, more splits than tiles (some empty)
        runs += [(17, Tiles(16, 16, 4, 1), False), (17, Tiles(16, 16, 4, 1), True),
                 (5, Tiles(16, 16, 4, 1), True)]
    for splits, tiles, tma in runs:
        o, lse = poisoned(batch.q.shape, dtype), poisoned(batch.q.shape[:2])
        used = shared_prefix_attention(batch.q, o, lse, pool.k, pool.v, table, group_indptr,
                                       doc_req, doc_lens, per_doc, max(docs), scale,
                                       num_splits=splits, doc_starts=doc_starts, tiles=tiles,
                                       tma=tma)
        what = f"{case} splits={used} tma={tma} contiguous"
        assert_close_to_ref(o, ref_o, dtype, f"{what} o")
        assert_close_to_ref(lse, ref_lse, max(dtype, torch.float32, key=DTYPES.index),
                            f"{what} lse")
