#!/usr/bin/env bash
# torchtitan 0.3's trainer on one GPU: its llama3_8b config (seq 8192, batch 1, bf16 FSDP mixed
# precision, selective activation checkpointing, flex attention) cut to LAYERS layers, seed 42,
# deterministic, once per loss -- torchtitan's ChunkedLossWrapper (the config's own), its plain
# CrossEntropyLoss, and vparallel_ce's fused VParallelLinearCrossEntropyLoss -- then a JSON-lines
# summary (step-1 loss, loss gap to the first run, peak reserved memory and median tokens/s, all
# read from torchtitan's own step lines).
#
#   launch/cluster/torchtitan_gpu.sh OUTDIR [STEPS] [LAYERS] [SECONDS_PER_RUN]
#
# Needs torchtitan 0.3.0 and vparallel_ce importable; writes OUTDIR/<loss>.log and OUTDIR/results.jsonl.
# Where torch lacks torch.distributed.fsdp.DataParallelMeshDims (torch < 2.12, e.g. 2.11), the runs
# apply launch/cluster/torch211_compat.py: stand-ins, for a one-GPU run, for it, for
# create_block_mask's separate_full_blocks and for FSDP's handling of the [norm, lm_head] group
# that ChunkedLossWrapper needs (each module sharded as its own group); TORCH211_COMPAT=1/0 forces
# it on/off.
# Every run passes --training.disable_cuda_graphs (all three eager, so their memory and speed
# compare like for like); CUDA_GRAPHS=1 keeps torchtitan 0.3's default capture instead.
# Other settings: LOSSES (default "chunked plain fused"; the first is the summary's reference),
# TITAN_CONFIG (default "--module llama3 --config llama3_8b"), SEQ_LEN (8192), VOCAB (32000: the
# generated tokenizer's size, at most the model's), PYTHON (python3), PORT (29611).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
dest="$1"; steps="${2:-20}"; layers="${3:-12}"; limit="${4:-600}"
python="${PYTHON:-python3}"
mkdir -p "$dest"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
compat="${TORCH211_COMPAT:-$("$python" -c 'import torch.distributed.fsdp as fsdp
print(int(not hasattr(fsdp, "DataParallelMeshDims")))')}" || exit 1
extra=()
[ "$compat" = 1 ] && extra+=(--torch211-compat)
graphs=(--training.disable_cuda_graphs)
[ "${CUDA_GRAPHS:-0}" = 1 ] && graphs=()
read -r -a config <<< "${TITAN_CONFIG:---module llama3 --config llama3_8b}"
"$python" "$here/torchtitan_assets.py" "$dest/assets" --vocab "${VOCAB:-32000}" --docs 1500 --words 200 400 || exit 1
runs=()
for loss in ${LOSSES:-chunked plain fused}; do
  start=$SECONDS
  timeout -k 10 "$limit" "$python" -m torch.distributed.run --nproc-per-node 1 --master-port "${PORT:-29611}" \
    "$here/torchtitan_bench.py" --layers "$layers" --loss "$loss" "${extra[@]}" -- \
    "${config[@]}" --hf_assets_path "$dest/assets/tokenizer" \
    --dataloader.dataset c4_test --dataloader.dataset_path "$dest/assets/data" \
    --training.local_batch_size 1 --training.seq_len "${SEQ_LEN:-8192}" --training.steps "$steps" "${graphs[@]}" \
    --debug.seed 42 --debug.deterministic --validator.no-enable --checkpoint.no-enable \
    --profiler.no-enable-profiling --metrics.no-enable-tensorboard \
    --metrics.log_freq 1 --metrics.disable_color_printing --dump_folder "$dest/$loss" \
    > "$dest/$loss.log" 2>&1
  echo "$loss: exit $?, $(grep -c 'step:' "$dest/$loss.log") step lines, $((SECONDS - start)) s"
  runs+=("$loss=$dest/$loss.log")
done
"$python" "$here/torchtitan_bench.py" --summarize "${runs[@]}" | tee "$dest/results.jsonl"
