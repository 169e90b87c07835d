#!/usr/bin/env bash
# Bring up the PostgreSQL the store tests run against (tests/test_store.py), on a fresh Debian machine, as root.
# Idempotent: installs the server only when missing, starts the cluster only when down, creates the role and the
# database only when absent. Prints only the export line the tests read on stdout (progress goes to stderr), so
#   eval "$(scripts/start-postgres.sh)"
# sets TANGRAM_TEST_PG_URL in the calling shell.
set -euo pipefail
exec 3>&1 1>&2

PORT=5432
ROLE=tangram
PASSWORD=tangram
DATABASE=tangram_test

if ! compgen -G "/usr/lib/postgresql/*/bin/postgres" >/dev/null; then
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql
fi

version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
if ! pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" {found = 1} END {exit !found}'; then
    pg_createcluster "$version" main --port "$PORT"
fi

# Containers often lack the socket directory that systemd-tmpfiles would create.
install -d -o postgres -g postgres -m 2775 /var/run/postgresql

status=$(pg_lsclusters -h | awk -v v="$version" '$1 == v && $2 == "main" {print $4}')
if [[ "$status" != online* ]]; then
    # Close fd 3 for the daemon: it would otherwise hold the caller's $(...) pipe open and hang the caller.
    pg_ctlcluster "$version" main start 3>&-
fi

for _ in $(seq 1 50); do
    pg_isready -q -h 127.0.0.1 -p "$PORT" && break
    sleep 0.2
done
pg_isready -h 127.0.0.1 -p "$PORT"

psql_admin() { runuser -u postgres -- psql -p "$PORT" -v ON_ERROR_STOP=1 -tA "$@"; }

if [[ -z "$(psql_admin -c "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'")" ]]; then
    psql_admin -c "CREATE ROLE $ROLE LOGIN PASSWORD '$PASSWORD'"
fi
if [[ -z "$(psql_admin -c "SELECT 1 FROM pg_database WHERE datname = '$DATABASE'")" ]]; then
    psql_admin -c "CREATE DATABASE $DATABASE OWNER $ROLE"
fi

echo "export TANGRAM_TEST_PG_URL=postgresql+asyncpg://$ROLE:$PASSWORD@127.0.0.1:$PORT/$DATABASE" >&3
