#!/usr/bin/env bash
# Unpack Prometheus from Debian's package (binaries only: no service is started) for the deploy tests, which run a
# real Prometheus against a live broker with deploy/prometheus/prometheus.yml. Idempotent; progress goes to stderr.
# Prints only the export line the tests need on stdout:
#   eval "$(bash scripts/install-prometheus.sh)"
set -euo pipefail
exec 3>&1 1>&2
prefix=/opt/tangram-prometheus
if ! command -v prometheus >/dev/null && [ ! -x "$prefix/usr/bin/prometheus" ]; then
    apt-get update -qq </dev/null
    work=$(mktemp -d)
    (cd "$work" && apt-get download -qq -o APT::Sandbox::User=root prometheus </dev/null && dpkg -x prometheus_*.deb "$prefix")
    rm -rf "$work"
fi
echo "export PATH=\"\$PATH:$prefix/usr/bin\"" >&3
