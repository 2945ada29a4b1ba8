"""`SessionPrefill`: the prefill half of an engine session's iteration (`EngineSession`,
engine/session.py, is the class that uses it and owns the state it reads).

    _prefill(bounded) -> document chunks (`_prefill_documents`: `Scheduler.document_chunk`;
        also launched alone by `EngineSession.prefill_ahead`), then the questions
        whose documents are ready: width-1 requests of one document in one grouped extend
        (`_question_steps`), parallel requests in a stream-masked extend of their own,
        scoring requests answered whole (`_score`); bounded while others decode: at most one
        of each an iteration. A chunk that ends its document runs in the forward of the
        question prefill after it (`StepInputs.lead`), so that a few hundred question rows
        do not read the weights in a forward of their own
    _settle_prefill -> what was launched is read back an iteration later (after that
        iteration's decode step is queued behind it), its device time charged to the streams
        that waited for it, and question prefills' first tokens accepted
"""

from __future__ import annotations

import time

from ppqa.engine.launches import Prefilled, PrefillTimer
from ppqa.engine.runtime.request import Request, Stream
from ppqa.engine.runtime.runner import StepInputs
from ppqa.engine.runtime.scoring import choice_logprobs, split_by_rows
from ppqa.engine.runtime.steps import PlannedStep, score_step


class HeldChunk:
    """A document chunk planned and not yet launched, and the streams waiting for it."""

    def __init__(self, inputs: StepInputs, waiting: list[Stream], ends_document: bool) -> None:
        self.inputs, self.waiting, self.ends_document = inputs, waiting, ends_document


