#!/usr/bin/env bash
# The GPU tests and the measurements of docs/benchmarks.md, by section name, on a machine with an NVIDIA GPU.
# Usage: scripts/gpu_suite.sh OUT_DIR [tests] [optimizer] [cross_entropy] [ce_rows] [ce_chunks] [gelu] [train]
#        [step] [step_ablate] [step15b] [step_sizes] [curve] [sweep] [defaults] [defaults15b] [plan] [attention]
#        [diverge15b] [compile15b] [compile_check] [fp8_tests] [fp8_15b] [fp8_sizes] [fp8_defaults15b] [fp8_quality]
# fp8_quality: QUALITY_MODEL (gpt2-124m), QUALITY_SEED (1337), QUALITY_PRECISIONS ("bf16 fp8") pick the runs; each run
#   goes to /tmp/fp8-quality/<model>/<precision>-s<seed> and the comparison reads every run there so far
# plan: PLAN_MODELS and PLAN_BATCHES (space-separated) pick the grid, default gpt2-124m at 16 64 512; it starts no
#   point after PLAN_TIME_LIMIT_S and goes on from the JSON files in PLAN_MEASURED
set -uo pipefail
out=${1:?output dir}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 WANDB_SILENT=true TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
for what in "$@"; do
  echo "=== $what ==="
  case $what in
    tests) MINITRAIN_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q tests/test_optim.py tests/test_amp.py \
             tests/test_cross_entropy.py tests/test_gelu.py tests/test_model.py 2>&1 | grep -E "^(E  |FAILED|[0-9]+ (passed|failed))" | tail -40
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
    fp8_tests)  # the fp8 tests on the GPU: compiled float8 kernels, a cuda trainer (the plan accepts an H200)
      TRITON_INTERPRET=0 timeout 400 python3 -m pytest -q tests/test_fp8.py 2>&1 | grep -E "^(E  |FAILED|[0-9]+ (passed|failed))" | tail -20 ;;
    fp8_15b)  # the target: fp8 >= 1.12x bf16 at gpt2-1.5b, both resident, each planned in 45% of the GPU
      timeout 590 python3 scripts/bench_fp8.py speed --models gpt2-1.5b --out "$out/bench_fp8_15b.json" 2>&1 | grep -E "^gpt2|Error" ;;
    fp8_sizes)
      timeout 590 python3 scripts/bench_fp8.py speed --models gpt2-774m gpt2-124m --out "$out/bench_fp8_sizes.json" 2>&1 | grep -E "^gpt2|Error" ;;
    fp8_defaults15b)  # what a user gets: the plan's own micro-batch and policy on the whole GPU, its memory line
      for p in fp8 bf16; do
        rm -rf /tmp/fp8-defaults-15b
        timeout 280 python3 scripts/train.py model=gpt2-1.5b precision=$p trainer.max_steps=8 trainer.log_every=4 \
          trainer.eval_every=1000 trainer.save_every=1000 trainer.sample_tokens=0 hydra.run.dir=/tmp/fp8-defaults-15b \
          2>&1 | grep -v "it/s\]\|step/s\]" | grep -aE "^(plan|  |step|memory|compile check|error)" | tail -16
        cp /tmp/fp8-defaults-15b/metrics.jsonl "$out/fp8_defaults_15b_$p.jsonl"
      done ;;
    fp8_quality)  # one model and seed, bf16 and fp8 on the built-in corpus, 1000 steps; GPT-3's peak lr for the size
      model=${QUALITY_MODEL:-gpt2-124m}; seed=${QUALITY_SEED:-1337}; q=/tmp/fp8-quality/$model
      case $model in gpt2-124m) lr=6e-4 ;; gpt2-350m) lr=3e-4 ;; *) lr=2.5e-4 ;; esac
      for p in ${QUALITY_PRECISIONS:-bf16 fp8}; do
        rm -rf $q/$p-s$seed
        timeout 560 python3 scripts/train.py model=$model precision=$p trainer.seed=$seed trainer.max_steps=1000 \
          trainer.lr=$lr trainer.min_lr=$(python3 -c "print($lr / 10)") trainer.eval_every=100 trainer.eval_batches=20 \
          trainer.log_every=50 trainer.save_every=1000 trainer.sample_tokens=0 hydra.run.dir=$q/$p-s$seed 2>&1 \
          | grep -aE "^(error|finished)"
        mkdir -p "$out/fp8_quality" && cp $q/$p-s$seed/metrics.jsonl "$out/fp8_quality/$model-$p-s$seed.jsonl"
      done
      python3 scripts/bench_fp8.py quality $q/* --out "$out/fp8_quality_$model.json" ;;
    gelu) timeout 60 python3 scripts/bench_gelu.py --out "$out/bench_gelu.json" 2>&1 | tail -6 ;;
    attention) timeout 120 python3 scripts/bench_attention.py --out "$out/bench_attention.json" 2>&1 | tail -24 ;;
    ce_rows) timeout 200 python3 scripts/tune_cross_entropy_rows.py --out "$out/tune_ce_rows.json" 2>&1 | tail -60 ;;
    ce_chunks) timeout 200 python3 scripts/bench_cross_entropy.py --shapes 16384x768x50304 16384x2048x128256 \
                 --chunk-mib 16 32 64 --out "$out/bench_ce_chunks.json" 2>&1 | tail -16 ;;
    sweep)  # the 12-cell precision x checkpointing sweep, one process per cell so each cell's peak memory is its own
      sw=/tmp/sweep-124m; rm -rf $sw; i=0
      for p in fp32 bf16 fp16; do for c in none full every_k selective; do
        timeout 120 python3 scripts/train.py model=gpt2-124m precision=$p checkpointing=$c trainer.batch_size=16 \
          trainer.max_steps=30 trainer.log_every=10 trainer.eval_every=1000 trainer.save_every=1000 \
          trainer.sample_tokens=0 trainer.warmup_steps=5 logger.group=sweep-124m hydra.run.dir=$sw/$i \
          2>&1 | grep -E "^(step|memory|= pred|measured|predicted)" | tail -3
        i=$((i+1)); done; done
      python3 scripts/report.py $sw --out $out/sweep 2>&1 | tail -20 ;;
  esac
done
