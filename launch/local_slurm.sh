#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests and for trying the Slurm path on a laptop.
#
#   sudo launch/local_slurm.sh up       # munged + slurmctld + slurmd, partition `debug`
#   eval "$(launch/local_slurm.sh env)" # SLURM_CONF for sbatch/srun/squeue in this shell
#   sbatch --wait launch/slurm.sbatch trainer.max_steps=5
#   sudo launch/local_slurm.sh down     # stops what `up` started, removes its state dir
#   launch/local_slurm.sh status
#
# Needs Debian's slurm-wlm and munge (`apt-get install slurm-wlm munge`, Slurm 22.05) and root
# (slurmd starts job steps as the submitting user). Everything `up` creates lives in one state
# dir ($ZEROLAB_SLURM_DIR, default /tmp/zerolab-slurm): config, munge socket, spool, logs and the
# pids of the daemons it started; `down` stops exactly those pids. A munged or Slurm that was
# already running on the machine is left alone: this cluster uses its own munge socket and its
# own ports ($ZEROLAB_SLURM_PORT and the next one, default 16817/16818).
#
# Settings that make Slurm 22.05 run in a container without systemd or cgroups (docs/launch.md, "Trying Slurm on one machine"):
# proctrack/linuxproc, task/none, select/cons_tres, no cgroup.conf, the node's real CPU count and
# a RealMemory below the machine's.
set -euo pipefail

STATE=${ZEROLAB_SLURM_DIR:-/tmp/zerolab-slurm}
PORT=${ZEROLAB_SLURM_PORT:-16817}
CONF=$STATE/slurm.conf
MUNGE_DIR=$STATE/munge
SOCKET=$MUNGE_DIR/munge.socket
PIDS=$STATE/pids          # "<name> <pid>" per line, only for daemons this script started
NODE=$(hostname -s)
TRIES=${ZEROLAB_SLURM_WAIT_TRIES:-300}   # bounded polls of 0.1 s (30 s) for each daemon

