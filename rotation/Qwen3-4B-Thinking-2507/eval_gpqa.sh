#!/usr/bin/env bash
# Serve this model (BF16 arm, then INT2 arm) and run the recipe's GPQA evaluation.
# A thin wrapper over `sglang-oscar eval-recipe`; every setting lives in recipe.toml.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NAME="$(basename "$HERE")"
cd "$HERE/../.."
RECIPE="rotation/$NAME/recipe.toml"

usage() {
  cat <<USAGE
Usage: rotation/$NAME/eval_gpqa.sh [--dry-run] [--help] [-- EVAL_RECIPE_ARGS...]

Runs, from the repository root:
  sglang-oscar eval-recipe --recipe $RECIPE [EVAL_RECIPE_ARGS...]

  --dry-run   print the exact command and exit
  -- ARGS     extra arguments for eval-recipe (e.g. -- --arms int2 --data-file gpqa=gpqa_diamond.csv)
USAGE
}

DRY_RUN=0
EXTRA=()
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "eval_gpqa.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

if command -v sglang-oscar >/dev/null 2>&1; then
  OSCAR=(sglang-oscar)
else
  OSCAR=("${PYTHON:-python3}" -m sglang_oscar.cli)
fi

CMD=("${OSCAR[@]}" eval-recipe --recipe "$RECIPE")
if ((${#EXTRA[@]} > 0)); then
  CMD+=("${EXTRA[@]}")
fi
printf '%q' "${CMD[0]}"
printf ' %q' "${CMD[@]:1}"
printf '\n'
if ((DRY_RUN == 0)); then
  exec "${CMD[@]}"
fi
