"""`Intake`: how questions submitted to an engine session reach its scheduler
(engine/session.py owns one).

    submit(requests) -> prepare.prepare_groups (per template and document: render, tokenize,
        check fit and sampling) -> a mode per document group (auto: the cost model, or cascade
        where cascade already decodes the document) -> requests of P streams (parallel) or one
        question each (stock, cascade) -> Scheduler.add; questions with choices become
        scoring requests (engine/scoring.py)
    submit(..., background=True) -> prepare.render_groups now; the tokenizer thread runs
        `encode_many`; `collect` finishes each group (prepare.group_streams) and queues it
        once `ahead` session iterations have run since (one where the session had nothing
        scheduled; an idle session waits for the oldest and takes every one due with it),
        waiting for its tokens if need be: a count rather than the thread's progress, so the
        same work in the same order makes the same steps (bf16 answers depend on batch
        composition)

Rejections go to the session's `reject` (its `on_error`); the session's statistics record
the modes chosen and the widest P.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ppqa.engine import scoring
from ppqa.engine.launches import Tokenizing
from ppqa.engine.outputs import QuestionRequest, RunStats
from ppqa.engine.prepare import (choose_plan, group_streams, make_requests, prepare_groups,
                                 render_groups)
from ppqa.engine.runtime.document_cache import document_key
from ppqa.engine.runtime.request import Request, Stream
from ppqa.engine.runtime.scheduler import Scheduler


class Intake:
    def __init__(self, engine, sched: Scheduler, stats: RunStats, scores: scoring.ScoreBook,
                 reject: Callable[[QuestionRequest, Exception], None], ahead: int) -> None:
        self.engine, self.sched, self.stats, self.scores = engine, sched, stats, scores
        self.reject, self.ahead = reject, ahead
        self.modes: set[str] = set()
        # Background submits whose texts the tokenizer thread is encoding, in submit order.
        self._tokenizing: deque[Tokenizing] = deque()
        self._thread: ThreadPoolExecutor | None = None

    def submit(self, requests: Sequence[QuestionRequest], mode: str,
               streams: int | str | None, background: bool, iteration: int) -> int:
        """See `EngineSession.submit`; `iteration`: the session's count of iterations now."""
        due = iteration + (self.ahead if self.sched.has_work() else 1)
        if background and self.engine.tokenizer.tokenizes_off_thread:
            groups = render_groups(self.engine, requests, self.reject)
            if groups:
                texts = [t for g in groups for t in g.texts.all]
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(1, thread_name_prefix="ppqa-tokenize")
                future = self._thread.submit(self.engine.tokenizer.encode_many, texts)
                self._tokenizing.append(Tokenizing(groups, future, mode, streams, due))
            return sum(len(g.requests) for g in groups)
        self.collect(iteration, wait_all=True)  # earlier background submits queue first
        jobs = prepare_groups(self.engine, requests, self.reject, self.scores.expect)
        accepted = sum(self._queue_group(doc_ids, group, mode, streams, later=len(jobs) - i - 1)
                       for i, (doc_ids, group) in enumerate(jobs))
        self._record_mode()
        return accepted

    @property
    def pending(self) -> bool:
        return bool(self._tokenizing)

    @property
    def pending_questions(self) -> int:
        """Questions of background submits not yet queued."""
        return sum(len(g.requests) for work in self._tokenizing for g in work.groups)

    def collect(self, iteration: int, wait_all: bool = False, wait_first: bool = False) -> None:
        """Queue the background submits due by `iteration`, in submit order, waiting for their
        tokens if need be; wait_first (there is nothing else to run): the oldest whatever its
        due, with every one due by then (a worker's first claims, submitted together while the
        session was idle, start in one step rather than one document an iteration beside
        decode); wait_all: every one."""
        if wait_first and self._tokenizing:
            iteration = max(iteration, self._tokenizing[0].due)
        while self._tokenizing and (wait_all or self._tokenizing[0].due <= iteration):
            work = self._tokenizing.popleft()
            try:
                encoded = work.future.result()
            except Exception as error:  # noqa: BLE001 - bad input fails its own questions
                for group in work.groups:
                    group.reject_all(self.reject, error)
                continue
            at = 0
            for i, group in enumerate(work.groups):
                n = len(group.texts.all)
                job = group_streams(self.engine, group, encoded[at:at + n], self.reject,
                                    self.scores.expect)
                at += n
                if job is not None:
                    self._queue_group(*job, work.mode, work.streams,
                                      later=len(work.groups) - i - 1)
        if self.modes:
            self._record_mode()

    def close(self) -> None:
        """Drop what is still being tokenized; the thread ends."""
        self._tokenizing.clear()
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None

    def _record_mode(self) -> None:
        self.stats.mode = next(iter(self.modes)) if len(self.modes) == 1 else "mixed"

    def _queue_group(self, doc_ids: list[int], group: list[Stream], mode: str,
                     streams: int | str | None, later: int = 0) -> int:
        """One document group's streams to the scheduler, in the mode chosen for them; returns
        how many. `later`: the groups of the same submit queued after this one."""
        engine = self.engine
        scored = [s for s in group if s.choice_ids is not None]
        group = [s for s in group if s.choice_ids is None]
        if scored:
            self._queue_scored(doc_ids, scored, scoring.scoring_mode(mode))
        if not group:
            return len(scored)
        if mode == "auto" and self.sched.cascade_on(document_key(doc_ids)):
            # Questions about a document that cascade already decodes join that group
            # (the worker may claim one document's jobs over several claims).
            chosen, width = "cascade", 1
        else:
            chosen, width = choose_plan(mode, streams, len(doc_ids), group,
                                        engine.model_config, engine.device.type,
                                        engine.dtype.itemsize, engine.config.default_streams,
                                        documents=self._documents(doc_ids, len(group), later))
        self.modes.add(chosen)
        self.stats.streams = max(self.stats.streams, width)
        for req in make_requests(engine, doc_ids, group, chosen, width):
            self.sched.add(req)
        return len(scored) + len(group)

    def _documents(self, doc_ids: list[int], questions: int, later: int) -> int:
        """How many documents a new group of `questions` streams may decode beside, itself
        included: those the scheduler holds, the `later` groups of its submit and those still
        tokenizing, as many as the batch has room for beside it."""
        room = max(1, self.sched.max_batch_requests // max(1, questions))
        others = (self.sched.documents(besides=document_key(doc_ids), up_to=room) + later
                  + sum(len(work.groups) for work in self._tokenizing))
        return min(1 + others, room)

    def _queue_scored(self, doc_ids: list[int], streams: list[Stream], mode: str) -> None:
        key = document_key(doc_ids)
        self.modes.add(mode)
        for whole in streams:
            for stream in scoring.streams_for_mode(whole, mode):
                self.sched.add(Request(doc_ids, [stream], width=1, doc_key=key, mode=mode))
