#!/usr/bin/env bash
# Stops what tools/slurm/start.sh started in FOLDER: cancels every job (and waits for their processes to go),
# then stops the two slurmd's, slurmctld and munged by the process ids in their pid files, and removes FOLDER.
#
#   tools/slurm/stop.sh "$MESHWISE_SLURM_DIR"
set -uo pipefail
dir="${1:-${MESHWISE_SLURM_DIR:-}}"
if [ -z "$dir" ] || [ ! -f "$dir/slurm.conf" ]; then
    echo "usage: tools/slurm/stop.sh FOLDER   (the folder tools/slurm/start.sh printed)" >&2
    exit 2
fi
export SLURM_CONF="$dir/slurm.conf"
scancel --full --signal=KILL $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
for _ in $(seq 1 20); do
    [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
    sleep 0.5
done

stop_pid() { # stop_pid PIDFILE: TERM, then KILL after 5 s
    local file=$1 pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
}
for file in "$dir"/slurmd-*.pid "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
    stop_pid "$file"
done
rm -rf "$dir"
if ! pgrep -x slurmd >/dev/null; then  # the last test cluster on this host: its host names go too
    hosts=$(grep -v '# tools/slurm/start.sh$' /etc/hosts) && printf '%s\n' "$hosts" >/etc/hosts  # in place: a bind mount
fi
echo "tools/slurm/stop.sh: stopped and removed $dir" >&2
