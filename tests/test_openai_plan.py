"""OpenAI requests to jobs, without a server: body checks, batch lines, grouping, splitting.

The property that matters most: a group's document + a request's question, tokenized as the
engine does (`Tokenizer.prompt` with the `raw` template), are exactly the ids of the request's
whole prompt rendered with the model's chat template, for the byte tokenizer of the dummy
models and for SmolLM2's real BPE tokenizer and chat template.
"""

from __future__ import annotations

import json

import pytest

from ppqa.engine.loading.presets import preset_config
from ppqa.openai.batch_in import BatchFileError, plan_batch_file, read_batch_requests
from ppqa.openai.chat_request import RequestError, parse_chat_body
from ppqa.openai.grouping import common_prefix_length, group_by_shared_prefix
from ppqa.openai.plan import PlannedRequest, plan_requests
from ppqa.openai.prompt_model import PromptModel
from ppqa.openai.render import render_prompt

FERRY = "The Orrin ferry leaves every hour from 7:00 to 19:00. Tickets cost 4 euros."
TOWN = "Harrowmere is a small town by a lake.\n\nIts mayor is Ada Blythe, elected in 2019."
QUESTIONS = ["When does the first ferry leave?", "How much is a ticket?", "Who is the mayor?"]


def body(document: str, question: str, **extra) -> dict:
    return {"model": "gpt-4o-mini", "messages": [
        {"role": "system", "content": "Answer from this document.\n\n" + document},
        {"role": "user", "content": question}], "temperature": 0, **extra}