class SessionPrefill:
    """Prefill launches and their reads for `EngineSession`, which sets `sched`, `stats`,
    `engine`, `started`, `_unsettled`, `_iteration`, `_cuda`, `_grouped_prefill`,
    `_last_read` and `_scores`, and provides `_run`, `_launch`, `_finish` and `_deliver`."""

    def _prefill(self, bounded: bool) -> None:
        """Document chunks, then the questions whose documents are ready; bounded: at most one
        of each. A chunk that ends a document runs in the forward of the first question prefill
        after it (`StepInputs.lead`) where their rows fit one chunk's budget. Launched here and
        read in `_settle_prefill` (at the end of the next iteration, after its decode step is
        queued, with `overlap_steps`; at once without), which charges their device time to the
        streams that waited for them."""
        sched, stats = self.sched, self.stats
        held, _ = self._document_chunks(bounded)
        if held is not None and not held.ends_document:  # no question waits for it alone
            self._launch_chunk(held)
            held = None
        while True:
            ready = sched.questions_ready()
            if not ready:
                break
            scoring = [r for r in ready if r.scoring]
            steps = self._question_steps([r for r in ready if not r.scoring])
            if held is not None and (scoring or not steps or not self._fits(held, steps[0])):
                self._launch_chunk(held)  # scoring reads the document before any step here
                held = None
            for batch in split_by_rows(scoring):
                self._score(batch)
            for step in steps:
                stats.prefilled_tokens += step.inputs.num_tokens
                streams = [(s, len(s.suffix_ids)) for r in step.requests for s in r.streams]
                if held is not None:
                    step.inputs.lead = held.inputs
                    stats.prefilled_tokens += held.inputs.num_tokens
                    stats.chunks_with_questions += 1
                    # The forward's time shared by tokens: the chunk's share by its waiters.
                    share = held.inputs.num_tokens / max(len(held.waiting), 1)
                    streams += [(s, share) for s in held.waiting]
                    held = None
                timer = PrefillTimer(self._cuda)
                launched = self._launch(step, None)
                self._launched_prefill(Prefilled(timer.stop(), streams, launched))
            if bounded:
                break
        if held is not None:
            self._launch_chunk(held)
        if not self.engine.config.overlap_steps:
            self._settle_prefill()

    def _fits(self, held: HeldChunk, step: PlannedStep) -> bool:
        """Whether a chunk and a question prefill fit one forward: no more rows than a chunk
        alone may have, so that a forward's activations stay what the KV pool left room for."""
        rows = held.inputs.num_tokens + step.inputs.num_tokens
        return rows <= self.sched.max_prefill_tokens

    def _prefill_documents(self, bounded: bool) -> int:
        """Launch the chunks of the documents that admitted requests wait for (bounded: one
        chunk); returns how many were launched."""
        held, planned = self._document_chunks(bounded)
        if held is not None:
            self._launch_chunk(held)
        return planned

    def _document_chunks(self, bounded: bool) -> tuple[HeldChunk | None, int]:
        """`_prefill_documents` with its last chunk planned and not launched: (that chunk or
        None, how many were planned)."""
        sched = self.sched
        planned, held = 0, None
        while docs := sched.pending_documents():
            if held is not None:
                self._launch_chunk(held)
            doc = docs[0]
            waiting = [s for r in sched.prefilling if r.doc is doc for s in r.streams]
            inputs = sched.document_chunk(doc)  # marks the document ready at its last chunk
            held = HeldChunk(inputs, waiting, ends_document=doc.ready)
            planned += 1
            if bounded:
                break
        return held, planned

    def _launch_chunk(self, held: HeldChunk) -> None:
        timer = PrefillTimer(self._cuda)
        self._run(held.inputs)
        self._launched_prefill(Prefilled(timer.stop(), [(s, 1.0) for s in held.waiting]))
        self.stats.steps += 1
        self.stats.prefilled_tokens += held.inputs.num_tokens

    def _launched_prefill(self, work: Prefilled) -> None:
        work.iteration = self._iteration
        self._unsettled.append(work)
        if not self._cuda:
            # The CPU ran it in the launch: the step in flight, computed before it, must not
            # be charged for it when read back.
            self._last_read = time.perf_counter()

    def _settle_prefill(self, earlier_only: bool = False) -> None:
        """Wait for the prefill launched so far, in order: charge each its device time (shared
        by its streams' weights), and read back the first tokens of question prefills (their
        requests decode from the next step on; answers that end there are delivered).
        earlier_only: only what earlier iterations launched (the device has run it: the
        decode step read back since was queued behind it); this iteration's stays queued
        behind its decode step, and the host goes on to the next iteration meanwhile."""
        if not self._unsettled:
            return
        if earlier_only:
            done = 0
            while (done < len(self._unsettled)
                   and self._unsettled[done].iteration < self._iteration):
                done += 1
            unsettled, self._unsettled = self._unsettled[:done], self._unsettled[done:]
        else:
            unsettled, self._unsettled = self._unsettled, []
        for work in unsettled:
            seconds = work.timer.seconds()
            self.stats.prefill_s += seconds
            total = sum(w for _, w in work.streams)
            for stream, weight in work.streams:
                stream.prefill_s += seconds * weight / max(total, 1)
            if work.launched is not None:
                self._finish(work.launched, charge=False)
        self._last_read = time.perf_counter()

    def _unread_steps(self) -> set[int]:
        """Question prefill steps whose tokens are not on the host yet: their requests wait."""
        return {w.launched.step.uid for w in self._unsettled if w.launched is not None}

    def _score(self, requests: list[Request]) -> None:
        """Score the choices of ready scoring requests in one extend, answer the questions
        whose choices are all scored, and free the requests (engine/scoring.py)."""
        begin = time.perf_counter()
        cascade = self._grouped_prefill or any(r.mode == "cascade" for r in requests)
        inputs, plan = score_step(requests, cascade=cascade)
        logprobs = choice_logprobs(self._run(inputs), plan)  # waits for the device
        self.stats.steps += 1
        self.stats.prefilled_tokens += inputs.num_tokens
        seconds = time.perf_counter() - begin
        self.stats.prefill_s += seconds
        if not self._cuda:  # charged to these questions: not to the decode step in flight too
            self._last_read = time.perf_counter()
        for req in requests:
            req.streams[0].prefill_s += seconds * req.prefill_tokens / max(inputs.num_tokens, 1)
        per_stream: dict[int, list[float]] = {}
        for (stream, _), lp in zip(plan.choices, logprobs):
            per_stream.setdefault(id(stream), []).append(lp)
        self.sched.retire(requests)
        now = time.perf_counter()
        for req in requests:
            stream = req.streams[0]
            stream.finish_reason = "choice"
            if stream.cancelled:
                continue
            for answer in self._scores.add(stream, per_stream[id(stream)], mode=req.mode,
                                           latency_s=now - self.started):
                self._deliver(stream.key, answer)

    def _question_steps(self, ready: list[Request]) -> list[PlannedStep]:
        """The question prefill of newly ready requests: width-1 requests grouped by document
        (on a GPU), parallel requests in a stream-masked extend of their own."""
        narrow = [r for r in ready if r.mode != "parallel"]
        wide = [r for r in ready if r.mode == "parallel"]
        steps = []
        if narrow:
            cascade = self._grouped_prefill or any(r.mode == "cascade" for r in narrow)
            steps.append(self.sched.prefill_step(narrow, cascade=cascade))
        if wide:
            steps.append(self.sched.prefill_step(wide, cascade=False))
        return steps
