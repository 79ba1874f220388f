#!/usr/bin/env bash
# Build each peer framework's own virtual environment at <repo>/.peers/NAME/ (gitignored).
#
#   bash benchmarks/peers/setup.sh flower pfl      # or: all
#
# Dispatches to benchmarks/peers/envs/NAME.sh, one file per peer, which pins its versions.
# Idempotent: an env whose .peers/NAME/READY exists is left alone (delete the folder to rebuild).
# READY (holding the pinned versions) is written only after a smoke import succeeds, so a
# half-built env never looks complete; a failed build leaves .peers/NAME/FAILED with its last log
# line instead (retried on the next call). Prints one line per peer; exits non-zero if any failed.
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$REPO/.peers}"
export HERE REPO PEERS_DIR

available() { for f in "$HERE"/envs/*.sh; do b="$(basename "$f" .sh)"; [[ "$b" == _* ]] || echo "$b"; done; }

if [[ $# -eq 0 ]]; then
    echo "usage: bash benchmarks/peers/setup.sh NAME... | all   (peers: $(available | tr '\n' ' '))" >&2
    exit 2
fi
names=("$@")
if [[ "$1" == "all" ]]; then mapfile -t names < <(available); fi

mkdir -p "$PEERS_DIR"
status=0
for name in "${names[@]}"; do
    script="$HERE/envs/$name.sh"
    if [[ ! -f "$script" ]]; then
        echo "$name: unknown peer (known: $(available | tr '\n' ' '))"
        status=1
        continue
    fi
    env_dir="$PEERS_DIR/$name"
    if [[ -f "$env_dir/READY" ]]; then
        echo "$name: ready ($(tr '\n' ' ' < "$env_dir/READY"))"
        continue
    fi
    log="$PEERS_DIR/$name.log"
    # Each env script runs in its own bash with the helpers of envs/_lib.sh; its output goes to the log.
    if ENV_DIR="$env_dir" NAME="$name" bash -c 'set -euo pipefail; source "$HERE/envs/_lib.sh"; source "$1"' _ "$script" >"$log" 2>&1; then
        rm -f "$env_dir/FAILED"
        echo "$name: built ($(tr '\n' ' ' < "$env_dir/READY"))"
    else
        # FAILED (never READY) holds the reason: the harness gives the peer one row saying it
        reason="$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)"
        mkdir -p "$env_dir" && rm -f "$env_dir/READY" && echo "$reason" > "$env_dir/FAILED"
        echo "$name: FAILED ($reason; full log: $log)"
        status=1
    fi
done
exit $status
