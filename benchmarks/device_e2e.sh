#!/usr/bin/env bash
# One device call for the product as users run it: start-up on an empty and on a warm Triton
# cache, the GPU tests, the prefill profile, the engine session on the paper mix at two batch
# ceilings, e2e workloads (stock against auto, one pass), one OpenAI Batch file through ppqa
# serve against ingest/run, and the decode step with a JSON schema's mask against without. Each step has its own time limit; logs and JSON go to $OUT.
# Run on a fresh machine (its Triton cache is empty), from the repo root, with `.whl` (the
# wheels the device lacks) and `.carry` (PPQA_HOME with the saved BPE tokenizer) carried.
# STEPS="startup pytest ..." runs a subset, in that order; BYTECODE=1 keeps compiled bytecode
# between processes (PYTHONPYCACHEPREFIX), as a pip install does; HELPERS=1 starts compile helpers in the
# start-up profiles (as `ppqa run` does), PROFILE=1 profiles the warm one, STARTUP_JOB=D,Q,T
# times a job twice after each start-up is ready (startup_profile --job); DEADLINE (s) bounds
# the whole call so that the archive is always written.
# `.whl` holds cp312 manylinux wheels of what the device image lacks (device README, Notes):
# SQLAlchemy, greenlet, pydantic, pydantic_core, typing_extensions, typing-inspection,
# annotated-types, gguf, platformdirs (the store and loaders); fastapi, starlette, uvicorn,
# python-multipart, annotated-doc, opentelemetry-api (serve); llguidance (JSON answers);
# jsonschema, jsonschema-specifications, referencing, rpds-py, attrs (its GPU test). `.carry`
# is a PPQA_HOME holding models/smollm2/tokenizer-*/ (bpe.tokenizer_dir(): run
# `ppqa models pull smollm2` and load `dummy:<preset>+bpe` once, then copy that folder).
set -u
OUT=${OUT:-/tmp/ppqa-device-out}
mkdir -p "$OUT"
if [ -d .whl ] || [ ! -d /tmp/site ]; then  # a later call on the same machine may leave .whl home
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PPQA_HOME=$PWD/.carry/home PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

if [ -n "${BYTECODE:-}" ]; then  # as after a pip install: sources compiled to bytecode once
  # (the device image sets PYTHONDONTWRITEBYTECODE and ships none, so each process compiles
  # torch's sources again: `import torch` ~4 s instead of ~2, results/h200/import_times.log)
  unset PYTHONDONTWRITEBYTECODE
  export PYTHONPYCACHEPREFIX=/tmp/pycache
  python3 -c "import torch, triton, sqlalchemy, pydantic, rich, typer, ppqa.engine, ppqa.cli.app" \
    > /dev/null 2>&1 || echo "bytecode warm-up import failed"
fi

DEADLINE=${DEADLINE:-570}  # seconds: no step starts or runs past it, so the archive is always made
step() {  # step NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log, a short tail here
  local name=$1 limit=$2
  shift 2
  local left=$((DEADLINE - SECONDS - 10))
  if [ "$left" -lt 20 ]; then echo "== $name: skipped, ${left} s left"; return; fi
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? after $((SECONDS - t0)) s"
  grep -v -i -E "warn|return F\.|return torch\.|^\s*$" "$OUT/$name.log" | tail -n "${TAIL:-6}"
}

e2e() {  # e2e WORKLOAD LIMIT [bench args]; TAG names the log and JSON (default: WORKLOAD)
  local w=$1 limit=$2 name=${TAG:-$1}
  shift 2
  step "e2e_$name" "$limit" python3 -m ppqa bench --e2e "$w" --modes stock,auto --passes 1 \
    --out "$OUT/e2e_$name.json" "$@"
}

