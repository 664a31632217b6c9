#!/usr/bin/env bash
# One H200 session's checks, in one call (device tool): the CUDA tests (kernels, autocast, the
# RL ops), then the RL benchmark and a side-by-side slice of bench_loss, each bounded in time.
#   bash launch/gpu_checks.sh            # writes logs and jsonl under $OUT
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 240 python3 -m pytest -q -n 8 -x tests/test_kernels.py tests/test_autocast.py tests/test_logprobs.py \
  tests/test_linear.py tests/test_cross_entropy.py 2>&1 | tail -25 | tee "$OUT/pytest.log"
timeout 120 python3 launch/bench_rl.py --shapes 8192x4096x128256,8192x4096x16032 --out "$OUT/bench_rl.jsonl" 2>&1 \
  | tail -20 | tee "$OUT/bench_rl.log"
timeout 200 python3 launch/bench_loss.py --shapes llama3_8b,llama3_8b_tp8 \
  --methods compile,liger,gemm3,kernels,ours:token:1,ours:auto:auto --json "$OUT/bench_loss.jsonl" 2>&1 \
  | tail -24 | tee "$OUT/bench_loss.log"
