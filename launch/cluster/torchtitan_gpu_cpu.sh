#!/usr/bin/env bash
# A CPU dry run of torchtitan_gpu.sh: the same script, its three losses, on torchtitan's debug
# Llama (tests/torchtitan_cpu.py's ``debugmodel``: SDPA attention; here with the GPU config's bf16
# FSDP mixed precision, whose gradient dtypes FSDP's groups must keep uniform) with seq 64,
# a 2048-word tokenizer and gloo, as torch 2.11 would take it through torchtitan: without the torch
# >= 2.12 names (cpu_dryrun/sitecustomize.py takes them away) and with torch211_compat.py standing
# in. Checks that the runs start, finish and log the same step-1 loss (no speed or memory meaning),
# then that torchtitan's flex-attention mask (the GPU config's attention; its backward does not run
# on CPU) is built through the create_block_mask stand-in as torch builds it by default.
#
#   launch/cluster/torchtitan_gpu_cpu.sh OUTDIR [STEPS] [LAYERS]
#
# Run from the repository root with torchtitan 0.3.0 installed; a few minutes on 2 cores.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
dest="$1"; steps="${2:-3}"; layers="${3:-2}"
export PYTHONPATH="$here/cpu_dryrun:$root${PYTHONPATH:+:$PYTHONPATH}"
export VPCE_TITAN_CPU=1 VPCE_WITHOUT_TORCH212_NAMES=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TITAN_CONFIG="--module tests.torchtitan_cpu --config debugmodel --training.mixed_precision_param bfloat16"
export SEQ_LEN=64 VOCAB=2048
export PORT="${PORT:-29631}"
"$here/torchtitan_gpu.sh" "$dest" "$steps" "$layers" 300 || exit 1
"${PYTHON:-python3}" - "$dest/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
losses = {r["run"]: r["step1_loss"] for r in rows}
assert all(r["steps"] > 0 for r in rows), rows
spread = max(losses.values()) - min(losses.values())
print(f"step-1 losses {losses}, spread {spread:.2e}")
sys.exit(0 if spread <= 1e-4 else 1)
PY
[ $? = 0 ] || exit 1
"${PYTHON:-python3}" - "$here" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import torch211_compat

print("stand-ins:", torch211_compat.apply())
import torch
from torch.nn.attention import flex_attention
from torchtitan.models.common.attention import FlexAttention, get_causal_mask_mod
from torchtitan.models.common.decoder import Decoder


class Attention:  # what _create_flex_attention_mask reads of an attention config
    inner_attention = FlexAttention.Config()


got = Decoder._create_flex_attention_mask(None, torch.arange(512)[None], Attention, [get_causal_mask_mod()])
want = flex_attention.create_block_mask(get_causal_mask_mod(), 1, None, 512, 512, device="cpu")
fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
same = all(torch.equal(getattr(got, f), getattr(want, f)) for f in fields)
print(f"torchtitan's flex mask through the stand-in: {'same as' if same else 'NOT'} torch's")
sys.exit(0 if same else 1)
PY
