#!/usr/bin/env bash
# Source on the device machine (see ../shared/device_notes.md): installs the sglang bundle when
# .device-bundle/p2 was carried (or reuses /tmp/site from an earlier call on the same machine),
# puts this checkout's python/ on PYTHONPATH and registers the `sglang.srt.plugins` entry point
# (`pip install -e .` fails there: setuptools picks up the bundled `kernels` package), so
# `python -m sglang.launch_server --kv-cache-dtype int2` loads the plugin.
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if [ -d .device-bundle/p2 ] && [ ! -d /tmp/site/sglang ]; then
  # shellcheck disable=SC1091
  source .device-bundle/p2/install.sh > "$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; return 1; }
elif [ -d /tmp/site/sglang ]; then
  case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH};; esac
fi
ep=/tmp/oscar-ep/sglang_oscar-0.1.0.dist-info
mkdir -p "$ep"
printf 'Metadata-Version: 2.1\nName: sglang-oscar\nVersion: 0.1.0\n' > "$ep/METADATA"
printf '[sglang.srt.plugins]\noscar = sglang_oscar.plugin:register\n' > "$ep/entry_points.txt"
export PYTHONPATH="$PWD/python:/tmp/oscar-ep:${PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python -c "import importlib.metadata as m; assert any(e.name=='oscar' for e in m.entry_points(group='sglang.srt.plugins')), 'plugin entry point not visible'" || return 1
