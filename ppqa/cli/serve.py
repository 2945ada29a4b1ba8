"""`ppqa serve`: the OpenAI API (Files, Batches, Models, Chat) over the job store, on uvicorn.

Order as in `ppqa run`: the store is opened and, with --worker, the device checked and the
model loaded before the server listens, so a bad option exits 2 with one line. Without
--worker only the model's tokenizer is loaded (prompts are rendered at the server) and
`ppqa run` processes on the same store answer; with it, a `Worker` (`--follow`) runs on a
thread of this process. SIGINT/SIGTERM stop uvicorn, which stops the worker (unfinished jobs
are released, as `ppqa run` does); chat calls still waiting then answer 503 (their jobs
cancelled), and other requests get SHUTDOWN_GRACE_SECONDS to finish.
"""

from typing import Annotated

import typer

from ppqa.cli.common import fail, open_store, say
from ppqa.modes import check_mode
from ppqa.worker.options import WorkerOptions

app = typer.Typer()

# How long a stopping server lets requests in progress (an upload, say) finish before it closes
# their connections; waiting chat calls end at once (`ServerConfig.closing`).
SHUTDOWN_GRACE_SECONDS = 10

EXAMPLES = """

Examples:

  ppqa serve --worker --device cpu --model smollm2

  ppqa serve --port 9000 --api-key s3cret     (answered by `ppqa run --follow` workers)

  OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=s3cret python my_batch_script.py
"""


@app.command(help="Serve the OpenAI Files, Batches and Chat Completions API over the job "
                  "store." + EXAMPLES)
def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to listen on, e.g. --host 0.0.0.0 "
                                           "(all interfaces: use --api-key).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port, e.g. --port 9000.")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="PPQA_API_KEY", show_default=False,
        help="Require 'Authorization: Bearer KEY' on every request.")] = None,
    model: Annotated[str, typer.Option(
        "--model", envvar="PPQA_MODEL",
        help="Model whose chat template renders the prompts (and that --worker runs; other "
             "workers must run the same), e.g. --model dummy:tiny-mha.")] = "smollm2",
    worker: Annotated[bool, typer.Option(
        "--worker", help="Also answer jobs in this process (a `ppqa run --follow` worker on "
                         "a thread).")] = False,
    gpu: Annotated[int | None, typer.Option("--gpu", min=0, show_default=False, envvar="PPQA_GPU",
                                            help="--worker: GPU index, e.g. --gpu 1.")] = None,
    device: Annotated[str | None, typer.Option(
        "--device", show_default=False, help="--worker: torch device, e.g. --device cpu.")] = None,
    mode: Annotated[str, typer.Option(help="--worker: engine mode (auto, parallel, stock, "
                                           "cascade).")] = "auto",
    max_jobs: Annotated[int, typer.Option(
        min=1, help="--worker: most jobs taken at once, e.g. --max-jobs 4.")
    ] = WorkerOptions.max_jobs,
    lease_seconds: Annotated[float, typer.Option(
        min=1.0, help="--worker: lease of a claimed job (a cancelled job is let go within a "
                      "third of it).")] = 60.0,
    kv_tokens: Annotated[int | None, typer.Option(
        min=16, show_default=False, help="--worker on the CPU: KV pool size in tokens.")] = None,
    mem_fraction: Annotated[float | None, typer.Option(
        min=0.01, max=1.0, show_default=False,
        help="--worker on a GPU: share of free memory for the KV pool.")] = None,
    max_file_mb: Annotated[float, typer.Option(
        min=0.001, help="Largest upload (and request body) in MB, e.g. --max-file-mb 50.")] = 200.0,
    request_timeout: Annotated[float, typer.Option(
        min=1.0, help="Seconds a chat call waits for its answer before a 504.")] = 600.0,
) -> None:
    from ppqa.openai.prompt_model import engine_prompt_model, load_prompt_model

    try:
        import uvicorn

        from ppqa.openai.server import ServerConfig, create_app
    except ImportError as exc:
        fail(f"ppqa serve needs FastAPI and uvicorn ({exc}): pip install 'ppqa[serve]'")

    try:
        check_mode(mode, "--mode")
    except ValueError as exc:
        fail(str(exc))
    db = open_store(ctx, create=True)  # a new server may start on a new store
    running = None
    if worker:
        running = _worker(db, model, gpu, device, mode, max_jobs, lease_seconds,
                          {"kv_token_budget": kv_tokens, "mem_fraction": mem_fraction})
        prompt_model = engine_prompt_model(running.engine, model)
    else:
        say(f"loading the tokenizer of {model} ...")
        prompt_model = load_prompt_model(model)
    config = ServerConfig(db=db, model=prompt_model, api_key=api_key, worker=running,
                          max_file_bytes=int(max_file_mb * 2**20), request_timeout=request_timeout)

    where = "a worker in this process" if worker else "ppqa run workers on this store"
    say(f"ppqa serve: http://{host}:{port}/v1 (model {model}, answered by {where}; store "
        f"{db.description})")
    app = create_app(config)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            config.closing.set()  # waiting chat calls answer 503 now, so the shutdown is prompt
            super().handle_exit(sig, frame)

    Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                          timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)).run()


def _worker(db, model: str, gpu, device, mode: str, max_jobs: int, lease_seconds: float,
            pool: dict):
    from ppqa.worker.loop import Worker
    from ppqa.worker.options import WorkerOptions
    from ppqa.worker.report import ProgressSink
    from ppqa.worker.setup import SetupError, load_engine, resolve_device

    class Quiet(ProgressSink):
        """Only what needs a person: problems and failed jobs (chat traffic would flood it)."""

        def message(self, text: str) -> None:
            say(f"worker: {text}")

        def settled(self, outcome) -> None:
            if outcome.status == "failed":
                say(f"worker: job {outcome.job_id} failed: {outcome.error}")

    from ppqa.engine import precompile

    fields = {k: v for k, v in pool.items() if v is not None}
    # As `ppqa run`: compile helpers where the Triton cache lacks the kernels, and a warm-up
    # before the first request, so that no request waits for a compilation.
    precompile.start(model, f"cuda:{gpu}" if gpu is not None else device, fields)
    try:
        device_name = resolve_device(gpu, device)
        say(f"loading {model} on {device_name} ...")
        engine = load_engine(model, device_name, **fields)
        if engine.device.type == "cuda":
            say(f"kernels compiled and graphs captured in {engine.warmup():.1f} s")
    except SetupError as exc:
        precompile.stop()
        fail(str(exc))
    options = WorkerOptions(model=model, device=device_name, mode=mode, max_jobs=max_jobs,
                            follow=True, lease_seconds=lease_seconds, poll_seconds=0.2)
    return Worker(db, engine, options, Quiet())
