#!/usr/bin/env bash
# End-to-end checks of the served INT2 KV cache on the GPU machine (the harness is tests/e2e).
#   bash device/e2e.sh [--only a,b,c] [--tp2] [more options of python -m tests.e2e]
#   e.g. bash device/e2e.sh --only b,d,g --server-args=--disable-prefill-cuda-graph
# Sets up sglang and the plugin's entry point (device/env.sh), then runs `python -m tests.e2e`;
# e2e.json, e2e.md and the server logs (as logs.tgz: a device call returns at most 8 files) go to $OUT
# (default /tmp/oscar_e2e), checkpoints to ${OUT}_work.
# E2E_CALL_S (default 590): seconds of the device call; the harness gets a SIGTERM in time to stop its
# servers, write its results and leave the archive below (its --budget alone does not bound a check's requests).
# Exit code: the harness's (1 if a selected check did not pass; 124 when the SIGTERM came).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/oscar_e2e}"
mkdir -p "$OUT"
# shellcheck disable=SC1091
source device/env.sh || exit 1
PY="${PYTHON:-python3}"
"$PY" -c "import sglang_oscar, sys; print('sglang_oscar from', sglang_oscar.__file__, '| python', sys.version.split()[0])"
nvidia-smi --query-gpu=index,name,memory.used,memory.total,compute_mode --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
# 45 s after the SIGTERM: the harness stops its servers (15 s each, eight at a time) and writes e2e.json
left=$(( ${E2E_CALL_S:-590} - SECONDS - 55 )); [ "$left" -ge 60 ] || left=60
timeout -k 45 "$left" "$PY" -m tests.e2e --out "$OUT" --python "$(command -v "$PY")" "$@"
rc=$?
# a device call returns at most 8 files from $OUT: the server logs travel as one archive
if [ -d "$OUT/logs" ]; then tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"; fi
exit $rc
