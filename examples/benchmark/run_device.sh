#!/usr/bin/env bash
# One device call: install, GPU tests, kernel micro-benchmark, layer benchmark. Logs under $OUT.
#   STAGES="tests micro layers" SHAPES="qwen3" VARIANTS="hf_eager ops_inductor" bash examples/benchmark/run_device.sh
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STAGES=${STAGES:-"tests micro layers"}
SHAPES=${SHAPES:-qwen3}
python3 -m pip install --no-deps --no-build-isolation -e . >"$OUT/pip.log" 2>&1 || { echo "pip install failed"; tail -5 "$OUT/pip.log"; }
nvidia-smi -L
for s in $STAGES; do
  case $s in
    tests)  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x --tb=short tests/gpu -p no:cacheprovider \
              >"$OUT/tests.log" 2>&1; echo "tests rc=$?"; grep -E "passed|failed|error|Error|assert" "$OUT/tests.log" | tail -25 ;;
    micro)  timeout ${MICRO_TIMEOUT:-200} python3 examples/benchmark/moe_layer.py --micro --shapes $SHAPES \
              --json "$OUT/micro.json" 2>&1 | tee "$OUT/micro.log" | tail -30 ;;
    layers) timeout ${LAYER_TIMEOUT:-300} python3 examples/benchmark/moe_layer.py --shapes $SHAPES \
              ${VARIANTS:+--variants $VARIANTS} ${EXTRA:-} --json "$OUT/layers.json" 2>&1 | tee "$OUT/layers.log" \
              | grep -v '^{' | tail -40 ;;
  esac
done
