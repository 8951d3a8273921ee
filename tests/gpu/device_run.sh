#!/usr/bin/env bash
# One call on a lent GPU machine (see docs/gpu.md): install the carried wheels, then run what is asked.
#   bash tests/gpu/device_run.sh [kernels] [sanitize] [micro] [engine] [bench ARGS...]
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
    final) timeout 200 python -m pytest -m gpu tests/gpu/test_sampling.py tests/gpu/test_engine.py tests/gpu/test_awq_gemm.py tests/gpu/test_attention.py tests/gpu/test_build.py -q -p no:cacheprovider 2>&1 | tail -n 4
      timeout 150 compute-sanitizer --tool racecheck --print-limit 10 python -m tests.gpu.sanitize_smoke 2>&1 | tail -n 4 ;;
    pdl) timeout 200 python -m pytest -m gpu tests/gpu/test_pdl.py -q -p no:cacheprovider -rf -x 2>&1 | tail -n 30 ;;
    benchpdl)  # decode without programmatic dependent launch, then with each trigger point (common.cuh), no baseline
      for v in ${PDL_VARIANTS:-none 0 1 2 3 4}; do echo "== PDL trigger $v"
        if [ $v = none ]; then p=--no-pdl; else p=--pdl; fi
        FLLAMA_NVCC_FLAGS="-DFLLAMA_PDL_TRIGGER=${v/none/4}" timeout 200 python -m fllama_cli.main bench --model llama2-7b \
          --random --scheme fp16,int8,awq --batch 1,8,32 --prompt-len 512 --gen-len 128 --repeat 3 --baseline none $p \
          --markdown "$out/pdl_$v.md" > /dev/null 2>&1; grep -E "^\| (fp16|int8|awq)" "$out/pdl_$v.md" | cut -d"|" -f2,3,4,6,7
      done ;;
    awqtests) timeout 300 python -m pytest -m gpu tests/gpu/test_awq_gemv.py tests/gpu/test_engine.py -q -p no:cacheprovider -rf -x 2>&1 | tail -n 30 ;;
    wgmma) timeout 300 python -m pytest -m gpu tests/gpu/test_awq_wgmma.py tests/gpu/test_int8_wgmma.py tests/gpu/test_int8_gemm.py tests/gpu/test_awq_gemv.py \
        -q -p no:cacheprovider -rf -x 2>&1 | tail -n 30 ;;
    microprefill) timeout 200 python -m kernels_cu.microbench --only prefill,dequant --prefill-ms ${PREFILL_MS:-2048} 2>&1 | tail -n 30 ;;
    microawq) timeout 200 python -m kernels_cu.microbench --only awq --ms 1,8,16,32 2>&1 | tail -n 40 ;;
    microdq) timeout 100 python -m kernels_cu.microbench --only dequant 2>&1 | tail -n 10 ;;
    probeawq)  # the AWQ decode GEMVs with their math and loads-only (-DFLLAMA_AWQ_TIMING_NO_MATH): what the load pattern allows
      for f in -DFLLAMA_AWQ_TIMING_NO_MATH ""; do echo "== ${f:-with the math}"
        FLLAMA_NVCC_FLAGS="$f" timeout 100 python -m kernels_cu.microbench --only awq --ms 1 2>&1 | grep awq-gemv | head -n 4; done ;;
    microl2) timeout 100 python -m kernels_cu.microbench --only l2 2>&1 | tail -n 26 ;;  # decode GEMVs cold vs L2-resident
    prefillawq) timeout 200 python -m fllama_cli.main bench --model llama2-7b --random --scheme fp16,awq \
        --batch 1 --prompt-len 2048 --gen-len 32 --repeat 5 --baseline none 2>&1 | grep -E "fp16|awq" | tail -n 4 ;;
    benchawq) timeout 300 python -m fllama_cli.main bench --model llama2-7b --random --scheme awq \
        --batch 1,8,32 --prompt-len 512 --gen-len 128 --repeat 3 --baseline none 2>&1 | tail -n 12 ;;
    micro) timeout 200 python -m kernels_cu.microbench --json "$out/micro.json" 2>&1 | tail -n 45 ;;
    microq) timeout 150 python -m kernels_cu.microbench --only awq,int8 --ms 1,8,16 2>&1 | tail -n 30 ;;
    attnbench) timeout 120 python -m kernels_cu.attention_bench --batch 1,8,32 --ctx 576,2048 2>&1 | tail -n 20 ;;
    foldtests) timeout 400 python -m pytest -m gpu tests/gpu/test_norm_fold.py tests/gpu/test_fp16_gemv.py tests/gpu/test_awq_gemv.py \
        tests/gpu/test_embedding.py tests/gpu/test_engine.py -q -p no:cacheprovider -rf -x 2>&1 | tail -n 30 ;;
    ab)  # one engine per scheme, an EngineConfig switch on / off alternated (kernels_cu/engine_ab.py)
      timeout 500 python -m kernels_cu.engine_ab --switch ${AB_SWITCH:-fold_norms} --scheme ${AB_SCHEMES:-awq,fp16} \
        --batch ${AB_BATCH:-1,8} --rounds ${AB_ROUNDS:-2} 2>&1 | tail -n 12 ;;
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
    bench7b) timeout 420 python -m fllama_cli.main bench --model llama2-7b --random --scheme fp16,int8,awq \
        --batch 1,8,32 --prompt-len 512 --gen-len 128 --repeat 3 --markdown "$out/bench7b.md" 2>&1 | tail -n 30 ;;
    prefill2k) timeout 300 python -m fllama_cli.main bench --model llama2-7b --random --scheme fp16,int8,awq \
        --batch 1 --prompt-len 2048 --gen-len 32 --repeat 5 --markdown "$out/prefill2k.md" 2>&1 | tail -n 12 ;;
    bench70b) timeout 300 python -m fllama_cli.main bench --model llama2-70b --random --scheme awq --batch 1,8 \
        --prompt-len 512 --gen-len 64 --repeat 2 --baseline none --markdown "$out/bench70b.md" 2>&1 | tail -n 12 ;;
    profile) for sch in ${PROFILE_SCHEMES:-fp16 int8 awq}; do timeout 120 python -m kernels_cu.profile_engine --scheme $sch --tokens ${PROFILE_TOKENS:-2048} --rows 14 2>&1 \
        | grep -E "^==|Name|cuda|Kernel|kernel|gemm|gemv|attn|Memcpy|elementwise|sm90|Self CUDA time total" | cut -c1-60,100-200 | head -n 40; done ;;
    timeline) for sch in ${PROFILE_SCHEMES:-fp16 int8 awq}; do  # each decode kernel's critical-path increment (timeline.py)
        timeout 120 python -m kernels_cu.profile_engine --scheme $sch --tokens ${PROFILE_TOKENS:-512} --batch ${PROFILE_BATCH:-1} \
        --timeline 2>&1 | grep -v -i warn | head -n 40; done ;;
    ncu)  # Nsight Compute counters of each decode GEMV (kernels_cu/gemv_probe.py), real clocks, L2 flushed per launch
      timeout 400 ncu --clock-control none --nvtx --nvtx-include "probe/" --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum" \
        python -m kernels_cu.gemv_probe --ms ${PROBE_MS:-1} --only ${PROBE_ONLY:-awq,int8,fp16} > "$out/ncu.txt" 2>&1
      grep -E "^  [a-z_0-9]+gemv|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issued Ipc Active|No Eligible|Warp Cycles Per Issued|hmma|pipe_alu|pipe_fma|inst_executed.sum|stalled_(long_scoreboard|math_pipe_throttle|wait|short_scoreboard|barrier|mio_throttle|lg_throttle|not_selected|selected|dispatch_stall|no_instruction|tex_throttle)_" "$out/ncu.txt" \
        | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//; s/ +/ /g' | head -n 400 ;;
    ncusrc)  # per-SASS-instruction stall samples of the q|k|v-shaped GEMV (PROBE_ONLY scheme, M = 1)
      timeout 300 ncu --clock-control none --nvtx --nvtx-include "probe/" -c 1 --section SourceCounters --section WarpStateStats \
        --page source --print-source sass --csv python -m kernels_cu.gemv_probe --ms 1 --only ${PROBE_ONLY:-awq} > "$out/ncu_src.csv" 2>&1
      timeout 300 ncu --clock-control none --nvtx --nvtx-include "probe/" -c 1 --section SourceCounters \
        python -m kernels_cu.gemv_probe --ms 1 --only ${PROBE_ONLY:-awq} 2>&1 | grep -v "^==PROF" | tail -n 60 ;;
    *) ;;
  esac
done
