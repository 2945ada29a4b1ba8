"""ppqa bench --e2e: seeded workloads of the requested sizes (byte and BPE tokenizers), the
dummy+bpe model, the summary maths, a tiny end-to-end run through the CLI on the CPU, and a
7B-style HF folder written from dummy weights that loads back to the same model."""

import json
import math

import pytest
from typer.testing import CliRunner

from ppqa.bench import e2e_report, workloads as w
from ppqa.cli.app import app
from ppqa.engine.loading.tokenizer import ByteTokenizer


def _check_sizes(workload: w.Workload, jobs: w.Jobs, slack: float) -> None:
    index = 0
    for group in workload.groups:
        for _ in range(min(group.documents, 2)):
            low = group.doc_tokens * (1 - group.doc_spread) * (1 - slack) - 2
            high = group.doc_tokens * (1 + group.doc_spread) * (1 + slack) + 2
            assert low <= jobs.doc_tokens[index] <= high, (workload.name, jobs.doc_tokens[index])
            mine = [j for j in jobs.jobs if j.document == index]
            assert len(mine) % workload.copies == 0
            assert sum(len(j.questions) for j in mine) == group.questions * workload.copies
            assert len({qid for j in mine for qid, _ in j.questions}) == group.questions
            if group.answer_range is None:
                assert {j.max_new_tokens for j in mine} == {group.answer_tokens}
            index += 1


@pytest.mark.parametrize("name", sorted(w.WORKLOADS))
def test_workloads_are_seeded_and_sized_with_the_byte_tokenizer(name):
    tok = ByteTokenizer(vocab_size=384)
    workload = w.WORKLOADS[name]
    jobs = w.make_jobs(workload, tok, max_docs=2)
    assert w.make_jobs(workload, tok, max_docs=2) == jobs
    _check_sizes(workload, jobs, slack=0.0)
    assert all(len(tok.encode(d)) == n for d, n in zip(jobs.documents, jobs.doc_tokens))
    distinct = {q for j in jobs.jobs for _, q in j.questions}
    asked = sum(len(j.questions) for j in jobs.jobs) // workload.copies
    assert len(distinct) > 0.9 * asked  # varied, not one form repeated


def test_loogle_budgets_are_drawn_per_question_around_their_mean():
    workload = w.WORKLOADS["loogle"]
    jobs = w.make_jobs(workload, ByteTokenizer(vocab_size=384))
    budgets = [j.max_new_tokens for j in jobs.jobs for _ in j.questions]
    assert len(budgets) == 96 * 18 and min(budgets) >= 60 and max(budgets) <= 400
    assert abs(sum(budgets) / len(budgets) - 234) < 15
    assert all(b == 60 or b % 50 == 0 for b in budgets)
    per_doc = {}
    for j in jobs.jobs:  # one job per (document, budget)
        assert j.max_new_tokens not in per_doc.setdefault(j.document, set())
        per_doc[j.document].add(j.max_new_tokens)
    assert sum(len(v) for v in per_doc.values()) > 2 * 96  # answers end at different steps
    assert abs(sum(jobs.doc_tokens) / len(jobs.doc_tokens) - 19900) < 20


def test_another_seed_draws_other_documents():
    tok = ByteTokenizer(vocab_size=384)
    base = w.WORKLOADS["tiny"]
    other = w.Workload("tiny-seed-1", base.model, base.groups, seed=1)
    assert w.make_jobs(base, tok).documents != w.make_jobs(other, tok).documents


def test_batch_file_ingests_each_job(tmp_path):
    jobs = w.make_jobs(w.WORKLOADS["loogle"], ByteTokenizer(vocab_size=384), max_docs=1)
    batch = w.write_batch(jobs, tmp_path)
    db = tmp_path / "jobs.db"
    result = CliRunner().invoke(app, ["--db", str(db), "ingest", "--batch", str(batch), "--json"])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == len(jobs.jobs) > 1
    assert len(list((tmp_path / "docs").iterdir())) == 1  # the document written once


