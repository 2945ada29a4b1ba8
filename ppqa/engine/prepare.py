"""From `QuestionRequest`s to the engine's streams and requests, before anything is queued.

    prepare_groups: questions grouped per (template, template text, document), each group's
        prompt rendered (`render_groups`) and tokenized once (the document part shared, a
        suffix per question), every question checked to fit (context, KV pool) and its
        sampling parameters and JSON schema checked; a failure rejects that group or question
        alone. A generating question
        becomes one stream per sample; a question with choices one scoring stream, whatever
        its samples (they are drawn from its one scoring, engine/scoring.py).
    choose_plan: the mode and width P of one document's questions (auto: the cost model).
    make_requests: the streams as scheduler requests: one per stream (stock, cascade), or
        packed P to a row (parallel), streams of one question sharing it in their row.

`EngineSession.submit` (engine/session.py) calls these and queues the requests; with
`background=True` it renders at once and tokenizes on a thread, finishing each group with
`group_streams` a few steps later.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ppqa.config import SamplingParams, sample_seed
from ppqa.engine import scoring
from ppqa.engine.outputs import InvalidRequestError, PromptTooLongError, QuestionRequest
from ppqa.engine.loading.tokenizer import PromptTexts
from ppqa.engine.runtime import cost_model
from ppqa.engine.runtime.batching import pack_streams
from ppqa.engine.runtime.document_cache import document_key
from ppqa.engine.runtime.request import Request, Stream


def choose_plan(mode: str, streams: int | str | None, doc_tokens: int, group: Sequence[Stream],
                model_config, device_kind: str, dtype_bytes: int, default_streams: int,
                documents: int = 1) -> tuple[str, int]:
    """(mode, P) for one document's questions. "auto" mode and streams="auto" ask the cost
    model (runtime/cost_model.py), with the `documents` (this one included) expected to decode
    in the same steps; parallel with streams=None uses the default P; P is capped at
    the question count. On a GPU auto chooses between stock and cascade, which share a decode
    step; on the CPU the torch backend's cascade is a literal split for testing, slower than
    parallel (benchmarks/RESULTS.md, 'CPU'), so auto chooses between stock and parallel."""
    workload = cost_model.Workload(
        doc_tokens=doc_tokens, questions=len(group),
        question_tokens=round(sum(len(s.suffix_ids) for s in group) / len(group)),
        max_new_tokens=round(sum(s.sampling.max_new_tokens for s in group) / len(group)),
        documents=documents)
    rates = cost_model.DeviceRates.for_device(device_kind)
    if mode == "auto":
        candidates = ("stock", "cascade") if device_kind == "cuda" else ("stock", "parallel")
        mode, p, _ = cost_model.choose(model_config, workload, rates, candidates, dtype_bytes)
        if streams == "auto" or streams is None:
            return mode, p
    if mode != "parallel":
        return mode, 1
    if streams == "auto":
        streams = cost_model.best_streams(model_config, workload, rates, dtype_bytes)
    return mode, min(streams or default_streams, len(group))


def prepare_groups(engine, requests: Sequence[QuestionRequest],
                   reject: Callable[[QuestionRequest, Exception], None],
                   expect_scores: Callable) -> list[tuple[list[int], list[Stream]]]:
    """Tokenize per (template, document) and check every question fits; one group per
    document: `render_groups`, each group's texts tokenized, `group_streams`."""
    jobs = []
    for group in render_groups(engine, requests, reject):
        try:
            encoded = engine.tokenizer.encode_many(group.texts.all)
        except Exception as error:  # noqa: BLE001 - bad input fails its own questions
            group.reject_all(reject, error)
            continue
        job = group_streams(engine, group, encoded, reject, expect_scores)
        if job is not None:
            jobs.append(job)
    return jobs


@dataclass
class RenderedGroup:
    """The questions of one (template, document) group and their prompt's texts, rendered but
    not yet tokenized."""

    requests: list[QuestionRequest]
    texts: PromptTexts

    def reject_all(self, reject: Callable[[QuestionRequest, Exception], None],
                   error: Exception) -> None:
        for req in self.requests:
            reject(req, _input_error(error))


def render_groups(engine, requests: Sequence[QuestionRequest],
                  reject: Callable[[QuestionRequest, Exception], None]) -> list[RenderedGroup]:
    """The requests grouped per (template, template text, document), each group's prompt
    rendered. Any error of a group's inputs (its template, a document too big for any
    context) fails that group alone, as a permanent `InvalidRequestError` when it is not a
    ValueError already."""
    groups: dict[tuple[str, str | None, str], list[QuestionRequest]] = {}
    for req in requests:
        groups.setdefault((req.template, req.template_source, req.document), []).append(req)
    out = []
    for (template, source, document), reqs in groups.items():
        choices = ([r.choices for r in reqs] if any(r.choices is not None for r in reqs)
                   else None)
        try:
            _check_size(engine, document, reqs)
            texts = engine.tokenizer.prompt_texts(template, document, [r.question for r in reqs],
                                                  template_source=source, choices=choices)
        except Exception as error:  # noqa: BLE001 - bad input fails its own questions
            for req in reqs:
                reject(req, _input_error(error))
            continue
        out.append(RenderedGroup(reqs, texts))
    return out


