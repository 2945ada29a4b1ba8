"""`Engine`: load a model, then answer many questions about documents in one of three modes.

    Engine(spec) -> loader (config, weights, tokenizer) -> model on the device, KV pool,
    req_to_token table, document cache, attention backend, runner.
    run(requests) -> prompts per (template, document) -> checks (context, pool) -> requests of
    P streams (parallel) or one question each (stock, cascade) -> scheduler loop:
        admit -> prefill new documents (once per engine) -> prefill questions -> decode steps,
    each step: scheduler builds it -> runner -> sampler; its tokens are read back while the next
    step runs -> scheduler.postprocess -> answers handed to `on_answer`.
`answer(document, questions)` is `run` for one document, returning answers in question order.
The document cache outlives `run` calls, so a document is prefilled once per engine.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Collection, Sequence

import torch

from ppqa.config import EngineConfig, SamplingParams
from ppqa.modes import check_mode
from ppqa.engine.runtime import cost_model
from ppqa.engine.setup import EngineParts, build_parts
from ppqa.engine.runtime.kv_cache import document_key
from ppqa.engine.outputs import (Answer, InvalidRequestError, PromptTooLongError, QuestionRequest,
                                 RunStats)
from ppqa.engine.runtime.request import Request, Stream
from ppqa.engine.runtime.sampling import sample
from ppqa.engine.runtime.scheduler import PlannedStep, Scheduler, pack_streams


def choose_plan(mode: str, streams: int | str | None, jobs: Sequence[tuple[list[int], list[Stream]]],
                model_config, device_kind: str, dtype_bytes: int, default_streams: int
                ) -> tuple[str, int]:
    """(mode, P) for a run. "auto" mode and streams="auto" ask the cost model
    (engine/cost_model.py) about the run's largest document group; parallel with streams=None
    uses the default P. P is capped at the largest group's question count."""
    if not jobs:
        return ("stock" if mode == "auto" else mode), 1
    doc_ids, group = max(jobs, key=lambda job: len(job[1]))
    workload = cost_model.Workload(
        doc_tokens=len(doc_ids), questions=len(group),
        question_tokens=round(sum(len(s.suffix_ids) for s in group) / len(group)),
        max_new_tokens=round(sum(s.sampling.max_new_tokens for s in group) / len(group)))
    rates = cost_model.DeviceRates.for_device(device_kind)
    if mode == "auto":
        # On the CPU the torch backend's cascade (a literal split, for testing) loses to
        # parallel (benchmarks/README.md, CPU table), so auto does not offer it there.
        candidates = ("stock", "cascade", "parallel") if device_kind == "cuda" else ("stock", "parallel")
        mode, p, _ = cost_model.choose(model_config, workload, rates, candidates, dtype_bytes)
        if streams == "auto" or streams is None:
            return mode, p
    if mode != "parallel":
        return mode, 1
    if streams == "auto":
        streams = cost_model.best_streams(model_config, workload, rates, dtype_bytes)
    return mode, min(streams or default_streams, len(group))


