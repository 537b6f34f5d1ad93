#!/usr/bin/env bash
# A Slurm cluster of this one machine: munged, slurmctld and one slurmd, all state under one dir.
#
#   scripts/slurm_cluster.sh start    # installs slurm-wlm + munge (apt, as root) if missing, starts
#   scripts/slurm_cluster.sh status   # exit 0 when the node takes jobs
#   scripts/slurm_cluster.sh stop     # cancels the jobs, stops the daemons, removes the state dir
#
# Clients (sbatch, squeue, scancel, and Monarch's SlurmJob through them) find the cluster through
# SLURM_CONF; `start` prints the line to export. Each command is idempotent. The node is this host
# as `slurmd -C` sees it (its cores and memory), in one partition named "local".
# Every file of the cluster (config, munge key and socket, pid files, logs, spool and state) lives in
# its state dir, and `stop` stops only the daemons of that dir (named by its pid files, their command
# lines naming the dir), so clusters of distinct dirs and ports run side by side on one machine.
# RLACTORS_SLURM_DIR sets the state dir (default /tmp/rlactors-slurm), RLACTORS_SLURM_CTLD_PORT and
# RLACTORS_SLURM_D_PORT the ports of slurmctld and slurmd (default 6817 and 6818). Exit status 3:
# this machine cannot have the cluster (Slurm is missing and cannot be installed: no root, or no
# apt-get).
set -euo pipefail

DIR="${RLACTORS_SLURM_DIR:-/tmp/rlactors-slurm}"
CTLD_PORT="${RLACTORS_SLURM_CTLD_PORT:-6817}"
D_PORT="${RLACTORS_SLURM_D_PORT:-6818}"
CONF="$DIR/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket"
export SLURM_CONF="$CONF"

say() { echo "slurm_cluster: $*" >&2; }
die() { say "$*"; exit 1; }
cannot() { say "$*"; exit 3; }  # this machine cannot have the cluster (the tests skip)

# Process $1 runs and is a daemon of this dir (its command line names a file here), not a process
# (another cluster's daemon, say) that took the pid of one that died.
ours() { tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline" | grep -qF -- "$DIR/"; }
pid_alive() { [[ -s "$1" ]] && ours "$(cat "$1")"; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    [[ $EUID -eq 0 ]] || cannot "slurm-wlm and munge are not installed, and installing them needs root"
    command -v apt-get >/dev/null || cannot "slurm-wlm and munge are not installed, and there is no apt-get"
    say "installing slurm-wlm and munge (apt-get)"
    apt-get update -q >/dev/null || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
        || die "apt-get install slurm-wlm munge failed"
}

write_conf() {
    local node host
    node="$(slurmd -C | head -1)"  # NodeName=<host> CPUs=.. Boards=.. ... RealMemory=..
    host="${node#NodeName=}"
    host="${host%% *}"
    cat >"$CONF" <<EOF
ClusterName=rlactors
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$D_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
InactiveLimit=0
KillWait=5
MinJobAge=30
SlurmdTimeout=60
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
}

node_ready() {
    # The node takes jobs: idle, mixed or allocated (not down, drained or unknown).
    local state
    state="$(sinfo --noheader --format=%T 2>/dev/null | head -1)" || return 1
    [[ "$state" =~ ^(idle|mixed|allocated|completing) ]]
}

status() {
    pid_alive "$DIR/munged.pid" && pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid" && node_ready
}

stop_daemon() {
    local pidfile="$DIR/$1.pid" pid
    pid_alive "$pidfile" || return 0
    pid="$(cat "$pidfile")"
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do ours "$pid" || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

stop() {
    local jobs
    if pid_alive "$DIR/slurmctld.pid"; then
        # slurmstepd outlives slurmd by design: end the jobs (their steps and processes) first.
        jobs="$(squeue --noheader --format=%i 2>/dev/null | paste -sd' ' -)"
        [[ -z "$jobs" ]] || scancel $jobs || true
        for _ in $(seq 150); do
            [[ -z "$(squeue --noheader --format=%i 2>/dev/null)" ]] && break
            sleep 0.2
        done
    fi
    stop_daemon slurmd
    stop_daemon slurmctld
    stop_daemon munged
    rm -rf "$DIR"
}

start() {
    [[ $EUID -eq 0 ]] || cannot "a Slurm node runs its daemons as root"
    if status; then
        say "running ($CONF)"
        echo "export SLURM_CONF=$CONF"
        return
    fi
    stop  # whatever half of a cluster an earlier start left
    install_packages
    mkdir -p "$DIR"/{munge,state,spool,log}
    head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
    chmod 400 "$DIR/munge/munge.key"
    munged --force --key-file="$DIR/munge/munge.key" --socket="$MUNGE_SOCKET" --pid-file="$DIR/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
        || die "munged did not start (see $DIR/log/munged.log)"
    write_conf
    slurmctld -f "$CONF" || die "slurmctld did not start (see $DIR/log/slurmctld.log)"
    slurmd -f "$CONF" || die "slurmd did not start (see $DIR/log/slurmd.log)"
    for _ in $(seq 150); do
        if node_ready; then
            say "started ($CONF)"
            echo "export SLURM_CONF=$CONF"
            return
        fi
        sleep 0.2
    done
    die "the node did not come up within 30 s (see $DIR/log)"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) if status; then say "running ($CONF)"; else say "not running"; exit 1; fi ;;
    *) die "usage: $0 start|stop|status" ;;
esac
