#!/usr/bin/env bash
# Source on the GPU machine, from the repository root (docs/serving.md, "Running it"):
#   source device/env.sh
# 1. the sglang bundle: sources .device-bundle/p2/install.sh when it was carried (after the staging
#    call `bash .device-bundle/p1/stage.sh`) and /tmp/site holds no sglang yet, else reuses /tmp/site
#    from an earlier call on the same machine; its log goes to $OUT/install.log;
# 2. the plugin entry point (sglang.srt.plugins: oscar = sglang_oscar.plugin:register), so that
#    `python -m sglang.launch_server --kv-cache-dtype int2` loads the plugin: `pip install -e .` with
#    PYTHONPATH unset (with it set, setuptools imports the bundled `kernels` package and fails), and
#    if that does not make it visible a minimal sglang_oscar-0.dist-info in /tmp/oscar-ep on PYTHONPATH;
# 3. this checkout's python/ first on PYTHONPATH; PYTHONUNBUFFERED=1, HF_HUB_OFFLINE=1.
# Returns non-zero (and says why) when the bundle install fails, sglang is not importable or the entry point
# stays invisible.
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if [ -f .device-bundle/p2/install.sh ] && [ ! -d /tmp/site/sglang ]; then
  # shellcheck disable=SC1091
  source .device-bundle/p2/install.sh > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; return 1; }
elif [ -d /tmp/site/sglang ]; then
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH};; esac
fi
PY="${PYTHON:-python3}"
# a fresh machine (a warm one is given back after 30 min) has no /tmp/site: without this the servers fail later
"$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('sglang') is None)" || {
  echo "sglang is not importable: on a fresh machine run the staging call, then carry .device-bundle/p2"; return 1; }
_oscar_has_ep() {
  "$PY" -c "import sys; from importlib.metadata import entry_points as e; \
eps = [x for x in e(group='sglang.srt.plugins') if x.name == 'oscar']; \
sys.exit(0 if eps and eps[0].value == 'sglang_oscar.plugin:register' else 1)"
}
if ! _oscar_has_ep; then
  if ! env -u PYTHONPATH "$PY" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/pip_install.log" 2>&1 \
      || ! _oscar_has_ep; then
    ep=/tmp/oscar-ep/sglang_oscar-0.dist-info
    mkdir -p "$ep"
    printf 'Metadata-Version: 2.1\nName: sglang-oscar\nVersion: 0\n' > "$ep/METADATA"
    printf '[sglang.srt.plugins]\noscar = sglang_oscar.plugin:register\n' > "$ep/entry_points.txt"
    case ":${PYTHONPATH:-}:" in *:/tmp/oscar-ep:*) ;; *) export PYTHONPATH=/tmp/oscar-ep${PYTHONPATH:+:$PYTHONPATH};; esac
    echo "entry point: pip install -e . did not provide it (see $OUT/pip_install.log); using $ep"
  fi
fi
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
_oscar_has_ep || { echo "the sglang.srt.plugins entry point 'oscar' is not discoverable"; return 1; }
