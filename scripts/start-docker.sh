#!/usr/bin/env bash
# Bring up the Docker engines the sandbox tests run against, on a fresh Debian machine, as root, and make sure the
# default sandbox image (tangram/sandbox-python:bookworm, built offline with debootstrap) is in each.
#   node 1: the default engine on unix:///var/run/docker.sock
#   node 2: a second dockerd on unix:///run/tangram/node2/docker.sock with its own data root, exec root and
#           containerd, standing for a second node (no bridge network: sandboxes run with network none); its data
#           root is a btrfs file system (a sparse file on a loop device) under the btrfs storage driver, whose
#           simple quotas cap each sandbox's disk (storage_opt size), where node 1's overlay2 on ext4 cannot
#   node 3: a third dockerd on unix:///run/tangram/node3/docker.sock, like node 2 but on overlay2 under the host's
#           file system, run with user-namespace remapping (--userns-remap default: the engine makes the dockremap
#           user and its /etc/subuid range), for the tests of sandboxes whose root is nobody on the host
# Nodes 1 and 2 also know gVisor's runtime, ``runsc`` (Debian's package), for nodes that set ``runtime = "runsc"``:
# without a network (sandboxes have none) and with host-backed unix sockets, so that the executor's socket is one
# the host can connect to.
# Idempotent: installs docker.io and debootstrap only when missing, starts an engine only when it does not answer,
# builds the image only when an engine lacks it. Prints only the export line the tests read on stdout (progress
# goes to stderr), so
#   eval "$(bash scripts/start-docker.sh)"
# sets TANGRAM_TEST_DOCKER_NODES (nodes 1 and 2) and TANGRAM_TEST_USERNS_ENGINE (node 3) in the calling shell.
set -euo pipefail
exec 3>&1 1>&2
root=$(cd "$(dirname "$0")/.." && pwd)
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

NODE1=unix:///var/run/docker.sock
NODE2_DIR=/run/tangram/node2
NODE2=unix://$NODE2_DIR/docker.sock
NODE2_DATA=/var/lib/tangram/node2
NODE2_DISK=/var/lib/tangram/node2.btrfs
NODE2_DISK_SIZE=32G
NODE2_CONFIG=/etc/tangram/node2-daemon.json
NODE3_DIR=/run/tangram/node3
NODE3=unix://$NODE3_DIR/docker.sock
NODE3_DATA=/var/lib/tangram/node3
NODE3_CONFIG=/etc/tangram/node3-daemon.json
#: the runtimes both engines know, as dockerd's config spells them
RUNTIMES='{"runsc": {"path": "/usr/bin/runsc", "runtimeArgs": ["--network=none", "--host-uds=create"]}}'
LOG_DIR=/var/log/tangram
WAIT_S=60

if [ "$(id -u)" != 0 ]; then
    echo "start-docker.sh: must run as root (it installs packages and starts dockerd)" >&2
    exit 1
