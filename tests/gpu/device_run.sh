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
    kernels) timeout 300 python -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rf 2>&1 | tee "$out/pytest_gpu.log" | tail -n 60 ;;
    sanitize)
      FLLAMA_CUDA_SYNC=1 timeout 240 compute-sanitizer --tool memcheck --print-limit 5 python -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider -k "not large and not bench" 2>&1 | tail -n 8
      timeout 200 compute-sanitizer --tool racecheck --print-limit 5 python -m pytest -m gpu tests/gpu/test_sampling.py tests/gpu/test_attention.py tests/gpu/test_rmsnorm.py tests/gpu/test_int8_gemm.py tests/gpu/test_awq_gemm.py -q -x -p no:cacheprovider -k "not large" 2>&1 | tail -n 8 ;;
    micro) timeout 200 python -m kernels_cu.microbench --json "$out/micro.json" 2>&1 | tail -n 45 ;;
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
    *) ;;
  esac
done
