#!/usr/bin/env bash
# A single-host SLURM for tests (issue 43): munged, slurmctld and two slurmd's (nodes mwnode1 and mwnode2 on this one host,
# so that `srun -N 2` gets a two-node allocation with SLURM_NODEID 0 and 1), everything in one temporary folder.
#
#   eval "$(tools/slurm/start.sh)"        # installs slurm-wlm + munge with apt if needed, starts, prints exports
#   srun -n 4 hostname; sinfo
#   tools/slurm/stop.sh "$MESHWISE_SLURM_DIR"   # cancels every job, stops the daemons it started, removes it
#
# Needs root (slurmd starts jobs as their user) and, when SLURM is not installed, apt-get (Debian's SLURM 22.05).
# Exit code 77 with one line on stderr where it cannot run (not root, no apt-get), so callers can skip.
# No systemd and no cgroups: processes are tracked through /proc (proctrack/linuxproc), which finds the workers
# torchrun starts in sessions of their own. Each node declares NODE_CPUS CPUs whatever the host has (the config
# wins: SlurmdParameters=config_overrides), so 4 tasks fit on a 2-core host.
# Credentials live 10 s (AuthInfo cred_expire; SLURM's default 120 s), which is also how long a requeued job
# (scontrol requeue) waits before it may start again; the schedulers look at pending jobs every second (SLURM's
# defaults: 30 s and 60 s), so that it then starts at once.
# Settings (environment): MESHWISE_SLURM_DIR (the folder; default a new /tmp/meshwise-slurm.XXXXXX),
# MESHWISE_SLURM_PORT (slurmctld's port, slurmd's are the next two; default 16817), NODE_CPUS (default 4).
set -euo pipefail

say() { echo "tools/slurm/start.sh: $*" >&2; }
if [ "$(id -u)" -ne 0 ]; then
    say "cannot run: needs root (slurmd starts jobs as their user, munged and the daemons are started here)"
    exit 77
fi
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    if ! command -v apt-get >/dev/null; then
        say "cannot run: SLURM is not installed and there is no apt-get to install slurm-wlm and munge"
        exit 77
    fi
    say "installing slurm-wlm and munge with apt-get"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge; } \
        >/dev/null 2>&1; then
        say "cannot run: apt-get could not install slurm-wlm and munge (no package access?)"
        exit 77
    fi
fi

dir="${MESHWISE_SLURM_DIR:-$(mktemp -d /tmp/meshwise-slurm.XXXXXX)}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
port="${MESHWISE_SLURM_PORT:-16817}"
cpus="${NODE_CPUS:-4}"
host="$(hostname)"
mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
chmod 755 "$dir"

# munge: our own daemon on a socket in the folder, so that nothing of the host's is touched
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    chmod 400 /etc/munge/munge.key
fi
chown munge:munge "$dir/munge" 2>/dev/null || true
chmod 700 "$dir/munge"
munge_user=munge
id munge >/dev/null 2>&1 || munge_user=root
runuser -u "$munge_user" -- munged --force --socket="$dir/munge/munge.socket" --pid-file="$dir/munge/munged.pid" \
    --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"

cat >"$dir/slurm.conf" <<CONF
# written by tools/slurm/start.sh: a single-host test cluster, two slurmd's (mwnode1, mwnode2) on $host
ClusterName=meshwise
SlurmctldHost=$host
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=15
MinJobAge=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
NodeName=mwnode1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + 1)) CPUs=$cpus RealMemory=1000 State=UNKNOWN
NodeName=mwnode2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$((port + 2)) CPUs=$cpus RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=mwnode[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF
mkdir -p "$dir/spool/mwnode1" "$dir/spool/mwnode2"
# srun hands the tasks the node names (SLURM_STEP_NODELIST=mwnode[1-2]): they must resolve, to this host
grep -q "mwnode1 mwnode2" /etc/hosts || echo "127.0.0.1 mwnode1 mwnode2  # tools/slurm/start.sh" >>/etc/hosts

export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF" -i
for node in mwnode1 mwnode2; do
    slurmd -f "$SLURM_CONF" -N "$node"
done

# up when both nodes are idle (slurmd registers within a second or two)
for _ in $(seq 1 60); do
    if [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle')" -eq 2 ]; then
        cat >"$dir/env.sh" <<ENV
export SLURM_CONF=$dir/slurm.conf
export MESHWISE_SLURM_DIR=$dir
ENV
        cat "$dir/env.sh"
        say "SLURM up in $dir (nodes mwnode1, mwnode2 on $host; stop with tools/slurm/stop.sh $dir)"
        exit 0
    fi
    sleep 0.5
done
say "SLURM did not come up within 30 s; its logs:"
tail -n 20 "$dir"/slurmctld.log "$dir"/slurmd-*.log >&2 || true
"$(dirname "$0")/stop.sh" "$dir" || true
exit 1
