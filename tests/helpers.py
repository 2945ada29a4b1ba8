"""Helpers the tests share: tiny CPU engines, a template that makes token counts exact, seeded
text, the workload of the step-in-flight tests, a JSON schema that a random model's answers
complete, a transformers twin of one of our models, and a look at what an engine's KV pool
holds after a run.

Imported as `from tests.helpers import ...` (pyproject's `pythonpath = ["."]`); test files import
from here, never from one another. Fixtures live in conftest.py and fixtures_models.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# A template whose prefix is the document itself and whose suffix is the question itself, so tests
# control token counts exactly (ByteTokenizer: one token per ASCII character, plus BOS).
PLAIN_TEMPLATE = "{% block prefix %}{{ document }}{% endblock %}{% block question %}{{ question }}{% endblock %}"
WORDS = "the of river stone light blue seven north market paper quiet window a is on".split()


# Bounded in every field, so even a random model's answer closes within 128 tokens: the byte
# tokenizer spends up to 6 tokens on a character (\uXXXX), and the rest is under 70.
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["yes", "no", "unsure"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "ok": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["label", "score", "ok", "note"],
    "additionalProperties": False,
}


def parses_as_json(text: str) -> bool:
    """Whether `text` is a JSON document."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def plain_template(tmp_path: Path) -> str:
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE, encoding="utf-8")
    return str(path)


def text(rng: random.Random, chars: int) -> str:
    out = ""
    while len(out) < chars:
        out += rng.choice(WORDS) + " "
    return out[:chars]


def tiny_engine(preset: str = "tiny-gqa", **config):
    from ppqa import Engine, EngineConfig

    return Engine(f"dummy:{preset}", device="cpu", config=EngineConfig(**config))


def overlap_workload(rng: random.Random, tmpl: str) -> list:
    """Two documents of nine questions each; answers of 1 to 6 tokens, some greedy and some
    sampled (seeded), some with a stop string: streams end by EOS, stop and budget mid-batch."""
    from ppqa import QuestionRequest, SamplingParams

    docs = [text(rng, n) for n in (150, 60)]
    requests = []
    for d, doc in enumerate(docs):
        for q in range(9):
            stop = ("e",) if q % 4 == 1 else ()  # a common letter: some answers stop on it
            sp = SamplingParams(max_new_tokens=rng.randint(1, 6), stop=stop,
                                temperature=0.9 if q % 3 == 0 else 0.0, seed=100 * d + q)
            requests.append(QuestionRequest((d, q), doc, text(rng, rng.randint(2, 12)), sp, tmpl))
    return requests


def budget_questions(rng: random.Random, doc: str, count: int, tmpl: str, tag: str,
                     budget: int) -> list:
    """`count` questions of 3-20 characters about `doc`, keyed (tag, i), each answering
    `budget` tokens greedily (no EOS)."""
    from ppqa import QuestionRequest, SamplingParams

    return [QuestionRequest((tag, i), doc, text(rng, rng.randint(3, 20)),
                            SamplingParams(max_new_tokens=budget, ignore_eos=True), tmpl)
            for i in range(count)]


def session_questions(rng: random.Random, doc: str, count: int, tmpl: str, tag: str,
                      budget: int | None = None) -> list:
    """`count` questions of 3-25 characters about `doc`, keyed (tag, i), each answering
    `budget` tokens greedily (default: 1-10 drawn; no EOS)."""
    from ppqa import QuestionRequest, SamplingParams

    return [QuestionRequest((tag, i), doc, text(rng, rng.randint(3, 25)),
                            SamplingParams(max_new_tokens=budget or rng.randint(1, 10),
                                           ignore_eos=True),
                            tmpl) for i in range(count)]


def stock_answers(eng, requests) -> dict:
    """Stock's answers (key -> Answer), one document at a time in a plain run."""
    out: dict = {}
    for doc in dict.fromkeys(r.document for r in requests):
        group = [r for r in requests if r.document == doc]
        eng.run(group, mode="stock", on_answer=lambda r, a: out.__setitem__(r.key, a))
    return out


def stock_by_document(engine, requests) -> dict:
    """Stock's answers (key -> token ids), a run per document."""
    out: dict = {}
    for doc in dict.fromkeys(r.document for r in requests):
        engine.run([r for r in requests if r.document == doc], mode="stock",
                   on_answer=lambda r, a: out.__setitem__(r.key, a.token_ids))
    return out


def documents_arriving(engine, tmpl: str, mode: str) -> tuple[dict, dict, object, int]:
    """Four documents (one of several chunks where `max_prefill_tokens` is ~400) submitted
    to one session two steps apart, so that each prefills while the earlier ones decode:
    (answers, stock's answers by document, the session's RunStats, documents), answers as
    key -> token ids."""
    rng = random.Random(mode)
    docs = [text(rng, n) for n in (150, 60, 700, 90)]
    batches = [budget_questions(rng, doc, 3 + d, tmpl, f"d{d}", budget=6 + 2 * d)
               for d, doc in enumerate(docs)]
    expected = stock_by_document(engine, [q for batch in batches for q in batch])
    engine.parts.docs.clear()
    got: dict = {}
    session = engine.session(on_answer=lambda r, a: got.__setitem__(r.key, a.token_ids))
    for batch in batches:
        session.submit(batch, mode=mode, streams=3 if mode == "parallel" else None)
        session.step()
        session.step()
    session.drain()
    return got, expected, session.close(), len(docs)


