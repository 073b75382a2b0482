#!/usr/bin/env bash
# A real one-node Slurm cluster on this machine, for tests and trying the sbatch script.
#
#   bash scripts/slurm/local_cluster.sh install   # apt-get install slurm-wlm munge (if missing)
#   bash scripts/slurm/local_cluster.sh start     # munged + slurmctld + slurmd; waits for an idle node
#   bash scripts/slurm/local_cluster.sh status    # sinfo
#   bash scripts/slurm/local_cluster.sh stop      # stops slurmd, slurmctld and munged
#
# Needs root and Debian's slurm-wlm (22.05) with munge. Works without systemd: the daemons are
# started directly. Every command is idempotent: `start` on a running cluster only checks it.
# State, spool, logs and pid files live under $MAXFP4_SLURM_DIR (default /var/tmp/maxfp4-slurm);
# the config goes to /etc/slurm/slurm.conf, where every Slurm client looks for it.
set -euo pipefail

DIR="${MAXFP4_SLURM_DIR:-/var/tmp/maxfp4-slurm}"
CONF=/etc/slurm/slurm.conf
# Marks the config as ours, so `start` never overwrites a slurm.conf somebody else wrote.
MARK="# written by maxfp4 scripts/slurm/local_cluster.sh"
PARTITION=local
NODE="$(hostname -s)"

say() { echo "local_cluster: $*" >&2; }
die() { say "$*"; exit 1; }

need_root() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (sudo bash $0 $1)"
}

alive() {  # alive PIDFILE: the process named in PIDFILE runs
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install() {
    need_root install
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        say "slurm-wlm and munge already installed"
        return
    fi
    export DEBIAN_FRONTEND=noninteractive
    # The package lists of a fresh machine may be empty or stale.
    apt-get update -q
    apt-get install -y -q --no-install-recommends slurm-wlm munge
}

start_munge() {
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        # The Debian package normally creates the key. munged takes any 32 to 1024 random
        # bytes; dd needs no mungekey.
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    # munged refuses a key, socket or log directory that others can write or read.
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
    chmod 0700 /etc/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge
    chmod 0400 /etc/munge/munge.key
    if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        return
    fi
    # munged as the munge user, as its packaged service does; it forks into the background.
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
        sleep 0.1
    done
    die "munged did not start; see /var/log/munge/munged.log"
}

write_conf() {
    local hw cpus mem
    # The controller drains a node that reports fewer CPUs or less memory than configured, so
    # take slurmd's own count; leave a little memory to the daemons.
    hw="$(slurmd -C | head -n1)"
    cpus="$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")"
    mem="$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")"
    cpus="${cpus:-$(nproc --all)}"
    mem="${mem:-1024}"
    if [ "$mem" -gt 1024 ]; then
        mem=$((mem - 256))
    fi
    if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script; not touching it"
    fi
    mkdir -p "$(dirname "$CONF")" "$DIR/state" "$DIR/spool" "$DIR/log"
    cat >"$CONF" <<EOF
$MARK
ClusterName=maxfp4-local
# The loopback address, so the cluster works whatever the host name resolves to.
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# No cgroups: linuxproc tracks processes through /proc, task/none binds nothing. Containers
# and machines without systemd rarely give a writable cgroup tree.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
# Cores are the consumable resource; memory is not tracked, so small jobs can share the node.
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
# A node that was down (e.g. the machine restarted) comes back as soon as slurmd registers.
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
# Finished jobs stay visible to scontrol show job for 10 minutes (no accounting database).
MinJobAge=600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

node_state() {
    sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n1
}

start() {
    need_root start
    command -v slurmctld >/dev/null || die "Slurm is not installed: run 'bash $0 install' first"
    start_munge
    if alive "$DIR/slurmctld.pid" && alive "$DIR/slurmd.pid"; then
        say "slurmctld and slurmd already running"
    else
        write_conf
        # Without -c slurmctld recovers its saved state: job ids keep increasing across
        # restarts, so output files named after job ids are never overwritten.
        alive "$DIR/slurmctld.pid" || slurmctld
        for _ in $(seq 100); do
            scontrol ping 2>/dev/null | grep -q UP && break
            sleep 0.2
        done
        scontrol ping | grep -q UP || die "slurmctld did not come up; see $DIR/log/slurmctld.log"
        alive "$DIR/slurmd.pid" || slurmd
    fi
    local state=""
    for _ in $(seq 150); do
        state="$(node_state)"
        case "$state" in
            idle|mixed|allocated|completing) break ;;
            # Left down/drained by an earlier stop or a crash: the node is this machine, so
            # it is fine to bring it back.
            down*|drain*|fail*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.2
    done
    case "$state" in
        idle|mixed|allocated|completing) ;;
        *) die "node $NODE is '${state:-unknown}', not idle; see $DIR/log/slurmd.log and $DIR/log/slurmctld.log" ;;
    esac
    sinfo
}

stop() {
    need_root stop
    # Daemons go down in reverse order of start; each only if its pid file names a live process.
    local f pid
    for f in slurmd slurmctld; do
        if alive "$DIR/$f.pid"; then
            pid="$(cat "$DIR/$f.pid")"
            kill "$pid"
            for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
    done
    if [ -s /run/munge/munged.pid ] && kill -0 "$(cat /run/munge/munged.pid)" 2>/dev/null; then
        kill "$(cat /run/munge/munged.pid)"
    fi
    say "stopped"
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) sinfo ;;
    *) echo "usage: $0 install|start|status|stop" >&2; exit 2 ;;
esac
