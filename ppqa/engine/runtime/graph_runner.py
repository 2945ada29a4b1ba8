"""CUDA graphs for decode steps: capture once per step shape, then copy inputs in and replay.

A decode step's shapes depend only on the padded batch (B requests of P new tokens each) and
on host-side launch choices of the attention backend, which the backend derives from
`max_prefix_len` (split counts), and on which kernel variants the step's metadata selects (the
optional document hints, contiguous cascade documents). The graph key is therefore (kind, B, T,
P, length bucket, cascade groups, fields present): the length bucket is an upper bound on every row's length, rounded up to a
quarter of a power of two so that a long run captures a handful of graphs, not one per step.
The kernels read real lengths from tensors, so a bound only steers how the work is split.

Replay: the step's device tensors (from `ModelRunner.prepare`) are copied into the graph's
static tensors, the graph replays the model's forward and logits, and the static logits come
back. Every graph shares one memory pool; capture happens on a side stream after one eager
warm-up run (Triton compiles and the backend plans outside the capture), queued behind the
device's work rather than after waiting for it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ppqa.engine.attention.metadata import CascadeMetadata, ForwardMetadata


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the bucket of a decode step's requests
    and of a cascade step's group counts."""
    return 1 << max(n - 1, 0).bit_length()


def length_bucket(n: int) -> int:
    """The smallest of 2^k x (1, 1.25, 1.5, 1.75) that is >= n (at least 256)."""
    n = max(n, 256)
    top = pow2(n)
    for step in (top // 2 + top // 8, top // 2 + top // 4, top // 2 + 3 * top // 8):
        if n <= step:
            return step
    return top


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    meta: ForwardMetadata  # static tensors; host maxima set to the bucket's bounds
    logits: torch.Tensor


# A shape is captured on its third use; before that its steps run eagerly.
CAPTURE_AFTER = 3

_TENSOR_FIELDS = ("positions", "out_slots", "q_sid", "qo_indptr", "req_indices", "kv_start",
                  "prefix_lens", "logit_indices")
_OPTIONAL_FIELDS = ("doc_start", "doc_len")  # present or not per step: part of the key


def _fields(meta: ForwardMetadata) -> list[str]:
    return list(_TENSOR_FIELDS) + [n for n in _OPTIONAL_FIELDS if getattr(meta, n) is not None]


class GraphCache:
    """Captured decode steps of one model runner, keyed by step shape."""

    def __init__(self, model, backend, device: torch.device) -> None:
        self.model, self.backend, self.device = model, backend, device
        self.graphs: dict[tuple, CapturedStep] = {}
        self.seen: dict[tuple, int] = {}  # uses of shapes not captured yet
        self.pool = torch.cuda.graph_pool_handle()
        self.stream: torch.cuda.Stream | None = None
        self.sync_captures = 0  # captures that fell back to `torch.cuda.graph` (see _capture)

    def key(self, meta: ForwardMetadata) -> tuple:
        casc = meta.cascade
        # Cascade steps are keyed by bounds, not counts: groups padded to a power of two with
        # empty ones, group size and document groups rounded up, so documents coming and
        # going in a long session reuse a few graphs instead of capturing one per mix. The
        # group size rounds up to a power of two, or to whole query tiles of the document
        # kernel where that is less (the backend's `cascade_group_bound`).
        group_bound = getattr(self.backend, "cascade_group_bound", None)
        cascade_key = None if casc is None else (
            pow2(casc.doc_req_indices.shape[0]),
            pow2(casc.max_group_size) if group_bound is None
            else group_bound(casc.max_group_size, casc.contiguous),
            length_bucket(casc.max_doc_len), casc.contiguous,
            pow2(casc.doc_groups if casc.doc_groups is not None else casc.doc_req_indices.shape[0]))
        return self._key(meta, cascade_key)

    def _key(self, meta: ForwardMetadata, cascade_key) -> tuple:
        return (meta.kind, meta.batch_size, meta.num_tokens, meta.max_extend_len,
                length_bucket(meta.max_prefix_len + meta.max_extend_len), cascade_key,
                tuple(_fields(meta)))

    def run(self, input_ids: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor | None:
        """The step's logits from its graph; None (run it eagerly) while its shape has been
        seen fewer than CAPTURE_AFTER times: a capture costs as much as many eager steps, and
        a long session's passing shapes (a draining batch's tail) are used only a few times."""
        key = self.key(meta)
        step = self.graphs.get(key)
        if step is None:
            self.seen[key] = self.seen.get(key, 0) + 1
            if self.seen[key] < CAPTURE_AFTER:
                return None
            step = self.graphs[key] = self._capture(key, input_ids, meta)
        step.input_ids.copy_(input_ids)
        for name in _fields(meta):
            getattr(step.meta, name).copy_(getattr(meta, name))
        if meta.cascade is not None:
            _copy_groups(step.meta.cascade, meta.cascade)
        step.graph.replay()
        return step.logits

    def _static_meta(self, key: tuple, meta: ForwardMetadata) -> ForwardMetadata:
        """A copy of `meta` in tensors the graph owns, with host maxima at the bucket's bounds."""
        bound = key[4]
        fields = {name: getattr(meta, name).clone() for name in _fields(meta)}
        cascade = None
        if meta.cascade is not None:
            groups, group_size, doc_bound, contiguous, doc_groups = key[5]
            casc = meta.cascade

            def room(t: torch.Tensor | None, extra: int) -> torch.Tensor | None:
                return None if t is None else torch.zeros(groups + extra, dtype=t.dtype,
                                                          device=t.device)
            cascade = CascadeMetadata(
                group_req_indptr=room(casc.group_req_indptr, 1),
                doc_req_indices=room(casc.doc_req_indices, 0), doc_lens=room(casc.doc_lens, 0),
                doc_starts=room(casc.doc_starts, 0), max_group_size=group_size,
                max_doc_len=doc_bound, contiguous=contiguous, doc_groups=doc_groups)
            _copy_groups(cascade, casc)
        return dataclasses.replace(meta, **fields, cascade=cascade,
                                   max_prefix_len=bound - meta.max_extend_len)

    def _forward(self, input_ids: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        init = getattr(self.backend, "init_forward_metadata", None)
        if init is not None:
            init(meta)
        hidden = self.model(input_ids, meta.positions, meta, self.backend)
        return self.model.compute_logits(hidden[meta.logit_indices])

    def _capture(self, key: tuple, input_ids: torch.Tensor, meta: ForwardMetadata) -> CapturedStep:
        """Capture on the cache's side stream, queued behind the device's work without waiting
        for it. (`torch.cuda.graph` synchronizes the device and empties the allocator's device
        and pinned-host caches on entering: a capture mid-run idled the GPU for its whole host
        time, and the steps after it pinned their copies afresh.) Where that capture fails (the
        graph pool could not grow without freeing cached blocks, which synchronizes), the step
        is captured again through `torch.cuda.graph`."""
        static_ids = input_ids.clone()
        static_meta = self._static_meta(key, meta)
        current = torch.cuda.current_stream(self.device)
        if self.stream is None:  # one stream for every capture: its cached blocks are reused
            self.stream = torch.cuda.Stream(self.device)
        stream = self.stream
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            # The warm-up writes this step's K/V exactly as the replay that follows will.
            self._forward(static_ids, static_meta)
        try:
            graph, logits = self._record(stream, static_ids, static_meta)
        except RuntimeError:
            # A capture that failed inside CUDA may leave the allocator routing this stream's
            # allocations to the graph pool: later captures take a new stream.
            self.stream = None
            graph = torch.cuda.CUDAGraph()  # its entry synchronizes: the warm-up is done
            with torch.cuda.graph(graph, pool=self.pool):
                logits = self._forward(static_ids, static_meta)
            self.sync_captures += 1
        current.wait_stream(stream)
        return CapturedStep(graph, static_ids, static_meta, logits)

    def _record(self, stream: torch.cuda.Stream, input_ids: torch.Tensor,
                meta: ForwardMetadata) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(graph, static logits) of one forward captured on `stream`. Thread-local capture:
        other threads' CUDA calls meanwhile (a pinned buffer for the grammar's masks) are not
        the capture's concern."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                logits = self._forward(input_ids, meta)
            except BaseException:
                try:
                    graph.capture_end()
                except RuntimeError:  # the failed capture's own error; the first one is raised
                    pass
                raise
            graph.capture_end()
        return graph, logits



def _copy_groups(static: CascadeMetadata, real: CascadeMetadata) -> None:
    """The step's groups into the graph's padded tensors; the groups past them are empty (no
    rows, no document), which the kernels skip."""
    n = real.doc_req_indices.shape[0]
    static.group_req_indptr[:n + 1].copy_(real.group_req_indptr)
    static.group_req_indptr[n + 1:] = real.group_req_indptr[n]
    for name in ("doc_req_indices", "doc_lens", "doc_starts"):
        target, source = getattr(static, name), getattr(real, name)
        if target is not None and source is not None:
            target[:n].copy_(source)
            target[n:] = 0
