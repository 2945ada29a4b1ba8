"""`POST /v1/chat/completions` over the job store: a request becomes a job, and waits for it.

    body -> `parse_chat_body` -> `plan_requests` (one request: its document is everything before
    its last message, so that calls about the same document share one) -> `ingest_chat`
    (priority CHAT_PRIORITY: interactive calls go before batches) -> `AnswerWaiter` polls the
    store for the answers -> a chat.completion object (`batch_out.chat_completion`).

Any worker on the store answers (`ppqa run`, or the server's own with `--worker`); calls that
share a document are claimed together and decoded in one engine run. ONE poll loop per server
reads the answers of every waiting call in one query per tick, however many wait. A call whose
client went away, that waits longer than the timeout, or that still waits when the server
begins to shut down (`closing`: answered 503 within a second, so that the server can stop),
has its jobs cancelled.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

from ppqa.openai.batch_out import chat_completion
from ppqa.openai.chat_request import RequestError, parse_chat_body
from ppqa.openai.plan import PlannedRequest, plan_requests
from ppqa.openai.prompt_model import PromptModel
from ppqa.store.db import Database
from ppqa.store.jobs import cancel_open_jobs
from ppqa.store.models import CANCELLED, FAILED
from ppqa.store.openai_batches import ingest_chat
from ppqa.store.openai_results import ChoiceResult, question_results

CHAT_PRIORITY = 1
LABEL = "chat"  # document names ("chat group 1") and messages


class ChatFailed(RuntimeError):
    """The call's job ended without an answer (failed, or cancelled by someone)."""


class ServerClosing(RuntimeError):
    """The server began to shut down while the call waited; its jobs are cancelled."""


class AnswerWaiter:
    """Futures for sets of question ids, resolved by one polling task (module doc)."""

    def __init__(self, db: Database, poll_seconds: float,
                 closing: threading.Event | None = None) -> None:
        self.db, self.poll_seconds = db, poll_seconds
        self.closing = closing or threading.Event()
        self._waiting: dict[int, tuple[list[int], asyncio.Future]] = {}
        self._task: asyncio.Task | None = None
        self._next = 0

    async def wait(self, question_ids: list[int], timeout: float,
                   gone: Callable[[], Awaitable[bool]]) -> list[ChoiceResult] | None:
        """The questions' results once each is answered or its job ended; None if the client
        is `gone()`, `timeout` seconds pass or the server is `closing` first."""
        future = asyncio.get_running_loop().create_future()
        key, self._next = self._next, self._next + 1
        self._waiting[key] = (question_ids, future)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll())
        deadline = time.monotonic() + timeout
        try:
            while not future.done():
                left = deadline - time.monotonic()
                if left <= 0 or self.closing.is_set() or await gone():
                    return None
                await asyncio.wait([future], timeout=min(1.0, left))
            return future.result()
        finally:
            self._waiting.pop(key, None)

    async def _poll(self) -> None:
        while self._waiting:
            waiting = list(self._waiting.values())
            ids = sorted({q for qids, _ in waiting for q in qids})
            try:
                found = {c.question_id: c for c in
                         await asyncio.to_thread(question_results, self.db, ids)}
            except Exception as exc:  # noqa: BLE001 - a store that fails now: fail the calls
                for _, future in waiting:
                    if not future.done():
                        future.set_exception(exc)
                found = {}
            for qids, future in waiting:
                if future.done() or any(q not in found for q in qids):
                    continue
                results = [found[q] for q in qids]
                if all(_ended(c) for c in results):
                    future.set_result([ChoiceResult(**{**vars(c), "choice": i})
                                       for i, c in enumerate(results)])
            await asyncio.sleep(self.poll_seconds)


def _ended(choice: ChoiceResult) -> bool:
    return choice.text is not None or choice.job_status in (FAILED, CANCELLED)


class ChatService:
    def __init__(self, db: Database, model: PromptModel, plan_lock: threading.Lock, *,
                 poll_seconds: float = 0.1, timeout: float = 600.0,
                 closing: threading.Event | None = None) -> None:
        self.db, self.model, self.plan_lock, self.timeout = db, model, plan_lock, timeout
        self.waiter = AnswerWaiter(db, poll_seconds, closing)

    def submit(self, body: object) -> tuple[list[int], int]:
        """Queue a call; (its question ids, its prompt tokens). RequestError for a bad body."""
        request = parse_chat_body(body)
        with self.plan_lock:
            try:
                plan = plan_requests([PlannedRequest(1, "chat", request)], self.model,
                                     label=LABEL, priority=CHAT_PRIORITY)
            except RequestError as exc:
                raise RequestError(str(exc).removeprefix(f"{LABEL}:1: "), exc.param) from None
        return ingest_chat(self.db, plan), plan.choices[0].prompt_tokens

    async def complete(self, body: object, gone: Callable[[], Awaitable[bool]]) -> dict | None:
        """The chat.completion for `body`; None if the client went away or it timed out
        (its jobs are then cancelled); ChatFailed if a job ended without an answer;
        ServerClosing if the server began to shut down first (its jobs cancelled)."""
        question_ids, prompt_tokens = await asyncio.to_thread(self.submit, body)
        results = await self.waiter.wait(question_ids, self.timeout, gone)
        if results is None:
            await asyncio.to_thread(self._cancel, question_ids)
            if self.waiter.closing.is_set():
                raise ServerClosing("the server is shutting down; the request was not answered "
                                    "(its job is cancelled)")
            return None
        unanswered = [c for c in results if c.text is None]
        if unanswered:
            c = unanswered[0]
            raise ChatFailed(c.job_error or f"job {c.job_id} was {c.job_status} before answering")
        return chat_completion(f"chatcmpl-{question_ids[0]}", self.model.name, prompt_tokens,
                               results)

    def _cancel(self, question_ids: list[int]) -> None:
        jobs = sorted({c.job_id for c in question_results(self.db, question_ids)})
        with self.db.write() as conn:
            cancel_open_jobs(conn, self.db.now(conn), jobs)
