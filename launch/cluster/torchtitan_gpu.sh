#!/usr/bin/env bash
# torchtitan's trainer on one GPU: the Llama3-8B flavor cut to 12 layers, seq 8192, batch 1, bf16
# (torchtitan's AMP), selective (per-op) activation checkpointing, seed 42, deterministic, with
# torchtitan's llama3 spec and both vparallel specs; then a JSON-lines summary.
#
#   launch/cluster/torchtitan_gpu.sh OUTDIR [STEPS] [SECONDS_PER_RUN]
#
# Needs torchtitan 0.2.2 and vparallel_ce importable; writes OUTDIR/<spec>.log and OUTDIR/results.jsonl.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="$1"; steps="${2:-20}"; limit="${3:-170}"
python="${PYTHON:-python3}"
mkdir -p "$dest"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$python" "$here/torchtitan_assets.py" "$dest/assets" --vocab 32000 --docs 1500 --words 200 400 || exit 1
runs=()
for spec in llama3 llama3_vparallel llama3_vparallel_fused; do
  timeout -k 10 "$limit" "$python" -m torch.distributed.run --nproc-per-node 1 --master-port 29611 \
    "$here/torchtitan_bench.py" --flavor 8B --layers 12 -- \
    --experimental.custom_import vparallel_ce.integrations.torchtitan \
    --job.custom_config_module vparallel_ce.integrations.torchtitan \
    --model.name "$spec" --model.hf_assets_path "$dest/assets/tokenizer" \
    --training.dataset c4_test --training.dataset_path "$dest/assets/data" \
    --training.local_batch_size 1 --training.seq_len 8192 --training.steps "$steps" \
    --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op \
    --optimizer.lr 3e-4 --debug.seed 42 --debug.deterministic \
    --metrics.log_freq 1 --metrics.disable_color_printing --job.dump_folder "$dest/$spec" \
    > "$dest/$spec.log" 2>&1
  echo "$spec: exit $?, $(grep -c 'step:' "$dest/$spec.log") step lines"
  runs+=("$spec=$dest/$spec.log")
done
"$python" "$here/torchtitan_bench.py" --summarize "${runs[@]}" | tee "$dest/results.jsonl"
