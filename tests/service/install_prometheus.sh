#!/usr/bin/env bash
# Install a real Prometheus server (Debian's `prometheus` package) for tests/service's metrics
# end-to-end test. Idempotent; needs root (CI runs as root). The package's service is not
# started here: the test starts its own /usr/bin/prometheus on loopback.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
prometheus --version 2>&1 | head -n 1
