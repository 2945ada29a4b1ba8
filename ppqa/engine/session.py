"""`EngineSession`: one long-lived loop over an engine; work is added while it runs.

    submit(requests) -> (engine/intake.py) prompts per (template, document) -> checks
        (context, pool) -> a mode per document group (auto: the cost model) -> requests of
        P streams (parallel) or one question each (stock, cascade) -> the scheduler's
        queue; questions with choices
        become scoring requests (engine/scoring.py), which a prefill step answers whole.
        With background=True (the worker's claims) the prompts are rendered at once and
        tokenized on a thread while steps run; the step after `tokenize_ahead_iterations`
        more takes them from there.
    prefill_ahead() -> while nothing decodes: admit what was submitted and launch its
              documents' prefill (a worker's first claims), questions and decode left to step
    step() -> schedule: admit what fits; prefill a document chunk and ready questions (bounded
              while others decode, so they keep producing tokens; launched, and read at the
              end of the next iteration, after its decode step is queued:
              engine/prefilling.py)
           -> run: one decode step per kind of request (every width-1 request in one step,
              stock and cascade side by side; parallel requests per width)
           -> postprocess: the step in flight is read back, finished streams become answers
              and go to `on_answer` at once.

One decode step stays in flight: step t+1 is built and launched (its input tokens taken from
step t's sampled tokens on the device) before step t's tokens are read back, so host work
overlaps the GPU. A step holding streams under a grammar (JSON answers) is launched in two
parts, because each stream's mask depends on the token it accepted last: its forward goes to
the device first; then step t is read back and its tokens accepted (the matchers consume them,
finished streams become answers); then the masks are filled on a background thread while the
forward runs and the main thread goes on to build the next step, and the step is sampled
(masks applied) when something needs its tokens: the next forward or its read back (`_launch`,
`_run`, `Launched.complete`; runtime/grammar.py). A stream
that step t finished is fed once more by step t+1, whose token for it is dropped, as for any
stream under the overlap.
`Engine.run` and `Engine.answer` are a session that is fed once and drained; the worker keeps
one session for its whole life and feeds it as jobs arrive. The document cache
belongs to the engine, so a document is prefilled once per engine, whichever session asks.

Under tensor parallelism every rank runs a subclass of this session over its shard
(`engine/parallel/lockstep.py`): rank 0's public calls are repeated by the other ranks, and
each step's sampled tokens (`_sample`) are rank 0's. Internal reads back use `_flush`, so that
only a caller's `flush` is a call to repeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ppqa.engine import scoring
from ppqa.engine.intake import Intake
from ppqa.engine.launches import Launched, Prefilled, charge_streams
from ppqa.engine.outputs import Answer, QuestionRequest, RunStats
from ppqa.engine.prefilling import SessionPrefill
from ppqa.engine.runtime.grammar import fill_later
from ppqa.engine.runtime.graph_runner import pow2
from ppqa.engine.runtime.sampling import FILL, sample
from ppqa.engine.runtime.scheduler import Scheduler
from ppqa.engine.runtime.steps import PlannedStep
from ppqa.modes import check_mode

AnswerCallback = Callable[[QuestionRequest, Answer], None]
ErrorCallback = Callable[[QuestionRequest, Exception], None]


class EngineSession(SessionPrefill):
    """A running loop over `engine`: `submit` adds questions, `step` advances the work by one
    iteration, `cancel` drops questions; answers and rejections go to the callbacks."""

    # A constrained step launched behind the step in flight fills its masks on a background
    # thread and samples just before the next forward (or read back) needs its tokens, so the
    # host builds the next step while the masks fill. Off where ranks sample in lockstep.
    defer_masks = True
    # A background submit's questions join the queue once this many iterations have run
    # since it (with the next step, where the session had nothing scheduled when it came):
    # a count, not "when its tokens are ready", so
    # that the same work in the same order makes the same steps (bf16 answers depend on batch
    # composition). A `paper` claim's 16k-token document took 62-75 ms to tokenize, about
    # four of its iterations (results/h200/gprof_paper_auto_s23c1.json,
    # `claim_if_room/submit`).
    tokenize_ahead_iterations = 4

    def __init__(self, engine, on_answer: AnswerCallback | None = None,
                 on_error: ErrorCallback | None = None) -> None:
        self.engine = engine
        self._parts = parts = engine.parts
        self.on_answer, self.on_error = on_answer, on_error
        self.sched = Scheduler(parts.pool, parts.table, parts.docs,
                               max_prefill_tokens=engine.config.max_prefill_tokens,
                               max_batch_requests=engine.config.max_batch_requests,
                               max_wide_requests=engine.config.wide_requests)
        self.stats = RunStats()
        self.started = time.perf_counter()
        self._in_flight: Launched | None = None
        # When the last decode step's tokens came back, or the last prefill ended: on the CPU
        # a decode step is charged from the later of its launch and this, so time spent in a
        # prefill while it was in flight is charged once (to the prefill), not to both. (On a
        # GPU both are charged their device time, `Launched.device_seconds` and `PrefillTimer`.)
        self._last_read = 0.0
        # Prefill launched and not yet read (`_settle_prefill`): with `overlap_steps`, a
        # document chunk and a question prefill are read at the end of the next iteration,
        # after its decode step is queued, so the GPU has work queued while the host goes on.
        self._unsettled: list[Prefilled] = []
        self._iteration = 0  # `step` calls that ran work: when a launch or a submit happened
        self._scores = scoring.ScoreBook()  # questions with choices, until all are scored
        self._intake = Intake(engine, self.sched, self.stats, self._scores, self._reject,
                              self.tokenize_ahead_iterations)
        tokenizer = engine.tokenizer
        self._eos = [] if not tokenizer.eos_token_ids else list(tokenizer.eos_token_ids)
        self._cuda = engine.device.type == "cuda"
        # Width-1 questions of one document prefill together against it (the cascade extend,
        # exact for stock too); the CPU's torch backend does that as a slow literal split.
        self._grouped_prefill = self._cuda
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(engine.device)

    # ---- feeding -----------------------------------------------------------------------------

    def submit(self, requests: Sequence[QuestionRequest], *, mode: str = "auto",
               streams: int | str | None = None, background: bool = False) -> int:
        """Queue questions (any documents); returns how many were accepted. A question that
        cannot fit, or whose template or tokenization fails, goes to `on_error` (raised
        without one) and the others go ahead.

        background: render the prompts now and tokenize them on the session's tokenizer
        thread, so that a long document's tokenizing overlaps the steps the GPU runs; the
        questions join the queue once `tokenize_ahead_iterations` steps have run, or with the
        first step where nothing was scheduled when they came (the rejections found then go to
        `on_error` too). Returns how
        many questions went to the thread. Where the tokenizer would hold the GIL while it
        works, it tokenizes here as without (engine/intake.py)."""
        check_mode(mode)
        if streams is not None and streams != "auto" and (not isinstance(streams, int) or streams < 1):
            raise ValueError(f"streams must be None, 'auto' or an integer >= 1, got {streams!r}")
        return self._intake.submit(requests, mode, streams, background, self._iteration)

    def cancel(self, doomed: Callable[[QuestionRequest], bool]) -> int:
        """Drop the questions that `doomed(request)` picks, queued or running: they get no
        answer, and their KV and rows are free for others at once. Returns how many."""
        self._intake.collect(self._iteration, wait_all=True)
        dropped = len({id(s.key) for s in self.sched.cancel(doomed)})  # a question, not a choice
        self._scores.drop(doomed)
        self.stats.cancelled += dropped
        return dropped

    @property
    def queued_requests(self) -> int:
        """Requests waiting for admission (not yet holding KV or a row), a question still
        being tokenized counted as one."""
        return len(self.sched.waiting) + self._intake.pending_questions

    @property
    def active_requests(self) -> int:
        return self.sched.active

    @property
    def open_questions(self) -> int:
        """Questions submitted and not yet answered, rejected or cancelled."""
        sched = self.sched
        return self._intake.pending_questions + len(
            {id(st.key) for r in [*sched.waiting, *sched.prefilling, *sched.running,
                                  *sched.leaving]
             for st in r.streams if not st.cancelled and not st.is_finished})

    def has_work(self) -> bool:
        return (self.sched.has_work() or self._in_flight is not None or bool(self._unsettled)
                or self._intake.pending)

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> bool:
        """One iteration: schedule (admit, prefill), run (decode), postprocess. False when
        there was nothing to do."""
        sched = self.sched
        if self._intake.pending:  # background submits that are due join; with nothing else, wait
            self._intake.collect(self._iteration, wait_first=not sched.has_work())
        if not sched.has_work():
            self._flush()
            return False
        self._iteration += 1
        if self._in_flight is not None and sched.waiting:
            self.stats.left_early += sched.release_leaving(self._in_flight.step.uid)
        if sched.should_admit():
            sched.admit()
        # While others decode, one document chunk and one question prefill an iteration.
        self._prefill(bounded=bool(sched.running))
        self._decode()
        return True

    def prefill_ahead(self) -> bool:
        """While nothing decodes: queue every submit (waiting for its tokens), admit what
        fits and launch the admitted documents' prefill, without waiting for the device. A
        worker calls it between the claims it makes while idle, so the GPU prefills the first
        documents while the host claims and tokenizes the next. Questions and decoding wait
        for `step`, whose first decode step holds every question admitted by then. Each call
        admits up to the prefill budget, where one first `step` admits that much in all and
        the rest join later beside decode. A document admitted after another is prefilled
        copies the leading tokens it shares with that one (`DocumentCache.insert`); its
        first chunk's attention path does not depend on it (attention/triton_backend.py,
        `_first_chunk`). Returns whether a document chunk was launched."""
        sched = self.sched
        if sched.running or self._in_flight is not None:
            return False
        if self._intake.pending:
            self._intake.collect(self._iteration, wait_all=True)
        if sched.should_admit():
            sched.admit()
        launched = self._prefill_documents(bounded=False)
        if not self.engine.config.overlap_steps:
            self._settle_prefill()
        return launched > 0

    def drain(self, should_stop: Callable[[], bool] | None = None) -> None:
        """Step until every submitted question is answered (or `should_stop()` turns true)."""
        while self.has_work():
            if should_stop is not None and should_stop():
                self.stats.stopped = True
                return
            self.step()

    def flush(self) -> None:
        """Read back the step in flight, if any."""
        self._flush()

    def _flush(self) -> None:
        if self._in_flight is not None:
            launched, self._in_flight = self._in_flight, None
            self._finish(launched)
        self._settle_prefill()

    def close(self) -> RunStats:
        """Drop whatever is left (a stop or an error) and return the session's statistics."""
        self._in_flight = None
        self._unsettled.clear()
        self._intake.close()
        self.sched.abort_all()
        if self._cuda:
            self.stats.peak_memory_bytes = torch.cuda.max_memory_allocated(self.engine.device)
        self.stats.wall_s = time.perf_counter() - self.started
        return self.stats

    # ---- preparing requests ------------------------------------------------------------------

    def _reject(self, req: QuestionRequest, error: Exception) -> None:
        if self.on_error is None:
            raise error
        self.stats.errors += 1
        self.on_error(req, error)

    # ---- schedule, run, postprocess ----------------------------------------------------------

    def _decode(self) -> None:
        begin = time.perf_counter()
        batches = self.sched.decode_batches(self._unread_steps())
        if not batches and self._unsettled:  # nothing else to run: the new requests now,
            self._flush()  # after the step in flight is read while the device prefills them
            batches = self.sched.decode_batches()
        for i, batch in enumerate(batches):
            if i:  # the step read back by the batch before may have finished some of these
                batch = [r for r in batch if r.row >= 0 and r.schedulable().any()]
                if not batch:
                    continue
            self.stats.max_batch_requests = max(self.stats.max_batch_requests, len(batch))
            prev, self._in_flight = self._in_flight, None
            # Fixed shapes for CUDA graphs: B padded to a power of two with dummy requests.
            pad_to = pow2(len(batch)) if self.engine.config.cuda_graphs else 0
            step = self.sched.decode_step(batch, pad_to=pad_to,
                                          prev=None if prev is None else prev.step)
            self._in_flight = self._launch(step, prev)
            if not self.engine.config.overlap_steps:
                self._flush()
        if not batches:
            self._flush()
        waited = time.perf_counter()
        # Earlier iterations' prefill; this one's is read in the next, so the host claims,
        # admits and launches the next prefill while the device still has this iteration's
        # prefill and decode step to run.
        self._settle_prefill(earlier_only=True)
        self.stats.decode_s += waited - begin

    def _launch(self, step: PlannedStep, prev: Launched | None) -> Launched:
        """Run `step` and sample it; `prev` (the step in flight, whose device tokens are this
        step's inputs) is read back and postprocessed after this step's forward is queued, so
        the host does that while the device runs the forward. A step without grammar rows
        samples before `prev` is read (the device samples at once); one with grammar rows after
        (its masks need the tokens of `prev` accepted), filling them on a background thread while
        the forward runs; it samples when its tokens are first needed (`_run`, `read`)."""
        launched_at = time.perf_counter()
        began = None
        if self._cuda:  # the step's device time starts here (its tokens' copy ends it)
            began = torch.cuda.Event(enable_timing=True)
            began.record()
        logits = self._run(step.inputs, prev)
        self.stats.steps += 1
        if prev is None:
            return Launched(step, self._sample(logits, step), launched_at, began)
        self.stats.overlapped_steps += 1  # launched before the step in flight was read
        if step.sampling.grammar is not None:
            self._finish(prev)
            if not self.defer_masks:
                return Launched(step, self._sample(logits, step), launched_at, began)
            masks = fill_later(step.sampling.grammar, *logits.shape, pin=logits.is_cuda)
            return Launched(step, None, launched_at, began,
                             later=lambda: self._sample(logits, step, masks.result()))
        launched = Launched(step, self._sample(logits, step), launched_at, began)
        self._finish(prev)
        return launched

    def _run(self, inputs, prev: Launched | None = None) -> torch.Tensor | None:
        """Forward one step (`prev`: the step in flight whose device tokens feed it). A step
        still waiting for its masks samples first, so that its logits are sampled before any
        later forward and its tokens exist for this one."""
        if self._in_flight is not None:
            self._in_flight.complete()
        if prev is not None:
            prev.complete()
        return self._parts.runner.run(inputs, None if prev is None else prev.tokens)

    def _sample(self, logits: torch.Tensor, step: PlannedStep, bitmask=FILL) -> torch.Tensor:
        return sample(logits, step.sampling, bitmask)

    def _finish(self, launched: Launched, charge: bool = True) -> None:
        tokens = launched.read()
        now = time.perf_counter()
        step = launched.step
        if charge:
            # A decode step's time, shared by its streams. On a GPU its device time, from the
            # first of its launches to its tokens' copy: a prefill queued between two decode
            # steps is charged to its own streams, and a host that read a step back late does
            # not charge the device work queued after it. On the CPU, where a launch runs the
            # step, from its launch (or the previous step's read, when it was launched behind
            # that one) to its tokens, so that steps in flight together count once.
            fed = [s for req, mask in zip(step.requests, step.fed)
                   if req.row >= 0 or req.left_early
                   for i, s in enumerate(req.streams) if mask[i]]
            seconds = launched.device_seconds()
            if seconds is None:
                seconds = now - max(launched.launched_at, self._last_read)
            charge_streams(fed, "decode_s", seconds)
            self._last_read = now
        finished = self.sched.postprocess(step, tokens, eos_ids=self._eos,
                                          decode=self.engine.tokenizer.decode, now=now)
        if not finished:
            return
        modes = {id(s): (r.mode, r.width) for r in step.requests for s in r.streams}
        for stream in finished:
            mode, width = modes.get(id(stream), ("stock", 1))
            answer = Answer(stream.text, list(stream.output_ids), stream.finish_reason,
                            stream.prompt_tokens, latency_s=now - self.started, mode=mode,
                            streams=width, prefill_s=stream.prefill_s, decode_s=stream.decode_s,
                            sample=stream.sample)
            self._deliver(stream.key, answer)

    def _deliver(self, key: QuestionRequest, answer: Answer) -> None:
        stats = self.stats
        stats.questions += 1
        stats.answer_tokens += len(answer.token_ids)
        stats.prompt_tokens += answer.prompt_tokens
        if self.on_answer is not None:
            self.on_answer(key, answer)
