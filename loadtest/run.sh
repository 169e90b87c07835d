#!/usr/bin/env bash
# Headless locust load test of the agentic action mix (loadtest/locustfile.py), with a time limit.
#
#   bash loadtest/run.sh [--host URL] [--users N] [--spawn-rate R] [--run-time T] [--stop-timeout S] [--out DIR]
#                        [-- MORE LOCUST ARGUMENTS]
#
# Without --host it starts the search upstream (python -m loadtest.upstream on port 8391) and a broker from
# loadtest/broker.toml (port 8390; its SQLite file and both logs go to --out) and stops them at the end. Users start
# trajectories for --run-time, then get --stop-timeout seconds to finish the ones under way (and delete their
# sandboxes). It prints locust's summary, keeps CSV stats in --out, and exits nonzero when any request failed.
# The mix and the think times come from LOADTEST_* variables (loadtest/README.md, loadtest/locustfile.py).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
host="" users=12 rate=4 run_time=60s stop_timeout=120 out=""
while (($#)); do
    case "$1" in
        --host) host=$2; shift 2 ;;
        --users) users=$2; shift 2 ;;
        --spawn-rate) rate=$2; shift 2 ;;
        --run-time) run_time=$2; shift 2 ;;
        --stop-timeout) stop_timeout=$2; shift 2 ;;
        --out) out=$2; shift 2 ;;
        --) shift; break ;;
        *) echo "run.sh: unknown argument '$1'; see the top of loadtest/run.sh" >&2; exit 2 ;;
    esac
done
out=${out:-$(mktemp -d /tmp/tangram-loadtest.XXXXXX)}
mkdir -p "$out"
out=$(cd "$out" && pwd)

# locust and the reward model are in the dev extras
TANGRAM_EXTRAS=dev source "$root/scripts/venv.sh"

started=()
stop_started() {
    for pid in "${started[@]}"; do
        kill -TERM "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}
trap stop_started EXIT

wait_healthy() {  # URL NAME LOG PID
    for _ in $(seq 300); do
        if python -c "import urllib.request, sys; urllib.request.urlopen(sys.argv[1], timeout=2)" "$1" 2>/dev/null
        then
            return 0
        fi
        if ! kill -0 "$4" 2>/dev/null; then
            echo "run.sh: the $2 exited during start-up; the end of $3:" >&2
            tail -n 20 "$3" >&2
            exit 1
        fi
        sleep 0.5
    done
    echo "run.sh: the $2 did not answer $1 within 150 s; see $3" >&2
    exit 1
}

if [ -z "$host" ]; then
    image=tangram/sandbox-python:bookworm
    if ! docker image inspect "$image" >/dev/null 2>&1; then
        echo "run.sh: the Docker engine does not answer or lacks $image; run .venv/bin/tangram image build" >&2
        exit 1
    fi
    python -m loadtest.upstream --port 8391 >"$out/upstream.log" 2>&1 &
    started+=($!)
    wait_healthy "http://127.0.0.1:8391/search?q=ready" "search upstream" "$out/upstream.log" "$!"
    # from $out, so the relative SQLite path in broker.toml lands there; the reward model comes from a package
    (cd "$out" && HF_HUB_OFFLINE=1 exec tangram serve --config "$root/loadtest/broker.toml") >"$out/broker.log" 2>&1 &
    started+=($!)
    wait_healthy "http://127.0.0.1:8390/healthz" "broker" "$out/broker.log" "$!"
    host=http://127.0.0.1:8390
fi

echo "run.sh: $users users for $run_time against $host; stats in $out" >&2
status=0
locust -f "$root/loadtest/locustfile.py" --headless --users "$users" --spawn-rate "$rate" --run-time "$run_time" \
    --stop-timeout "$stop_timeout" --only-summary --host "$host" --csv "$out/locust" "$@" || status=$?
exit "$status"
