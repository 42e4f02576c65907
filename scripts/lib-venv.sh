# Shared by the scripts that make a pinned Python venv (python-venv.sh, smg-venv.sh, …).
# Source it, then call:
#
#   ensure_venv VENV "python -c check" PIN...
#
# Creates VENV once (bootstrapping pip when the host python has no ensurepip), installs the exact
# PINS, and records them in a stamp file. When the stamp matches and CHECK (a Python snippet run by
# the venv's python) succeeds, nothing is downloaded. Concurrent callers on one venv are serialised
# with flock. Prints nothing on stdout; logs go to stderr. PYTHON chooses the host interpreter.

venv_log() { echo "venv($(basename "$1")): $2" >&2; }

ensure_venv() {
    local venv=$1 check=$2
    shift 2
    local py=${PYTHON:-python3}
    local stamp="$venv/.kvbridge-pins"
    local want
    want=$(printf '%s\n' "$@")

    mkdir -p "$(dirname "$venv")"
    if command -v flock >/dev/null 2>&1; then
        exec 9>"$venv.lock"
        flock 9
    fi

    if [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
        && "$venv/bin/python" -c "$check" 2>/dev/null; then
        return 0
    fi
    command -v "$py" >/dev/null 2>&1 || { venv_log "$venv" "no '$py' on PATH (set PYTHON)"; return 1; }
    "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' \
        || { venv_log "$venv" "$("$py" --version 2>&1) is too old: Python >= 3.10 needed"; return 1; }
    if [ ! -x "$venv/bin/python" ]; then
        venv_log "$venv" "creating"
        rm -rf "$venv"
        if ! "$py" -m venv "$venv" >&2; then
            # Debian's python3 without python3-venv has no ensurepip: make the venv without pip and
            # bootstrap pip from a wheel the host's pip fetches (a wheel runs as a zip on sys.path).
            venv_log "$venv" "no ensurepip; bootstrapping pip from PyPI"
            rm -rf "$venv"
            "$py" -m venv --without-pip "$venv" >&2
            local tmp whl
            tmp=$(mktemp -d)
            "$py" -m pip download --no-deps --only-binary=:all: -d "$tmp" pip >&2
            whl=$(ls "$tmp"/pip-*.whl)
            "$venv/bin/python" "$whl/pip" install --no-index "$whl" >&2
            rm -rf "$tmp"
        fi
    fi
    venv_log "$venv" "installing $*"
    rm -f "$stamp"
    "$venv/bin/python" -m pip install --disable-pip-version-check --no-input -q "$@" >&2
    "$venv/bin/python" -c "$check"
    printf '%s\n' "$want" >"$stamp"
}
