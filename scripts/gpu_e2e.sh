#!/usr/bin/env bash
# Device-side wrapper of scripts/gpu_e2e.py (end-to-end checks of the served INT2 KV cache).
#   usage (repository root, on the GPU machine): bash scripts/gpu_e2e.sh [--only a,b,c] [--tp2] [gpu_e2e.py options]
# 1. the sglang bundle: sources .device-bundle/p2/install.sh when it is there (after the staging call
#    `bash .device-bundle/p1/stage.sh`), else reuses /tmp/site from an earlier call on the same machine;
# 2. makes the plugin entry point (sglang.srt.plugins: oscar = sglang_oscar.plugin:register) discoverable:
#    `pip install -e .` without PYTHONPATH (the bundled `kernels` package breaks setuptools), else a
#    minimal sglang_oscar-0.dist-info on PYTHONPATH next to $PWD/python;
# 3. runs gpu_e2e.py; logs, e2e.json and e2e.md go to $OUT (default /tmp/oscar_e2e). Exit code: the script's.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/oscar_e2e}"
mkdir -p "$OUT"
if [ -f .device-bundle/p2/install.sh ]; then
  # shellcheck disable=SC1091
  source .device-bundle/p2/install.sh > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
elif [ -d /tmp/site/sglang ]; then
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
fi
PY="${PYTHON:-python3}"
has_ep() {
  "$PY" - <<'PYEOF'
import sys
from importlib.metadata import entry_points
eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "oscar"]
sys.exit(0 if eps and eps[0].value == "sglang_oscar.plugin:register" else 1)
PYEOF
}
if ! has_ep; then
  if ! env -u PYTHONPATH "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip_install.log" 2>&1 || ! has_ep; then
    EP="$(mktemp -d)"
    mkdir -p "$EP/sglang_oscar-0.dist-info"
    printf 'Metadata-Version: 2.1\nName: sglang-oscar\nVersion: 0\n' > "$EP/sglang_oscar-0.dist-info/METADATA"
    printf '[sglang.srt.plugins]\noscar = sglang_oscar.plugin:register\n' > "$EP/sglang_oscar-0.dist-info/entry_points.txt"
    export PYTHONPATH="$EP${PYTHONPATH:+:$PYTHONPATH}"
    echo "entry point: pip install -e . failed (see $OUT/pip_install.log); using $EP/sglang_oscar-0.dist-info"
  fi
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
has_ep || { echo "the sglang.srt.plugins entry point 'oscar' is not discoverable"; exit 1; }
"$PY" -c "import sglang_oscar, sys; print('sglang_oscar from', sglang_oscar.__file__, '| python', sys.version.split()[0])"
nvidia-smi --query-gpu=index,name,memory.used,memory.total,compute_mode --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
"$PY" scripts/gpu_e2e.py --out "$OUT" --python "$(command -v "$PY")" "$@"
