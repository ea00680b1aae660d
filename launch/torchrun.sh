#!/usr/bin/env bash
# One machine, one process per GPU (or 2 on CPU): Hydra overrides pass straight through.
#
#   launch/torchrun.sh strategy=zero2 trainer.max_steps=100
#   NPROC=4 launch/torchrun.sh model=gpt_small
#
# Every rank's stdout/stderr is tee'd (torchrun --tee 3) to the console and to
# <run dir>/logs/rank<r>.{out,err}; <run dir>/status says completed, failed or preempted (stopped
# by SIGTERM/SIGUSR1 after a checkpoint; exit code 75) at the end.
# A stop (the rest of the step, the save, the exit) may take $ZEROLAB_STOP_S seconds (default 300)
# before torchrun SIGKILLs the ranks: its --shutdown-timeout, as in launch/slurm.sbatch (torchrun's
# own default, 30 s, is shorter than a large model's save). Set it to your scheduler's grace period.
# Python: $ZEROLAB_PYTHON, else the active virtualenv, else the repository's .venv, else python3.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n ${ZEROLAB_PYTHON:-} ]]; then PYTHON=$ZEROLAB_PYTHON
elif [[ -n ${VIRTUAL_ENV:-} ]]; then PYTHON=$VIRTUAL_ENV/bin/python
elif [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python
else PYTHON=python3; fi

STOP_S=${ZEROLAB_STOP_S:-300}
[[ $STOP_S =~ ^[0-9]+$ ]] || { echo "zerolab: ZEROLAB_STOP_S must be whole seconds, not '$STOP_S'" >&2; exit 2; }

if [[ -z ${NPROC:-} ]]; then
    NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    [[ $NPROC -gt 0 ]] || NPROC=2
fi

# Choose (and validate) the run directory once, so the logs can go into it.
RUN_DIR=$(WORLD_SIZE=$NPROC "$PYTHON" "$ROOT/launch/run_dir.py" "$@") || exit $?  # checked for NPROC ranks
LOGS=$RUN_DIR/logs
echo "zerolab: $NPROC ranks, run dir $RUN_DIR; a stop may take ${STOP_S} s (torchrun --shutdown-timeout=$STOP_S)"

# SIGTERM/SIGUSR1 to this script (kill, a scheduler) go to torchrun as SIGTERM, which forwards
# it to the ranks: they finish the step, save a checkpoint and exit (docs/checkpoints.md, Preemption).
rm -f "$RUN_DIR/preempted.json"
stop() { [[ -n ${pid:-} ]] && kill -TERM "$pid" 2>/dev/null; }
trap stop TERM USR1
"$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$NPROC" \
    --shutdown-timeout="$STOP_S" --log-dir "$LOGS/torchrun" --tee 3 \
    "$ROOT/train.py" "$@" "run.dir=$RUN_DIR" &
pid=$!
while true; do  # `wait` returns early when a trapped signal arrives; wait again for torchrun itself
    wait "$pid"; rc=$?
    kill -0 "$pid" 2>/dev/null || break
done

# torchrun nests its logs as <log dir>/<run id>/attempt_<n>/<local rank>/{stdout,stderr}.log;
# link them as rank<r>.out/.err (one node: local rank = rank).
for f in "$LOGS"/torchrun/*/attempt_*/*/std{out,err}.log; do
    [[ -f $f ]] || continue
    r=$(basename "$(dirname "$f")")
    ext=out; [[ $f == *stderr.log ]] && ext=err
    ln -sfn "${f#"$LOGS"/}" "$LOGS/rank$r.$ext"
done
# The ranks leave preempted.json when they stopped on a signal after saving a checkpoint.
if [[ $rc -eq 0 ]]; then status=completed
elif [[ -f $RUN_DIR/preempted.json ]]; then status=preempted; rc=75  # EX_TEMPFAIL: resume to continue
else status=failed; fi
echo "$status" >"$RUN_DIR/status"
exit $rc
