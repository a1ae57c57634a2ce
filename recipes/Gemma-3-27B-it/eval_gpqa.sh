#!/usr/bin/env bash
# Serve this model (BF16 and INT2 arms from recipe.toml), run its evals, compare (--help for options).
# Every setting lives in recipe.toml; the steps are in ../_lib/eval_gpqa_lib.sh.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$HERE/../_lib/eval_gpqa_lib.sh" "$HERE" "$@"
