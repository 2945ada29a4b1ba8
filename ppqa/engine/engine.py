"""`Engine`: load a model, then answer many questions about documents in one of three modes.

    Engine(spec) -> loader (config, weights, tokenizer) -> model on the device, KV pool,
    req_to_token table, document cache, attention backend, runner.
    session() -> an `EngineSession` (engine/session.py): questions submitted while it runs,
    each step schedules (admit, prefill), runs (decode) and postprocesses (answers out).
    run(requests) -> a session fed once and drained; answers handed to `on_answer`.
`answer(document, questions)` is `run` for one document, returning answers in question order;
`score(document, questions, choices)` the same for questions answered by choosing a label.
The document cache outlives sessions, so a document is prefilled once per engine.
With `EngineConfig.tensor_parallel` N > 1 one Engine is built per rank (process): rank 0 is used
as above and ends with `shutdown()`; the others call `follow()` (engine/parallel/lockstep.py).
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable, Sequence


from ppqa.config import EngineConfig, SamplingParams
from ppqa.engine.outputs import Answer, PromptTooLongError, QuestionRequest, RunStats
from ppqa.engine.runtime.grammar import Grammars
from ppqa.engine.session import EngineSession
from ppqa.engine.setup import EngineParts, build_parts


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
        # JSON schemas compiled against this tokenizer, each once (cached by its text).
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size)

    @property
    def parts(self) -> EngineParts:
        """The built parts (model, KV pool, req_to_token table, document cache, backend, runner),
        read-only, for inspection: work goes through `answer`, `run` and `session`."""
        if self._parts is None:
            raise RuntimeError(f"this engine ({self.model_name}) is closed")
        return self._parts

    def close(self) -> None:
        """Let go of the weights, the KV pool and the captured graphs now, so that the process
        can build another engine in their memory: the parts refer to each other, so after a
        plain `del engine` only Python's cycle collector frees them, at a time of its choosing
        (on a GPU the next engine's pool, sized from the memory free, would come out small).
        Idempotent; the engine answers nothing after it. `with Engine(...) as engine:` closes
        at the block's end."""
        if self._parts is None:
            return
        self.shutdown()
        self._parts = None
        gc.collect()
        if self.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def kv_capacity(self) -> int:
        """Tokens one request (document + questions + answers) may occupy at most."""
        return min(self.parts.pool.allocator.capacity, self.parts.table.max_row_len)

    @property
    def peak_memory_bytes(self) -> int:
        """The most device memory allocated since the last session started (0 on the CPU)."""
        if self.device.type != "cuda":
            return 0
        import torch

        return int(torch.cuda.max_memory_allocated(self.device))

    @property
    def captured_graphs(self) -> int:
        """Decode steps captured as CUDA graphs so far (one per step shape)."""
        graphs = self.parts.runner.graphs
        return 0 if graphs is None else len(graphs.graphs)

    @property
    def rank(self) -> int:
        """This process's tensor-parallel rank (0 without tensor parallelism)."""
        lockstep = self.parts.lockstep
        return 0 if lockstep is None else lockstep.tp.rank

    def follow(self) -> None:
        """Tensor-parallel ranks other than 0: repeat rank 0's sessions until its `shutdown()`."""
        from ppqa.engine.parallel.follower import follow

        follow(self)

    def shutdown(self) -> None:
        """Rank 0 of a tensor-parallel engine: release the followers (their `follow()` returns).
        Idempotent; nothing to do without tensor parallelism."""
        lockstep = self.parts.lockstep
        if lockstep is not None and lockstep.is_leader and not lockstep.closed:
            lockstep.post("exit")
            lockstep.send()
            lockstep.closed = True

    @property
    def kv_free_tokens(self) -> int:
        """KV slots free now (cached documents that no request holds count as used)."""
        return self.parts.pool.allocator.num_free

    # ---- public API --------------------------------------------------------------------------

    def answer(self, document: str, questions: Sequence[str], mode: str = "auto",
               sampling: SamplingParams | Sequence[SamplingParams] | None = None,
               streams: int | None = None, template: str = "qa") -> list[Answer]:
        """Answers to `questions` about `document`, in question order."""
        _check_questions(questions)
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or SamplingParams()] * len(questions)
        else:
            params = list(sampling)
            if len(params) != len(questions):
                raise ValueError(f"{len(params)} SamplingParams for {len(questions)} questions")
        requests = [QuestionRequest(i, document, q, p, template)
                    for i, (q, p) in enumerate(zip(questions, params))]
        return self._in_order(requests, mode=mode, streams=streams)

    def score(self, document: str, questions: Sequence[str],
              choices: Sequence[str] | Sequence[Sequence[str]], *, template: str = "label",
              norm: str = "none", mode: str = "auto") -> list[Answer]:
        """Each question answered by the most likely of its choices, in question order: no
        generation, one forward over the questions and their choices (engine/scoring.py).
        `choices`: one list of labels for every question, or one list per question; `norm`:
        how choices are compared (ppqa/choices.py: none, token or char). Each Answer holds
        `choice`, `choice_logprobs` and `choice_probs` in the choices' order."""
        _check_questions(questions)
        if isinstance(choices, str) or not choices:
            raise ValueError("choices must be a list of labels, or one list per question")
        per_question = ([list(choices)] * len(questions) if isinstance(choices[0], str)
                        else [list(c) for c in choices])
        if len(per_question) != len(questions):
            raise ValueError(f"{len(per_question)} choice lists for {len(questions)} questions")
        requests = [QuestionRequest(i, document, q, template=template, choices=tuple(c),
                                    choice_norm=norm)
                    for i, (q, c) in enumerate(zip(questions, per_question))]
        return self._in_order(requests, mode=mode)

    def _in_order(self, requests: list[QuestionRequest], **run_kwargs) -> list[Answer]:
        """`run` over requests keyed 0..n-1, their answers in that order."""
        answers: dict[int, Answer] = {}

        def keep(request: QuestionRequest, answer: Answer) -> None:
            answer.question_index = request.key
            answers[request.key] = answer

        self.run(requests, on_answer=keep, **run_kwargs)
        return [answers[i] for i in range(len(requests))]

    def session(self, on_answer: Callable[[QuestionRequest, Answer], None] | None = None,
                on_error: Callable[[QuestionRequest, Exception], None] | None = None
                ) -> EngineSession:
        """A long-lived loop over this engine: `submit` questions while it runs, `step` it,
        answers go to `on_answer` as they finish (see engine/session.py)."""
        lockstep = self.parts.lockstep
        if lockstep is None:
            return EngineSession(self, on_answer, on_error)
        if not lockstep.is_leader:
            raise ValueError(f"tensor-parallel rank {lockstep.tp.rank} repeats rank 0's "
                             "sessions: call engine.follow(), not session()")
        from ppqa.engine.parallel.lockstep import LeaderSession

        return LeaderSession(self, on_answer, on_error)

    def run(self, requests: Sequence[QuestionRequest], *, mode: str = "auto",
            streams: int | str | None = None,
            on_answer: Callable[[QuestionRequest, Answer], None] | None = None,
            on_error: Callable[[QuestionRequest, Exception], None] | None = None,
            should_stop: Callable[[], bool] | None = None) -> RunStats:
        """Answer many questions (any documents); answers go to `on_answer` as they finish.

        A question that cannot fit, or whose template, document or sampling parameters fail,
        goes to `on_error` (raised if there is none); the others run. When `should_stop()`
        turns true, no new work starts and unfinished questions are dropped.
        """
        session = self.session(on_answer, on_error)
        try:
            session.submit(requests, mode=mode, streams=streams)
            session.drain(should_stop)
            if not session.stats.stopped:
                session.flush()
        finally:
            stats = session.close()  # frees whatever an early stop or an error left behind
        return stats

    def warmup(self) -> float:
        """Compile the kernels and capture the decode graphs that sessions meet, so that a
        user's first batch pays for none of it; returns the seconds it took. Runs every phase
        of `warmup_phases` in order; on a GPU, then marks the Triton cache as holding this
        model's kernels (engine/precompile.py: later starts need no compile helpers)."""
        import time

        began = time.perf_counter()
        for _, phase in self.warmup_phases():
            phase()
        if self.device.type == "cuda":
            from ppqa.engine import precompile

            precompile.mark_warm(self.model_name, vars(self.config))
        return time.perf_counter() - began

    def kernels_cached(self) -> bool:
        """Whether this is a GPU whose Triton cache holds the kernels the warm-up meets: a
        warm-up of this model and configuration, with today's kernel sources, completed there
        (engine/precompile.py's marker). Then a session finds each kernel on disk at its first
        use, and `warmup` would add only graphs for its own synthetic step shapes."""
        if self.device.type != "cuda":
            return False
        from ppqa.engine import precompile

        return precompile.marker(self.model_name, vars(self.config)).exists()

    def warmup_phases(self) -> list[tuple[str, Callable[[], None]]]:
        """The warm-up as named phases, each synthetic work that meets a set of kernels and
        graphs: `long` a document one chunk longer than `max_prefill_tokens` (its second chunk
        reads the first through the document hint) with a full step of questions
        (`max_batch_requests`) by cascade; `few-long` a few questions on that document by stock
        and by cascade (a long document's split-KV decode, whose partial states a few requests
        need); `many` the same count by stock on a short document
        (the full-batch decode graphs and the large question prefill); `few-<mode>` a few
        questions in each mode (the small batches a draining step passes through); `mixed` a
        step holding stock and cascade requests together; `choices` a few questions scored
        against single- and multi-token choices; `tiles` the cascade document kernel at every
        tile it can choose, over gathered and contiguous documents (GPU only: which a session
        meets depends on its timing, TritonBackend.warm_cascade_tiles); `cudnn` a document
        chunk's cuDNN calls in each kind (causal, unmasked over aligned and over unaligned
        keys: kernels cuDNN builds once per machine, TritonBackend.warm_cudnn_kernels; GPU
        only). Each decode shape runs
        three steps, the use on which it is captured. The synthetic documents stay cached only
        until their KV is needed. Later phases meet the documents earlier ones left cached, so
        compile helpers (engine/precompile.py) run them in groups that keep that order."""
        sampling = SamplingParams(max_new_tokens=4, ignore_eos=True)
        many = [f"What happened on day {i}?" for i in range(self.config.max_batch_requests)]
        few = many[:8]
        short = _synthetic_text(self.tokenizer, 150)
        long = _synthetic_text(self.tokenizer, self.config.max_prefill_tokens + 64)

        def long_document(questions: list[str], modes: tuple[str, ...]) -> Callable[[], None]:
            def run() -> None:
                if self.fit_error(len(self.tokenizer.encode(long)) + 64, 16, 4) is None:
                    for mode in modes:
                        self.answer(long, questions, mode=mode, sampling=sampling)
            return run

        def few_in(mode: str) -> Callable[[], None]:
            return lambda: self.answer(short, few, mode=mode, sampling=sampling,
                                       streams=4 if mode == "parallel" else None)

        def mixed() -> None:
            session = self.session()
            session.submit([QuestionRequest(i, short, q, sampling) for i, q in enumerate(few)],
                           mode="cascade")
            session.submit([QuestionRequest(i, short[::-1], q, sampling)
                            for i, q in enumerate(few)], mode="stock")
            session.drain()
            session.close()

        def choices() -> None:
            self.score(short, few, ["yes", "no", "not stated in the document"], mode="cascade")

        def tiles() -> None:
            warm = getattr(self.parts.backend, "warm_cascade_tiles", None)
            if warm is not None and self.device.type == "cuda":
                warm(self.parts.table.table,
                     max(self.config.max_batch_requests, self.config.max_prefill_tokens))

        def cudnn() -> None:
            warm = getattr(self.parts.backend, "warm_cudnn_kernels", None)
            if warm is not None and self.device.type == "cuda":
                warm()

        return [("long", long_document(many, ("cascade",))),
                ("few-long", long_document(few, ("stock", "cascade"))),
                ("many", lambda: self.answer(short, many, mode="stock", sampling=sampling)),
                *((f"few-{mode}", few_in(mode)) for mode in ("stock", "cascade", "parallel")),
                ("mixed", mixed), ("choices", choices), ("tiles", tiles), ("cudnn", cudnn)]

    # ---- used by sessions --------------------------------------------------------------------

    def next_seed(self) -> int:
        """A sampling seed for a question that gives none, from the engine's seeded generator."""
        return self._seeds.getrandbits(62)

    def fit_error(self, doc: int, question: int, max_new: int) -> PromptTooLongError | None:
        """Why document + question + answer budget cannot run here, or None."""
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
                f"raise EngineConfig.kv_token_budget on the CPU or mem_fraction on a GPU "
                f"(ppqa run --kv-tokens, --mem-fraction)",
                needed=need, available=self.kv_capacity)
        return None


def _synthetic_text(tokenizer, tokens: int) -> str:
    """Plain prose of about `tokens` tokens of `tokenizer` (warm-up documents)."""
    words = "the harbor opened early and the ferry left at noon on every day of the week "
    per_copy = max(len(tokenizer.encode(words)), 1)
    return words * max(tokens // per_copy, 1)


def _check_questions(questions) -> None:
    if isinstance(questions, str):
        raise TypeError("questions must be a sequence of strings, not one string")
    if len(questions) == 0:
        raise ValueError("no questions: give at least one question about the document")
