#!/usr/bin/env bash
# A throw-away one-node Slurm cluster on this host, for tests and CI.
#
#   eval "$(scripts/slurm_ci.sh start)"  # install if needed, start, print `export SLURM_CONF=...`
#   scripts/slurm_ci.sh stop [DIR]       # DIR: the state directory (default: from $SLURM_CONF)
#
# `start` installs Debian's slurmctld, slurmd, slurm-client and munge with
# apt-get when they are missing (apt-get update first), writes a one-node
# configuration in a fresh temp directory (root, loopback, free ports, its own
# munge key and socket, so it does not disturb another Slurm on this host),
# starts munged, slurmctld and slurmd, and waits until `sinfo` shows the node
# idle. Only `export` lines go to stdout; progress goes to stderr.
# `stop` cancels the cluster's jobs, kills the three daemons by their pid
# files and removes the directory.
#
# The node advertises max(nproc, 8) CPUs (SlurmdParameters=config_overrides),
# so a 2x2 mesh packed on the one node (-N1 -n4) fits on a 2-core machine.
#
# Exit status: 0 ok; 1 the cluster did not come up; 2 not root; 3 apt-get is
# unavailable or could not install the packages (callers may skip Slurm tests).
set -euo pipefail

die() { echo "slurm_ci: $*" >&2; exit "${2:-1}"; }
say() { echo "slurm_ci: $*" >&2; }

install_packages() {
    local missing=0
    for b in slurmctld slurmd sbatch munged; do
        command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing=1
    done
    [ "$missing" = 0 ] && return 0
    command -v apt-get >/dev/null 2>&1 || die "apt-get is not available; cannot install Slurm" 3
    say "installing slurmctld slurmd slurm-client munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >&2 || die "apt-get update failed" 3
    apt-get install -y -q --no-install-recommends \
        slurmctld slurmd slurm-client munge >&2 \
        || die "apt-get install of the Slurm packages failed" 3
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

pid_of() { [ -s "$1" ] && cat "$1" || true; }

kill_pidfile() {  # kill_pidfile FILE NAME: TERM, wait up to 10 s, then KILL
    local pid
    pid=$(pid_of "$1")
    [ -n "$pid" ] || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    say "$2 (pid $pid) did not exit on TERM; killing it"
    kill -KILL "$pid" 2>/dev/null || true
}

start() {
    [ "$(id -u)" = 0 ] || die "must run as root (the one-node cluster runs its daemons as root)" 2
    install_packages
    export PATH="$PATH:/usr/sbin:/sbin"
    local dir host cpus mem p1 p2
    dir=$(mktemp -d /tmp/monarch-slurm.XXXXXX)
    touch "$dir/.monarch-slurm"
    mkdir -p "$dir/state" "$dir/spool"
    host=$(hostname -s)
    cpus=$(nproc); [ "$cpus" -ge 8 ] || cpus=8
    mem=$(awk '/MemTotal/ {print int($2 / 1024 / 2)}' /proc/meminfo)
    p1=$(free_port); p2=$(free_port)
    while [ "$p2" = "$p1" ]; do p2=$(free_port); done

    # munge: our own key, socket and pid file
    dd if=/dev/urandom of="$dir/munge.key" bs=1024 count=1 status=none
    chmod 0600 "$dir/munge.key"
    munged --force --key-file="$dir/munge.key" --socket="$dir/munge.socket" \
        --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" \
        --seed-file="$dir/munged.seed" 2>>"$dir/munged.log" \
        || { cat "$dir/munged.log" >&2; rm -rf "$dir"; die "munged did not start"; }

    cat >"$dir/slurm.conf" <<EOF
# one-node test cluster written by scripts/slurm_ci.sh
ClusterName=monarchci
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CryptoType=crypto/munge
SlurmctldPort=$p1
SlurmdPort=$p2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
KillWait=5
InactiveLimit=0
MailProg=/bin/true
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
EOF
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -f "$SLURM_CONF" || { stop_dir "$dir"; die "slurmctld did not start"; }
    slurmd -f "$SLURM_CONF" || { stop_dir "$dir"; die "slurmd did not start"; }
    local state=""
    for _ in $(seq 300); do
        state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
        [ "$state" = idle ] && break
        sleep 0.2
    done
    if [ "$state" != idle ]; then
        say "the node did not become idle (state: '${state:-unknown}'); logs:"
        tail -n 20 "$dir"/slurmctld.log "$dir"/slurmd.log >&2 || true
        stop_dir "$dir"
        die "Slurm did not come up"
    fi
    say "one-node Slurm is up in $dir (node $host, $cpus CPUs, ports $p1/$p2)"
    echo "export SLURM_CONF=$dir/slurm.conf"
    echo "export MONARCH_SLURM_DIR=$dir"
}

stop_dir() {
    local dir=$1
    [ -f "$dir/.monarch-slurm" ] || die "$dir is not a directory made by slurm_ci.sh start"
    export PATH="$PATH:/usr/sbin:/sbin"
    if [ -s "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
        # cancel every job of this cluster, so no slurmstepd outlives slurmd
        SLURM_CONF="$dir/slurm.conf" scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 100); do
            [ -z "$(SLURM_CONF="$dir/slurm.conf" squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    kill_pidfile "$dir/slurmd.pid" slurmd
    kill_pidfile "$dir/slurmctld.pid" slurmctld
    kill_pidfile "$dir/munged.pid" munged
    rm -rf "$dir"
}

case "${1:-}" in
    start) start ;;
    stop)
        dir=${2:-${MONARCH_SLURM_DIR:-}}
        if [ -z "$dir" ] && [ -n "${SLURM_CONF:-}" ]; then dir=$(dirname "$SLURM_CONF"); fi
        [ -n "$dir" ] || die "stop: give the directory, or set SLURM_CONF / MONARCH_SLURM_DIR"
        [ -d "$dir" ] || { say "$dir is already gone"; exit 0; }
        stop_dir "$dir"
        say "stopped the Slurm of $dir"
        ;;
    *) echo "usage: $0 start|stop [DIR]" >&2; exit 64 ;;
esac
