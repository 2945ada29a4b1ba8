"""The stream-K document kernel (`launch_stream_prefix`) against the float64 reference: groups
of contiguous documents, an empty group for stock rows, groups past the step's (a graph's
padding), at grids and state counts that make CTAs' runs cross items and leave states unused;
the scratch states start as NaN, so a state the kernel should have written or marked empty
shows."""

import math

import pytest
import torch
from checks import DEVICE, DTYPES, HEADS, ON_GPU, assert_close_to_ref, case_id, poisoned
from contig_inputs import plan_takes
from kernel_inputs import Pool, decode_step

from ppqa.kernels._arch import Tiles
from ppqa.kernels.cascade import shared_prefix_attention_ref, tiling
from ppqa.kernels.cascade_stream import launch_stream_prefix, stream_ctas, stream_states
from ppqa.kernels.merge import merge_partials

# (document lengths, requests per group); a 0 is a group whose document is empty (the step's
# stock requests)
CASES = [((300,), 5), ((300, 37, 0), 3), ((130, 700, 64), 2)] + \
    ([((1000, 300), 64), ((20000, 19000, 0), 18)] if ON_GPU else [])
STREAM_DTYPES = DTYPES if ON_GPU else [torch.float32, torch.bfloat16]


def step_inputs(docs, per_doc, heads, dtype, padding):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(sum(docs) + per_doc + len(docs))
    suffixes = [torch.randint(1, 40, (per_doc,), generator=gen).tolist() for _ in docs]
    pool = Pool(sum(docs) + len(docs) * per_doc * 45 + 64, num_kv_heads, head_dim, dtype, DEVICE,
                gen)
    takes = [take for n, lens in zip(docs, suffixes)
             for take in [(n, n > 0)] + [(m + 1, False) for m in lens]]
    runs = iter(plan_takes(pool, takes, gen))
    starts = [next(runs) if n else 0 for n in docs]
    batch, indptr, doc_rows = decode_step(pool, docs, suffixes, num_heads, head_dim, gen, DEVICE,
                                          cascade=True)
    to = dict(device=DEVICE, dtype=torch.int32)
    ref = shared_prefix_attention_ref(
        batch.q, pool.k, pool.v, batch.req_to_token, torch.tensor(indptr, **to),
        torch.tensor(doc_rows, **to), torch.tensor(docs, **to), 1 / math.sqrt(head_dim))
    # a graph's padded groups: no requests, no document
    indptr = indptr + [indptr[-1]] * padding
    docs, starts = list(docs) + [0] * padding, starts + [0] * padding
    return (pool, batch, torch.tensor(indptr, **to), torch.tensor(docs, **to),
            torch.tensor(starts, **to), ref)


def run_stream(pool, batch, indptr, doc_lens, starts, per_doc, states, offset=0, **kw):
    """Document states [offset, offset + states) of poisoned buffers, merged; the states below
    offset (the suffix's, in a step) are marked empty here."""
    rows, num_heads, head_dim = batch.q.shape
    part_o = poisoned((rows, num_heads, offset + states, head_dim))
    part_lse = poisoned((rows, num_heads, offset + states))
    part_lse[:, :, :offset] = float("-inf")
    launch_stream_prefix(batch.q, pool.k, pool.v, indptr, doc_lens, starts, per_doc,
                         1 / math.sqrt(head_dim), states, part_o, part_lse, state_offset=offset,
                         **kw)
    assert not torch.isnan(part_lse).any(), "a state neither written nor marked empty"
    o, lse = poisoned(batch.q.shape, batch.q.dtype), poisoned(batch.q.shape[:2])
    merge_partials(part_o, part_lse, o, lse)
    return o, lse


@pytest.mark.parametrize("dtype", STREAM_DTYPES, ids=case_id)
@pytest.mark.parametrize("heads", HEADS, ids=case_id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"docs{'-'.join(map(str, c[0]))}x{c[1]}")
def test_stream_prefix_matches_reference(case, heads, dtype):
    docs, per_doc = case
    pool, batch, indptr, doc_lens, starts, (ref_o, ref_lse) = step_inputs(docs, per_doc, heads,
                                                                          dtype, padding=3)
    # (ctas, states, tiles, tma): the planned grid; one CTA doing all; grids whose runs end
    # mid-item; a bound of 2 states that lengthens runs; short key tiles (many units)
    runs = [(None, 3, None, None), (1, 2, None, False), (3, 2, None, True),
            (7, 5, None, False), (64, 9, None, True)]
    if dtype == torch.float32:
        runs += [(5, 2, Tiles(16, 16, 4, 1), False), (13, 4, Tiles(16, 16, 4, 1), True)]
    for ctas, states, tiles, tma in runs:
        o, lse = run_stream(pool, batch, indptr, doc_lens, starts, per_doc, states,
                            offset=2, ctas=ctas, tiles=tiles, tma=tma)
        what = f"{case} ctas={ctas} states={states} tiles={tiles} tma={tma} stream"
        assert_close_to_ref(o, ref_o, dtype, f"{what} o")
        assert_close_to_ref(lse, ref_lse, max(dtype, torch.float32, key=DTYPES.index),
                            f"{what} lse")


def test_stream_states_fill_the_grid_within_the_scratch():
    """The planned states let the fewest documents the plan allows keep every CTA busy, and
    stay within the scratch; too small a scratch gives 0 (the split kernel then runs)."""
    from ppqa.kernels.merge import PartialScratch
    num_heads, num_kv_heads, head_dim = HEADS[1]
    dtype = torch.float32
    tiles, _, _ = tiling(DEVICE, dtype, num_heads // num_kv_heads, 18, contiguous=True)
    ctas = stream_ctas(DEVICE, tiles, num_kv_heads)  # a KV head's
    assert ctas * num_kv_heads <= stream_ctas(DEVICE, tiles, 1) < (ctas + 1) * num_kv_heads
    for least in (1, 2, 5, 40):
        states = stream_states(DEVICE, dtype, 64, num_heads, num_kv_heads, head_dim, least, 18)
        assert states >= 2
        # every item of the fewest groups meets at most `states` CTAs, and together they can
        # use all of a head's CTAs
        assert least * (states - 1) >= min(ctas, least * 63)
    scratch = PartialScratch(64 * num_heads * head_dim * 3, DEVICE)
    assert stream_states(DEVICE, dtype, 64, num_heads, num_kv_heads, head_dim, 1, 18,
                         scratch) == 3
    assert stream_states(DEVICE, dtype, 64, num_heads, num_kv_heads, head_dim, 1, 18,
                         scratch, reserved_states=2) == 0


def test_stream_prefix_refuses_one_state():
    pool, batch, indptr, doc_lens, starts, _ = step_inputs((37,), 2, HEADS[0], torch.float32, 0)
    with pytest.raises(ValueError, match="at least 2 states"):
        run_stream(pool, batch, indptr, doc_lens, starts, 2, 1)
