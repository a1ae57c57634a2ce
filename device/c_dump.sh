#!/usr/bin/env bash
# Check c's served K/V rows against the oracle's, layer by layer, on the GPU machine.
#   bash device/c_dump.sh [FAMILY] [more options of python -m tests.e2e]     (default family gemma4)
# Runs check c with --c-fp32 and OSCAR_E2E_DUMP_KV set: the fp32 int2 servers save the q / K / V rows
# and the attention output of their first prompt of each length (tests/e2e/fp32_shim.py). Then
# scripts/served_kv_diff.py compares each dump with the oracle (rows vs the oracle's on the checkpoint
# in fp32 and fp64; the oracle replayed on the served rows) and only its reports stay in $OUT
# (kv_diff.txt, kv_diff.tgz with one JSON per dump): the dumps exceed what a device call returns.
set -uo pipefail
cd "$(dirname "$0")/.."
FAM="${1:-gemma4}"
[ $# -gt 0 ] && shift
export OUT="${OUT:-/tmp/oscar_e2e}"
export OSCAR_E2E_DUMP_KV="$OUT/kvdump"
bash device/e2e.sh --only c --families "$FAM" --c-fp32 "$@"
rc=$?
# shellcheck disable=SC1091
source device/env.sh || exit 1
PY="${PYTHON:-python3}"
mkdir -p "$OUT/kv_diff"
for f in "$OUT"/kvdump/kv_*.pt; do
  [ -e "$f" ] || { echo "no dumps in $OUT/kvdump" | tee -a "$OUT/kv_diff.txt"; break; }
  name=$(basename "$f" .pt)
  len=${name##*_}
  [ "$len" -ge 64 ] || continue  # the servers' own warm-up requests
  PYTHONPATH="$PWD:$PYTHONPATH" "$PY" scripts/served_kv_diff.py --dump "$f" --out "$OUT/kv_diff/$name.json" 2>&1 \
    | grep -v -i warn | tee -a "$OUT/kv_diff.txt"
done
tar czf "$OUT/kv_diff.tgz" -C "$OUT" kv_diff && rm -rf "$OUT/kv_diff" "$OUT/kvdump"
exit $rc
