#!/bin/sh
# Set-up for the timeline's browser tests (tests/timeline/test_timeline_browser.py):
# Debian's chromium (headless, driven over the DevTools protocol) and websocket-client.
# Run as root on Debian/Ubuntu; the tests install chromium themselves when they can, and
# skip with the reason when they cannot.
set -eu
PYTHON="${PYTHON:-.venv/bin/python}"
if ! command -v chromium >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends chromium || {
        apt-get update && apt-get install -y --no-install-recommends chromium; }
fi
"$PYTHON" -m pip install --quiet "websocket-client>=1.7"
chromium --version