def test_a_folder_used_by_another_workload_gets_this_ones_documents(tmp_path):
    tok = ByteTokenizer(vocab_size=384)
    w.write_batch(w.make_jobs(w.WORKLOADS["loogle"], tok, max_docs=1), tmp_path)
    jobs = w.make_jobs(w.WORKLOADS["tiny"], tok)
    batch = w.write_batch(jobs, tmp_path)
    for line in batch.read_text().splitlines():
        item = json.loads(line)
        job = next(j for j in jobs.jobs if j.name == item["name"])
        text = (tmp_path / item["document_path"]).read_text(encoding="utf-8")
        assert text == jobs.documents[job.document]


def test_dummy_bpe_model_has_smollm2s_tokenizer_and_vocabulary(smollm2):
    from ppqa import Engine, SamplingParams
    from ppqa.engine.loading.loader import load_model
    from ppqa.engine.loading.json_tokenizer import JsonTokenizer

    loaded = load_model("dummy:tiny-gqa+bpe")
    assert isinstance(loaded.tokenizer, JsonTokenizer)  # read without transformers
    assert loaded.config.vocab_size == loaded.tokenizer.vocab_size == 49152
    assert loaded.config.eos_token_ids == loaded.tokenizer.eos_token_ids
    assert "BPE" in loaded.source
    workload = w.WORKLOADS["paper"]
    jobs = w.make_jobs(workload, loaded.tokenizer, max_docs=2)
    _check_sizes(workload, jobs, slack=0.01)
    question_tokens = [len(loaded.tokenizer.encode(q)) for j in jobs.jobs for _, q in j.questions]
    assert 15 <= sum(question_tokens) / len(question_tokens) <= 30
    assert max(question_tokens) <= 40

    eng = Engine("dummy:tiny-gqa+bpe", device="cpu")
    doc, qs = jobs.documents[0][:2000], [q for _, q in jobs.jobs[0].questions[:3]]
    sampling = SamplingParams(max_new_tokens=6)
    stock = eng.answer(doc, qs, mode="stock", sampling=sampling)
    assert [a.text for a in eng.answer(doc, qs, mode="parallel", sampling=sampling)] == \
        [a.text for a in stock]
    assert all(a.text.strip() for a in stock)  # every id of the vocabulary decodes to text


def test_summary_speedups_are_geometric_means_over_passes():
    runs = [{"mode": "stock", "pass": 0, "process_s": 8.0, "run_s": 4.0},
            {"mode": "parallel", "pass": 0, "process_s": 2.0, "run_s": 1.0,
             "answers_compared": 3, "answers_match_stock": 3},
            {"mode": "parallel", "pass": 1, "process_s": 2.0, "run_s": 2.0,
             "answers_compared": 3, "answers_match_stock": 2},
            {"mode": "stock", "pass": 1, "process_s": 4.0, "run_s": 4.0}]
    summary = e2e_report.summarize(runs, ["stock", "parallel"])
    assert summary["parallel"]["speedup_process"] == pytest.approx(math.sqrt(4.0 * 2.0))
    assert summary["parallel"]["speedup_run"] == pytest.approx(math.sqrt(4.0 * 2.0))
    assert summary["stock"]["process_s"] == pytest.approx(6.0)
    assert (summary["parallel"]["answers_match_stock"], summary["parallel"]["answers_compared"]) \
        == (5, 6)
    assert e2e_report._percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert e2e_report._percentile([5.0], 95) == 5.0


