#!/usr/bin/env bash
# System packages for T2 (Mooncake Store) and its tests: libibverbs1 (mooncake's store.so links it,
# even for TCP) and iproute2 + util-linux (the tests run Mooncake in a loopback-only network
# namespace: `unshare -n` + `ip link set lo up`). Needs root (or sudo).
set -euo pipefail
need=()
ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 || need+=(libibverbs1)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