class Engine:
    """A loaded model with its KV pool and document cache; `answer` and `run` use it.

    `Engine("smollm2")`, an HF directory, a .gguf path or "dummy:<preset>"; `device` and `dtype`
    override the config's (default: cuda if present, bf16 there and fp32 on the CPU).
    """

    def __init__(self, model: str = "smollm2", *, device: str | None = None, dtype: object = None,
                 config: EngineConfig | None = None) -> None:
        from ppqa.engine.loading.loader import load_model  # the loader pulls tokenizers etc.; import late

        parts = build_parts(config, device, dtype, lambda dev, dt, seed: load_model(
            model, device=dev, dtype=dt, seed=seed), model_name=model)
        self._adopt(parts)

    @classmethod
    def from_loaded(cls, loaded, *, device: str | None = None, dtype: object = None,
                    config: EngineConfig | None = None, model_name: str | None = None) -> Engine:
        """An engine from a `LoadedModel` (config, weights, tokenizer) built by the caller."""
        engine = cls.__new__(cls)
        engine._adopt(build_parts(config, device, dtype, lambda dev, dt, seed: loaded,
                                  model_name=model_name or loaded.config.name))
        return engine

    def _adopt(self, parts: EngineParts) -> None:
        self._parts = parts
        self.model_name = parts.model_name
        self.device = parts.device
        self.dtype = parts.dtype
        self.config = parts.config
        self.model_config = parts.model.config
        self.tokenizer = parts.tokenizer
        self._seeds = random.Random(self.config.seed)

    @property
    def kv_capacity(self) -> int:
        """Tokens one request (document + questions + answers) may occupy at most."""
        return min(self._parts.pool.allocator.capacity, self._parts.table.max_row_len)

    # ---- public API --------------------------------------------------------------------------

    def answer(self, document: str, questions: Sequence[str], mode: str = "auto",
               sampling: SamplingParams | Sequence[SamplingParams] | None = None,
               streams: int | None = None, template: str = "qa") -> list[Answer]:
        """Answers to `questions` about `document`, in question order."""
        if isinstance(questions, str):
            raise TypeError("questions must be a sequence of strings, not one string")
        if len(questions) == 0:
            raise ValueError("no questions: give at least one question about the document")
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or SamplingParams()] * len(questions)
        else:
            params = list(sampling)
            if len(params) != len(questions):
                raise ValueError(f"{len(params)} SamplingParams for {len(questions)} questions")
        requests = [QuestionRequest(i, document, q, p, template)
                    for i, (q, p) in enumerate(zip(questions, params))]
        answers: dict[int, Answer] = {}

        def keep(request: QuestionRequest, answer: Answer) -> None:
            answer.question_index = request.key
            answers[request.key] = answer

        self.run(requests, mode=mode, streams=streams, on_answer=keep)
        return [answers[i] for i in range(len(questions))]

    def run(self, requests: Sequence[QuestionRequest], *, mode: str = "auto",
            streams: int | None = None,
            on_answer: Callable[[QuestionRequest, Answer], None] | None = None,
            on_error: Callable[[QuestionRequest, Exception], None] | None = None,
            should_stop: Callable[[], bool] | None = None,
            cancelled: Collection[object] | None = None) -> RunStats:
        """Answer many questions (any documents); answers go to `on_answer` as they finish.

        A question that cannot fit, or whose template, document or sampling parameters fail,
        goes to `on_error` (raised if there is none); the others run. When `should_stop()`
        turns true, no new work starts and unfinished questions are dropped. `cancelled`: keys
        of requests to drop, to which another thread may add while this runs (the worker's
        lease keeper, when a job is cancelled); its size is checked before every step.
        """
        started = time.perf_counter()
        check_mode(mode)  # reject an unknown mode before any work
        if streams is not None and streams != "auto" and (not isinstance(streams, int) or streams < 1):
            raise ValueError(f"streams must be None, 'auto' or an integer >= 1, got {streams!r}")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        stats = RunStats()
        jobs = self._prepare(requests, on_error, stats)
        stats.mode, stats.streams = choose_plan(
            mode, streams, jobs, self.model_config, self.device.type, self.dtype.itemsize,
            self.config.default_streams)
        parts = self._parts
        sched = Scheduler(parts.pool, parts.table, parts.docs,
                          max_prefill_tokens=self.config.max_prefill_tokens,
                          max_batch_requests=self.config.max_batch_requests)
        for doc_ids, job_streams in jobs:
            for req in self._requests(doc_ids, job_streams, stats.mode, stats.streams):
                sched.add(req)
        try:
            self._loop(sched, stats, started, on_answer, should_stop, cancelled)
        finally:
            sched.abort_all()  # frees whatever an early stop or an error left behind
        if self.device.type == "cuda":
            stats.peak_memory_bytes = torch.cuda.max_memory_allocated(self.device)
        stats.wall_s = time.perf_counter() - started
        return stats

    # ---- internals ---------------------------------------------------------------------------

    def _prepare(self, requests: Sequence[QuestionRequest], on_error, stats: RunStats
                 ) -> list[tuple[list[int], list[Stream]]]:
        """Tokenize per (template, document) and check every question fits; one job per document.
        Whatever one group's template, document or sampling parameters raise fails that group's
        requests alone (`on_error`), never the run."""
        groups: dict[tuple[str, str | None, str], list[QuestionRequest]] = {}
        for req in requests:
            groups.setdefault((req.template, req.template_source, req.document), []).append(req)

        def reject(req: QuestionRequest, error: Exception) -> None:
            if on_error is None:
                raise error
            stats.errors += 1
            on_error(req, error)

        jobs = []
        for (template, source, document), reqs in groups.items():
            try:
                self._check_size(document, reqs)
                prompt = self.tokenizer.prompt(template, document, [r.question for r in reqs],
                                               template_source=source)
            except Exception as error:  # noqa: BLE001 - this group's input, not the engine
                for req in reqs:
                    reject(req, _input_error(error))
                continue
            if self.config.share_question_prefix:
                prompt = prompt.with_common_opening()
            doc_ids, streams = list(prompt.prefix_ids), []
            for req, suffix in zip(reqs, prompt.suffix_ids):
                error = self._fit_error(len(doc_ids), len(suffix), req.sampling.max_new_tokens)
                if error is not None:
                    reject(req, error)
                    continue
                seed = req.sampling.seed if req.sampling.seed is not None else self._seeds.getrandbits(62)
                streams.append(Stream(key=req, suffix_ids=list(suffix), sampling=req.sampling,
                                      seed=seed, prompt_tokens=len(doc_ids) + len(suffix)))
            if streams:
                jobs.append((doc_ids, streams))
        return jobs

    def _check_size(self, document: str, reqs: Sequence[QuestionRequest]) -> None:
        """PromptTooLongError, before any tokenization, for a document (or question) whose
        UTF-8 size alone proves it cannot fit the context: a token stands for at most
        `max_token_bytes` bytes (a margin of 4 covers normalizers that shorten text), so a
        30 MB document is refused at once instead of after a minute of tokenizing."""
        context = self.model_config.max_position_embeddings
        limit = 4 * self.tokenizer.max_token_bytes * context
        for what, text in (("document", document), *(("question", r.question) for r in reqs)):
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > limit:
                raise PromptTooLongError(
                    f"the {what} ({size:,} bytes) cannot fit the model's context of {context} "
                    f"tokens (at most {limit:,} bytes of text)", needed=size, available=limit)

    def _fit_error(self, doc: int, question: int, max_new: int) -> PromptTooLongError | None:
        need = doc + question + max_new
        what = (f"document ({doc} tokens) + question ({question} tokens) + max_new_tokens "
                f"({max_new}) = {need} tokens")
        context = self.model_config.max_position_embeddings
        if need > context:
            return PromptTooLongError(f"{what} exceeds the model's context of {context} tokens",
                                      needed=need, available=context)
        if need > self.kv_capacity:
            return PromptTooLongError(
                f"{what} do not fit the KV pool, which holds {self.kv_capacity} tokens per request; "
                f"raise EngineConfig.kv_token_budget (CPU) or mem_fraction (GPU)",
                needed=need, available=self.kv_capacity)
        return None

    def _requests(self, doc_ids: list[int], streams: list[Stream], mode: str,
                  width: int) -> list[Request]:
        key = document_key(doc_ids)  # hashed once per document, not once per request
        if mode != "parallel":
            return [Request(doc_ids, [s], width=1, doc_key=key) for s in streams]
        sizes = [len(s.suffix_ids) + s.sampling.max_new_tokens for s in streams]
        return [Request(doc_ids, [streams[i] for i in group], width=width, doc_key=key)
                for group in pack_streams(sizes, width, len(doc_ids), self.kv_capacity)]

    def _loop(self, sched: Scheduler, stats: RunStats, started: float, on_answer,
              should_stop, cancelled) -> None:
        """Admit, prefill, decode. One decode step stays in flight: step t+1 is built and
        launched (its input tokens taken from step t's sampled tokens on the device) before
        step t's tokens are read back and applied, so host work overlaps the GPU. Admission
        first drains the step in flight; prefills run synchronously."""
        runner, tokenizer = self._parts.runner, self.tokenizer
        eos = [] if not tokenizer.eos_token_ids else list(tokenizer.eos_token_ids)
        cascade = stats.mode == "cascade"
        kind = "extend" if stats.mode == "parallel" else "decode"

        def launch(step: PlannedStep, prev: _Launched | None) -> _Launched:
            logits = runner.run(step.inputs, None if prev is None else prev.tokens)
            stats.steps += 1
            return _Launched(step, sample(logits, step.sampling))

        def finish(launched: _Launched) -> None:
            tokens = launched.read()
            now = time.perf_counter()
            for stream in sched.postprocess(launched.step, tokens, eos_ids=eos,
                                            decode=tokenizer.decode, now=now):
                answer = Answer(stream.text, list(stream.output_ids), stream.finish_reason,
                                stream.prompt_tokens, latency_s=now - started)
                stats.questions += 1
                stats.answer_tokens += len(answer.token_ids)
                stats.prompt_tokens += answer.prompt_tokens
                if on_answer is not None:
                    on_answer(stream.key, answer)

        in_flight: _Launched | None = None
        cancelled_seen = 0
        while sched.has_work():
            if should_stop is not None and should_stop():
                stats.stopped = True
                return
            if cancelled is not None and len(cancelled) != cancelled_seen:
                cancelled_seen = len(cancelled)
                stats.cancelled += sched.drop(lambda stream: stream.key.key in cancelled)
            if sched.should_admit():
                if in_flight is not None:
                    finish(in_flight)
                    in_flight = None
                begin = time.perf_counter()
                admitted = sched.admit()
                for doc in sched.documents_to_prefill(admitted):
                    for inputs in sched.document_steps(doc):
                        runner.run(inputs)
                        stats.steps += 1
                    doc.ready = True
                    stats.prefilled_tokens += doc.length - doc.copied
                if admitted:
                    step = sched.prefill_step(admitted, cascade=cascade)
                    stats.prefilled_tokens += step.inputs.num_tokens
                    finish(launch(step, None))
                    stats.prefill_s += time.perf_counter() - begin
            begin = time.perf_counter()
            batch = sched.decode_batch(cascade)
            launched = None
            if batch:
                stats.max_batch_requests = max(stats.max_batch_requests, len(batch))
                # Fixed shapes for CUDA graphs: B padded to a power of two with dummy requests.
                pad_to = 1 << (len(batch) - 1).bit_length() if self.config.cuda_graphs else 0
                step = sched.decode_step(batch, kind=kind, cascade=cascade, pad_to=pad_to,
                                         prev=None if in_flight is None else in_flight.step)
                launched = launch(step, in_flight)
            if in_flight is not None:
                finish(in_flight)
            in_flight = launched
            if in_flight is not None and not self.config.overlap_steps:
                finish(in_flight)
                in_flight = None
            stats.decode_s += time.perf_counter() - begin


def _input_error(error: Exception) -> ValueError:
    """A request's own input failed: a ValueError (kept as is) or one naming what was raised,
    so that callers treat it as permanent (retrying the same input cannot help)."""
    if isinstance(error, ValueError):
        return error
    wrapped = InvalidRequestError(f"{type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


class _Launched:
    """A step on its way: its sampled tokens on the device, copied to pinned host memory
    behind the step (no wait); `read` waits for this step alone."""

    def __init__(self, step: PlannedStep, tokens: torch.Tensor) -> None:
        self.step, self.tokens = step, tokens
        self._event = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def read(self) -> list[int]:
        if self._event is None:
            return self.tokens.tolist()
        self._event.synchronize()
        return self._host.tolist()