def answers_by_key(engine, requests, **run_kwargs) -> dict:
    """`engine.run(requests)`: request key -> (token ids, finish reason, text), every one answered."""
    got = {}
    engine.run(requests, on_answer=lambda r, a: got.__setitem__(r.key, a), **run_kwargs)
    assert len(got) == len(requests)
    return {k: (a.token_ids, a.finish_reason, a.text) for k, a in got.items()}


def assert_pool_holds_only_cached_documents(engine) -> None:
    """After a run (finished, stopped or failed): every KV slot and table row has come back but
    the cached documents' slots, and no request still holds a document."""
    parts = engine.parts
    cached = parts.docs.documents()
    assert parts.pool.allocator.num_free == parts.pool.allocator.capacity - sum(
        d.length for d in cached)
    assert parts.table.num_free_rows == engine.config.wide_requests
    assert all(d.ref_count == 0 for d in cached)


def hf_config(config):
    """A transformers config equivalent to our `ModelConfig` (Qwen2 for q/k/v bias, else Llama)."""
    import transformers

    rope = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling:
        rope = {**config.rope_scaling, "rope_theta": config.rope_theta}
        rope["rope_type"] = rope.pop("type", None) or rope["rope_type"]
    common = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                  intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
                  num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
                  head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
                  max_position_embeddings=config.max_position_embeddings,
                  tie_word_embeddings=config.tie_word_embeddings, rope_parameters=rope)
    if config.attention_bias:
        return transformers.Qwen2Config(**common)
    return transformers.LlamaConfig(attention_bias=False, **common)


def hf_twin(config, weights):
    """A transformers causal LM built from `config`, holding exactly `weights` (fp32, eval mode):
    the reference the loader and model tests compare with."""
    import transformers

    hc = hf_config(config)
    cls = transformers.Qwen2ForCausalLM if config.attention_bias else transformers.LlamaForCausalLM
    model = cls(hc).eval()
    state = {name: w.float() for name, w in weights}
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied model's lm_head is the embedding: transformers lists it as missing but shares it.
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


WORKER_MODEL = "dummy:tiny-mha"


def job_states(db) -> dict[int, tuple]:
    """Every job's (status, attempts, error), by id."""
    from sqlalchemy import select

    from ppqa.store.models import Job

    with db.read() as conn:
        return {r.id: (r.status, r.attempts, r.error) for r in conn.execute(
            select(Job.id, Job.status, Job.attempts, Job.error))}


def make_worker(db, engine, progress=None, **options):
    """A Worker on `engine` (the tiny CPU model by default) with a 30 s lease; `options`
    override WorkerOptions fields."""
    from ppqa.worker.loop import Worker, WorkerOptions

    options = {"model": WORKER_MODEL, "device": "cpu", "lease_seconds": 30, **options}
    return Worker(db, engine, WorkerOptions(**options), progress)


def process_alive(pid: int) -> bool:
    """Running, not yet exited (a zombie waiting to be reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def cli_runner(db: str, **env: str):
    """`run(*args, input=None, ok=True)`: the ppqa CLI in this process on the store `db`
    (CliRunner), asserting exit code 0 unless ok=False; `run.db` is the path."""
    from typer.testing import CliRunner

    from ppqa.cli.app import app

    def run(*args, input=None, ok=True):
        result = CliRunner().invoke(app, ["--db", db, *map(str, args)], input=input,
                                    env=env or None)
        if ok:
            assert result.exit_code == 0, result.stderr
        return result

    run.db = db
    return run


def pending_document(eng, doc_ids: list[int], mode: str = "cascade"):
    """(session, document): one question about `doc_ids` admitted to a new session of `eng`,
    its document waiting for prefill (`session.sched.document_chunk` takes it chunk by chunk)."""
    from ppqa import SamplingParams
    from ppqa.engine.prepare import make_requests
    from ppqa.engine.runtime.request import Stream

    stream = Stream(key=0, suffix_ids=[5, 6, 7], sampling=SamplingParams(max_new_tokens=1),
                    seed=0, prompt_tokens=len(doc_ids) + 3)
    session = eng.session()
    for req in make_requests(eng, doc_ids, [stream], mode, 1):
        session.sched.add(req)
    session.sched.admit()
    return session, session.sched.pending_documents()[0]


def on_each_step(monkeypatch, engine, hook) -> None:
    """Every session the worker makes calls `hook(n)` before its n-th step (from 1)."""
    make_session = engine.session

    def session(*args, **kwargs):
        made = make_session(*args, **kwargs)
        step, count = made.step, [0]

        def counted():
            count[0] += 1
            hook(count[0])
            return step()

        made.step = counted
        return made

    monkeypatch.setattr(engine, "session", session)
