"""What the OpenAI tests share: request bodies and batch files about two small documents, and
the reference answer of a request (`Engine.answer` on its whole rendered prompt, one request
at a time, stock mode, greedy) that every path (CLI, server batches, chat calls) must match.
"""

from __future__ import annotations

import json

MODEL = "dummy:tiny-mha"
FERRY = ("The Orrin ferry leaves every hour from 7:00 to 19:00. Tickets cost 4 euros; "
         "children ride free.")
TOWN = "Harrowmere is a small town by a lake.\n\nIts mayor is Ada Blythe, elected in 2019."
QUESTIONS = ["When does the first ferry leave?", "How much is a ticket?", "Who is the mayor?"]


def chat_body(document: str, question: str, max_tokens: int = 10, **extra) -> dict:
    return {"model": "gpt-4o-mini", "max_tokens": max_tokens, "temperature": 0, "messages": [
        {"role": "system", "content": "Answer from this document.\n\n" + document},
        {"role": "user", "content": question}], **extra}


def batch_bodies() -> dict[str, dict]:
    """custom_id -> body: two documents x three questions, a one-message request, n=2."""
    bodies = {f"{name}-{i}": chat_body(doc, q) for name, doc in (("ferry", FERRY), ("town", TOWN))
              for i, q in enumerate(QUESTIONS)}
    bodies["solo"] = {"messages": [{"role": "user", "content": TOWN + "\n\nQuestion: Who?"}],
                      "max_tokens": 6, "temperature": 0}
    bodies["twice"] = chat_body(FERRY, "Is it free for children?", max_tokens=7, n=2)
    return bodies


def batch_file(bodies: dict[str, dict]) -> str:
    return "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                               "body": b}) + "\n" for cid, b in bodies.items())


def reference_answer(engine, body: dict) -> tuple[str, str, int]:
    """(text, finish_reason, tokens) of Engine.answer for the request's prompt on its own."""
    from ppqa.config import SamplingParams
    from ppqa.openai.chat_request import parse_chat_body
    from ppqa.openai.render import render_prompt

    request = parse_chat_body(body)
    text = render_prompt(engine.tokenizer, request.messages).text
    cut = len(text) // 2  # any cut: the byte tokenizer's ids do not depend on it
    answer = engine.answer(text[:cut], [text[cut:]], mode="stock", template="raw",
                           sampling=SamplingParams(max_new_tokens=request.max_tokens))[0]
    return answer.text, answer.finish_reason, len(answer.token_ids)


def normalized(line: dict) -> dict:
    """An output line without what differs between runs (ids, timestamps)."""
    out = json.loads(json.dumps(line))
    out.pop("id")
    if out["response"] is not None:
        out["response"].pop("request_id")
        out["response"]["body"].pop("id")
        out["response"]["body"].pop("created")
    return out