fi

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v mkfs.btrfs >/dev/null || missing+=(btrfs-progs)
command -v runsc >/dev/null || missing+=(runsc)
if ((${#missing[@]})); then
    echo "installing ${missing[*]} from Debian's packages" >&2
    # </dev/null and 3>&-: should a package script start a daemon, it must not hold our caller's pipe open.
    apt-get update </dev/null 3>&-
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" </dev/null 3>&-
fi

# dockerd needs cgroups (v1 hierarchies or the v2 unified one) and runs containers on overlay2 when the data root's
# filesystem allows it (it falls back to the slow vfs driver otherwise, e.g. on an overlay root).
if [ ! -e /sys/fs/cgroup/cgroup.controllers ] && [ ! -d /sys/fs/cgroup/memory ]; then
    if command -v cgroupfs-mount >/dev/null; then
        echo "no cgroup hierarchy mounted: mounting them with cgroupfs-mount" >&2
        cgroupfs-mount
    fi
    if [ ! -e /sys/fs/cgroup/cgroup.controllers ] && [ ! -d /sys/fs/cgroup/memory ]; then
        echo "start-docker.sh: no cgroup filesystem under /sys/fs/cgroup; dockerd cannot run containers" >&2
        exit 1
    fi
fi
grep -qw overlay /proc/filesystems || modprobe overlay 2>/dev/null || \
    echo "warning: no overlay filesystem in this kernel; dockerd will use the slow vfs storage driver" >&2

mkdir -p "$LOG_DIR" "$NODE2_DIR" "$NODE2_DATA" "$NODE3_DIR" "$NODE3_DATA"

answers() { timeout 10 docker -H "$1" info >/dev/null 2>&1; }

# The pid in a pidfile, if that process is alive (a dockerd still starting up must not be started twice).
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Run "$@" as a daemon: its own session, stdin from /dev/null, stdout and stderr to a log, and no other file
# descriptor of ours. A daemon that inherits the write end of a caller's $(...) pipe keeps that command
# substitution waiting for ever (a CI run hung 90 minutes on that).
detach() {
    local log=$1 fd
    shift
    (
        cd /
        for fd in /proc/$BASHPID/fd/*; do
            fd=${fd##*/}
            if [ "$fd" -gt 2 ]; then eval "exec $fd>&-"; fi
        done
        exec setsid "$@" </dev/null >>"$log" 2>&1
    ) &
    # Without job control the subshell is no process group leader, so setsid execs in place: this is dockerd.
    detached_pid=$!
}

# Wait until the engine at $1 answers, or fail with its log's tail; $2: its log, $3: its pidfile.
wait_for() {
    local url=$1 log=$2 pidfile=$3 _
    for _ in $(seq 1 "$WAIT_S"); do
        answers "$url" && return 0
        sleep 1
    done
    echo "start-docker.sh: the Docker engine at $url did not answer within ${WAIT_S}s; tail of $log:" >&2
    tail -n 30 "$log" >&2 || true
    alive "$pidfile" || echo "(dockerd is not running)" >&2
    return 1
}

# Node 1 runs on the default config file: add the runtimes to what it says (reloaded on SIGHUP if it runs).
node1_runtimes() {
    local config=/etc/docker/daemon.json
    mkdir -p /etc/docker
    RUNTIMES="$RUNTIMES" python3 - "$config" <<'PY'
import json, os, sys
path = sys.argv[1]
config = json.load(open(path)) if os.path.exists(path) and os.path.getsize(path) else {}
wanted = {**config.get("runtimes", {}), **json.loads(os.environ["RUNTIMES"])}
if config.get("runtimes") != wanted:
    config["runtimes"] = wanted
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
PY
    if alive /var/run/docker.pid; then
        kill -HUP "$(cat /var/run/docker.pid)"
    fi
}

start_node1() {
    local log=$LOG_DIR/dockerd-node1.log
    if answers "$NODE1"; then
        echo "node 1 engine already answers on $NODE1" >&2
        return 0
    fi
    if ! alive /var/run/docker.pid; then
        echo "starting node 1 engine on $NODE1 (log $log)" >&2
        touch "$log"
        local logged
        logged=$(stat -c %s "$log")
        # Plain defaults (socket /var/run/docker.sock, pidfile /var/run/docker.pid, data root /var/lib/docker):
        # repeating them as flags would clash with an /etc/docker/daemon.json that sets them.
        detach "$log" dockerd
        # A machine whose kernel lacks the NAT tables cannot give dockerd its default bridge network: retry
        # without it (sandboxes run with network none anyway).
        for _ in $(seq 1 20); do
            answers "$NODE1" && break
            if ! kill -0 "$detached_pid" 2>/dev/null &&
                tail -c +"$((logged + 1))" "$log" | grep -qiE 'iptables|bridge|nat chain'; then
                echo "node 1 engine failed to set up its bridge network; restarting it without one" >&2
                detach "$log" dockerd --bridge none --iptables=false --ip-masq=false
                break
            fi
            sleep 1
        done
    fi
    wait_for "$NODE1" "$log" /var/run/docker.pid
}

# Node 2's data root on btrfs, for the btrfs storage driver: a per-container size is a btrfs quota group limit
# (overlay2 needs XFS with project quotas, which this kernel's XFS lacks). Without loop devices or btrfs, node 2
# runs overlay2 on the host's file system, and the disk-cap tests say why they fail.
node2_data_root() {
    if [ "$(findmnt -n -o FSTYPE --mountpoint "$NODE2_DATA" || true)" = btrfs ]; then
        return 0
    fi
    # dockerd bind-mounts its data root onto itself (to make it private); an earlier engine on the host's file
    # system left that mount behind
    while mountpoint -q "$NODE2_DATA"; do
        umount "$NODE2_DATA"
    done
    if [ ! -f "$NODE2_DISK" ]; then
        truncate -s "$NODE2_DISK_SIZE" "$NODE2_DISK"
        mkfs.btrfs -q "$NODE2_DISK" >/dev/null
    fi
    if ! mount -o loop "$NODE2_DISK" "$NODE2_DATA"; then
        echo "warning: could not mount $NODE2_DISK (btrfs) on $NODE2_DATA: node 2 runs without disk caps" >&2
    fi
}

# Simple quotas (Linux >= 6.7) on node 2's btrfs, before each start of its engine: a subvolume's limit counts the
# extents written in it, and stays enforced when subvolumes are deleted, where full quota groups turn inconsistent
# at the first container removed and stop enforcing until a rescan. btrfs-progs before 6.7 cannot ask for them, so
# this asks the kernel itself (BTRFS_IOC_QUOTA_CTL). Each start, because the engine's btrfs driver turns quotas off
# when it stops and would turn full ones on again at its first capped container.
simple_quotas() {
    local uuid mode=none
    [ "$(findmnt -n -o FSTYPE --mountpoint "$NODE2_DATA" || true)" = btrfs ] || return 0
    uuid=$(findmnt -n -o UUID --mountpoint "$NODE2_DATA")
    if [ -r "/sys/fs/btrfs/$uuid/qgroups/mode" ]; then
        mode=$(cat "/sys/fs/btrfs/$uuid/qgroups/mode")
    fi
    [ "$mode" = squota ] && return 0
    if ! python3 - "$NODE2_DATA" "$mode" <<'PY'
import fcntl, os, struct, sys
BTRFS_IOC_QUOTA_CTL = 0xC0109428
DISABLE, ENABLE_SIMPLE_QUOTA = 2, 4
fd = os.open(sys.argv[1], os.O_RDONLY)
if sys.argv[2] != "none":
    fcntl.ioctl(fd, BTRFS_IOC_QUOTA_CTL, bytearray(struct.pack("QQ", DISABLE, 0)))
fcntl.ioctl(fd, BTRFS_IOC_QUOTA_CTL, bytearray(struct.pack("QQ", ENABLE_SIMPLE_QUOTA, 0)))
PY
    then
        echo "warning: no simple quotas on $NODE2_DATA (Linux >= 6.7 has them): node 2 runs without disk caps" >&2
    fi
}

# The storage driver of node 2's data root: btrfs where it is one.
node2_storage() {
    if [ "$(findmnt -n -o FSTYPE --mountpoint "$NODE2_DATA" || true)" = btrfs ]; then
        echo btrfs
    else
        echo overlay2
    fi
}

start_node2() {
    local log=$LOG_DIR/dockerd-node2.log
    if answers "$NODE2"; then
        echo "node 2 engine already answers on $NODE2" >&2
        return 0
    fi
    if ! alive "$NODE2_DIR/docker.pid"; then
        node2_data_root
        simple_quotas
        mkdir -p "$(dirname "$NODE2_CONFIG")"
        echo "{\"runtimes\": $RUNTIMES}" >"$NODE2_CONFIG"
        echo "starting node 2 engine on $NODE2 (log $log)" >&2
        # Its own data root, exec root (hence its own containerd, socket and state) and pidfile; no bridge and no
        # iptables rules, which would collide with node 1's docker0 and NAT chains.
        detach "$log" dockerd --host "$NODE2" --data-root "$NODE2_DATA" --exec-root "$NODE2_DIR/exec" \
            --pidfile "$NODE2_DIR/docker.pid" --bridge none --iptables=false --ip-masq=false \
            --storage-driver "$(node2_storage)" --config-file "$NODE2_CONFIG"
    fi
    wait_for "$NODE2" "$log" "$NODE2_DIR/docker.pid"
}

start_node3() {
    local log=$LOG_DIR/dockerd-node3.log
    if answers "$NODE3"; then
        echo "node 3 engine already answers on $NODE3" >&2
        return 0
    fi
    if ! alive "$NODE3_DIR/docker.pid"; then
        mkdir -p "$(dirname "$NODE3_CONFIG")"
        echo '{}' >"$NODE3_CONFIG"  # its own (empty) config: node 1's daemon.json is not its
        echo "starting node 3 engine (user-namespace remapping) on $NODE3 (log $log)" >&2
        detach "$log" dockerd --host "$NODE3" --data-root "$NODE3_DATA" --exec-root "$NODE3_DIR/exec" \
            --pidfile "$NODE3_DIR/docker.pid" --bridge none --iptables=false --ip-masq=false \
            --userns-remap default --config-file "$NODE3_CONFIG"
    fi
    wait_for "$NODE3" "$log" "$NODE3_DIR/docker.pid"
}

node1_runtimes
start_node1
start_node2
start_node3
for url in "$NODE1" "$NODE2" "$NODE3"; do
    echo "$url: $(docker -H "$url" info --format 'Docker {{.ServerVersion}}, storage {{.Driver}}, cgroup v{{.CgroupVersion}} ({{.CgroupDriver}})' 2>/dev/null)" >&2
done

# The default sandbox image in every engine: debootstrap runs only when neither the engines nor the cache have it.
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
    python=$VIRTUAL_ENV/bin/python
elif [ -x "$root/.venv/bin/python" ]; then
    python=$root/.venv/bin/python
else
    python=python3
fi
(cd "$root" && "$python" -m tangram.cli image build --engine "$NODE1" --engine "$NODE2" --engine "$NODE3" \
    </dev/null 3>&-)

echo "export TANGRAM_TEST_DOCKER_NODES=$NODE1,$NODE2 TANGRAM_TEST_USERNS_ENGINE=$NODE3" >&3