die() { echo "local_slurm.sh: $*" >&2; exit 1; }
alive() { [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; }
pid_of() { [[ -f $PIDS ]] && awk -v n="$1" '$1 == n {print $2}' "$PIDS" || true; }

# Poll a command until it succeeds, at most TRIES times; never a fixed sleep.
wait_for() {
    local what=$1; shift
    for ((i = 0; i < TRIES; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    echo "local_slurm.sh: timed out waiting for $what; logs in $STATE/log:" >&2
    tail -n 20 "$STATE"/log/*.log >&2 2>/dev/null || true
    return 1
}

ctl_up() { SLURM_CONF=$CONF scontrol ping 2>/dev/null | grep -q "is UP"; }
node_ready() {
    local s
    s=$(SLURM_CONF=$CONF sinfo -h -n "$NODE" -o %t 2>/dev/null | head -n1)
    [[ $s == idle || $s == mix || $s == alloc ]]
}
no_jobs() { [[ -z $(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null) ]]; }
munge_ok() { munge -n -S "$SOCKET" | unmunge -S "$SOCKET"; }

healthy() {
    [[ -f $PIDS ]] || return 1
    local name
    for name in munged slurmctld slurmd; do alive "$(pid_of $name)" || return 1; done
    ctl_up && node_ready
}

write_conf() {
    local cpus mem_mb
    cpus=$(nproc --all)
    # RealMemory must not exceed what slurmd measures, or the node is drained: keep 10 % spare.
    mem_mb=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
    cat >"$CONF" <<EOF
# Written by launch/local_slurm.sh; removed by 'local_slurm.sh down'.
ClusterName=zerolab
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a job step's credential lifetime, which also sets how long a requeued job waits
# before it may start again (slurm.conf(5); default 120 s). 30 s: a requeue-and-resume round trip
# on this one-node cluster takes half a minute instead of two.
AuthInfo=socket=$SOCKET,cred_expire=30
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
# sbatch --wait polls every 2 s only while its poll interval stays below MinJobAge/2 (it grows
# 2, 8, 32 s otherwise); job records are kept 4 s after the end.
MinJobAge=4
KillWait=10
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {  # start <name> <command...>: run a daemon in the foreground of its own session
    local name=$1; shift
    # SLURM_CONF in the environment also marks this cluster's slurmstepd processes (see down).
    SLURM_CONF=$CONF setsid "$@" </dev/null >>"$STATE/log/$name.out" 2>&1 &
    echo "$name $!" >>"$PIDS"
}

up() {
    [[ $EUID -eq 0 ]] || die "must run as root (slurmd launches jobs as the submitting user); try: sudo $0 up"
    local cmd
    for cmd in munged munge unmunge slurmctld slurmd scontrol sinfo sbatch setpriv; do
        command -v $cmd >/dev/null || die "'$cmd' not found; install Debian's packages: apt-get install slurm-wlm munge"
    done
    if healthy; then echo "local slurm: already up ($CONF)"; return 0; fi
    [[ -f $PIDS ]] && down quiet   # a half-started cluster from an earlier run: start over

    # The munge user must be able to reach its socket dir inside: 0755 whatever the umask.
    [[ -d $STATE ]] || install -d -m 0755 "$STATE"
    mkdir -p "$STATE"/{ctld,spool,log}
    touch "$STATE/.zerolab-local-slurm"   # marks the dir as ours, so `down` may delete it
    : >"$PIDS"

    # munged, as the munge user, on a private socket; munged insists on a socket dir that only
    # its owner can write to.
    install -d -m 0755 -o munge -g munge "$MUNGE_DIR"
    local key=/etc/munge/munge.key
    if [[ ! -r $key ]]; then
        key=$MUNGE_DIR/munge.key
        [[ -f $key ]] || mungekey --create --keyfile="$key"
        chown munge:munge "$key" && chmod 0600 "$key"
    fi
    start munged setpriv --reuid=munge --regid=munge --init-groups \
        munged -F --socket="$SOCKET" --key-file="$key" --pid-file="$MUNGE_DIR/munged.pid" \
        --seed-file="$MUNGE_DIR/munged.seed" --log-file="$MUNGE_DIR/munged.log"
    wait_for munged munge_ok

    write_conf
    start slurmctld slurmctld -D -i -f "$CONF"
    wait_for slurmctld ctl_up
    start slurmd slurmd -D -f "$CONF" -N "$NODE"
    wait_for "node $NODE to be idle" node_ready || {
        # A node left DOWN from a previous state is resumed once; then wait again.
        SLURM_CONF=$CONF scontrol update nodename="$NODE" state=resume 2>/dev/null || true
        wait_for "node $NODE to be idle" node_ready
    }
    echo "local slurm: up, partition debug on $NODE ($(nproc --all) CPUs); SLURM_CONF=$CONF"
}

down() {
    [[ -f $PIDS ]] || { [[ ${1:-} == quiet ]] || echo "local slurm: not running (no $PIDS)"; return 0; }
    # Cancel this cluster's jobs first and let them end while slurmd can still clean up.
    if alive "$(pid_of slurmctld)"; then
        SLURM_CONF=$CONF scancel --full --partition=debug 2>/dev/null || true
        TRIES=100 wait_for "jobs to end" no_jobs 2>/dev/null || true
    fi
    local name pid
    for name in slurmd slurmctld munged; do   # reverse start order
        pid=$(pid_of $name)
        alive "$pid" || continue
        kill -TERM "$pid" 2>/dev/null || true
        TRIES=100 wait_for "$name to exit" bash -c "! kill -0 $pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
    done
    # Job steps outlive slurmd by design; stop any slurmstepd this cluster's slurmd started.
    for pid in $(pgrep -x slurmstepd 2>/dev/null || true); do
        if tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qx "SLURM_CONF=$CONF"; then
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    if [[ -f $STATE/.zerolab-local-slurm ]]; then rm -rf "$STATE"; else rm -f "$PIDS"; fi
    [[ ${1:-} == quiet ]] || echo "local slurm: down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) if healthy; then echo "up ($CONF)"; SLURM_CONF=$CONF sinfo; else echo "down"; exit 3; fi ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
