"""The row-length buckets that CUDA graphs are captured for (`graph_runner.length_bucket`): pure
arithmetic, tested here on the CPU; the captures themselves are in tests/gpu/test_engine_graphs.py.

A bucket is the smallest of 2^k x (1, 1.25, 1.5, 1.75), at least 256, that holds the row: so a
step's row length never exceeds its graph's, a graph is at most 25% longer than its row, and
few graphs cover every length a model may reach.
"""

import bisect

from ppqa.engine.runtime.graph_runner import length_bucket

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
