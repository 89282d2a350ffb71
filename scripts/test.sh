#!/usr/bin/env bash
# THE test command: set up the environment, then run every test suite, each in its own process.
#
#   bash scripts/test.sh
#
# Suites:
#   test_handler.py  stubbed unit tests (no real torch model); must not share a process with
#                    the real-engine tests, so it runs alone
#   tests/           real-engine tests (tiny random-weight models built offline)
# A suite that is absent is reported and skipped. A suite that is present but collects no test
# (pytest exit code 5) is a failure, and so is a run in which no suite ran at all: this script
# never exits 0 without having run tests.
#
# Environment: VENV (see scripts/setup.sh), PYTEST_ADDOPTS (read by pytest itself),
# TEST_SUITE_TIMEOUT (seconds per suite, default 2400).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh || { echo "test: setup failed" >&2; exit 1; }

VENV="${VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="$VENV/bin/python"
SUITE_TIMEOUT="${TEST_SUITE_TIMEOUT:-2400}"

# No hub, no GPU: tests build their models locally, and must never wait on the network.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export PYTHONDONTWRITEBYTECODE=1

ran=()
failed=()
skipped=()

run_suite() {
    local name="$1" target="$2"
    if [[ ! -e "$target" ]]; then
        echo "test: $name: $target is absent, skipped"
        skipped+=("$name")
        return
    fi
    echo
    echo "=== test: $name: python -m pytest $target"
    local started=$SECONDS rc
    timeout --foreground "$SUITE_TIMEOUT" "$PY" -m pytest "$target" -ra
    rc=$?
    local took=$((SECONDS - started))
    case $rc in
        0) echo "=== test: $name passed (${took}s)"; ran+=("$name") ;;
        5) echo "=== test: $name collected no tests (pytest exit 5): counted as a failure"
           failed+=("$name: no tests collected") ;;
        124) echo "=== test: $name timed out after ${SUITE_TIMEOUT}s"
             failed+=("$name: timed out") ;;
        *) echo "=== test: $name failed (pytest exit $rc, ${took}s)"
           failed+=("$name: pytest exit $rc") ;;
    esac
}

run_suite "stubbed handler tests" test_handler.py
run_suite "real-engine tests" tests

echo
echo "=== test summary"
echo "passed:  ${#ran[@]} ${ran[*]+(${ran[*]})}"
[[ ${#skipped[@]} -gt 0 ]] && echo "skipped: ${#skipped[@]} (${skipped[*]})"
if [[ ${#failed[@]} -gt 0 ]]; then
    printf 'FAILED:  %s\n' "${failed[@]}"
    exit 1
fi
if [[ ${#ran[@]} -eq 0 ]]; then
    echo "FAILED:  no test suite ran"
    exit 1
fi
echo "all suites passed"
