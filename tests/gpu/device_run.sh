#!/usr/bin/env bash
# One call on a lent GPU machine (docs/gpu.md): install the carried wheels (.gpu-wheels/), then run the steps
# named, in order; what they write goes to $OUT. Steps: kernels sanitize engine e2e micro bench7b prefill2k
# bench70b profile timeline ab ncu l2hint. BENCH_ARGS adds options to the bench steps (e.g. --lm-head-int8); e2e
# needs .gpu-data/smollm2-8l.gguf (python -m tests.gpu.smollm2_slice 8 .gpu-data/smollm2-8l.gguf).
#   bash tests/gpu/device_run.sh kernels sanitize
set -uo pipefail
out=${OUT:-/tmp/out}; mkdir -p "$out"
eval "$(bash .gpu-wheels/install.sh | tail -n 1)"
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1 FLLAMA_CUDA_CACHE=/tmp/fllama-cuda
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
for step in "$@"; do
  case $step in
    kernels) timeout 420 python -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rf 2>&1 | tee "$out/pytest_gpu.log" | tail -n 60 ;;
    sanitize)
      for tool in memcheck racecheck synccheck; do
        FLLAMA_CUDA_SYNC=1 timeout 200 compute-sanitizer --tool $tool --print-limit 10 python -m tests.gpu.sanitize_smoke 2>&1 | tail -n 4
      done ;;
    engine) timeout 300 python -m pytest -m gpu tests/gpu/test_engine.py -q -p no:cacheprovider -rf 2>&1 | tail -n 40 ;;
    e2e)  # real SmolLM2 layers (a slice, see smollm2_slice.py): quantize on the CPU, run on the GPU
      src=.gpu-data/smollm2-8l.gguf
      python -m fllama_cli.main quantize $src --scheme int8 -o /tmp/s8 --device cpu --force -q
      python -m fllama_cli.main quantize $src --scheme awq --group-size 64 -o /tmp/sa --device cpu --force -q --samples 16 --seq-len 256
      sha256sum /tmp/s8/model.safetensors /tmp/sa/model.safetensors
      for ck in $src /tmp/s8 /tmp/sa; do
        python -m fllama_cli.main generate $ck -p "The capital of France is" -n 12 --temperature 0 --device cuda --json
        python -m fllama_cli.main eval $ck --data gutenberg:sherlock --seq-len 512 --max-tokens 4096 --device cuda --json
      done ;;
    micro) timeout 200 python -m kernels_cu.lab.microbench --json "$out/micro.json" 2>&1 | tail -n 45 ;;
    bench7b) timeout 420 python -m fllama_cli.main bench --model llama2-7b --random --scheme fp16,int8,awq \
        --batch 1,8,32 --prompt-len 512 --gen-len 128 --repeat 3 ${BENCH_ARGS:-} --markdown "$out/bench7b.md" 2>&1 | tail -n 30 ;;
    prefill2k) timeout 300 python -m fllama_cli.main bench --model llama2-7b --random --scheme fp16,int8,awq \
        --batch 1 --prompt-len 2048 --gen-len 32 --repeat 5 ${BENCH_ARGS:-} --markdown "$out/prefill2k.md" 2>&1 | tail -n 12 ;;
    bench70b) timeout 300 python -m fllama_cli.main bench --model llama2-70b --random --scheme awq --batch 1,8 \
        --prompt-len 512 --gen-len 64 --repeat 2 --baseline none ${BENCH_ARGS:-} --markdown "$out/bench70b.md" 2>&1 | tail -n 12 ;;
    profile) for sch in ${PROFILE_SCHEMES:-fp16 int8 awq}; do timeout 120 python -m kernels_cu.lab.profile_engine --scheme $sch --tokens ${PROFILE_TOKENS:-2048} --rows 14 2>&1 \
        | grep -E "^==|Name|cuda|Kernel|kernel|gemm|gemv|attn|Memcpy|elementwise|sm90|Self CUDA time total" | cut -c1-60,100-200 | head -n 40; done ;;
    timeline) for sch in ${PROFILE_SCHEMES:-fp16 int8 awq}; do  # each decode kernel's critical-path increment (kernels_cu/lab/timeline.py)
        timeout 120 python -m kernels_cu.lab.profile_engine --scheme $sch --tokens ${PROFILE_TOKENS:-512} --batch ${PROFILE_BATCH:-1} \
        --timeline 2>&1 | grep -v -i warn | head -n 40; done ;;
    ab)  # one engine per scheme, an EngineConfig or Tuning field on / off alternated (kernels_cu/lab/engine_ab.py)
      timeout 500 python -m kernels_cu.lab.engine_ab --switch ${AB_SWITCH:-fold_norms} --scheme ${AB_SCHEMES:-awq,fp16} \
        --batch ${AB_BATCH:-1,8} --rounds ${AB_ROUNDS:-2} 2>&1 | tail -n 12 ;;
    l2hint) timeout 300 python -m kernels_cu.lab.l2_hint --pdl 2>&1 | tail -n 20 ;;  # L2 policies of a weight stream
    ncu)  # Nsight Compute counters of each decode GEMV (kernels_cu/lab/gemv_probe.py), real clocks, L2 flushed per launch
      timeout 400 ncu --clock-control none --nvtx --nvtx-include "probe/" --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum" \
        python -m kernels_cu.lab.gemv_probe --ms ${PROBE_MS:-1} --only ${PROBE_ONLY:-awq,int8,fp16} > "$out/ncu.txt" 2>&1
      grep -E "^  [a-z_0-9]+gemv|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issued Ipc Active|No Eligible|Warp Cycles Per Issued|hmma|pipe_alu|pipe_fma|inst_executed.sum|stalled_(long_scoreboard|math_pipe_throttle|wait|short_scoreboard|barrier|mio_throttle|lg_throttle|not_selected|selected|dispatch_stall|no_instruction|tex_throttle)_" "$out/ncu.txt" \
        | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//; s/ +/ /g' | head -n 400 ;;
    *) echo "device_run.sh: unknown step $step" >&2 ;;
  esac
done
