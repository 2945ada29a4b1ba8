"""Grouping prompts by their longest shared prefix: which requests of a batch become one document.

`group_by_shared_prefix(texts)` partitions the prompts so that as much text as possible is
shared: it maximizes the sum over groups of (size - 1) x (the group's common prefix length), the
characters that are prefilled once for the group instead of once per request. Sorted, prompts
with long common prefixes are neighbours, and the common prefix of a run of neighbours is the
smallest adjacent one; the runs form a tree (each run splits at its smallest adjacent prefix into
runs with longer ones), and the best partition is found bottom-up: a run is one group when that
shares more than the best partitions of its sub-runs do.

Example: 3 documents x 10 questions behind one system prompt of S characters give 3 groups (one
per document) unless the documents are shorter than about S/13, when one group sharing only the
system prompt saves more. Cost: a sort, one prefix comparison per neighbour (binary search on
slices), and one pass per tree level.
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(a: str, b: str) -> int:
    """Length of the longest common prefix of `a` and `b` (slice compares, not a char loop)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def group_by_shared_prefix(texts: Sequence[str]) -> list[list[int]]:
    """Indices of `texts` partitioned as the module doc says; each group in input order, groups
    ordered by their first index."""
    n = len(texts)
    if n == 0:
        return []
    order = sorted(range(n), key=lambda i: texts[i])
    # adjacent[p]: common prefix of sorted positions p-1 and p (adjacent[0] unused)
    adjacent = [0] + [common_prefix_length(texts[order[p - 1]], texts[order[p]])
                      for p in range(1, n)]
    best: dict[tuple[int, int], tuple[int, list[tuple[int, int]]]] = {}
    stack = [(0, n, False)]
    while stack:  # post-order over runs [lo, hi) of sorted positions
        lo, hi, children_done = stack.pop()
        if hi - lo == 1:
            best[(lo, hi)] = (0, [(lo, hi)])
            continue
        shared = min(adjacent[lo + 1:hi])
        cuts = [p for p in range(lo + 1, hi) if adjacent[p] == shared]
        runs = list(zip([lo, *cuts], [*cuts, hi]))
        if not children_done:
            stack.append((lo, hi, True))
            stack.extend((a, b, False) for a, b in runs)
            continue
        split_value = sum(best[run][0] for run in runs)
        whole_value = (hi - lo - 1) * shared
        if shared > 0 and whole_value >= split_value:
            best[(lo, hi)] = (whole_value, [(lo, hi)])
        else:
            best[(lo, hi)] = (split_value, [g for run in runs for g in best[run][1]])
        for run in runs:
            del best[run]
    groups = [sorted(order[lo:hi]) for lo, hi in best[(0, n)][1]]
    return sorted(groups, key=lambda g: g[0])