def line(custom_id: str, body_: dict, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": body_, **extra})


def byte_model(context: int = 4096) -> PromptModel:
    return PromptModel("dummy:tiny-mha", preset_config("tiny-mha")[2], context)


@pytest.fixture(scope="module")
def smollm2_model(smollm2_gguf) -> PromptModel:
    from ppqa.engine.loading.loader import load_model

    loaded = load_model(str(smollm2_gguf))  # weights are lazy: only the tokenizer is built
    return PromptModel("smollm2", loaded.tokenizer, loaded.config.max_position_embeddings)


# ---- request bodies -------------------------------------------------------------------------

def test_body_defaults_follow_the_openai_api_and_ignore_the_model():
    req = parse_chat_body({"model": "gpt-4o", "messages": [{"role": "developer", "content": "d"},
                                                           {"role": "user", "content": [
                                                               {"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}]})
    assert req.messages == (("system", "d"), ("user", "a\nb"))
    assert (req.temperature, req.top_p, req.seed, req.n, req.stop, req.max_tokens) == \
        (1.0, 1.0, None, 1, (), None)  # no seed: the plan draws one
    assert req.ignored == ("model",)
    # What clients send with tools off: no tools, and a tool-call option with nothing to call.
    harmless = parse_chat_body({"messages": [{"role": "user", "content": "q"}], "tools": [],
                                "parallel_tool_calls": True})
    assert harmless.ignored == ("parallel_tool_calls",)
    assert parse_chat_body({"messages": [{"role": "user", "content": "q"}],
                            "max_completion_tokens": 7, "stop": "\n"}).max_tokens == 7


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "xml"}}, "response_format", "type is one of"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema", "cannot be compiled: Unimplemented keys"),
    ({"response_format": {"type": "json_object"}, "stop": "}"}, "stop", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "tools=.* is not supported \\(only \\[\\]\\)"),
    ({"audio": {"voice": "alloy"}}, "audio", "unsupported field 'audio'"),
    ({"stream": True}, "stream", "stream=True is not supported"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": 5, "max_completion_tokens": 5}, "max_tokens", "not both"),
    ({"temperature": 3}, "temperature", "from 0 to 2"),
    ({"top_p": 0}, "top_p", "above 0"),
    ({"n": 0}, "n", "from 1 to 128"),
    ({"seed": -1}, "seed", "from 0"),
    ({"stop": ["a", ""]}, "stop", "non-empty string"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "unsupported role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content", "only text parts"),
    ({"messages": []}, "messages", "non-empty list"),
])
def test_bad_bodies_are_refused_naming_the_field(extra, param, message):
    with pytest.raises(RequestError, match=message) as info:
        parse_chat_body({"messages": [{"role": "user", "content": "q"}], **extra})
    assert info.value.param == param


def test_batch_file_problems_are_all_listed_with_their_lines():
    text = "\n".join([
        line("a", body(FERRY, "q")),
        "not json",
        line("a", body(FERRY, "q")),
        line("c", body(FERRY, "q"), url="/v1/embeddings"),
        "",
        line("d", body(FERRY, "q", response_format={"type": "json_schema"})),
        json.dumps({"custom_id": "e", "body": {}}),
    ])
    with pytest.raises(BatchFileError) as info:
        read_batch_requests(text, "requests.jsonl")
    errors = {e.line: e.message for e in info.value.errors}
    assert sorted(errors) == [2, 3, 4, 6, 7]
    assert errors[2].startswith("requests.jsonl:2: invalid JSON")
    assert "duplicate custom_id 'a' (first at requests.jsonl:1)" in errors[3]
    assert "url must be '/v1/chat/completions'" in errors[4]
    assert "requests.jsonl:6: body: response_format of type json_schema needs" in errors[6]
    assert "missing 'method'" in errors[7]
    assert str(info.value).startswith("requests.jsonl:2: invalid JSON")
    assert "(and 4 more problems)" in str(info.value)



def test_batch_lines_are_strict_json_split_only_at_line_ends():
    # U+2028 inside a JSON string is JSON (and not a line end); NaN and a lone surrogate are not.
    separated = line("s", body(FERRY + "@", "q")).replace("@", "\u2028")
    (request,) = read_batch_requests(separated, "ok.jsonl")
    assert request.custom_id == "s"
    nan = line("a", body(FERRY, "q")).replace('"temperature": 0', '"temperature": NaN')
    surrogate = line("b", body(FERRY + "@", "q")).replace("@", "\\ud800")
    with pytest.raises(BatchFileError) as info:
        read_batch_requests(nan + "\r" + surrogate, "bad.jsonl")
    errors = {e.line: e.message for e in info.value.errors}
    assert "bad.jsonl:1: invalid JSON (NaN is not a JSON value)" in errors[1]
    assert "bad.jsonl:2: invalid JSON (a string holds a lone surrogate" in errors[2]


# ---- grouping -------------------------------------------------------------------------------

def test_common_prefix_length():
    assert common_prefix_length("abcdef", "abcxyz") == 3
    assert common_prefix_length("abc", "abc") == 3
    assert common_prefix_length("", "abc") == 0
    assert common_prefix_length("x" * 1000 + "a", "x" * 1000 + "b") == 1000


def test_grouping_keeps_documents_together_and_shares_short_prefixes_only_when_worth_it():
    system = "You are a helpful assistant. " * 3
    docs = [system + f"Document {i}: " + chr(65 + i) * 200 + "\nQuestion: " for i in range(3)]
    texts = [d + q for q in QUESTIONS for d in docs]  # interleaved on purpose
    assert group_by_shared_prefix(texts) == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    # Tiny documents: sharing the long system prompt in one group saves more.
    tiny = [system + f"Doc {i}.\n" + q for i in range(3) for q in QUESTIONS]
    assert group_by_shared_prefix(tiny) == [list(range(9))]
    assert group_by_shared_prefix(["abc", "xyz", "abd"]) == [[0, 2], [1]]
    assert group_by_shared_prefix(["same", "same"]) == [[0, 1]]
    assert group_by_shared_prefix(["one"]) == [[0]]
    assert group_by_shared_prefix([]) == []


# ---- planning -------------------------------------------------------------------------------

def batch_text() -> str:
    lines = [line(f"{d}-{i}", body(doc, q, max_tokens=8))
             for d, doc in (("ferry", FERRY), ("town", TOWN)) for i, q in enumerate(QUESTIONS)]
    lines.append(line("solo", {"messages": [{"role": "user", "content": TOWN + "\n\nQuestion: "
                                             "Who?"}], "max_tokens": 4, "n": 3, "seed": 5,
                               "temperature": 0.8}))
    lines.append(line("short", body(FERRY, "Say hi.", max_tokens=4)))  # other params: other job
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("which", ["byte", "smollm2"])
def test_plan_splits_on_token_boundaries_the_engine_sees(which, request):
    model = byte_model() if which == "byte" else request.getfixturevalue("smollm2_model")
    tok = model.tokenizer
    plan = plan_batch_file(batch_text(), "requests.jsonl", model)
    requests = {r.custom_id: r for r in read_batch_requests(batch_text(), "requests.jsonl")}
    assert plan.request_count == len(requests) == 8
    assert plan.group_sizes == [4, 3, 1]  # ferry (with 'short'), town, solo
    assert len(plan.jobs) == 2 + 1 + 3  # ferry x 2 params, town, solo's three seeds
    assert "8 requests in 3 shared-prefix groups" in plan.summary()
    assert "ignored 'model' (7 requests)" in plan.summary()
    for choice in plan.choices:
        job = plan.jobs[choice.job]
        question = job.questions[choice.position]
        assert question.custom_id == choice.custom_id
        whole = render_prompt(tok, requests[choice.custom_id].request.messages).text
        assert job.document_text + question.text == whole
        # What the worker's engine will prefill for this question:
        ids = tok.prompt("raw", job.document_text, [question.text]).ids(0)
        expected = tok.encode(whole)
        if tok.add_bos and expected[:1] != [tok.bos_token_id]:
            expected = [tok.bos_token_id, *expected]
        assert ids == expected and choice.prompt_tokens == len(ids)
    solo = [plan.jobs[c.job].params for c in plan.choices if c.custom_id == "solo"]
    assert [p.seed for p in solo] == [5, 6, 7] and {p.temperature for p in solo} == {0.8}
    # The lines without a seed share one drawn for the file (so they still share jobs); another
    # planning of the same file draws another, as the OpenAI API samples afresh.
    unseeded = {plan.jobs[c.job].params.seed for c in plan.choices if c.custom_id != "solo"}
    again = plan_batch_file(batch_text(), "requests.jsonl", model)
    assert len(unseeded) == 1 and unseeded != {
        again.jobs[c.job].params.seed for c in again.choices if c.custom_id != "solo"}
    assert {p.template for p in (j.params for j in plan.jobs)} == {"raw"}
    assert {j.params.model for j in plan.jobs} == {model.name}
    shared = {c.custom_id: plan.jobs[c.job].document_text for c in plan.choices}
    assert shared["ferry-0"] == shared["short"] and FERRY in shared["ferry-0"]
    assert shared["town-0"] == shared["town-2"] and TOWN in shared["town-0"]


def test_one_request_shares_what_precedes_its_last_message():
    model = byte_model()
    plans = [plan_requests([PlannedRequest(1, "c", parse_chat_body(body(TOWN, q)))], model,
                           label="request") for q in QUESTIONS]
    documents = {p.jobs[0].document_text for p in plans}
    assert len(documents) == 1 and documents.pop().endswith(TOWN + "\n\n")
    one_message = {"messages": [{"role": "user", "content": TOWN + "\n\nQuestion: Who?"}]}
    plan = plan_requests([PlannedRequest(1, "c", parse_chat_body(one_message))], model,
                         label="request")
    assert plan.jobs[0].questions[0].text.startswith("Question: Who?")


def test_prompts_that_do_not_fit_the_context_are_refused_with_their_line():
    text = "\n".join([line("a", body(FERRY, "q", max_tokens=8)),
                      line("b", body(TOWN, "q", max_tokens=90))])
    refused = (r"requests.jsonl:2: the prompt \(\d+ tokens\) \+ max_tokens \(90\) exceed the "
               r"model's context of 200")
    with pytest.raises(BatchFileError, match=refused):
        plan_batch_file(text, "requests.jsonl", byte_model(context=200))
    # Without max_tokens the answer gets what the context leaves, at most the default.
    unbounded = line("a", {"messages": [{"role": "user", "content": "hi"}]})
    assert plan_batch_file(unbounded, "r.jsonl", byte_model(context=60)).jobs[0].params \
        .max_new_tokens == 60 - len("User: hi\n\nAssistant:") - 1
