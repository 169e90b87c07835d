#!/usr/bin/env bash
# Install headless Chromium and its WebDriver from Debian's packages (the status page tests drive them), when
# missing. Idempotent; progress goes to stderr.
set -euo pipefail
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >&2
fi
