#!/usr/bin/env bash
# The GPU tests and the measurements of docs/benchmarks.md, by section name, on a machine with an NVIDIA GPU.
# Usage: scripts/gpu_suite.sh OUT_DIR [tests] [optimizer] [cross_entropy] [ce_rows] [ce_chunks] [gelu] [train]
#        [step] [step_ablate] [step15b] [step_sizes] [curve] [sweep] [sweep_alone] [defaults] [defaults15b] [plan]
#        [attention] [diverge15b] [compile15b] [compile_check] [determinism] [determinism_cost]
#        [determinism_cost15b] [allocator] [sample] [sample_run] [prepare_corpus] [prepare_many] [prepare_one]
#        [fp8_tests] [fp8_speed] [fp8_sizes] [fp8_defaults15b] [fp8_quality] [muon] [muon_bench] [ns_kernel]
#        [muon_step] [muon_quality] [step_modern] [recipe] [recipe_ablate] [smoke]
# smoke: every benchmark script once in its quickest mode (the tiny model, one small shape), a few minutes: each
#   still runs end to end on this GPU; its figures are not results
# plan: PLAN_MODELS and PLAN_BATCHES (space-separated) pick the grid, default gpt2-124m at 16 64 512; it starts no
#   point after PLAN_TIME_LIMIT_S and goes on from the JSON files in PLAN_MEASURED
set -uo pipefail
out=${1:?output dir}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 WANDB_SILENT=true PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
for what in "$@"; do
  echo "=== $what ==="
  case $what in
    tests) MINITRAIN_TEST_DEVICE=cuda timeout 420 python3 -m pytest -q tests/test_optim.py tests/test_amp.py \
             tests/test_cross_entropy.py tests/test_gelu.py tests/test_model.py tests/test_decode.py \
             tests/test_generate_modern.py tests/test_qk_norm_rope.py \
             2>&1 | grep -E "^(E  |FAILED|[0-9]+ (passed|failed))" | tail -40
           # compiled kernels (not the interpreter the CPU tests default to), on a cuda trainer
           TRITON_INTERPRET=0 timeout 300 python3 -m pytest -q tests/test_trainer.py tests/test_prefetch.py \
             -k "never_syncs or cuda_graph or cuda" 2>&1 | grep -E "^(E  |FAILED|[0-9]+ (passed|failed))" | tail -20 ;;
    defaults)  # what a user gets with no keys but the model (issue 16), beside a hand-picked micro-batch
      for extra in "" "trainer.micro_batch=16"; do
        rm -rf /tmp/defaults-124m
        timeout 280 python3 scripts/train.py model=gpt2-124m trainer.max_steps=200 trainer.sample_tokens=0 $extra \
          hydra.run.dir=/tmp/defaults-124m 2>&1 | grep -v "it/s\]\|step/s\]" | grep -E "^(plan|  |step|memory|error)" | tail -24
        cp /tmp/defaults-124m/metrics.jsonl "$out/defaults_124m${extra:+_micro16}.jsonl"
      done ;;
    defaults15b)
      rm -rf /tmp/defaults-15b
      timeout 560 python3 scripts/train.py model=gpt2-1.5b trainer.batch_size=512 trainer.max_steps=6 \
        trainer.log_every=2 trainer.eval_every=1000 trainer.save_every=1000 trainer.sample_tokens=0 \
        hydra.run.dir=/tmp/defaults-15b 2>&1 | grep -v "it/s\]\|step/s\]" | grep -E "^(plan|  |step|memory|error)" | tail -24
      cp /tmp/defaults-15b/metrics.jsonl "$out/defaults_15b.jsonl" ;;
    plan) timeout 590 python3 scripts/bench_plan.py --models ${PLAN_MODELS:-gpt2-124m} --batches ${PLAN_BATCHES:-16 64 512} \
            --time-limit-s ${PLAN_TIME_LIMIT_S:-470} --measured ${PLAN_MEASURED:-} --out "$out/bench_plan.json" 2>&1 | tail -40 ;;
    optimizer) timeout 240 python3 scripts/bench_optimizer.py --out "$out/bench_optimizer.json" 2>&1 | tail -40 ;;
    cross_entropy) timeout 400 python3 scripts/bench_cross_entropy.py --out "$out/bench_cross_entropy.json" 2>&1 | tail -40 ;;
    train) timeout 300 python3 scripts/train.py model=gpt2-124m precision=bf16 trainer.batch_size=16 \
             trainer.max_steps=60 trainer.log_every=10 trainer.eval_every=60 trainer.save_every=1000 \
             trainer.warmup_steps=10 trainer.lr=6e-4 trainer.min_lr=6e-5 hydra.run.dir=/tmp/run-124m 2>&1 \
             | grep -v "it/s\]\|step/s\]" | tail -25
           cp /tmp/run-124m/metrics.jsonl "$out/train_124m_metrics.jsonl" ;;
    step) timeout 400 python3 scripts/bench_step.py --models gpt2-124m --batch 16 --profile --reference-graphs \
            --rounds 8 --steps 48 --out "$out/bench_step_124m.json" 2>&1 | grep -v "^ .* ms .*x" | tail -40 ;;
    step_sizes)  # no checkpointing (both fit at B=16); the compiled reference fails the first-loss check at 774m
      timeout 590 python3 scripts/bench_step.py --models gpt2-350m gpt2-774m --batch 16 16 --rounds 8 --steps 32 \
        --big-checkpointing none --reference-eager --out "$out/bench_step_sizes.json" 2>&1 | grep -v "^{" | tail -14 ;;
    curve)  # the two recipes' loss curves over 200 steps of the built-in corpus, and their validation losses
      timeout 500 python3 scripts/bench_step.py --models gpt2-124m --batch 16 --steps 200 --rounds 4 --val \
        --out "$out/bench_step_curve.json" 2>&1 | tail -8 ;;
    step_ablate)  # each part swapped back, and the loss with twice its logit workspace (512 MiB)
      timeout 500 python3 scripts/bench_step.py --models gpt2-124m --batch 16 --rounds 8 \
        --ablate trainer.compile_mode=default model.gelu=torch loss.chunk_bytes=536870912 \
        --out "$out/bench_step_124m_ablate.json" 2>&1 | grep -v "^{" | tail -12 ;;
    step_modern)  # the modern block's step, one option undone at a time, beside GPT-2's block (docs/benchmarks.md,
      # "Time to target"): AdamW on every row, compiled with CUDA graphs
      timeout 590 python3 scripts/bench_step.py --models gpt2-124m --batch 16 --rounds 4 --steps 24 \
        --no-reference-compiled --minitrain-extra model=gpt2-124m-modern --ablate model.logit_softcap=null \
        model.qk_norm=false model.position=learned model.mlp=gelu model.norm=layernorm model.tie_head=true \
        model=gpt2-124m --out "$out/bench_step_modern.json" 2>&1 | grep -v "^{" | tail -14 ;;
    step15b)  # each recipe at the largest batch it runs (probed: a process per try), no checkpointing (the plan
      # grid's best for gpt2-1.5b); the compiled reference fails the first-loss check at this width (diverge15b)
      timeout 590 python3 scripts/bench_step.py --models gpt2-1.5b --batch auto --warmup 2 --steps 4 \
        --big-checkpointing none --minitrain-extra trainer.compile_mode=default --no-reference-compiled --reference-eager \
        --out "$out/bench_step_15b.json" 2>&1 | grep -v "^ .* ms .*x" | tail -12 ;;
    diverge15b)  # the reference's gpt2-1.5b loss runs away compiled: both recipes at B=8, the reference also eager
      timeout 400 python3 scripts/bench_step.py --models gpt2-1.5b --batch 8 --warmup 2 --steps 10 --rounds 1 \
        --big-checkpointing none --reference-eager --out "$out/diverge15b.json" 2>&1 | grep -E "^gpt2-1.5b" | tail -8 ;;
    compile15b)  # where torch.compile's first step leaves eager's: the reference at gpt2-1.5b's width, then narrower
      timeout 500 python3 scripts/compile_vs_eager.py --model gpt2-1.5b --batch 8 --variants "" "model.n_layer=4" \
        "model.n_layer=4 loss=fused" "model.n_layer=4 model.gelu=fused" "model.n_layer=4 precision=fp32" \
        "model.n_layer=4 model.n_embd=1536 model.n_head=24" "model.n_layer=4 model.n_embd=1024 model.n_head=16" \
        --out "$out/compile_vs_eager_15b.json" 2>&1 | grep -E "^gpt2" ;;
    compile_check)  # the trainer's first-step check: it passes on the default gpt2-124m run and stops the
      # gpt2-1.5b one whose compiled autocast graph departs from eager
      for args in "model=gpt2-124m" "model=gpt2-1.5b precision=amp_bf16 trainer.batch_size=8"; do
        rm -rf /tmp/compile-check
        timeout 280 python3 scripts/train.py $args trainer.max_steps=3 trainer.eval_every=1000 trainer.save_every=1000 \
          trainer.sample_tokens=0 hydra.run.dir=/tmp/compile-check 2>&1 | grep -aE "^error"
        grep -h "^compile check" /tmp/compile-check/*.log
      done ;;
    sample)  # decode tokens/s beside transformers' generate (same weights, bf16, greedy) at batch 1 and 16, gpt2-1.5b
      # and gpt2-124m, after an fp32 check that the graphed decode gives transformers' greedy tokens (about 5 minutes)
      timeout 590 python3 scripts/bench_sample.py --models gpt2-1.5b gpt2-124m --batches 1 16 --rounds 3 \
        --out "$out/bench_sample.json" 2>&1 | grep -v "Loading weights" | tail -12 ;;
    sample_run)  # scripts/sample.py as a user runs it, on a run just trained: top-p draws with the graphed decode and
      # eagerly (--no-compile; another random stream, so other texts), then greedy both ways (the same text until
      # bf16 rounding in different kernels parts them); each prints its decode tokens/s
      rm -rf /tmp/sample-run
      timeout 300 python3 scripts/train.py trainer.max_steps=100 trainer.sample_tokens=0 hydra.run.dir=/tmp/sample-run \
        2>&1 | grep -aE "^(error|finished)"
      for extra in "" "--no-compile" "--temperature 0" "--temperature 0 --no-compile"; do
        timeout 300 python3 scripts/sample.py /tmp/sample-run --num-samples 4 --max-new-tokens 100 --top-p 0.95 $extra \
          2>&1 | tail -3
      done ;;
    prepare_corpus|prepare_many|prepare_one)  # a 1 GB corpus's preparation on the host's cores against the
      # tokenizers library alone (CPU only); prepare_corpus builds the corpus (kept in /tmp/bench-prepare), then each
      # layout is a call of its own
      layout=${what#prepare_}
      if [ $layout = corpus ]; then
        timeout 590 python3 scripts/bench_prepare.py --gb 1 --work /tmp/bench-prepare --rounds 0 2>&1 | tail -2
      else
        timeout 590 python3 scripts/bench_prepare.py --gb 1 --work /tmp/bench-prepare --rounds 2 --layouts $layout \
          --out "$out/bench_prepare_$layout.json" 2>&1 | tail -6
      fi ;;
    fp8_tests)  # tests/test_fp8.py's whole runs on the GPU with real float8 GEMMs, minitrain's kernels and torchao's
      # (compiled with CUDA graphs under every checkpointing policy, eager policies ending bitwise equal, a resume);
      # its other tests are the CPU's (CPU bytes counted, Triton through the interpreter)
      TRITON_INTERPRET=0 timeout 520 python3 -m pytest -q tests/test_fp8.py \
        -k "fp8_run_trains or fp8_run_compiles or fp8_learns or float8_kernels_train" 2>&1 \
        | grep -E "^(E  |FAILED|[0-9]+ (passed|failed))" | tail -20 ;;
    fp8_speed|fp8_sizes)  # fp8 against bf16, tokens/s in alternating rounds, both resident in 47% of the GPU each at
      # bf16's policy on the whole GPU: fp8_speed the issue's target (>= 1.12x at gpt2-1.5b, the default batch of 32),
      # fp8_sizes gpt2-774m then gpt2-124m (no model starts after 300 s); FP8_MODELS overrides either's models
      models=$([ $what = fp8_speed ] && echo gpt2-1.5b || echo gpt2-774m gpt2-124m)
      timeout 510 python3 scripts/bench_fp8.py speed --models ${FP8_MODELS:-$models} --time-limit-s 300 \
        --out "$out/bench_$what.json" 2>&1 | grep -vE "it/s\]|Failed to load|register_constant" | tail -24 ;;
    fp8_defaults15b)  # what a user gets: precision=fp8 with the plan's own micro-batch and policy on the whole GPU,
      # the trainer's memory line against its prediction (bf16's B=32 figures: step15b, plan)
      rm -rf /tmp/fp8-defaults-15b
      timeout 470 python3 scripts/train.py model=gpt2-1.5b precision=fp8 trainer.max_steps=12 trainer.log_every=4 \
        trainer.eval_every=1000 trainer.save_every=1000 trainer.sample_tokens=0 hydra.run.dir=/tmp/fp8-defaults-15b \
        2>&1 | grep -v "it/s\]\|step/s\]" | grep -aE "^(plan|  |step|memory|compile check|error)" | tail -20
      cp /tmp/fp8-defaults-15b/metrics.jsonl "$out/fp8_defaults_15b.jsonl" ;;
    fp8_quality)  # validation loss, fp8 against bf16: QUALITY_MODEL (gpt2-124m), QUALITY_STEPS (1000) on the built-in
      # corpus at GPT-3's peak lr for the size, a cell per precision in QUALITY_PRECISIONS (bf16,fp8) and seed in
      # QUALITY_SEEDS (1337) through train.py -m, QUALITY_AT_A_TIME side by side (1); QUALITY_EXTRA: more overrides,
      # e.g. a noise control, model.gelu=fused,torch with QUALITY_PRECISIONS=bf16. Deterministic, so that a cell's
      # figures reproduce on the same GPU (docs/benchmarks.md: without, reruns of one cell differ). The cells'
      # records (not their checkpoints) go to OUT/fp8_quality/; `bench_fp8.py quality OUT*/fp8_quality/*/*`
      # compares them all
      model=${QUALITY_MODEL:-gpt2-124m}; precisions=${QUALITY_PRECISIONS:-bf16,fp8}; seeds=${QUALITY_SEEDS:-1337}
      extra=${QUALITY_EXTRA:-}; tag=${extra//[^a-z0-9]/-}; read -ra extra_args <<< "$extra"  # split, not globbed
      name=$model-${precisions//,/-}-s${seeds//,/-}${tag:+-$tag}; sw=/tmp/fp8-quality/$name; rm -rf $sw
      lr=$(python3 -c "from minitrain.tools.benchmarks.step import LR; print(LR.get('$model', 6e-4))")
      timeout 575 python3 scripts/train.py -m model=$model precision=$precisions trainer.seed=$seeds \
        trainer.max_steps=${QUALITY_STEPS:-1000} trainer.lr=$lr trainer.min_lr=$(python3 -c "print(f'{$lr / 10:g}')") \
        trainer.eval_every=100 trainer.eval_batches=20 trainer.log_every=50 trainer.save_every=1000 \
        trainer.deterministic=true trainer.sample_tokens=0 hydra.sweeper.max_batch_size=${QUALITY_AT_A_TIME:-1} \
        hydra.sweep.dir=$sw "${extra_args[@]}" 2>&1 | tail -3
      mkdir -p "$out/fp8_quality"
      tar -C /tmp/fp8-quality --exclude=checkpoints -cf - $name | tar -C "$out/fp8_quality" -xf -
      python3 scripts/bench_fp8.py quality $sw/* --out "$out/fp8_quality/$name.json"  # the figures before the plots
      python3 scripts/report.py $sw --out "$out/fp8_quality/$name" 2>&1 | sed -n 1,8p
      rm -rf $sw/*/checkpoints ;;
    muon)  # Muon's GPU tests (compiled kernels: the step never syncs, the fused step replayed as a CUDA graph, a skipped
      # step and a resume bit for bit; the exact parity with torch.optim.Muon is the CPU's: cuBLAS's batched and
      # per-matrix GEMMs round apart), then optimizer=muon through the trainer: gpt2-124m, compiled with CUDA graphs
      MINITRAIN_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q tests/test_muon.py \
        -k "never_syncs or cuda_graph or overflow or resume_is_bit or schedule or refuses" 2>&1 \
        | grep -E "^(E  |FAILED|[0-9]+ (passed|failed))" | tail -20
      rm -rf /tmp/muon-124m
      timeout 280 python3 scripts/train.py model=gpt2-124m optimizer=muon trainer.max_steps=100 trainer.log_every=20 \
        trainer.eval_every=100 trainer.save_every=1000 trainer.sample_tokens=0 hydra.run.dir=/tmp/muon-124m 2>&1 \
        | grep -v "it/s\]\|step/s\]" | grep -aE "^(plan|  |step|memory|error|finished)" | tail -24
      cp /tmp/muon-124m/metrics.jsonl "$out/muon_124m_metrics.jsonl"
      for precision in fp16 fp8; do  # loss scaling on both sides' gradients; float8 linears whose weights are Muon's
        rm -rf /tmp/muon-124m-$precision
        timeout 200 python3 scripts/train.py model=gpt2-124m optimizer=muon precision=$precision trainer.max_steps=30 \
          trainer.log_every=10 trainer.eval_every=30 trainer.save_every=1000 trainer.sample_tokens=0 \
          hydra.run.dir=/tmp/muon-124m-$precision 2>&1 | grep -aE "^(step|error|finished)" | tail -5
      done ;;
    muon_bench)  # Muon's step against torch.optim.Muon + our fused AdamW at gpt2-124m and gpt2-1.5b shapes (each
      # first update checked, alternating rounds), with optimizer.muon.ns_kernel=cublas and =triton, beside the floor:
      # Newton-Schulz at the bf16 GEMM rate of this run
      timeout 500 python3 scripts/bench_optimizer.py --cases muon-gpt2-124m muon-gpt2-1.5b \
        --out "$out/bench_muon.json" 2>&1 | tail -20 ;;
    ns_kernel)  # Newton-Schulz's symmetric Triton kernels (optimizer.muon.ns_kernel=triton): their tests with compiled,
      # autotuned kernels (and the Muon step's with them: no host sync, replayed as a CUDA graph), then orthogonalize
      # alone on gpt2-124m's and gpt2-1.5b's Muon batches, each kernel first checked against the fp32 iteration, in
      # alternating rounds, beside the FLOP floors (every FLOP; only the upper triangles of X X^T and A A) at the
      # bf16 GEMM rate of this run
      MINITRAIN_TEST_DEVICE=cuda timeout 500 python3 -m pytest -q tests/test_newton_schulz_triton.py tests/test_muon.py \
        -k "triton and not ns_kernel_is_the_kernel" 2>&1 | grep -E "^(E  |FAILED|[0-9]+ (passed|failed))" | tail -20
      timeout 400 python3 scripts/bench_optimizer.py --cases ns-gpt2-124m ns-gpt2-1.5b \
        --out "$out/bench_ns_kernel.json" 2>&1 | tail -24 ;;
    muon_step)  # Muon's share of the gpt2-124m step: minitrain's recipe with optimizer=muon against the reference, with
      # minitrain on AdamW interleaved (--ablate), and the profile's optimizer phase
      timeout 500 python3 scripts/bench_step.py --models gpt2-124m --batch 16 --rounds 6 --profile \
        --minitrain-extra optimizer=muon --ablate optimizer=adamw --out "$out/bench_step_muon.json" 2>&1 \
        | grep -v "^{" | tail -40 ;;
    muon_quality)  # AdamW at its best lr against Muon at its best: QUALITY_MODEL (gpt2-124m) for QUALITY_STEPS (1000)
      # on the installed packages' sources (data=packages, prepared first; the model's vocabulary sized to its BPE),
      # deterministic; an lr sweep per optimizer in MUON_SWEEPS (adamw muon): trainer.lr over ADAMW_LRS, then
      # optimizer.muon.lr over MUON_LRS (the AdamW side at GPT-3's lr for the size), QUALITY_AT_A_TIME cells side by
      # side (3; on one GPU they share it, so their wall times are not the step's: muon_step measures that); the
      # cells' records go to OUT/muon_quality/, `bench_optimizer.py --quality OUT*/muon_quality/MODEL-*` compares them
      model=${QUALITY_MODEL:-gpt2-124m}; data="data=packages model.vocab_size=null"
      lr=$(python3 -c "from minitrain.tools.benchmarks.step import LR; print(LR.get('$model', 6e-4))")
      timeout 300 python3 scripts/prepare_data.py $data 2>&1 | tail -1
      for sweep in ${MUON_SWEEPS:-adamw muon}; do
        sw=/tmp/muon-quality/$model-$sweep; rm -rf $sw
        if [ $sweep = adamw ]; then
          cells="optimizer=adamw trainer.lr=${ADAMW_LRS:-6e-4,1.2e-3,2.4e-3}"
        else
          cells="optimizer=muon trainer.lr=$lr optimizer.muon.lr=${MUON_LRS:-0.01,0.02,0.04}"
        fi
        timeout 560 python3 scripts/train.py -m model=$model $data $cells trainer.max_steps=${QUALITY_STEPS:-1000} \
          trainer.min_lr=0 trainer.eval_every=${QUALITY_EVAL_EVERY:-50} trainer.eval_batches=20 trainer.log_every=50 \
          trainer.save_every=100000 trainer.deterministic=true trainer.sample_tokens=0 \
          hydra.sweeper.max_batch_size=${QUALITY_AT_A_TIME:-3} hydra.sweep.dir=$sw 2>&1 | tail -3
        mkdir -p "$out/muon_quality"
        tar -C /tmp/muon-quality --exclude=checkpoints -cf - $model-$sweep | tar -C "$out/muon_quality" -xf -
      done
      python3 scripts/bench_optimizer.py --quality "$out"/muon_quality/$model-* --out "$out/muon_quality/$model.json" \
        2>&1 | tail -12 ;;
    gelu) timeout 60 python3 scripts/bench_gelu.py --out "$out/bench_gelu.json" 2>&1 | tail -6 ;;
    attention) timeout 120 python3 scripts/bench_attention.py --out "$out/bench_attention.json" 2>&1 | tail -24 ;;
    ce_rows) timeout 200 python3 scripts/tune_cross_entropy_rows.py --out "$out/tune_ce_rows.json" 2>&1 | tail -60 ;;
    ce_chunks) timeout 200 python3 scripts/bench_cross_entropy.py --shapes 16384x768x50304 16384x2048x128256 \
                 --chunk-mib 16 32 64 --out "$out/bench_ce_chunks.json" 2>&1 | tail -16 ;;
    smoke)
      s="$out/smoke"; mkdir -p "$s"
      timeout 90 python3 scripts/bench_gelu.py --shape 4096x3072 --out "$s/gelu.json" 2>&1 | tail -4
      timeout 90 python3 scripts/bench_attention.py --shapes 4x12x1024x64 --out "$s/attention.json" 2>&1 | tail -6
      timeout 120 python3 scripts/bench_optimizer.py --cases gpt2-124m --out "$s/optimizer.json" 2>&1 | tail -8
      timeout 120 python3 scripts/bench_optimizer.py --cases ns-gpt2-124m --rounds 2 --calls 1 \
        --out "$s/ns_kernel.json" 2>&1 | tail -12
      python3 scripts/optimizer_widget.py --measured "$s/optimizer.json" --out "$s/optimizer_widget.png" 2>&1 | tail -2
      timeout 150 python3 scripts/bench_cross_entropy.py --shapes 2048x768x50304 --out "$s/cross_entropy.json" 2>&1 | tail -9
      timeout 120 python3 scripts/tune_cross_entropy_rows.py --shapes 2560x50304 --blocks 16384x768 \
        --out "$s/ce_rows.json" 2>&1 | tail -4
      timeout 150 python3 scripts/compile_vs_eager.py --model tiny --batch 4 --out "$s/compile_vs_eager.json" 2>&1 | grep -E "^tiny"
      timeout 240 python3 scripts/bench_step.py --models tiny --batch 8 --warmup 3 --steps 4 --rounds 2 --profile \
        --reference-eager --out "$s/step.json" 2>&1 | grep -v "^{\|^ .* ms .*x" | tail -16
      timeout 200 python3 scripts/bench_plan.py --models tiny --batches 8 --warmup 3 --steps 1 --rounds 2 \
        --out "$s/plan.json" 2>&1 | tail -4
      timeout 150 python3 scripts/bench_distributed.py --gpus 1 --models tiny --modes ddp --steps 12 \
        --out "$s/distributed.json" 2>&1 | tail -2
      timeout 150 python3 scripts/bench_prepare.py --gb 0.01 --work /tmp/bench-prepare-smoke --rounds 1 \
        --out "$s/prepare.json" 2>&1 | tail -3
      timeout 200 python3 scripts/bench_fp8.py speed --models tiny --extra model.n_layer=2 model.n_embd=768 \
        model.n_head=12 --warmup 3 --rounds 2 --steps 2 --out "$s/fp8.json" 2>&1 | grep -E "^(model|tiny)" ;;
    sweep|sweep_alone)  # the README's sweep through `train.py -m`: gpt2-124m, precision x checkpointing, each cell a
      # process of its own; `sweep` runs three side by side on the one GPU (each process's allocator counts its own
      # peak), `sweep_alone` one at a time (after `sweep`: its compiled graphs come from the cache) and sets each
      # cell's peak beside the side-by-side one
      at_a_time=$([ $what = sweep ] && echo 3 || echo 1); sw=/tmp/$what-124m; rm -rf $sw
      timeout 580 python3 scripts/train.py -m model=gpt2-124m precision=fp32,bf16,fp16 \
        checkpointing=none,selective,every_k,full trainer.batch_size=16 trainer.max_steps=20 trainer.log_every=5 \
        trainer.eval_every=1000 trainer.eval_batches=2 trainer.save_every=1000 trainer.sample_tokens=0 \
        trainer.warmup_steps=5 hydra.sweeper.max_batch_size=$at_a_time hydra.sweep.dir=$sw 2>&1 | tail -3
      python3 scripts/report.py $sw --out $out/$what 2>&1 | sed -n 1,18p
      rm -rf $sw/*/checkpoints  # 24 cells' checkpoints would fill the disk the later targets write theirs to
      [ $what = sweep_alone ] && python3 - /tmp/sweep-124m $sw <<'PY' 2>&1 | tail -14
import sys
from minitrain.tools.report import load_sweep
side, alone = ({c.name: c for c in load_sweep(d)[0]} for d in sys.argv[1:])
for name, cell in alone.items():
    if name in side:
        print(f"{name}: measured peak side by side / alone {side[name].measured_gb / cell.measured_gb:.4f}")
PY
      ;;
    allocator)  # tokens/s and peaks with trainer.expandable_segments=true (the default) against false, alternating
      # cells of a process each: gpt2-124m bf16 without recompute and with full recompute (the report's table)
      sw=/tmp/allocator; rm -rf $sw
      timeout 580 python3 scripts/train.py -m model=gpt2-124m precision=bf16 checkpointing=none,full \
        trainer.expandable_segments=true,false,true,false trainer.batch_size=16 trainer.max_steps=60 \
        trainer.log_every=10 trainer.eval_every=1000 trainer.eval_batches=2 trainer.save_every=1000 \
        trainer.sample_tokens=0 hydra.sweep.dir=$sw 2>&1 | tail -3
      python3 scripts/report.py $sw --out $out/allocator 2>&1 | sed -n 1,12p
      rm -rf $sw/*/checkpoints ;;
    determinism)  # trainer.deterministic=true: two 30-step gpt2-124m runs (compiled, CUDA graphs) and one SIGKILLed
      # and resumed end with the same bits; the loss rows' kernel gives the same bits on any grid
      MINITRAIN_TEST_DEVICE=cuda timeout 580 python3 -m pytest -q tests/test_determinism.py -k "not cpu" 2>&1 \
        | grep -E "^(E  |FAILED|[0-9]+ (passed|failed))" | tail -30 ;;
    determinism_cost|determinism_cost15b)  # tokens/s with trainer.deterministic=true against the default (the
      # report's table); for gpt2-124m also how far two default runs of one config drift apart
      if [ $what = determinism_cost ]; then
        args="model=gpt2-124m trainer.deterministic=false,false,true trainer.max_steps=100 trainer.log_every=10"
      else
        args="model=gpt2-1.5b trainer.batch_size=32 trainer.deterministic=false,true trainer.max_steps=10"
        args="$args trainer.log_every=2"
      fi
      sw=/tmp/$what; rm -rf $sw
      timeout 580 python3 scripts/train.py -m $args trainer.eval_every=50 trainer.save_every=1000 \
        trainer.sample_tokens=0 hydra.sweep.dir=$sw 2>&1 | tail -3
      python3 scripts/report.py $sw --out $out/$what 2>&1 | sed -n 1,9p
      rm -rf $sw/*/checkpoints
      [ $what = determinism_cost ] && python3 - $sw <<'PY' 2>&1 | tail -4
import sys
from pathlib import Path
from minitrain.tools.report import read_step_records
# cells 0 and 1: the default config twice
first, second = (read_step_records(Path(sys.argv[1]) / cell / "metrics.jsonl") for cell in ("0", "1"))
for key in ("train/loss", "val/loss"):
    pairs = [(a["step"], a[key] - b[key]) for a, b in zip(first, second) if key in a and key in b]
    differs = next((step for step, d in pairs if d != 0), None)
    print(f"{key}, two default runs: first differs at step {differs}, largest |difference| "
          f"{max(abs(d) for _, d in pairs):.6f} over steps {pairs[0][0]}-{pairs[-1][0]}")
PY
      ;;
    recipe)  # time to a target loss (scripts/bench_recipe.py): the GPT-2 recipe (gpt2-124m, AdamW) over trainer.lr in
      # RECIPE_GPT2_LRS, its best final validation loss the target; the modern recipe (gpt2-124m-modern, Muon) over
      # optimizer.muon.lr in RECIPE_MODERN_LRS, stopped at and timed to its first evaluation at or below it (the
      # target read from the GPT-2 runs already in OUT/recipe/gpt2, copied into the work dir). RECIPE_TOKENS
      # (196608000: 6000 steps of 32 x 1024) per run (RECIPE_MODERN_TOKENS: the modern runs' own budget, which their
      # schedule decays over) on data=packages (prepared first), deterministic, evaluated every
      # 50 steps; RECIPE_SIDES (gpt2 modern): the sides this call runs (at gpt2-124m's default budget a run takes
      # minutes: one side and one lr a call, the calls sharing OUT/recipe); then the comparison of every run in
      # OUT/recipe (the record and the loss curves)
      work=/tmp/bench-recipe; mkdir -p "$out/recipe"
      timeout 300 python3 scripts/prepare_data.py data=packages model.vocab_size=null 2>&1 | tail -1
      for side in ${RECIPE_SIDES:-gpt2 modern}; do
        rm -rf $work/$side
        if [ "$side" = modern ] && [ -d "$out/recipe/gpt2" ]; then
          rm -rf $work/gpt2; mkdir -p $work; cp -r "$out/recipe/gpt2" $work/
        fi
        timeout 590 python3 scripts/bench_recipe.py --work $work --recipes $side --tokens ${RECIPE_TOKENS:-196608000} \
          ${RECIPE_MODERN_TOKENS:+--modern-tokens $RECIPE_MODERN_TOKENS} \
          --gpt2-lrs ${RECIPE_GPT2_LRS:-6e-4,1.2e-3} --modern-lrs ${RECIPE_MODERN_LRS:-0.01,0.02} 2>&1 | tail -4
        rm -rf $work/$side/*/checkpoints
        tar -C $work -cf - $side | tar -C "$out/recipe" -xf -
      done
      python3 scripts/bench_recipe.py --compare "$out/recipe/gpt2" "$out/recipe/modern" --out "$out/recipe/recipe.json" \
        2>&1 | tail -12 ;;
    recipe_ablate)  # each option of the modern recipe undone alone (scripts/bench_recipe.py --ablate): the options in
      # RECIPE_ABLATE (default every one), one lr each (RECIPE_MODERN_LRS, default 0.02; the optimizer row AdamW at
      # RECIPE_GPT2_LRS, default 6e-4), RECIPE_MODERN_TOKENS per run (default 19660800: 600 steps of 32 x 1024, evaluated every 100), against
      # the modern recipe's run in OUT/ablate/modern (made first, at the same budget and lr, where there is none);
      # stopped at the target of the GPT-2 runs in OUT/ablate/gpt2 where there are some (RECIPE_TOKENS their budget),
      # else each runs its budget. The calls share OUT/ablate: name the options not run yet; each call reports all
      work=/tmp/bench-recipe-ablate; rm -rf $work; mkdir -p $work "$out/ablate"
      timeout 300 python3 scripts/prepare_data.py data=packages model.vocab_size=null 2>&1 | tail -1
      cp -r "$out/ablate/." $work/
      budget=(--tokens ${RECIPE_TOKENS:-196608000} --modern-tokens ${RECIPE_MODERN_TOKENS:-19660800}
              --gpt2-lrs ${RECIPE_GPT2_LRS:-6e-4} --modern-lrs ${RECIPE_MODERN_LRS:-0.02} --eval-every 100)
      [ -d $work/modern ] || timeout 590 python3 scripts/bench_recipe.py --work $work --recipes modern "${budget[@]}" \
        2>&1 | tail -2
      timeout 590 python3 scripts/bench_recipe.py --work $work --ablate ${RECIPE_ABLATE:-} \
        "${budget[@]}" --out "$out/ablate/ablate.json" 2>&1 | tail -14
      rm -rf $work/*/*/checkpoints $work/ablate/*/*/checkpoints
      cp -r $work/. "$out/ablate/" ;;
  esac
done