def test_tiny_e2e_runs_through_the_cli_with_identical_answers(tmp_path):
    out = tmp_path / "e2e.json"
    result = CliRunner().invoke(app, [
        "bench", "--e2e", "tiny", "--device", "cpu", "--modes", "stock,parallel",
        "--out", str(out), "--work-dir", str(tmp_path / "work")])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["kind"] == "e2e"
    host = data["host"]  # what says whether two runs' hosts compare
    assert host["cpu_model"] and 0 < host["python_probe_s"] < 10
    (bench,) = data["workloads"]
    assert bench["workload"]["questions"] == 12 and bench["model"] == "dummy:tiny-gqa"
    assert [(r["pass"], r["mode"]) for r in bench["runs"]] == [
        (0, "stock"), (0, "parallel"), (1, "parallel"), (1, "stock")]
    for run in bench["runs"]:
        assert run["rc"] == 0 and not run.get("error")
        assert run["questions"] == 12 and run["answer_tokens"] == 12 * 8
        assert run["process_s"] > run["startup_s"] > 0 and run["process_s"] > run["run_s"] > 0
        assert run["prefill_s"] > 0 and run["decode_s"] > 0
        assert run["worker_s"] == pytest.approx(run["run_s"] - run["prefill_s"] - run["decode_s"])
        assert run["worker_s"] >= 0  # no second counted twice in the jobs' reports
        assert run["answers_per_s"] == pytest.approx(12 / run["process_s"])
        assert run["jobs_by_status"] == {"done": 3}
        assert not [k for k in run if k.startswith("latency")]  # up front: no arrivals
    assert bench["runs"][1]["resolved_modes"] == {"parallel/P=4": 3}
    par = bench["summary"]["parallel"]
    assert par["answers_match_stock"] == par["answers_compared"] == 24  # greedy fp32: identical
    assert par["speedup_process"] > 0 and par["speedup_run"] > 0
    floor = bench["workload"]["floor"]  # bench/floor.py, on the workload's own prompts
    assert 0 < floor["prefill_s"] and 0 < floor["decode_s"]
    assert par["run_over_floor"] == pytest.approx(par["run_s"] / floor["total_s"])
    assert "| tiny | tiny-gqa | parallel |" in result.stdout
    again = CliRunner().invoke(app, ["bench", "--from", str(out)])
    assert again.exit_code == 0 and "| tiny | tiny-gqa | stock |" in again.stdout


