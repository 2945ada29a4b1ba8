"""The GPU attention backend: maps each step's ForwardMetadata onto the Triton kernels.

Per step (`init_forward_metadata`, called by the runner once; `forward` also notices a new
`meta`), the backend fixes the host-side launch plan: the split count of each kernel, from the
batch shape, the metadata's maxima and the SM count. Per layer, `forward`:
  1. scatters the step's K/V into the layer's pool buffers (`store_kv`);
  2. "extend" (prefill, question prefill, every `parallel` decode step): `extend_attention`
     with the stream rule from meta.q_sid and pool.slot_sid; a document's first chunk
     (`meta.plain_causal`, or after a copied opening of at most CHUNK_ROWS tokens) in
     bf16/fp16 through our causal kernel (`kernels/causal_prefill.py`) or cuDNN instead,
     chosen per row class (`triton_first`), and a later chunk of a document held in one slot run
     (`meta.doc_prior`) as two cuDNN calls, the chunk against the earlier tokens (every key
     visible) and against itself (causal), merged by their log-sum-exp;
     "decode" (stock): `decode_attention` over row[kv_start, prefix_len + 1);
     "decode" with meta.cascade: the suffix row[doc_len, prefix_len + 1) per request
     (decode kernel) and the group's document (shared-prefix kernel) each write partial states
     into one preallocated buffer, which one merge launch reduces to the output. On a GPU the
     document part runs on a side stream beside the suffix (`overlap`): one is bound by tensor
     cores, the other by memory, and CUDA graph capture keeps the fork and join as edges;
     "extend" with meta.cascade (cascade question prefill): the shared-prefix kernel over the
     group's question tokens, the extend kernel from kv_start, merged by their lse.
Partial states live in a `PartialScratch` allocated once, so split launches allocate nothing
and keep fixed addresses (CUDA graph capture); splits are capped to what it holds.
Under TRITON_INTERPRET=1 the same code runs on CPU tensors (slowly), which the tests use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ppqa.engine.attention.fused_chunks import (
    CHUNK_ROWS, chunk_attention, first_chunk_class, fusable, triton_first,
)
from ppqa.engine.attention.metadata import ForwardMetadata, RecentPlans
from ppqa.kernels.cascade import (
    group_size_bound, launch_shared_prefix, prefix_splits, shared_prefix_attention, split_fill,
    tiling as cascade_tiling,
)
from ppqa.kernels.cascade_stream import launch_stream_prefix, stream_states
from ppqa.kernels.causal_prefill import causal_attention
from ppqa.kernels.decode_attention import decode_attention, decode_splits, launch_decode
from ppqa.kernels.extend_attention import extend_attention, extend_splits
from ppqa.kernels.kv_store import store_kv
from ppqa.kernels.merge import PartialScratch, merge_attention_states, merge_partials

# Partial-state scratch: 256 MiB on a GPU holds 64 splits of 64 tokens x 32 heads x 128 dims
# (or 16 splits of a 256-request decode step); the CPU interpreter needs far less.
GPU_SCRATCH_BYTES = 256 << 20
CPU_SCRATCH_BYTES = 16 << 20
# Cascade decode takes the stream kernel where the split kernel's CTAs would fill less than this
# share of the GPU's slots. One layer on an H100, Qwen2.5-7B, ~20k-token documents: the split
# kernel ahead at 73% and 85% (0.225 against 0.236 ms, 0.203 against 0.211), the stream one
# at 52% and 61% (0.250 against 0.314, 0.291 against 0.324), and 4-6% behind at the paper
# grid's shapes, whose splits fill a wave (results/h100/cascade_groups_stream_s50c4.json,
# cascade_groups_paper_stream_s50c4.json).
STREAM_BELOW_FILL = 0.7


@dataclass
class StepPlan:
    """Host-side launch choices for one step, shared by every layer."""

    splits: int  # extend or decode splits (suffix splits for cascade)
    prefix_splits: int = 0  # cascade: document splits (the stream kernel's states)
    stream: bool = False  # cascade decode: the document part by the stream-K kernel


class TritonBackend:
    def __init__(self, pool, num_heads: int, num_kv_heads: int, head_dim: int, sm_scale: float,
                 scratch_bytes: int | None = None, overlap: bool = True,
                 stream_prefix: bool | None = None) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{num_kv_heads}")
        self.pool = pool
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sm_scale = sm_scale
        # Cascade decode: the document product on a side stream, concurrent with the suffix
        # decode (GPU only; EngineConfig.overlap_cascade). False: one after the other.
        self.overlap = overlap
        # Cascade decode over contiguous documents: the document part dealt evenly over the
        # GPU by the stream-K kernel (kernels/cascade_stream.py) rather than split
        # per document for the bound a graph was captured at. None: where the split plan
        # would fill less than STREAM_BELOW_FILL of the GPU; True: always; False: never.
        self.stream_prefix = stream_prefix
        self.device = pool.k_buffers[0].device
        self.dtype = pool.k_buffers[0].dtype
        if scratch_bytes is None:
            scratch_bytes = GPU_SCRATCH_BYTES if self.device.type == "cuda" else CPU_SCRATCH_BYTES
        self.scratch = PartialScratch(scratch_bytes // 4, self.device)
        self._meta: ForwardMetadata | None = None
        # Whether cuDNN took a document's first chunk (None until tried), and the path that
        # ran the last one: "cudnn" or "triton" (see _first_chunk).
        self._cudnn_causal: bool | None = None
        self.causal_path: str | None = None
        # Whether cuDNN with its log-sum-exp took a later document chunk: None until tried.
        self._chunk_ok: bool | None = None
        self._plan = StepPlan(1)
        self._recent = RecentPlans()  # a forward of two parts meets two metadata a layer
        # High priority: the block scheduler then places the document product's few long CTAs
        # before the suffix's many short ones, which fill the room left beside them.
        self._side = (torch.cuda.Stream(self.device, priority=-1)
                      if self.device.type == "cuda" else None)

    def cascade_group_bound(self, size: int, contiguous: bool) -> int:
        """The group size a captured cascade step holds for a step whose largest group is
        `size` (kernels/cascade.group_size_bound)."""
        return group_size_bound(self.device, self.dtype, self.num_heads // self.num_kv_heads,
                                size, contiguous)

    def warm_cascade_tiles(self, req_to_token: torch.Tensor, max_rows: int) -> int:
        """Launch the cascade document kernel once for every tile it chooses for groups of up to
        `max_rows` query rows (requests in a decode step, question tokens in a prefill), over
        gathered and over contiguous documents, reading a few slots of the pool; returns the
        launches. Which tile a step takes follows how many of a document's questions run
        together and whether its slots are one run, which the timing of admissions and frees
        decides: each tile a warm-up does not meet is a Triton compile (or a load from the
        disk cache) in the middle of some later session."""
        group = self.num_heads // self.num_kv_heads
        q = torch.zeros(1, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        one = functools.partial(torch.tensor, dtype=torch.int32, device=self.device)
        indptr, doc_rows, doc_lens, doc_starts = one([0, 1]), one([0]), one([16]), one([1])
        part_o, part_lse = self.scratch.views(1, self.num_heads, 1, self.head_dim)
        stream_parts = self.scratch.views(1, self.num_heads, 2, self.head_dim)
        k_buf, v_buf = self.pool.k_buffers[0], self.pool.v_buffers[0]
        seen = set()
        for contiguous in (False, True):
            rows = 1
            while rows <= max(max_rows, 1):
                tiles, block_m, _ = cascade_tiling(self.device, self.dtype, group, rows,
                                                   contiguous=contiguous)
                if (contiguous, tiles, block_m) not in seen:
                    seen.add((contiguous, tiles, block_m))
                    launch_shared_prefix(q, k_buf, v_buf, req_to_token, indptr, doc_rows,
                                         doc_lens, rows, self.sm_scale, 1, part_o, part_lse,
                                         doc_starts=doc_starts if contiguous else None)
                    if contiguous and self.stream_prefix is not False:
                        launch_stream_prefix(q, k_buf, v_buf, indptr, doc_lens, doc_starts,
                                             rows, self.sm_scale, 2, *stream_parts)
                rows *= 2
        return len(seen)

    def warm_cudnn_kernels(self, rows: int = 4 * CHUNK_ROWS) -> int:
        """Run `chunk_attention`'s cuDNN calls once in each kind a prefill meets, on tensors of
        its own: a chunk of `rows` tokens after an earlier part of 4 x CHUNK_ROWS keys and after
        one of 59 more (a length no multiple of 64, as after a copied template opening), each
        a causal call over the chunk and an unmasked one over the earlier keys. cuDNN
        builds each kind's kernel once per machine (0.7-1.5 s, kept across processes); a
        warm-up's documents need not meet every kind (a first chunk takes cuDNN only once its
        row class has paid, `triton_first`; no warm-up document follows a copied opening), and
        met in a job instead, each build leaves the GPU idle (results/h100/cudnn_plans_s33c4
        .json, gprof_paper_auto_first_s33c3.json). Returns the calls made: 0 where cuDNN
        takes no such tensors (not a GPU, not bf16/fp16, or shapes it refuses, where the
        engine's own calls fall back to other kernels as well)."""
        q = torch.zeros(rows, self.num_heads, self.head_dim, dtype=self.dtype,
                        device=self.device)
        if not fusable(q):
            return 0
        k = torch.zeros(rows, self.num_kv_heads, self.head_dim, dtype=self.dtype,
                        device=self.device)
        o = torch.empty_like(q)
        calls = 0
        for earlier in (4 * CHUNK_ROWS, 4 * CHUNK_ROWS + 59):  # past CHUNK_ROWS: two calls
            prior = k.new_zeros((earlier,) + k.shape[1:])
            try:
                chunk_attention(q, k, k, prior, prior, o, self.sm_scale)
            except (RuntimeError, TypeError):  # as `_fused_chunk`: not taken here
                return 0
            calls += 2
        return calls

    def init_forward_metadata(self, meta: ForwardMetadata) -> None:
        self._plan = self.plan(meta)
        self._meta = meta
        self._recent.keep(meta, self._plan)

    def plan(self, meta: ForwardMetadata) -> StepPlan:
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        if meta.kind == "extend":
            return StepPlan(extend_splits(self.device, self.dtype, meta.batch_size,
                                          meta.num_tokens, *heads, meta.max_extend_len,
                                          meta.max_prefix_len, self.scratch,
                                          contiguous=meta.doc_start is not None))
        # A decode row ends at prefix_len + 1; for cascade that bounds the suffix as well.
        # A cascade step with stock requests in it (document hints present) has whole rows too.
        whole = meta.cascade is None or meta.doc_start is not None
        splits = decode_splits(self.device, meta.batch_size, *heads, meta.max_prefix_len + 1,
                               self.scratch, whole_rows=whole)
        if meta.cascade is None:
            return StepPlan(splits)
        casc = meta.cascade
        # Leave at least half the scratch's states to the document part.
        cap = self.scratch.max_states(meta.batch_size, self.num_heads, self.head_dim)
        splits = max(1, min(splits, cap // 2))
        # A padded batch's group of dummies launches CTAs that return at once: not counted.
        groups = casc.doc_req_indices.shape[0] if casc.doc_groups is None else casc.doc_groups
        doc = prefix_splits(self.device, self.dtype, meta.batch_size, *heads,
                            groups, casc.max_group_size, casc.max_doc_len,
                            self.scratch, reserved_states=splits, contiguous=casc.contiguous)
        # A graph's bound holds from half its documents, plus one. Where the split plan leaves
        # much of the GPU idle at that many, the stream kernel deals the work over all of it.
        least = groups // 2 + 1
        if self._doc_starts(casc) is not None and (self.stream_prefix or (
                self.stream_prefix is None and split_fill(
                    self.device, self.dtype, *heads[:2], least, casc.max_group_size,
                    doc) < STREAM_BELOW_FILL)):
            states = stream_states(self.device, self.dtype, meta.batch_size, *heads, least,
                                   casc.max_group_size, self.scratch, reserved_states=splits)
            if states:
                return StepPlan(splits, states, stream=True)
        return StepPlan(splits, doc)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: ForwardMetadata) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        store_kv(k_buf, v_buf, meta.out_slots, k, v)
        if self._meta is not meta:
            plan = self._recent.get(meta)
            if plan is None:
                self.init_forward_metadata(meta)
            else:
                self._meta, self._plan = meta, plan
        plan = self._plan
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.plain_causal and self._first_chunk(q, k, v, o):
            return o
        if meta.doc_prior is not None and self._fused_chunk(q, k, v, o, k_buf, v_buf,
                                                            *meta.doc_prior):
            return o
        if meta.kind == "extend" and meta.cascade is not None:
            self._cascade_extend(q, k, v, o, k_buf, v_buf, meta, plan)
        elif meta.kind == "extend":
            extend_attention(q, k, v, o, k_buf, v_buf, meta.req_to_token, meta.req_indices,
                             meta.kv_start, meta.prefix_lens, meta.qo_indptr, meta.q_sid,
                             self.pool.slot_sid, meta.max_extend_len, self.sm_scale,
                             num_splits=plan.splits, scratch=self.scratch,
                             doc_start=meta.doc_start, doc_len=meta.doc_len)
        elif meta.cascade is None:
            decode_attention(q, o, k_buf, v_buf, meta.req_to_token, meta.req_indices,
                             meta.kv_start, meta.prefix_lens, self.sm_scale,
                             num_splits=plan.splits, scratch=self.scratch, seq_len_offset=1,
                             doc_start=meta.doc_start, doc_len=meta.doc_len)
        else:
            self._cascade(q, o, k_buf, v_buf, meta, plan)
        return o

    def _first_chunk(self, q, k, v, o, k_prior=None, v_prior=None) -> bool:
        """A document's first chunk, plain causal attention, through our causal kernel or
        cuDNN, exact attention at the matrix units' rate where the extend kernel runs this
        shape at 160-170 TFLOP/s (benchmarks/RESULTS.md, 'Prefill'). The chunk may follow a
        short prior (k_prior/v_prior, at most CHUNK_ROWS tokens: a template's opening copied
        from a cached document), which its rows see as well. Our kernel (`causal_attention`)
        runs every length with one compiled variant; cuDNN runs the square at its rows padded
        to a multiple of CHUNK_ROWS (`chunk_attention`), so that every document of one row
        class shares the plan it builds. `triton_first` decides per row class, whatever the
        document's opening; where cuDNN refuses, ours runs. bf16/fp16 on a GPU only; False
        elsewhere, and the extend kernel runs instead."""
        if not fusable(q):
            return False
        if k_prior is None:
            k_prior, v_prior = k[:0], v[:0]
        prior = k_prior.shape[0]
        tokens, heads, head_dim = q.shape
        padded, loss = first_chunk_class(prior + tokens, heads, head_dim)
        row_class = (padded, heads, k.shape[1], head_dim, q.dtype, q.device)
        if self._cudnn_causal is not False and not triton_first(row_class, loss):
            try:
                chunk_attention(q, k, v, k_prior, v_prior, o, self.sm_scale)
                self._cudnn_causal, self.causal_path = True, "cudnn"
                return True
            except (RuntimeError, TypeError):  # not taken here, or an op of another signature
                self._cudnn_causal = False
        if prior:
            k, v = torch.cat([k_prior, k]), torch.cat([v_prior, v])
        causal_attention(q, k, v, o, self.sm_scale)
        self.causal_path = "triton"
        return True

    def _fused_chunk(self, q, k, v, o, k_buf, v_buf, first_slot: int, prior: int) -> bool:
        """A later prefill chunk of a document whose earlier `prior` tokens are the slot run
        from `first_slot`. After a short prior (at most CHUNK_ROWS tokens: an opening copied
        from a cached document) the chunk is the document's first (`_first_chunk`); after a
        longer one it goes through cuDNN (`chunk_attention`). The extend kernel runs these
        chunks at 310-340 TFLOP/s with the document hint; this way a document prefills 15-18%
        faster once cuDNN holds plans for the shapes (results/h200/prefill_chunks_s14c6.json).
        bf16/fp16 on a GPU only; False when it does not apply or cuDNN does not take the
        shapes, and the extend kernel runs instead."""
        earlier = [x[first_slot:first_slot + prior] for x in (k_buf, v_buf)]
        if prior <= CHUNK_ROWS:
            return self._first_chunk(q, k, v, o, *earlier)
        if self._chunk_ok is False or not fusable(q):
            return False
        try:
            chunk_attention(q, k, v, *earlier, o, self.sm_scale)
        except (RuntimeError, TypeError):  # no cuDNN here, or an op of another signature
            self._chunk_ok = False
            return False
        self._chunk_ok = True
        return True

    @staticmethod
    def _doc_starts(casc) -> torch.Tensor | None:
        """The groups' document runs when every document is one (the contiguous kernel)."""
        return casc.doc_starts if casc.contiguous and casc.doc_starts is not None else None

    def _cascade_extend(self, q, k, v, o, k_buf, v_buf, meta: ForwardMetadata,
                        plan: StepPlan) -> None:
        """Cascade question prefill (eager, not graphed): each group's question tokens against
        its document in one shared-prefix launch, the stream-masked extend from kv_start (the
        document's end), both in float32 with their lse, merged here."""
        casc = meta.cascade
        shape, lse_shape = q.shape, q.shape[:2]
        doc_o = torch.empty(shape, dtype=torch.float32, device=q.device)
        doc_lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        shared_prefix_attention(q, doc_o, doc_lse, k_buf, v_buf, meta.req_to_token,
                                casc.group_req_indptr, casc.doc_req_indices, casc.doc_lens,
                                casc.max_group_size, casc.max_doc_len, self.sm_scale,
                                scratch=self.scratch, doc_starts=self._doc_starts(casc))
        own_o = torch.empty(shape, dtype=torch.float32, device=q.device)
        own_lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        extend_attention(q, k, v, own_o, k_buf, v_buf, meta.req_to_token, meta.req_indices,
                         meta.kv_start, meta.prefix_lens, meta.qo_indptr, meta.q_sid,
                         self.pool.slot_sid, meta.max_extend_len, self.sm_scale, lse=own_lse,
                         num_splits=plan.splits, scratch=self.scratch)
        merge_attention_states(doc_o, doc_lse, own_o, own_lse, o)

    def _fork(self) -> torch.cuda.Stream | None:
        """The side stream, made to wait for the current one (q and the K/V store ready);
        None without `overlap` or a GPU."""
        if self._side is None or not self.overlap:
            return None
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        return self._side

    def document_part(self, q, k_buf, v_buf, meta: ForwardMetadata, plan: StepPlan, part_o,
                      part_lse, state_offset: int = 0) -> None:
        """A cascade decode step's document states [state_offset, + plan.prefix_splits), by
        the kernel the plan chose."""
        casc = meta.cascade
        if plan.stream:
            launch_stream_prefix(q, k_buf, v_buf, casc.group_req_indptr, casc.doc_lens,
                                 casc.doc_starts, casc.max_group_size, self.sm_scale,
                                 plan.prefix_splits, part_o, part_lse, state_offset=state_offset)
        else:
            launch_shared_prefix(q, k_buf, v_buf, meta.req_to_token, casc.group_req_indptr,
                                 casc.doc_req_indices, casc.doc_lens, casc.max_group_size,
                                 self.sm_scale, plan.prefix_splits, part_o, part_lse,
                                 state_offset=state_offset, doc_starts=self._doc_starts(casc))

    def _cascade(self, q, o, k_buf, v_buf, meta: ForwardMetadata, plan: StepPlan) -> None:
        """Suffix states [0, splits) and document states [splits, splits + prefix_splits) of
        one buffer, then a single merge. With `overlap`, the document launch goes first on the
        side stream (its CTAs are the long ones) and the merge waits for both."""
        states = plan.splits + plan.prefix_splits
        part_o, part_lse = self.scratch.views(q.shape[0], self.num_heads, states, self.head_dim)
        side = self._fork()
        with torch.cuda.stream(side):  # None: a no-op, the launches run in order
            self.document_part(q, k_buf, v_buf, meta, plan, part_o, part_lse, plan.splits)
        # Stock requests in a cascade step read their rows whole, with their documents' hints.
        launch_decode(q, k_buf, v_buf, meta.req_to_token, meta.req_indices, meta.kv_start,
                      meta.prefix_lens, self.sm_scale, plan.splits, part_o=part_o,
                      part_lse=part_lse, seq_len_offset=1, doc_start=meta.doc_start,
                      doc_len=meta.doc_len)
        if side is not None:
            torch.cuda.current_stream(self.device).wait_stream(side)
        merge_partials(part_o, part_lse, o)
