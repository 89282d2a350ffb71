#!/usr/bin/env bash
# Run the remote-code families (MiniCPM-V-2_6, Phi-3-vision, InternVL2) on their repositories' own
# code, on the legacy line (transformers 4.48.3): tests/test_remote_code_real.py builds tiny
# random-weight models from that code (tools/legacy_models.py) and checks the worker against each
# model card's recipe. CI cannot: it has no model hub, and this project does not carry the code.
#
#   bash scripts/legacy_check.sh CODE_DIR [pytest arguments]
#
# CODE_DIR holds one folder per family with the files of its Hugging Face repository, as published
# (Python files, config.json, tokenizer and processor files; no weights):
#   CODE_DIR/minicpmv/        openbmb/MiniCPM-V-2_6 (the Python files are enough: a missing config,
#                             processor config or tokenizer is replaced by the published config values
#                             and a byte-level stand-in tokenizer)
#   CODE_DIR/phi3_v/          microsoft/Phi-3-vision-128k-instruct
#   CODE_DIR/internvl_chat/   OpenGVLab/InternVL2-2B or -8B (InternLM2 language model)
# With access to the hub, for example:
#   huggingface-cli download openbmb/MiniCPM-V-2_6 --exclude "*.safetensors" "*.bin" --local-dir CODE_DIR/minicpmv
#
# Environment: LEGACY_VENV (default ~/.cache/runpod-vlm/legacy-venv; created on first use),
# PYTHON (the interpreter that creates it, default python3), TRANSFORMERS_VERSION (default 4.48.3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ $# -lt 1 || ! -d "$1" ]]; then
    sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
fi
CODE_DIR="$(cd "$1" && pwd)"
shift
for family in minicpmv/modeling_minicpmv.py phi3_v/modeling_phi3_v.py internvl_chat/modeling_internvl_chat.py; do
    [[ -f "$CODE_DIR/$family" ]] || echo "note: $CODE_DIR/$family is missing: that family's tests will be skipped"
done

VENV="${LEGACY_VENV:-$HOME/.cache/runpod-vlm/legacy-venv}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-4.48.3}"
if [[ ! -x "$VENV/bin/python" ]]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q torch==2.14.1 torchvision==0.29.1
"$VENV/bin/pip" install -q -r requirements-dev.txt
"$VENV/bin/pip" install -q -r requirements-legacy.txt "transformers==$TRANSFORMERS_VERSION"

VLM_LEGACY_CODE_DIR="$CODE_DIR" "$VENV/bin/python" -m pytest -q -rs -p no:cacheprovider \
    tests/test_remote_code_real.py "$@"
