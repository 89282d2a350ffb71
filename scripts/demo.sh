#!/usr/bin/env bash
# THE run command: the worker end to end on a machine with no GPU and no Hugging Face hub.
#
#   bash scripts/demo.sh
#
# 1. sets up the venv (scripts/setup.sh);
# 2. builds a tiny random-weight Qwen2-VL offline into .tiny-models/qwen2-vl (once);
# 3. runs `python handler.py --test_input "$(cat test_input.json)"` (runpod's local test mode:
#    one job, exit 0 on success, 1 when the job returns an error) with that model on CPU;
# 4. prints the job's output and the answer.
# The weights are random, so the answer is gibberish: the point is the whole path
# (request parsing, image decoding, chat template, processor, generate, output shape).
#
# Environment: VENV (see scripts/setup.sh), DEMO_INPUT (job file, default test_input.json).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/setup.sh

VENV="${VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
PY="$VENV/bin/python"
INPUT="${DEMO_INPUT:-test_input.json}"
MODEL_DIR=".tiny-models/qwen2-vl"

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

if [[ -f "$MODEL_DIR/config.json" ]]; then
    echo "demo: using $MODEL_DIR"
else
    if [[ ! -f tools/tiny_models.py ]]; then
        echo "demo: tools/tiny_models.py is missing: cannot build the tiny model" >&2
        exit 1
    fi
    echo "demo: building a tiny random-weight Qwen2-VL into $MODEL_DIR"
    mkdir -p "$(dirname "$MODEL_DIR")"
    tmp="$MODEL_DIR.partial.$$"
    rm -rf "$tmp"
    trap 'rm -rf "$tmp"' EXIT
    "$PY" -m tools.tiny_models qwen2-vl "$tmp"
    rm -rf "$MODEL_DIR"
    mv "$tmp" "$MODEL_DIR"  # only a complete build ever sits at $MODEL_DIR
    trap - EXIT
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
echo "demo: python handler.py --test_input \"\$(cat $INPUT)\""
set +e
VLM_MODEL="$MODEL_DIR" VLM_ALLOW_ANY=true VLM_DEVICE_MAP=cpu RUNPOD_LOG_LEVEL=INFO \
    "$PY" handler.py --test_input "$(cat "$INPUT")" >"$log" 2>&1
rc=$?
set -e
# The worker's own log, less the line that repeats the whole job (base64 image included).
grep -v -e 'Job result:' -e 'Retrieved local job' "$log" | cut -c1-300

"$PY" - "$log" "$rc" <<'EOF'
import ast, json, sys

log_path, rc = sys.argv[1], int(sys.argv[2])
result = None
with open(log_path, encoding="utf-8", errors="replace") as log:
    for line in log:
        if "Job result: " in line:
            result = ast.literal_eval(line.split("Job result: ", 1)[1].strip())
if rc != 0 or result is None:
    sys.exit(f"demo: the worker failed (exit {rc}); see its log above")
print("\ndemo: job output")
print(json.dumps(result, indent=2))
print("\ndemo: answer (random weights, so gibberish is expected):")
print(repr(result["output"]["response"]))
EOF
