"""The OpenAI API over the job store: Batch files in and out, and `ppqa serve`.

    request body (a batch line, or POST /v1/chat/completions) -> `chat_request.parse_chat_body`
    -> `render.render_prompt` (the model's chat template) -> `plan.plan_requests`: requests
    grouped by their longest shared prompt prefix (`grouping.py`), each group's shared text a
    job's document and each request's rest a question of the built-in `raw` template
    -> `store.openai_batches.ingest_plan` (jobs + request rows, one transaction)
    -> workers (`ppqa run`, or `ppqa serve --worker`) answer the jobs as any others
    -> `batch_out.py`: OpenAI Batch output lines and chat.completion objects from the answers.

`batch_in.py` reads a batch file, `batches.py` moves a /v1/batches batch through its statuses,
`chat.py` answers /v1/chat/completions by waiting on the store, `server.py` is the FastAPI app.
Not to be confused with the `openai` client package, which only the tests use.
"""
