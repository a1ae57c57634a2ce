#!/usr/bin/env bash
# Second device call (after `bash .device-bundle/p1/stage.sh`, see ../shared/device_notes.md):
# installs the sglang bundle and this package on the H200, then runs the GPU tests and the
# decode benchmark. Logs and result tables go to $OUT.
#   device run: carry [".device-bundle/p2"], command: bash scripts/device_run.sh [tests|bench|all|smoke]
set -uo pipefail
what="${1:-all}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
# shellcheck disable=SC1091
source scripts/device_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  python -m pytest -q -m gpu tests -x -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; rc=$?
  tail -30 "$OUT/gpu_tests.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  python scripts/bench_decode.py --out "$OUT/bench_decode.md" > "$OUT/bench_decode.log" 2>&1 || rc=1
  tail -40 "$OUT/bench_decode.log"
fi
if [ "$what" = smoke ]; then
  python scripts/serve_smoke.py --out "$OUT" $( [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && echo --tp2 ) || rc=1
fi
exit $rc