for s in ${STEPS:-startup pytest prefill quality loogle serve grammar timeline}; do
  case $s in
    pyenv)
      step pyenv 120 bash benchmarks/import_times.sh ;;
    startup)
      export TRITON_CACHE_DIR=/tmp/triton-startup-$$  # empty: the first run compiles everything
      step startup_cold 120 python3 benchmarks/startup_profile.py --no-profile ${HELPERS:+--helpers} \
        ${STARTUP_JOB:+--job "$STARTUP_JOB"} --out "$OUT/startup_cold.json"
      step startup_warm 90 python3 benchmarks/startup_profile.py $([ -n "${PROFILE:-}" ] || echo --no-profile) ${HELPERS:+--helpers} \
        ${STARTUP_JOB:+--job "$STARTUP_JOB"} --out "$OUT/startup_warm.json"
      unset TRITON_CACHE_DIR ;;
    startupwarm)  # start-up on the Triton cache as it is (after prewarm: warm), profiled
      step startup_warm_prof 90 python3 benchmarks/startup_profile.py \
        ${STARTUP_JOB:+--job "$STARTUP_JOB"} --out "$OUT/startup_warm_prof.json" ;;
    startupab)  # start-up on the Triton cache as it is, the earlier tree in .base against
      # this one, alternated, STARTUP_PAIRS times (no profiler): each run's ready time
      for i in $(seq "${STARTUP_PAIRS:-3}"); do
        PYTHONPATH=/tmp/site:$PWD/.base step "startup_base$i" 60 python3 \
          benchmarks/startup_profile.py --no-profile --out "$OUT/startup_base$i.json"
        step "startup_new$i" 60 python3 benchmarks/startup_profile.py --no-profile \
          --out "$OUT/startup_new$i.json"
      done ;;
    startup_alt)  # another helper layout on an empty cache: ALT_LAYOUT (phases, the default
      # here, or record), ALT_GROUPS (phases only: startup_profile --groups)
      export TRITON_CACHE_DIR=/tmp/triton-startup-alt-$$
      step startup_alt 120 python3 benchmarks/startup_profile.py --no-profile --helpers \
        --layout "${ALT_LAYOUT:-phases}" ${ALT_GROUPS:+--groups "$ALT_GROUPS"} \
        ${STARTUP_JOB:+--job "$STARTUP_JOB"} --out "$OUT/startup_alt.json"
      unset TRITON_CACHE_DIR ;;
    pytest)
      step pytest 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/gpu tests/kernels ;;
    docproduct)  # cascade's document part: ours against torch's cuDNN and FlashAttention
      step docproduct 150 python3 benchmarks/doc_product.py ${DOCPRODUCT_ARGS:-} \
        --out "$OUT/doc_product.json" ;;
    firstchunk)  # a first prefill chunk's causal attention: our kernel's tiles, FlashAttention, cuDNN
      step firstchunk 240 python3 benchmarks/first_chunk.py ${FIRSTCHUNK_ARGS:-} \
        --out "$OUT/first_chunk.json" ;;
    sdpa)  # what a new sequence length costs a document's first chunk (cuDNN plans)
      step sdpa 150 python3 benchmarks/sdpa_lengths.py ${SDPA_ARGS:-} --out "$OUT/sdpa_lengths.json" ;;
    prefillab)  # a document's later chunks: the extend kernel against cuDNN with its lse
      step prefillab 240 python3 benchmarks/profile_prefill.py --models dummy:qwen2.5-7b+bpe,dummy:codellama-7b+bpe \
        --doc-tokens ${AB_LENGTHS:-16001,20483} --questions 18 --question-tokens 20 --chunk-paths \
        --out "$OUT/prefill_chunks.json" ;;
    prefillchunk)  # document prefill at two chunk sizes (PREFILL_CHUNKS, max_prefill_tokens),
      # each length met twice before its timed case (cuDNN's plans in hand)
      # one model a process: an engine's memory outlives `del engine` within one, and the next
      # engine's KV pool is sized from what is left free
      for m in ${PREFILL_MODELS:-qwen2.5-7b codellama-7b}; do
        for c in ${PREFILL_CHUNKS:-8192 16384}; do
          step "prefillchunk_${m}_$c" 120 python3 benchmarks/profile_prefill.py \
            --models "dummy:$m+bpe" --doc-tokens ${AB_LENGTHS:-16001,20483} \
            --questions 18,256 --question-tokens 20 --chunk-paths --max-prefill-tokens "$c" \
            --out "$OUT/prefill_chunk_${m}_$c.json"
        done
      done ;;
    pytestsel)  # the GPU tests PYTEST_SEL names (files or node ids), e.g. after a change to them
      step pytestsel 240 python3 -m pytest -q -n 4 -p no:cacheprovider ${PYTEST_SEL:?} ;;
    preload)  # whether a variant preloaded from its recorded data lands under its launch's key
      TRITON_CACHE_DIR=/tmp/triton-preload-$$ step preload 150 python3 benchmarks/preload_check.py \
        ${PRELOAD_ARGS:-} --out "$OUT/preload_check.json" ;;
    pytestfc)  # the fused-causal and later-chunk GPU tests alone
      step pytestfc 90 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_causal.py ;;
    prefillq)  # question prefill by part: documents of 2k and 16k, 16 and 256 questions of 20
      # and 90 tokens, CodeLlama-7B (PREFILLQ_ARGS: more profile_prefill.py options)
      step prefillq 240 python3 benchmarks/profile_prefill.py --models dummy:codellama-7b+bpe \
        --doc-tokens 2048,16384 --questions 16,256 --question-tokens 20,90 --profile \
        ${PREFILLQ_ARGS:-} --out "$OUT/prefill_q.json" ;;
    prefill)
      step prefill 150 python3 benchmarks/profile_prefill.py --doc-tokens 8192,16384,20480 \
        --questions 64 --question-tokens 20 --alone --out "$OUT/prefill.json" ;;
    timeline)
      step timeline256 90 python3 benchmarks/session_timeline.py --workload paper --out "$OUT/timeline256.json"
      step timeline512 90 python3 benchmarks/session_timeline.py --workload paper --max-batch-requests 512 \
        --out "$OUT/timeline512.json" ;;
    wtimelinemb)  # workloads through the worker, two passes, at each batch ceiling of
      # WTL_BATCHES (default 256 512; B/W also sets max_wide_requests W), one process each:
      # the second pass's wall is the figure. WTL_WORK: "WORKLOAD:DOCS[:PATH]" specs (default
      # paper:8; PATH worker or arrivals)
      for spec in ${WTL_WORK:-paper:8}; do
        IFS=: read -r w n path <<< "$spec"
        path=${path:-worker}
        for bw in ${WTL_BATCHES:-256 512}; do
          IFS=/ read -r b wide <<< "$bw"
          tag="b$b${wide:+w$wide}"
          step "wtimeline_${w}_${path}_$tag" 150 python3 benchmarks/session_timeline.py \
            --workload "$w" --max-docs "$n" --paths "$path,$path" --max-batch-requests "$b" \
            ${wide:+--max-wide-requests "$wide"} --folder "/tmp/wtimeline$tag" \
            --out "$OUT/wtimeline_${w}_${path}_$tag.json"
        done
      done ;;
    wtimeline)  # the paper mix through a bare session and through the worker, one process
      step wtimeline 240 python3 benchmarks/session_timeline.py --workload paper \
        --paths session,worker,session,worker --folder /tmp/wtimeline --out "$OUT/wtimeline.json" ;;
    prewarm)  # the default Triton cache made warm for the 7B preset, so that the e2e steps'
      # first process (stock's, with one pass) does not pay the compiling that the other skips
      step prewarm 120 python3 -c "from ppqa import Engine; Engine('dummy:codellama-7b+bpe', device='cuda').warmup()" ;;
    prewarmq)  # the same for the Qwen2.5-7B preset of `loogle` and `quality`
      step prewarmq 120 python3 -c "from ppqa import Engine; Engine('dummy:qwen2.5-7b+bpe', device='cuda').warmup()" ;;
    quality) e2e quality 150 --max-docs 20 ;;
    loogle) e2e loogle 170 --max-docs 8 ;;
    loogle2) e2e loogle 280 --max-docs 8 --passes 2 ;;  # a second pass in the other order: both warm
    loogle48)  # 48 documents, the size issue 18 states for its LooGLE-shaped target: more than
      # one step's 256 requests wait, so steps stay full while documents come and go
      TAG=loogle48 e2e loogle 300 --max-docs 48 ;;
    quality2) e2e quality 200 --max-docs 20 --passes 2 ;;
    qualitycascade)  # `quality` with cascade forced against stock (auto chooses stock per
      # document, alone; its 256-request steps hold ~14 documents, whose cascade layer floor
      # they would share): does cascade's decode step gain what it costs in question prefill?
      TAG=quality_cascade e2e quality 260 --max-docs 20 --passes 2 --modes stock,cascade ;;
    bench16k)  # the engine alone: the paper grid's 16k/256 cell, cached document
      step bench16k 200 python3 -m ppqa bench --model dummy:codellama-7b --doc-tokens 16384 \
        --questions 256 --max-new-tokens 128 --seeds 0 --streams 64 --modes stock,cascade,auto \
        --cuda-graphs --out "$OUT/bench16k.json" ;;
    hostthreads)  # the host's step bookkeeping beside a busy tokenizer: torch's threads or one
      step hostthreads 120 python3 benchmarks/host_threads.py --out "$OUT/host_threads.json" ;;
    cudnnfirst)  # a process's first cuDNN call on the main thread, or after one on another
      step cudnnfirst 120 python3 benchmarks/cudnn_first_call.py --out "$OUT/cudnn_first_call.json" ;;
    cudnnplans)  # what each new shape of cuDNN attention costs a fresh process's main thread
      step cudnnplans 150 python3 benchmarks/cudnn_plans.py --out "$OUT/cudnn_plans.json" ;;
    suffix)  # the cascade step's suffix attention (each request's own tokens) by tile
      step suffix 150 python3 benchmarks/suffix_tiles.py --out "$OUT/suffix_tiles.json" ;;
    merge)  # the merge kernel's states per loop step at decode's shapes
      step merge 120 python3 benchmarks/merge_states.py --out "$OUT/merge_states.json" ;;
    gprof)  # GPU seconds by kernel kind in prefill and in decode, through the worker (its second
      # pass profiled): GPROF="WORKLOAD:MODE:MAX_DOCS ...", e.g. "loogle:stock:8 loogle:auto:8";
      # GPROF_ARGS: more session_timeline.py options, e.g. --trace-cudnn. A fourth field 0
      # ("labeling:auto:50:0") profiles the first pass of a process that, like `ppqa run` on a
      # warm Triton cache, ran no warm-up
      for spec in ${GPROF:?}; do
        IFS=: read -r w m n p <<< "$spec"
        if [ "${p:-1}" = 0 ]; then tag="${w}_${m}_first"; first="--profile-pass 0 --warmup cold"
        else tag="${w}_${m}"; first=""; fi
        step "gprof_$tag" 240 python3 benchmarks/session_timeline.py --workload "$w" \
          --mode "$m" --max-docs "$n" --paths worker,worker --profile-pass 1 \
          --folder "/tmp/gprof_$tag" --out "$OUT/gprof_$tag.json" ${GPROF_ARGS:-} $first
      done ;;
    spy)  # where the worker's threads spend one pass, sampled by py-spy (idle included, in
      # speedscope's per-thread timelines): SPY="WORKLOAD:MODE:MAX_DOCS", a fresh process on the
      # Triton cache as it is, as `ppqa run` starts; `.whl` carries py-spy's wheel
      IFS=: read -r w m n <<< "${SPY:?}"
      step "spy_${w}_${m}" 240 /tmp/site/bin/py-spy record --idle -r 100 -f speedscope \
        -o "$OUT/spy_${w}_${m}.json" -- python3 benchmarks/session_timeline.py --workload "$w" \
        --mode "$m" --max-docs "$n" --paths worker --warmup cold --folder /tmp/spy \
        --out "$OUT/spy_timeline_${w}_${m}.json" ;;
    gcpause)  # one full garbage collection in a process holding the warmed 7B engine, and after
      # gc.freeze() (benchmarks/gc_pauses.py)
      step gcpause 150 python3 benchmarks/gc_pauses.py --model dummy:qwen2.5-7b+bpe --device cuda \
        --warmup --out "$OUT/gc_pauses.json" ;;
    gcbase|gcnew)  # one worker pass in a fresh process (as `ppqa run` starts on a warm Triton
      # cache) through the tree in .base (gcbase) or this one (gcnew), with each garbage
      # collection's time and length: GCAB="WORKLOAD:MODE:MAX_DOCS" (default loogle:auto:24)
      IFS=: read -r w m n <<< "${GCAB:-loogle:auto:24}"
      tree=${s#gc}
      if [ "$tree" = base ]; then path=/tmp/site:$PWD/.base; else path=$PYTHONPATH; fi
      PYTHONPATH=$path step "gc_${w}_$tree" 150 python3 benchmarks/session_timeline.py \
        --workload "$w" --mode "$m" --max-docs "$n" --paths worker --warmup cold \
        --folder "/tmp/gc_$tree" --out "$OUT/gc_${w}_$tree.json" ;;
    gprofbase)  # gprof's first spec through the earlier tree in .base (made as for arrivalsab):
      # its ppqa first on the path, this tree's session_timeline.py
      IFS=: read -r w m n p <<< "${GPROF%% *}"
      if [ "${p:-1}" = 0 ]; then first="--profile-pass 0 --warmup cold"; else first=""; fi
      PYTHONPATH=/tmp/site:$PWD/.base step "gprof_${w}_${m}_base" 240 python3 \
        benchmarks/session_timeline.py --workload "$w" --mode "$m" --max-docs "$n" \
        --paths worker,worker --profile-pass "${p:-1}" --folder "/tmp/gprof_base" \
        --out "$OUT/gprof_${w}_${m}_base.json" ${GPROF_ARGS:-} $first ;;
    cgroups)  # one decode step's attention with several documents of few questions (loogle's
      # shape), stock against cascade, contiguous then gathered documents
      step cgroups 150 python3 benchmarks/cascade_groups.py ${CG_ARGS:-} --out "$OUT/cascade_groups.json"
      step cgroups_gather 150 python3 benchmarks/cascade_groups.py --gather ${CG_ARGS:-} \
        --out "$OUT/cascade_groups_gather.json" ;;
    cgpaper)  # the same step at the paper grid's shapes (CodeLlama-7B, 16k documents, 256 or
      # 64 questions each): where the split kernel's plan already fills the GPU
      step cgpaper 150 python3 benchmarks/cascade_groups.py --model codellama-7b \
        --doc-tokens 16384 --own 100 --cases "${CGP_CASES:-256;64x4;256,64}" \
        --out "$OUT/cascade_groups_paper.json" ;;
    overlap)  # one half-batch's GEMMs beside the other half's attention, two streams
      step overlap 150 python3 benchmarks/overlap_probe.py ${OVERLAP_ARGS:-} --out "$OUT/overlap_probe.json" ;;
    atimeline)  # labeling's 50 jobs through the worker up front, then arriving over 6 s
      # (arrivals6's pace), twice, one process: decode steps' rows and chunks over time
      step atimeline 240 python3 benchmarks/session_timeline.py --workload labeling \
        --max-docs 50 --paths worker,arrivals,worker,arrivals --arrival-seconds 6 \
        --folder /tmp/atimeline --out "$OUT/atimeline.json" ;;
    ltimeline)  # loogle through the worker twice in one process: compilations and eager steps
      step ltimeline 200 python3 benchmarks/session_timeline.py --workload loogle --max-docs 8 \
        --paths worker,worker --folder /tmp/ltimeline --out "$OUT/ltimeline.json" ;;
    paper) e2e paper 260 ;;
    # `ppqa run --warmup always` (PPQA_WARMUP) against the default `cold`, which runs no
    # warm-up where the Triton cache holds the model's kernels
    paperalways) PPQA_WARMUP=always TAG=paper_always e2e paper 260 ;;
    paperauto) TAG=paper_auto e2e paper 100 --modes auto ;;
    paperautoalways) PPQA_WARMUP=always TAG=paper_auto_always e2e paper 100 --modes auto ;;
    labelingalways) PPQA_WARMUP=always TAG=labeling_always e2e labeling 150 --max-docs 50 ;;
    labeling) e2e labeling 150 --max-docs 50 ;;
    labeling2) e2e labeling 200 --max-docs 50 --passes 2 ;;  # one pass varies by +-0.3 s of ~8
    arrivals) e2e arrivals 200 --max-docs 50 --arrival-seconds 30 ;;
    arrivalsab)  # arrivals6, auto only, alternating an earlier tree with this one, ABPASSES
      # pairs: here `git archive REF ppqa | tar -x -C .base` (.base ignored through
      # .git/info/exclude) and `.base` carried; python -m ppqa run in .base imports that copy
      for i in $(seq 1 "${ABPASSES:-2}"); do
        (cd .base && TAG=arrivals6_base$i e2e arrivals 60 --max-docs 50 --arrival-seconds 6 \
          --modes auto)
        TAG=arrivals6_new$i e2e arrivals 60 --max-docs 50 --arrival-seconds 6 --modes auto
      done ;;
    ab)  # auto alone on ABWORK's workloads ("W:DOCS ...", default quality:20 labeling:50),
      # alternating the earlier tree in .base (made as for arrivalsab) with this one, ABPASSES
      # pairs, each pair in the other order than the last
      for i in $(seq 1 "${ABPASSES:-2}"); do
        for spec in ${ABWORK:-quality:20 labeling:50}; do
          IFS=: read -r w n <<< "$spec"
          if [ $((i % 2)) = 1 ]; then
            (cd .base && TAG=${w}_base$i e2e "$w" 80 --max-docs "$n" --modes auto)
            TAG=${w}_new$i e2e "$w" 80 --max-docs "$n" --modes auto
          else
            TAG=${w}_new$i e2e "$w" 80 --max-docs "$n" --modes auto
            (cd .base && TAG=${w}_base$i e2e "$w" 80 --max-docs "$n" --modes auto)
          fi
        done
      done ;;
    arrivals6)  # the same jobs arriving faster than one worker answers them (labeling's run
      # takes ~8 s): its throughput against labeling's up-front run, issue 18's 10% target
      TAG=arrivals6 e2e arrivals 150 --max-docs 50 --arrival-seconds 6 ;;
    loadtime)  # a 7B-sized HF folder (CodeLlama-7B's shapes, ~13.5 GB in 5 GB shards) read
      # to the GPU: the loader's streamed reads against a memory-mapped read, and Engine(folder),
      # with the shards out of the page cache, then in it
      step loadtime_cold 300 python3 benchmarks/load_time.py --model dummy:codellama-7b+bpe \
        --folder /tmp/ppqa-7b --baseline --out "$OUT/load_time_cold.json"
      step loadtime_warm 120 python3 benchmarks/load_time.py --model dummy:codellama-7b+bpe \
        --folder /tmp/ppqa-7b --baseline --cached --out "$OUT/load_time_warm.json" ;;
    gguf1)  # the real SmolLM2 GGUF is over one call's carry: its first part waits in /tmp
      step gguf1 30 cp .gguf.1 /tmp/smollm2.gguf.1 ;;
    same)  # ... and the second part comes with this call (same_answers.py: real weights)
      step same 300 bash -c 'cat /tmp/smollm2.gguf.1 .gguf.2 > "$PPQA_HOME/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" \
        && python3 benchmarks/same_answers.py --device cuda --out "$OUT/same_answers.json"' ;;
    answers)  # issue 21's pairs (not in the default steps: about 6 minutes)
      step answers 420 python3 -m ppqa bench --e2e quality-letters,quality-choices,labeling-short,labeling-short-labels,labeling-copies8,labeling-samples8 \
        --modes auto --passes 1 --max-docs ${ANSWER_DOCS:-20} --out "$OUT/e2e_answers.json" ;;
    grammar)
      step grammar 100 python3 benchmarks/grammar_step.py --model dummy:codellama-7b+bpe --device cuda \
        --questions 256 --doc-tokens 2000 --out "$OUT/grammar_step.json" ;;
    serve)
      step serve 150 python3 benchmarks/serve_vs_run.py --workload labeling --max-docs 20 --passes 1 \
        --gpu 0 --out "$OUT/serve_vs_run.json" ;;
  esac
done
# The device tool brings back at most 8 files: everything as one archive.
tar czf /tmp/device_e2e.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/device_e2e.tgz "$OUT/"