def group_streams(engine, group: RenderedGroup, encoded: Sequence[list[int]],
                  reject: Callable[[QuestionRequest, Exception], None],
                  expect_scores: Callable) -> tuple[list[int], list[Stream]] | None:
    """A rendered group's document ids and streams from its texts' encodings (`encode_many`
    of `group.texts.all`), every question checked to fit (context, KV pool) and its sampling
    parameters and JSON schema checked; a failure rejects the group or the question alone.
    None when no stream is left."""
    try:
        prompt = engine.tokenizer.prompt_from(group.texts, encoded)
        if engine.config.share_question_prefix:
            prompt = prompt.with_common_opening()
    except Exception as error:  # noqa: BLE001 - bad input fails its own questions
        group.reject_all(reject, error)
        return None
    reqs = group.requests
    doc_ids, streams = list(prompt.prefix_ids), []
    for q, (req, suffix) in enumerate(zip(reqs, prompt.suffix_ids)):
        if req.choices is not None:
            stream = scoring.question_stream(req, suffix, prompt.choices[q], len(doc_ids))
            error = engine.fit_error(len(doc_ids), stream.reserve_tokens, 0)
            if error is not None:
                reject(req, error)
                continue
            # Only a question of several samples draws, so only it takes an engine seed
            # (one answer is the best choice; other questions keep the seeds they had).
            seed = req.sampling.seed or 0
            if req.sampling.seed is None and req.samples > 1:
                seed = engine.next_seed()
            expect_scores(req, prompt.choices[q], stream.prompt_tokens, seed)
            streams.append(stream)
            continue
        error = engine.fit_error(len(doc_ids), len(suffix), req.sampling.max_new_tokens)
        if error is None:
            error = _sampling_error(req.sampling)
        matcher = None
        if error is None and req.sampling.json_schema is not None:
            try:
                matcher = engine.grammars.matcher(req.sampling.json_schema)
            except ValueError as exc:
                error = InvalidRequestError(str(exc))
        if error is not None:
            reject(req, error)
            continue
        seed = (req.sampling.seed if req.sampling.seed is not None
                else engine.next_seed())
        # A question's samples are streams of their own, sharing the document in every
        # mode and, in parallel, the question too (see `_requests`); each follows the
        # JSON schema, if any, with a matcher of its own.
        streams.extend(Stream(key=req, suffix_ids=list(suffix), sampling=req.sampling,
                              seed=sample_seed(seed, i), sample=i,
                              prompt_tokens=len(doc_ids) + len(suffix),
                              matcher=matcher if i == 0 or matcher is None
                              else engine.grammars.matcher(req.sampling.json_schema))
                       for i in range(req.samples))
    return (doc_ids, streams) if streams else None


def make_requests(engine, doc_ids: list[int], streams: list[Stream], mode: str,
                  width: int) -> list[Request]:
    key = document_key(doc_ids)  # hashed once per document, not once per request
    if mode != "parallel":
        return [Request(doc_ids, [s], width=1, doc_key=key, mode=mode) for s in streams]
    # Streams of one question (its samples, or the same question asked twice) share it in
    # their rows: [doc][question][answers], the question's tokens forwarded once.
    by_question: dict[tuple[int, ...], list[Stream]] = {}
    for s in streams:
        by_question.setdefault(tuple(s.suffix_ids), []).append(s)
    single = [g[0] for g in by_question.values() if len(g) == 1]
    out = []
    for group in (g for g in by_question.values() if len(g) > 1):
        question = group[0].suffix_ids
        sizes = [s.sampling.max_new_tokens for s in group]
        out.extend(Request(doc_ids, [group[i] for i in part], width=width, doc_key=key,
                           mode=mode, shared_question=list(question))
                   for part in pack_streams(sizes, width, len(doc_ids) + len(question),
                                            engine.kv_capacity))
    sizes = [len(s.suffix_ids) + s.sampling.max_new_tokens for s in single]
    out.extend(Request(doc_ids, [single[i] for i in group], width=width, doc_key=key,
                       mode=mode)
               for group in (pack_streams(sizes, width, len(doc_ids), engine.kv_capacity)
                             if single else []))
    return out


def _check_size(engine, document: str, reqs: Sequence[QuestionRequest]) -> None:
    """PromptTooLongError, before any tokenization, for a document (or question) whose UTF-8
    size alone proves it cannot fit the context: a token stands for at most `max_token_bytes`
    bytes (a margin of 4 covers normalizers that shorten text), so a 30 MB document is refused
    at once instead of after a minute of tokenizing."""
    context = engine.model_config.max_position_embeddings
    limit = 4 * engine.tokenizer.max_token_bytes * context
    for what, text in (("document", document), *(("question", r.question) for r in reqs)):
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            raise PromptTooLongError(
                f"the {what} ({size:,} bytes) cannot fit the model's context of {context} "
                f"tokens (at most {limit:,} bytes of text)", needed=size, available=limit)


def _input_error(error: Exception) -> ValueError:
    """A request's own input failed: a ValueError (kept as is) or one naming what was raised,
    so that callers treat it as permanent (retrying the same input cannot help)."""
    if isinstance(error, ValueError):
        return error
    wrapped = InvalidRequestError(f"{type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def _sampling_error(params: SamplingParams) -> Exception | None:
    """A parameter the sampler cannot take (e.g. a seed beyond 64 bits), as an error."""
    if params.seed is not None and params.seed >= 1 << 63:
        return ValueError(f"seed must be below 2**63, got {params.seed}")
    return None
