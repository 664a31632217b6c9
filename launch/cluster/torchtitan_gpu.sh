#!/usr/bin/env bash
# torchtitan 0.3's trainer on one GPU: its llama3_8b config (seq 8192, batch 1, bf16 FSDP mixed
# precision, selective activation checkpointing) cut to LAYERS layers, seed 42, deterministic, once
# per loss -- torchtitan's ChunkedLossWrapper (the config's own), its plain CrossEntropyLoss, and
# vparallel_ce's fused VParallelLinearCrossEntropyLoss -- then a JSON-lines summary (peak reserved
# memory and median tokens/s side by side).
#
#   launch/cluster/torchtitan_gpu.sh OUTDIR [STEPS] [LAYERS] [SECONDS_PER_RUN]
#
# Needs torchtitan 0.3.0 and vparallel_ce importable; writes OUTDIR/<loss>.log and OUTDIR/results.jsonl.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="$1"; steps="${2:-20}"; layers="${3:-12}"; limit="${4:-600}"
python="${PYTHON:-python3}"
mkdir -p "$dest"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$python" "$here/torchtitan_assets.py" "$dest/assets" --vocab 32000 --docs 1500 --words 200 400 || exit 1
runs=()
for loss in chunked plain fused; do
  timeout -k 10 "$limit" "$python" -m torch.distributed.run --nproc-per-node 1 --master-port 29611 \
    "$here/torchtitan_bench.py" --layers "$layers" --loss "$loss" -- \
    --module llama3 --config llama3_8b --hf_assets_path "$dest/assets/tokenizer" \
    --dataloader.dataset c4_test --dataloader.dataset_path "$dest/assets/data" \
    --training.local_batch_size 1 --training.seq_len 8192 --training.steps "$steps" \
    --debug.seed 42 --debug.deterministic --validator.no-enable --checkpoint.no-enable \
    --profiler.no-enable-profiling --metrics.no-enable-tensorboard \
    --metrics.log_freq 1 --metrics.disable_color_printing --dump_folder "$dest/$loss" \
    > "$dest/$loss.log" 2>&1
  echo "$loss: exit $?, $(grep -c 'step:' "$dest/$loss.log") step lines"
  runs+=("$loss=$dest/$loss.log")
done
"$python" "$here/torchtitan_bench.py" --summarize "${runs[@]}" | tee "$dest/results.jsonl"
