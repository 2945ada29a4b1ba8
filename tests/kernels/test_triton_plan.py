"""The Triton backend's host-side launch plan for a cascade decode step padded for a CUDA graph:
the dummies' group has an empty document, its CTAs return at once, so the document splits are
planned for the groups that have a document (`CascadeMetadata.doc_groups`): a padded step plans
what the same step unpadded plans."""

from types import SimpleNamespace

import torch

from ppqa.engine.attention.metadata import CascadeMetadata, ForwardMetadata
from ppqa.engine.attention.triton_backend import TritonBackend

HEADS, DIM, DOC = 4, 16, 4096


def decode_meta(group_sizes: list[int], doc_lens: list[int], doc_groups: int | None):
    i32 = dict(dtype=torch.int32)
    batch = sum(group_sizes)
    indptr = torch.tensor([0] + group_sizes, **i32).cumsum(0).to(torch.int32)
    cascade = CascadeMetadata(indptr, torch.zeros(len(group_sizes), **i32),
                              torch.tensor(doc_lens, **i32), max_group_size=max(group_sizes),
                              max_doc_len=max(doc_lens), doc_starts=torch.ones(len(doc_lens), **i32),
                              contiguous=True, doc_groups=doc_groups)
    return ForwardMetadata(
        kind="decode", positions=torch.zeros(batch, dtype=torch.int64),
        out_slots=torch.zeros(batch, dtype=torch.int64), q_sid=torch.zeros(batch, **i32),
        qo_indptr=torch.arange(batch + 1, **i32), req_indices=torch.zeros(batch, **i32),
        kv_start=torch.full((batch,), DOC, **i32), prefix_lens=torch.full((batch,), DOC + 9, **i32),
        req_to_token=torch.zeros(1, DOC + 16, **i32), logit_indices=torch.arange(batch),
        max_extend_len=1, max_prefix_len=DOC + 9, cascade=cascade)


def test_padded_cascade_step_plans_document_splits_for_its_real_groups():
    kv = torch.zeros(DOC + 16, HEADS, DIM)
    pool = SimpleNamespace(k_buffers=[kv], v_buffers=[kv.clone()],
                           slot_sid=torch.full((DOC + 16,), -1, dtype=torch.int32))
    backend = TritonBackend(pool, HEADS, HEADS, DIM, DIM ** -0.5)
    alone = backend.plan(decode_meta([3], [DOC], None))
    padded = backend.plan(decode_meta([3, 1], [DOC, 0], doc_groups=1))
    counted = backend.plan(decode_meta([3, 1], [DOC, 0], doc_groups=None))  # dummies counted
    assert padded.prefix_splits == alone.prefix_splits
    # the premise: counting the dummies' group would change the plan (the interpreter's 4 "SMs"
    # hold 8 CTAs; one group's 4 programs fill them in 2 splits, two groups' 8 in one)
    assert counted.prefix_splits != alone.prefix_splits


def test_cascade_step_takes_the_stream_kernel_where_splits_would_leave_the_gpu_idle():
    """A graph bound of 8 documents (one KV head) plans one split each for 8, which at its
    fewest, 5, fills 5 of the interpreter's 8 CTA slots: the stream kernel, with states for 5
    documents to fill the grid. One document fills the slots with its splits: the split
    kernel. stream_prefix True / False forces either."""
    from ppqa.engine.attention.triton_backend import STREAM_BELOW_FILL
    from ppqa.kernels.cascade import split_fill, tiling
    from ppqa.kernels.cascade_stream import stream_ctas

    kv = torch.zeros(DOC + 16, 1, DIM)
    pool = SimpleNamespace(k_buffers=[kv], v_buffers=[kv.clone()],
                           slot_sid=torch.full((DOC + 16,), -1, dtype=torch.int32))
    backend = TritonBackend(pool, HEADS, 1, DIM, DIM ** -0.5)
    eight, one = decode_meta([3] * 8, [DOC] * 8, doc_groups=8), decode_meta([3], [DOC], None)
    backend.stream_prefix = False
    split_eight, split_one = backend.plan(eight), backend.plan(one)
    assert not split_eight.stream and not split_one.stream
    dev = torch.device("cpu")
    assert split_fill(dev, torch.float32, HEADS, 1, 5, 3, split_eight.prefix_splits) \
        < STREAM_BELOW_FILL <= split_fill(dev, torch.float32, HEADS, 1, 1, 3,
                                          split_one.prefix_splits)
    backend.stream_prefix = None
    auto_eight, auto_one = backend.plan(eight), backend.plan(one)
    assert auto_eight.stream and auto_one == split_one
    tiles = tiling(dev, torch.float32, HEADS, 3, contiguous=True)[0]
    assert 5 * (auto_eight.prefix_splits - 1) >= stream_ctas(dev, tiles, 1)
    assert auto_eight.splits == split_eight.splits  # the suffix's plan is the same
    backend.stream_prefix = True
    assert backend.plan(one).stream
