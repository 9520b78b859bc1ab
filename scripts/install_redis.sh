#!/usr/bin/env bash
# Install redis-server (Debian 7.0) if missing. The fleet tests and `make fleet-bench` start their
# own instance on 127.0.0.1 (never the system service). Needs root (or sudo).
set -euo pipefail
command -v redis-server >/dev/null 2>&1 && exit 0
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server
# the package's own service (if an init system started it) is not ours to use
$SUDO service redis-server stop >/dev/null 2>&1 || true
