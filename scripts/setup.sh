#!/usr/bin/env bash
# Create or refresh the Python environment the worker, its tests and the demo run in.
#
#   bash scripts/setup.sh            # venv at ./.venv (repo root)
#   VENV=/tmp/vlm-venv bash scripts/setup.sh
#
# Installs torch==2.14.1 + torchvision==0.29.1 (the Docker base image provides torch in
# production, so they are not in requirements.txt), then requirements-dev.txt. Idempotent: a stamp
# file inside the venv records a hash of everything that decides its contents; when it matches,
# this script does nothing and returns at once.
#
# Environment: VENV (venv path; relative paths are taken from the repo root), PYTHON (the
# interpreter that creates the venv, default python3; 3.10 or newer).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="${VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PYTHON="${PYTHON:-python3}"
TORCH_PINS=(torch==2.14.1 torchvision==0.29.1)
STAMP="$VENV/.runpod-vlm-setup"

# Two scripts (test.sh, demo.sh) may set up at once: serialise on a lock inside the venv.
mkdir -p "$VENV"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV/.setup.lock"
    flock 9
fi

want="$(
    {
        printf '%s\n' "${TORCH_PINS[@]}"
        "$PYTHON" -c 'import sys; print(sys.version)'
        cat requirements.txt requirements-dev.txt
    } | sha256sum | cut -d' ' -f1
)"

if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    echo "setup: $VENV is up to date"
    exit 0
fi

"$PYTHON" - <<'EOF'
import sys
if sys.version_info < (3, 10):
    sys.exit(f"setup: Python 3.10+ needed (runpod 1.12 requires it), found {sys.version.split()[0]}")
EOF

if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

pip_install() {
    # Hides pip's "Location 'file:...' is ignored" lines (index folders named in a machine-wide pip
    # config that lack a package): one per package, they bury real messages. pip's status is kept.
    local rc=0
    "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off -q "$@" 2>&1 \
        | { grep -v "^WARNING: Location 'file:" || true; } || rc=$?
    return "$rc"
}

# pip is quiet (its many lines bury real messages): one line a step, with its time, says where it is.
step() {
    local started=$SECONDS
    echo "setup: installing $1 (a few minutes on a fresh machine)"
    shift
    pip_install "$@"
    echo "setup: ... done in $((SECONDS - started))s"
}
step "${TORCH_PINS[*]}" "${TORCH_PINS[@]}"
step "requirements-dev.txt" -r requirements-dev.txt

# Fail here, not in the first test, if the environment cannot import what the worker needs.
"$VENV/bin/python" -c 'import torch, torchvision, transformers, accelerate, PIL, pydantic, runpod, pytest'

echo "$want" >"$STAMP"
echo "setup: $VENV ready"
