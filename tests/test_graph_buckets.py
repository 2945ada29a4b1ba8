"""The row-length buckets that CUDA graphs are captured for (`graph_runner.length_bucket`): pure
arithmetic, tested here on the CPU; the captures themselves are in tests/gpu/test_engine_graphs.py.

A bucket is the smallest of 2^k x (1, 1.25, 1.5, 1.75), at least 256, that holds the row: so a
step's row length never exceeds its graph's, a graph is at most 25% longer than its row, and
few graphs cover every length a model may reach.
"""

import bisect

import torch

from ppqa.engine.runtime.graph_runner import GraphCache, length_bucket
from ppqa.kernels.cascade import group_size_bound

GPU = torch.device("cuda")  # tiles are chosen for a GPU from the device type alone

LENGTHS = range(1, 70_000)
# every allowed bucket up to 2^18: 2^k x (4 + j) / 4, k >= 8, j in 0..3
ALLOWED = sorted(2**k * (4 + j) // 4 for k in range(8, 18) for j in range(4))


def test_a_bucket_holds_its_row_and_is_the_smallest_that_does():
    for n in LENGTHS:
        assert length_bucket(n) == ALLOWED[bisect.bisect_left(ALLOWED, n)], n


def test_buckets_grow_with_the_row_and_waste_at_most_a_quarter():
    buckets = [length_bucket(n) for n in LENGTHS]
    assert buckets == sorted(buckets)
    assert all(b <= 1.25 * n for n, b in zip(LENGTHS, buckets) if n >= 256)
    assert all(length_bucket(b) == b for b in set(buckets))  # a bucket is its own bucket


def test_few_buckets_cover_every_length():
    assert [length_bucket(n) for n in (1, 256, 257, 320, 321, 384, 449, 513)] == \
        [256, 256, 320, 320, 384, 384, 512, 640]
    # four from each power of two 256 .. 32,768 to the next, then 65,536 and 81,920
    assert len({length_bucket(n) for n in LENGTHS}) == 4 * 8 + 2


def _query_tiles(group: int, size: int, contiguous: bool) -> int:
    from ppqa.kernels.cascade import tiling

    return tiling(GPU, torch.bfloat16, group, size, contiguous=contiguous)[2]


def _tile(group: int, size: int, contiguous: bool):
    from ppqa.kernels.cascade import tiling

    return tiling(GPU, torch.bfloat16, group, size, contiguous=contiguous)[:2]


def test_a_cascade_graphs_group_bound_fills_no_more_query_tiles_than_its_steps():
    # The bound a captured cascade step is planned for: it holds the step's largest group,
    # stays within the power of two above it or within one query tile, and spans exactly the
    # query tiles that group fills, with the kernel tile of that power of two, so the
    # document kernel's splits are planned for tiles that work (GPU tiling, computed on the
    # host: no device needed).
    for group in (1, 2, 4, 6, 7, 8):
        for contiguous in (True, False):
            for size in range(1, 257):
                bound = group_size_bound(GPU, torch.bfloat16, group, size, contiguous)
                pow2 = 1 << (size - 1).bit_length()
                one_tile = _tile(group, pow2, contiguous)[1] // group
                assert size <= bound <= max(pow2, one_tile), (group, size, bound)
                assert _query_tiles(group, bound, contiguous) == \
                    _query_tiles(group, size, contiguous), (group, size, bound)
                assert _tile(group, bound, contiguous) == _tile(group, pow2, contiguous)
    # Qwen2.5-7B (7 query heads a KV head): 18 questions fill one 128-row tile, not two of 32
    assert group_size_bound(GPU, torch.bfloat16, 7, 18, True) == 18
    assert group_size_bound(GPU, torch.bfloat16, 1, 65, True) == 128  # MHA: a power of two


def test_groups_that_fit_one_query_tile_share_one_bound():
    # MHA over a contiguous document: every group of up to 64 requests takes one 64-row tile,
    # so steps whose largest group is 1, 16, 32 or 64 requests replay one graph
    assert {group_size_bound(GPU, torch.bfloat16, 1, n, True) for n in range(1, 65)} == {64}
    # Qwen2.5-7B: groups of up to 8 requests take a 64-row tile (9 requests), 9-18 a 128-row one
    assert {group_size_bound(GPU, torch.bfloat16, 7, n, True) for n in range(1, 9)} == {9}
    assert {group_size_bound(GPU, torch.bfloat16, 7, n, True) for n in range(9, 19)} == {18}


def test_graphs_of_cascade_steps_are_keyed_by_the_backends_group_bound():
    from types import SimpleNamespace

    from ppqa.engine.attention.metadata import CascadeMetadata

    def key(backend, size):
        i32 = dict(dtype=torch.int32)
        casc = CascadeMetadata(torch.tensor([0, size], **i32), torch.zeros(1, **i32),
                               torch.tensor([1000], **i32), max_group_size=size,
                               max_doc_len=1000, contiguous=True, doc_groups=1)
        cache = GraphCache.__new__(GraphCache)
        cache.backend = backend
        return cache.key(SimpleNamespace(cascade=casc, kind="decode", batch_size=size,
                                         num_tokens=size, max_extend_len=1, max_prefix_len=1100,
                                         doc_start=None, doc_len=None))[5]

    seven = SimpleNamespace(cascade_group_bound=lambda n, contiguous: group_size_bound(
        GPU, torch.bfloat16, 7, n, contiguous))
    assert key(seven, 18)[1] == 18 and key(seven, 19)[1] == 32  # 19: two tiles, up to 36
    assert key(SimpleNamespace(), 18)[1] == 32  # a backend without a bound: powers of two
