#!/usr/bin/env bash
# A CPU dry run of torchtitan_gpu.sh: the same script, its three losses, on torchtitan's debug
# Llama (tests/torchtitan_cpu.py's ``debugmodel``: SDPA attention, fp32 parameters) with seq 64,
# a 2048-word tokenizer and gloo, as torch 2.11 would take it through torchtitan: without the torch
# >= 2.12 names (cpu_dryrun/sitecustomize.py takes them away) and with torch211_compat.py standing
# in. Checks that the runs start, finish and log the same step-1 loss (no speed or memory meaning).
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
export TITAN_CONFIG="--module tests.torchtitan_cpu --config debugmodel" SEQ_LEN=64 VOCAB=2048
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