def test_a_run_whose_jobs_failed_is_a_failed_run_that_says_why(tmp_path):
    """A worker that fails every job (here a KV pool too small for the documents) exits 0 with
    no answers; its times compare with nothing, so the run is failed with a job's own error."""
    out = tmp_path / "e2e.json"
    result = CliRunner().invoke(app, [
        "bench", "--e2e", "tiny", "--device", "cpu", "--modes", "stock", "--passes", "1",
        "--run-args", "--kv-tokens 64", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (bench,) = json.loads(out.read_text())["workloads"]
    (run,) = bench["runs"]
    assert run["rc"] == 0 and run["jobs_by_status"] == {"failed": 3} and run["questions"] == 0
    assert run["error"].startswith("3 of 3 jobs failed, e.g. job 1: ")
    assert "KV pool" in run["error"]
    assert "failed: 3 of 3 jobs failed" in result.output
    assert bench["summary"]["stock"]["failed"] == 1 and bench["summary"]["stock"]["runs"] == 0


def test_arrivals_feed_a_following_worker_and_report_latency(tmp_path):
    out = tmp_path / "arrivals.json"
    result = CliRunner().invoke(app, [
        "bench", "--e2e", "tiny-arrivals", "--device", "cpu", "--modes", "stock", "--passes",
        "1", "--first-pass", "1", "--arrival-seconds", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (run,) = json.loads(out.read_text())["workloads"][0]["runs"]
    assert run["pass"] == 1
    assert run["rc"] == 130 and run["worker_summary"]["stopped_by"] == "SIGINT"
    assert run["questions"] == 12 and run["jobs_by_status"] == {"done": 3}
    assert 0 < run["latency_p50_s"] <= run["latency_p95_s"] <= run["latency_max_s"]
    assert len(run["latency_by_job_s"]) == 3 and max(run["latency_by_job_s"]) == pytest.approx(
        run["latency_max_s"], abs=1e-4)
    assert run["throughput_answers_per_s"] > 0 and run["ingest_ticks"] >= 2


def test_e2e_refuses_unknown_workloads_and_modes():
    bad = CliRunner().invoke(app, ["bench", "--e2e", "nope", "--device", "cpu"])
    assert bad.exit_code == 2 and "unknown workload 'nope'" in bad.output
    bad = CliRunner().invoke(app, ["bench", "--e2e", "tiny", "--modes", "stock,fast"])
    assert bad.exit_code == 2 and "modes must be some of" in bad.output


def test_merge_pairs_runs_split_over_calls_by_pass():
    def result(mode, p, process):
        run = {"mode": mode, "pass": p, "process_s": process, "run_s": process}
        return {"kind": "e2e", "workloads": [{"workload": {"name": "x"}, "model": "m",
                                              "modes": [mode], "runs": [run], "summary": {}}]}

    (merged,) = e2e_report.merge([result("parallel", 0, 2.0), result("stock", 0, 8.0),
                                  result("stock", 1, 6.0), result("parallel", 1, 3.0)])
    assert merged["modes"] == ["stock", "parallel"] and len(merged["runs"]) == 4
    assert merged["summary"]["parallel"]["speedup_process"] == pytest.approx(math.sqrt(4.0 * 2.0))
    assert "| x | m | stock |" in e2e_report.markdown_table([merged])


def test_hf_folder_from_dummy_weights_loads_back_to_the_same_model(smollm2, tmp_path):
    import torch

    from ppqa import Engine, SamplingParams
    from ppqa.bench.load_time import time_load, write_hf_folder
    from ppqa.engine.loading.loader import load_model

    folder = tmp_path / "hf"
    written = write_hf_folder("dummy:tiny-gqa+bpe", folder, dtype=torch.float32,
                              shard_bytes=5 * 10**6)
    assert written["shards"] == len(list(folder.glob("*.safetensors"))) > 1
    timed = time_load(folder, dtype=torch.float32, engine=False)
    assert timed["tensors"] > 0 and timed["read_gb_per_s"] > 0
    assert timed["page_cache"] == "cold" and "mmap_read_s" not in timed
    cached = time_load(folder, dtype=torch.float32, engine=False, cached=True, baseline=True)
    assert cached["page_cache"] == "warm" and cached["prepared"] == "read once"
    assert cached["tensors"] == timed["tensors"] and cached["mmap_read_gb_per_s"] > 0
    want, got = load_model("dummy:tiny-gqa+bpe"), load_model(str(folder))
    assert got.config.vocab_size == want.config.vocab_size
    assert (got.config.num_layers, got.config.attention_bias) == (3, True)  # qwen2 layout
    expected = dict(want.weights)
    found = dict(got.weights)
    assert set(found) == set(expected)
    assert all(torch.equal(found[n], expected[n]) for n in expected)
    (answer,) = Engine(str(folder), device="cpu").answer(
        "The ferry leaves every hour from seven.", ["When?"],
        sampling=SamplingParams(max_new_tokens=3))
    assert len(answer.token_ids) == 3


def test_run_args_that_name_the_gpus_replace_the_default_gpu(tmp_path) -> None:
    from ppqa.bench.e2e import E2EOptions, Runner

    def worker_args(*run_args: str) -> list[str]:
        opts = E2EOptions(workloads=["tiny"], run_args=list(run_args))
        return Runner(opts, tmp_path, "dummy:tiny-gqa", print).worker_args("stock", follow=False)

    assert worker_args()[-2:] == ["--gpu", "0"]
    split = worker_args("--gpus", "0,1", "--tensor-parallel", "2")
    assert "--gpu" not in split and split[-4:] == ["--gpus", "0,1", "--tensor-parallel", "2"]


def test_answer_variants_draw_the_same_questions_and_ingest_as_batch_lines(tmp_path):
    """The labeling and judging variants: choices, letters, JSON, samples and copies keep their
    base workload's documents and questions, and their batch lines pass `ppqa ingest --batch`
    with the parameters each names."""
    from sqlalchemy import select

    from ppqa.store.db import open_db
    from ppqa.store.models import Job

    tok = ByteTokenizer(vocab_size=384)
    choices = w.make_jobs(w.WORKLOADS["quality-choices"], tok, max_docs=1)
    letters = w.make_jobs(w.WORKLOADS["quality-letters"], tok, max_docs=1)
    text = w.make_jobs(w.WORKLOADS["quality"], tok, max_docs=1)
    assert choices.documents == letters.documents == text.documents
    for c, lt, t in zip(choices.jobs, letters.jobs, text.jobs):
        assert [q for _, q in c.questions] == [q for _, q in t.questions]
        for (_, shown), (_, asked), options in zip(lt.questions, c.questions, c.choices):
            assert len(options) == 4 == len(set(options))
            assert shown == asked + "".join(f"\n{k}. {o}" for k, o in zip("ABCD", options))
    expected = {"quality-choices": {}, "labeling-json": {"json_schema": w.JSON_SCHEMA},
                "labeling-samples8": {"samples": 8, "temperature": 0.8},
                "labeling-copies8": {"temperature": 0.8}}
    for name, params in expected.items():
        jobs = w.make_jobs(w.WORKLOADS[name], tok, max_docs=1)
        folder = tmp_path / name
        batch = w.write_batch(jobs, folder)
        db = folder / "store.db"
        result = CliRunner().invoke(app, ["--db", str(db), "ingest", "--batch", str(batch)])
        assert result.exit_code == 0, result.stderr
        store = open_db(db)
        with store.read() as conn:
            stored = [row[0] for row in conn.execute(select(Job.params))]
        store.close()
        assert len(stored) == len(jobs.jobs)
        for job_params in stored:
            assert {k: job_params.get(k) for k in params} == params
        if name == "labeling-copies8":
            assert sorted(p["seed"] for p in stored) == list(range(8))


@pytest.mark.parametrize("spec", ["dummy:tiny-gqa", "dummy:tiny-mha"])
def test_gguf_file_from_dummy_weights_loads_back_to_the_same_weights(spec, tmp_path):
    """load_time.py's GGUF writer: llama's q/k rows permuted as llama.cpp writes them (tiny-mha)
    and qwen2's left as they are (tiny-gqa) come back through the loader as the preset's own."""
    import torch

    from ppqa.bench.load_time import time_load, write_gguf_file
    from ppqa.engine.loading.loader import load_model

    path = tmp_path / "model.gguf"
    written = write_gguf_file(spec, path, dtype=torch.bfloat16)
    assert 0 < written["bytes"] < path.stat().st_size  # the tensors' bytes, then the header's
    assert not path.with_suffix(".partial").exists()
    want = dict(load_model(spec, dtype=torch.bfloat16).weights)
    got = dict(load_model(str(path), dtype=torch.bfloat16).weights)
    assert set(got) == set(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    timed = time_load(path, dtype=torch.bfloat16, engine=False, cached=True, baseline=True)
    assert timed["tensors"] == len(want) and timed["mmap_read_gb_per_s"] > 0


def test_question_requests_carry_each_jobs_budget_template_and_document():
    tok = ByteTokenizer(vocab_size=384)
    jobs = w.make_jobs(w.WORKLOADS["labeling"], tok, max_docs=2)
    requests = w.question_requests(jobs)
    assert len(requests) == sum(len(j.questions) for j in jobs.jobs)
    by_key = {r.key: r for r in requests}
    for job in jobs.jobs:
        for qid, question in job.questions:
            r = by_key[(job.name, qid)]
            assert (r.document, r.question, r.template) == \
                (jobs.documents[job.document], question, "label")
            assert r.sampling.max_new_tokens == job.max_new_tokens and r.sampling.ignore_eos
    short = w.question_requests(jobs, ["a", "b"])
    assert [r.document for r in short] == [["a", "b"][j.document] for j in jobs.jobs
                                          for _ in j.questions]
