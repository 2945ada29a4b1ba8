"""Which requests run this step: admission by free KV, chunked prefill, continuous batching.

Requests wait in arrival order (callers submit each document's requests together). `admit` takes
requests from the head of the queue while `KVPlacement` can place them (a req_to_token row, the
request's document, cached or inserted, and a reservation of every question and its whole answer
budget; kv_placement.py); a cascade group of a document that no admitted request holds waits
until a share of the rows is free (`_room_for_group`). Rows stop at `max_batch_requests`,
except for a whole cascade group of at least half that many that the pool holds: it may start
past them, up to `max_wide_requests` (`_widens`), so that two large documents decode in one step.
Admitted requests wait in `prefilling` while their document is prefilled in chunks
(`document_chunk`, at most `max_prefill_tokens` a forward, so running requests keep decoding
between chunks); then `questions_ready` hands out those whose document is ready, and
`prefill_step` prefills their questions in one packed extend. From then on every running request
decodes each step. A request leaves as soon as all its streams are finished (or cancelled),
freeing its slots and row, and waiting requests take its place; one whose every stream has its
last budgeted token in the step in flight leaves before that step is read (`release_leaving`),
so that the requests waiting for its place are admitted and prefilled behind that step instead
of after its read-back.

Each request has its own mode. One step serves every width-1 request (`stock` and `cascade`):
cascade requests grouped by document read it once per group, stock requests read their own rows
whole. `parallel` requests (P streams, an "extend" of P tokens each) take a step per width.

Steps are built ahead of their results: building a step (`PlannedStep`, laid out by steps.py)
advances the requests' rows and counters, and `postprocess` later accepts the step's sampled
tokens. The engine keeps
one decode step in flight this way (see session.py), so the host builds step t+1 and reads step
t's tokens while the GPU runs.

Data flow: session -> `admit` -> `document_chunk` (documents not yet prefilled) ->
`questions_ready` -> `prefill_step` -> `decode_batches` -> `decode_step` -> runner -> sampler
-> `postprocess` -> finished streams -> session.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ppqa.engine.runtime import steps
from ppqa.engine.runtime.document_cache import CachedDocument, DocumentCache
from ppqa.engine.runtime.kv_cache import KVPool, ReqToTokenTable
from ppqa.engine.runtime.kv_placement import KVPlacement
from ppqa.engine.runtime.layout import document_layout
from ppqa.engine.runtime.request import Request, Stream
from ppqa.engine.runtime.runner import StepInputs
from ppqa.engine.runtime.steps import PlannedStep


class Scheduler:
    def __init__(self, pool: KVPool, table: ReqToTokenTable, docs: DocumentCache, *,
                 max_prefill_tokens: int, max_batch_requests: int,
                 max_wide_requests: int | None = None) -> None:
        self.memory = KVPlacement(pool, table, docs)
        self.table = table
        self.max_prefill_tokens = max_prefill_tokens
        self.max_batch_requests = max_batch_requests
        self.max_wide_requests = max_wide_requests or max_batch_requests
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted; document or questions not prefilled yet
        self.running: list[Request] = []
        self.leaving: list[Request] = []  # place given back; last tokens in a step not yet read
        self._doc_next: dict[int, int] = {}  # id(doc) -> its next token to prefill
        self._step_ids = itertools.count(1)
        # The last `admit` stopped for want of rows, KV or batch room: retry after a release.
        self.admit_blocked = False
        # The document whose whole group is being admitted past max_batch_requests (`_widens`);
        # its requests left in the queue go on past it in the next `admit`.
        self._wide_doc = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def cascade_on(self, doc_key) -> bool:
        """Whether cascade requests about the document `doc_key` are queued or running: a
        question that joins them costs a step no second read of the document."""
        return any(r.mode == "cascade" and r.doc_key == doc_key
                   for r in (*self.waiting, *self.prefilling, *self.running))

    def documents(self, besides=None, up_to: int | None = None) -> int:
        """How many documents the queued and running requests are about, `besides` not counted;
        the count stops at `up_to`."""
        seen = set()
        for r in itertools.chain(self.running, self.prefilling, self.waiting):
            if r.doc_key != besides:
                seen.add(r.doc_key)
                if up_to is not None and len(seen) >= up_to:
                    break
        return len(seen)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def active(self) -> int:
        """Requests holding a row: prefilling or running."""
        return len(self.prefilling) + len(self.running)

    def should_admit(self) -> bool:
        """Whether `admit` may take a request now (cheap: no allocation is tried)."""
        return bool(self.waiting) and (not self.active or not self.admit_blocked)

    # ---- admission -------------------------------------------------------------------------

    def admit(self) -> list[Request]:
        """Move requests from the queue to running while rows, KV and the prefill budget allow.
        A cascade group of a document that nothing holds yet starts only with room for a
        share of it (`_room_for_group`), or, a large one the pool holds, past
        max_batch_requests up to max_wide_requests (`_widens`)."""
        admitted: list[Request] = []
        tokens = 0
        self.admit_blocked = False
        started = {r.doc_key for r in (*self.prefilling, *self.running)}
        while self.waiting:
            req = self.waiting[0]
            taken = self.active + len(admitted)
            if req.doc_key != self._wide_doc:
                self._wide_doc = None
                if req.doc_key not in started and self._widens(req, taken):
                    self._wide_doc = req.doc_key
            wide = self._wide_doc
            limit = self.max_wide_requests if req.doc_key == wide else self.max_batch_requests
            free_rows = limit - taken
            if free_rows <= 0:
                self.admit_blocked = True
                break
            if (req.mode == "cascade" and started and req.doc_key not in started
                    and req.doc_key != wide and not self._room_for_group(req.doc_key, free_rows)):
                self.admit_blocked = True  # retried when a request leaves
                break
            q_tokens = req.prefill_tokens
            if admitted and tokens + q_tokens > self.max_prefill_tokens:
                break  # the next `admit` takes more
            if not self.memory.place(req):
                self.admit_blocked = True
                break
            self.waiting.popleft()
            admitted.append(req)
            started.add(req.doc_key)
            tokens += q_tokens
        if not admitted and self.waiting and not self.active:
            req = self.waiting[0]
            raise RuntimeError(  # validation should make this impossible; never loop forever
                f"cannot admit a request of {req.doc_len} document + {req.reserve_tokens} reserved "
                f"tokens into an idle KV pool of {self.memory.describe()}")
        self.prefilling.extend(admitted)
        return admitted

    def release_leaving(self, step_uid: int) -> int:
        """Running requests whose every live stream has its last budgeted token in the step
        `step_uid` (in flight) give back their slots, row and document reference now; they wait
        in `leaving` until `postprocess` of that step accepts those tokens. Whoever takes the
        place next runs on the device behind that step: the slots' last K/V writes and the
        row's reads are ordered before any new owner's (table writes reach the device in a
        later step's `prepare`). The session reads that step within the same iteration, so
        `leaving` is empty between iterations. Returns how many left."""
        going = [r for r in self.running if r.pending_step == step_uid
                 and not (r.feeds_one() if r.width == 1 else r.schedulable().any())]
        if not going:
            return 0
        self.release_all(going)
        for req in going:
            req.left_early = True
        self.leaving.extend(going)
        self.running = [r for r in self.running if r.row >= 0]
        return len(going)

    def _widens(self, req: Request, taken: int) -> bool:
        """Whether the cascade group at the head of the queue (`req`'s document, none of it
        admitted yet) starts past max_batch_requests: it does not fit the rows left there, it
        holds at least half of max_batch_requests, all of it fits max_wide_requests beside the
        `taken` rows, and the KV pool holds its document, as one run, and every reservation
        without evicting a document in use. Whole or not at all: a part of it would leave the
        rest to start later, decoding its own steps beside the next group; and a document
        gathered from pieces would be read by the slower kernel in every step (with a decode
        graph and a prefill kernel variant of its own)."""
        if self.max_wide_requests <= self.max_batch_requests or req.mode != "cascade":
            return False
        group = list(itertools.takewhile(lambda r: r.doc_key == req.doc_key, self.waiting))
        if (len(group) <= self.max_batch_requests - taken
                or 2 * len(group) < self.max_batch_requests
                or taken + len(group) > self.max_wide_requests):
            return False
        return self.memory.holds_group(group)

    def _room_for_group(self, doc_key, free_rows: int) -> bool:
        """Whether a new document's cascade group may start beside the requests running: with
        rows free for all of its waiting requests, or for a quarter of the batch if it has more.
        Started on one free row, the group's first requests would read the whole document every
        step for a few queries, and the steps mixing two documents' groups would repeat for
        every row freed one at a time; the document, its prefill and its questions wait instead
        until a sizeable group can start (on the paper mix through the worker: 21.3 -> 16.1 s,
        benchmarks/results/h200/wtimeline_paper_s13c1.json against ..._s13c2.json)."""
        need = max(1, self.max_batch_requests // 4)
        count = 0
        for req in self.waiting:
            if req.doc_key != doc_key or count >= need:
                break
            count += 1
        return free_rows >= min(count, need)

    def release(self, req: Request) -> None:
        """Give back a request's slots, row and document reference."""
        self.release_all([req])

    def release_all(self, requests: Sequence[Request]) -> None:
        """`release` for many requests at once (`KVPlacement.release`); a waiting request that
        found no room may be admitted now."""
        if self.memory.release(requests):
            self.admit_blocked = False

    def abort_all(self) -> None:
        """Drop every queued, prefilling and running request (a stop, or an error)."""
        self.release_all(self.prefilling + self.running)
        self.prefilling.clear()
        self.running.clear()
        self.leaving.clear()
        self.waiting.clear()
        self._doc_next.clear()
        self._wide_doc = None

    def cancel(self, doomed: Callable[[object], bool]) -> list[Stream]:
        """Drop every stream whose key `doomed(key)` picks, wherever it is; a request left
        with no live stream leaves at once (a step in flight ignores it). Returns them."""
        dropped: list[Stream] = []
        for req in list(self.waiting) + self.prefilling + self.running:
            for s, stream in enumerate(req.streams):
                if not stream.cancelled and not stream.is_finished and doomed(stream.key):
                    req.cancel(s)
                    dropped.append(stream)
        if not dropped:
            return dropped
        gone = [r for r in self.waiting if all(st.cancelled for st in r.streams)]
        self.waiting = deque(r for r in self.waiting if r not in gone)
        for req in self.prefilling:
            if all(st.cancelled for st in req.streams):
                self.release(req)
        self.prefilling = [r for r in self.prefilling if r.row >= 0]
        for req in self.running:
            if req.is_finished:
                self.release(req)
        self.running = [r for r in self.running if r.row >= 0]
        return dropped

    # ---- steps -----------------------------------------------------------------------------

    def pending_documents(self) -> list[CachedDocument]:
        """Documents that admitted requests wait for, in admission order."""
        seen: dict[int, CachedDocument] = {}
        for req in self.prefilling:
            if not req.doc.ready:
                seen.setdefault(id(req.doc), req.doc)
        return list(seen.values())

    def document_chunk(self, doc: CachedDocument) -> StepInputs:
        """The next chunk (at most max_prefill_tokens) of a document's prefill, through the
        scratch row (no logits), from its first token not copied from another cached
        document. The chunk that reaches the end marks the document ready: the steps after it
        run behind it on the device."""
        start = self._doc_next.get(id(doc), doc.copied)
        end = min(doc.length, start + self.max_prefill_tokens)
        row = self.table.scratch_row
        self.table.write(row, 0, doc.slots)
        ids = torch.tensor(doc.token_ids[start:end], dtype=torch.int64)
        if end >= doc.length:
            self._doc_next.pop(id(doc), None)
            doc.ready = True
        else:
            self._doc_next[id(doc)] = end
        # The document hint covers what earlier chunks cached: [0, start) of a one-run document
        # is read with affine addresses, and the kernel takes its prefill tiles (a 16k-token
        # document's attention ran 3.5x faster so: benchmarks/RESULTS.md, 'Prefill').
        contiguous = doc.start >= 0
        return StepInputs(kind="extend", input_ids=ids, layout=document_layout(start, end),
                          qo_indptr=torch.tensor([0, end - start]), req_rows=torch.tensor([row]),
                          kv_start=torch.zeros(1, dtype=torch.int64),
                          prefix_lens=torch.tensor([start]),
                          logit_indices=torch.empty(0, dtype=torch.int64),
                          doc_start=torch.tensor([max(doc.start, 0)]),
                          doc_len=torch.tensor([start if contiguous else 0]),
                          plain_causal=start == 0,
                          doc_prior=(doc.start, start) if contiguous and start > 0 else None)

    def questions_ready(self) -> list[Request]:
        """Prefilling requests whose document is ready, up to max_prefill_tokens question
        tokens (at least one request); they leave `prefilling` for `running`."""
        out, tokens = [], 0
        for req in self.prefilling:
            if not req.doc.ready:
                continue
            q = req.prefill_tokens
            if out and tokens + q > self.max_prefill_tokens:
                break
            out.append(req)
            tokens += q
        if out:
            chosen = set(map(id, out))
            self.prefilling = [r for r in self.prefilling if id(r) not in chosen]
            self.running.extend(out)
        return out

    def prefill_step(self, requests: Sequence[Request], cascade: bool = False) -> PlannedStep:
        """One packed extend of the questions of newly admitted requests (steps.prefill_step)."""
        return steps.prefill_step(requests, next(self._step_ids), cascade)

    def retire(self, requests: Sequence[Request]) -> None:
        """Scored requests leave at once: nothing of theirs decodes."""
        self.release_all(requests)
        self.running = [r for r in self.running if r.row >= 0]

    def decode_batches(self, unread: set[int] | frozenset = frozenset()) -> list[list[Request]]:
        """The running requests that have a stream to feed, as the steps that serve them: one
        for every width-1 request (cascade requests first, grouped by document; stock after),
        one per parallel width. A request whose last tokens are all scheduled waits for them to
        be read, and so does one whose last tokens come from a step in `unread` (uids: a
        question prefill launched, not yet read back)."""
        self.running.sort(key=_step_order)  # stable: arrival order within a document
        batches: dict[tuple, list[Request]] = {}
        for r in self.running:
            if unread and r.pending_step in unread:
                continue
            if r.width == 1 and r.mode != "parallel":
                if r.feeds_one():
                    batches.setdefault((1, "decode"), []).append(r)
            elif r.schedulable().any():
                batches.setdefault((r.width, "extend"), []).append(r)
        return list(batches.values())

    def decode_step(self, requests: Sequence[Request], *, pad_to: int = 0,
                    prev: PlannedStep | None = None) -> PlannedStep:
        """One token per schedulable stream of every request of one of `decode_batches`
        (steps.decode_step), padded with dummy requests on the table's dummy row to `pad_to`."""
        return steps.decode_step(requests, next(self._step_ids), dummy_row=self.table.DUMMY_ROW,
                                 pad_to=pad_to, prev=prev)

    # ---- after sampling --------------------------------------------------------------------

    def postprocess(self, step: PlannedStep, tokens: list[int], *, eos_ids: Sequence[int],
                    decode: Callable[[list[int]], str], now: float) -> list[Stream]:
        """Accept a step's sampled tokens; return streams that finished; retire finished requests.

        A token fed to a stream that an earlier token had already finished (the engine builds
        the next step before reading this one) is dropped, as is every token of a request that
        has been retired meanwhile.
        """
        finished: list[Stream] = []
        done: list[Request] = []
        for req, base, fed in zip(step.requests, step.bases, step.fed):
            if req.row < 0 and not req.left_early:
                continue
            if req.pending_step == step.uid:
                req.pending_step = -1  # its tokens are on the host now
            if req.width == 1:  # stock and cascade: skip numpy on one-element arrays (hot at B=256)
                picks = [0] if fed[0] and req.live[0] else []
            else:
                picks = np.flatnonzero(fed[:req.width] & req.live).tolist()
            for s in picks:
                if req.accept(s, tokens[base + s], eos_ids, decode, now):
                    finished.append(req.streams[s])
            if req.is_finished:
                done.append(req)
        self.release_all(done)
        self.running = [r for r in self.running if r.row >= 0]
        if self.leaving:
            self.leaving = [r for r in self.leaving if not r.is_finished]
        return finished


def _step_order(req: Request) -> tuple[int, int]:
    """Cascade requests first, grouped by document; then the others (see `batching.cascade_groups`)."""
    return (0, req.doc.uid) if req.mode == "cascade" else (1, 0)
