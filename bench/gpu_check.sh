#!/usr/bin/env bash
# Planner vs allocator on one CUDA GPU: world-size-1 bf16 runs of gpt2_124m for every strategy,
# with and without activation checkpointing; the planner's predicted peak (python -m zerolab plan's
# arithmetic) beside torch.cuda.max_memory_allocated and the measured activation bytes. Appends a
# table to bench/RESULTS.md (bench/gpu_check.py writes it), then where the step goes on CUDA (profiled
# ddp and zero2 runs with traces: zerolab/profile/'s device path, checked and tabled by
# bench/step_profile.py check), then bench/sync_check.py's table (host synchronisation in unlogged
# steps). Aim: under 9 minutes on an H100/H200.
#
#   bench/gpu_check.sh [--micro-batch 8] [--seq 1024] [--steps 3] [--out bench/RESULTS.md] [--dry-run]
#
# --dry-run prints the commands without running anything (no GPU needed).
set -euo pipefail
cd "$(dirname "$0")/.."

MB=8 SEQ=1024 STEPS=3 OUT=bench/RESULTS.md DRY=0
PY=${PYTHON:-.venv/bin/python}
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --micro-batch) MB=${2:?--micro-batch needs a value}; shift 2 ;;
    --seq) SEQ=${2:?--seq needs a value}; shift 2 ;;
    --steps) STEPS=${2:?--steps needs a value}; shift 2 ;;
    --out) OUT=${2:?--out needs a path}; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
for v in "$MB" "$SEQ" "$STEPS"; do
  [[ "$v" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check.sh: '$v' is not a positive integer" >&2; exit 2; }
done
if [[ $DRY == 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check.sh: no CUDA GPU visible to torch; run it on a machine with one (or use --dry-run)" >&2
  exit 2
fi

ROOT="${TMPDIR:-/tmp}/zerolab-gpu-check.DRY-RUN"
[[ $DRY == 1 ]] || ROOT=$(mktemp -d "${TMPDIR:-/tmp}/zerolab-gpu-check.XXXXXX")
# label | overrides (deepspeed stages are one strategy with strategy.stage)
RUNS=("ddp|strategy=ddp" "zero1|strategy=zero1" "zero2|strategy=zero2" "fsdp|strategy=fsdp"
      "deepspeed-1|strategy=deepspeed strategy.stage=1" "deepspeed-2|strategy=deepspeed strategy.stage=2"
      "deepspeed-3|strategy=deepspeed strategy.stage=3")
if "$PY" -c "from zerolab.strategies import REGISTRY; import sys; sys.exit(0 if 'zero3' in REGISTRY else 1)" 2>/dev/null; then
  RUNS+=("zero3|strategy=zero3")
fi
DIRS=()
for run in "${RUNS[@]}"; do
  label=${run%%|*} overrides=${run#*|}
  for ck in none blocks; do
    dir="$ROOT/$label-$ck"
    # shellcheck disable=SC2086  # $overrides is a list of key=value words
    cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1 train.py $overrides
         model=gpt2_124m precision=bf16 data=synthetic "data.micro_batch=$MB" "model.block_size=$SEQ"
         "model.activation_checkpointing=$ck" "trainer.max_steps=$STEPS" trainer.eval_every=0
         trainer.eval_batches=1 dist.device=cuda run.save_model=false "run.dir=$dir"
         logging.wandb.mode=disabled logging.progress=false)
    if [[ $DRY == 1 ]]; then echo "${cmd[*]}"; continue; fi
    echo "== $label, checkpointing $ck" >&2
    "${cmd[@]}" > "$dir.log" 2>&1 || echo "   failed: see $dir.log" >&2
    DIRS+=("$label|$ck|$dir")
  done
done
# Then: where the step goes on CUDA (zerolab/profile/): steps 3 and 4 profiled, with a trace, under
# ddp and zero2 (one rank: NCCL's collectives still run); the parts must add up to each step.
PROFILED=()
for s in ddp zero2; do
  dir="$ROOT/profile-$s"
  cmd=("$PY" -m torch.distributed.run --standalone --nproc_per_node=1 train.py "strategy=$s" model=gpt2_124m
       precision=bf16 data=synthetic "data.micro_batch=$MB" "model.block_size=$SEQ" trainer.max_steps=4
       trainer.eval_every=0 trainer.eval_batches=1 "profile.steps=[3,4]" profile.trace=true dist.device=cuda
       run.save_model=false "run.dir=$dir" logging.wandb.mode=disabled logging.progress=false)
  if [[ $DRY == 1 ]]; then echo "${cmd[*]}"; continue; fi
  echo "== $s, profiled" >&2
  "${cmd[@]}" > "$dir.log" 2>&1 && PROFILED+=("$dir") || echo "   failed: see $dir.log" >&2
done
# Then: does a step that is not logged synchronise the host with the device (one rank, seconds).
SYNC=("$PY" bench/sync_check.py --device cuda --out "$OUT")
if [[ $DRY == 1 ]]; then echo "${SYNC[*]}"; exit 0; fi
"$PY" bench/gpu_check.py --micro-batch "$MB" --seq "$SEQ" --out "$OUT" "${DIRS[@]}"
if [[ ${#PROFILED[@]} -gt 0 ]]; then
  "$PY" bench/step_profile.py check --out "$OUT" "${PROFILED[@]}" || echo "   profile check failed" >&2
fi
"${SYNC[@]}" || echo "   sync check failed" >&2
