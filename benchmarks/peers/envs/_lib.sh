# Helpers sourced by setup.sh for every envs/NAME.sh (not a peer itself: its name starts with _).
# Variables set by setup.sh: HERE, REPO, PEERS_DIR, ENV_DIR, NAME.

PYENV_ROOT="${PYENV_ROOT:-/root/.pyenv}"

# make_venv 3.11 -- (re)create ENV_DIR from pyenv's Python 3.X; a stale half-built folder is removed first.
make_venv() {
    local py="$PYENV_ROOT/versions/$(ls "$PYENV_ROOT/versions" | grep -E "^$1\.[0-9]+$" | sort -V | tail -n 1)/bin/python"
    [[ -x "$py" ]] || { echo "no Python $1 under $PYENV_ROOT/versions"; return 1; }
    rm -rf "$ENV_DIR"
    "$py" -m venv "$ENV_DIR"
    "$ENV_DIR/bin/python" -m pip install --quiet --upgrade pip
}

# pip_install ARGS... -- pip inside the peer's env.
pip_install() { "$ENV_DIR/bin/python" -m pip install --progress-bar off "$@"; }

# smoke_import 'python code' -- must succeed before READY is written.
smoke_import() {
    cd "$HERE" && "$ENV_DIR/bin/python" -c "$1"
}

# write_ready -- records Python and the installed versions of the named distributions in READY.
write_ready() {
    "$ENV_DIR/bin/python" - "$@" > "$ENV_DIR/READY.tmp" <<'PY'
import sys
from importlib.metadata import version
print(f"python {sys.version.split()[0]}")
for dist in sys.argv[1:]:
    print(f"{dist} {version(dist)}")
PY
    mv "$ENV_DIR/READY.tmp" "$ENV_DIR/READY"
}
