#!/usr/bin/env bash
# Install the Debian packages the real-SLURM tests need (tests/slurm_cluster.py starts the
# daemons itself, privately, in a temp dir; nothing here starts or configures a service).
#
#   slurmctld slurmd slurm-client munge   the cluster (Debian 12: Slurm 22.05)
#   slurmdbd mariadb-server-core          accounting, so sacct and submitit see real job states
#   mariadb-client-core                   my_print_defaults, which mariadb-install-db calls
#   iptables                              packet loss on the emulated nodes' links (tests -m multinode)
#
# Idempotent: a fast no-op when everything is installed. Exit 0 on success, 1 when the packages
# cannot be installed (not root, no apt-get, no network); the fixture then skips the SLURM tests.
# Measured on the 2-core dev machine: ~25 s for a fresh install of all of them.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server-core mariadb-client-core iptables)

missing=()
for pkg in "${PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -eq 0 ]; then
    echo "setup_slurm: all packages present"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "setup_slurm: need root to install: ${missing[*]}" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup_slurm: no apt-get to install: ${missing[*]}" >&2
    exit 1
fi

# Keep the packages' maintainer scripts from starting system munge/slurm/mariadb services
# (the tests run private ones); a policy-rc.d that is already there is left alone.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    trap 'rm -f "$policy"' EXIT
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
start=$(date +%s)
echo "setup_slurm: installing ${missing[*]}"
if ! apt-get install -y --no-install-recommends "${missing[@]}" >"$log" 2>&1; then
    echo "setup_slurm: install failed, refreshing the package lists and retrying"
    if ! { apt-get update -qq && apt-get install -y --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
        tail -n 5 "$log" >&2
        echo "setup_slurm: apt-get install failed" >&2
        rm -f "$log"
        exit 1
    fi
fi
rm -f "$log"
echo "setup_slurm: installed in $(($(date +%s) - start)) s"
