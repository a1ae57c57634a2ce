#!/usr/bin/env bash
# Check c's served K/V rows against the oracle's, layer by layer, on the GPU machine.
#   bash device/c_dump.sh [FAMILY] [more options of python -m tests.e2e]     (default family gemma4)
# Runs check c with --c-fp32, prefill CUDA graphs off (the dump copies rows to the host inside
# forward_extend) and OSCAR_E2E_DUMP_KV pointing outside $OUT: the fp32 int2 servers save the
# q / K / V rows, outputs and sinks of their first prompt of each length (tests/e2e/fp32_shim.py).
# Then scripts/served_kv_diff.py compares each dump with the oracle (rows vs the oracle's on the
# checkpoint in fp32 and fp64; the oracle replayed on the served rows); only its reports come back
# in $OUT (kv_diff.txt, kv_diff.tgz with one JSON per dump). Options after FAMILY go to the harness
# (e.g. --budget 330); a --server-args given there replaces the one here, so keep
# --disable-prefill-cuda-graph in it.
set -uo pipefail
cd "$(dirname "$0")/.."
FAM="${1:-gemma4}"
[ $# -gt 0 ] && shift
export OUT="${OUT:-/tmp/oscar_e2e}"
export OSCAR_E2E_DUMP_KV="${OUT}_work/kvdump"
rm -rf "$OSCAR_E2E_DUMP_KV"
bash device/e2e.sh --only c --families "$FAM" --c-fp32 --server-args=--disable-prefill-cuda-graph "$@"
rc=$?
# shellcheck disable=SC1091
source device/env.sh || exit 1
PY="${PYTHON:-python3}"
mkdir -p "$OUT/kv_diff"
for f in "$OSCAR_E2E_DUMP_KV"/kv_*.pt; do
  [ -e "$f" ] || { echo "no dumps in $OSCAR_E2E_DUMP_KV" | tee -a "$OUT/kv_diff.txt"; break; }
  name=$(basename "$f" .pt)
  len=${name##*_}
  [ "$len" -ge 64 ] || continue  # the servers' own warm-up requests
  PYTHONPATH="$PWD:$PYTHONPATH" "$PY" scripts/served_kv_diff.py --dump "$f" --threads "$(nproc)" \
    --out "$OUT/kv_diff/$name.json" 2>&1 | grep -v -i warn | tee -a "$OUT/kv_diff.txt"
done
# one line over every dump: the largest replay difference (the oracle's attention on the served rows
# against the served output), the INT2 path's own agreement with the oracle, free of the model's cascades
"$PY" - "$OUT/kv_diff" <<'PYEOF' | tee -a "$OUT/kv_diff.txt"
import glob, json, sys
rows = [r for f in glob.glob(sys.argv[1] + "/*.json") for v in json.load(open(f)).values() for r in v if "replay_o_rel" in r]
if rows:
    worst = max(rows, key=lambda r: r["replay_o_rel"])
    print(f"replay: max rel {worst['replay_o_rel']:.2e} over {len(rows)} layer x prompt dumps "
          f"(layer {worst['layer']}, {worst['tokens']} tokens)")
else:
    print("replay: no layer replayed")
PYEOF
tar czf "$OUT/kv_diff.tgz" -C "$OUT" kv_diff && rm -rf "$OUT/kv_diff"
exit $rc
