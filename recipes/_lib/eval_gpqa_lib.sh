#!/usr/bin/env bash
# Serve this model (BF16 arm, then INT2 arm) and run the recipe's GPQA evaluation.
# A thin wrapper over `sglang-oscar eval-recipe`; every setting lives in recipe.toml.
set -euo pipefail

CALLER="$PWD"  # relative --out / --data-file paths are the caller's, not the repository's
# Shared body of recipes/<model>/eval_gpqa.sh; the wrapper passes its own folder first.
# shellcheck source=recipe_folder.sh
source "$(dirname "${BASH_SOURCE[0]}")/recipe_folder.sh" eval_gpqa_lib.sh "${1:-}"
shift
cd "$HERE/../.."

usage() {
  cat <<USAGE
Usage: recipes/$NAME/eval_gpqa.sh [--dry-run] [--help] [-- EVAL_RECIPE_ARGS...]

Runs, from the repository root:
  sglang-oscar eval-recipe --recipe $RECIPE [EVAL_RECIPE_ARGS...]

  --dry-run   print the exact command and exit
  -- ARGS     extra arguments for eval-recipe (e.g. -- --arms int2 --data-file gpqa=gpqa_diamond.csv)

Relative paths given with --out and --data-file are resolved against the directory you run
this script from (they are made absolute). Without --out, results go to runs/$NAME in the
repository root.
USAGE
}

# Absolute form of a path relative to the caller's directory ("" and absolute paths as is).
abs_path() {
  case "$1" in
    /* | "") printf '%s' "$1" ;;
    *) printf '%s/%s' "$CALLER" "$1" ;;
  esac
}

# TASK=PATH with PATH made absolute (an item without '=' is left for eval-recipe to refuse).
abs_data_file() {
  case "$1" in
    *=*) printf '%s=%s' "${1%%=*}" "$(abs_path "${1#*=}")" ;;
    *) printf '%s' "$1" ;;
  esac
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

ARGS=()
i=0
while ((i < ${#EXTRA[@]})); do
  a="${EXTRA[i]}"
  case "$a" in
    --out|--data-file)
      ARGS+=("$a")
      if ((i + 1 < ${#EXTRA[@]})); then
        i=$((i + 1))
        if [[ $a == --out ]]; then
          ARGS+=("$(abs_path "${EXTRA[i]}")")
        else
          ARGS+=("$(abs_data_file "${EXTRA[i]}")")
        fi
      fi
      ;;
    --out=*) ARGS+=("--out=$(abs_path "${a#--out=}")") ;;
    --data-file=*) ARGS+=("--data-file=$(abs_data_file "${a#--data-file=}")") ;;
    *) ARGS+=("$a") ;;
  esac
  i=$((i + 1))
done

if command -v sglang-oscar >/dev/null 2>&1; then
  OSCAR=(sglang-oscar)
else
  OSCAR=("${PYTHON:-python3}" -m sglang_oscar.cli)
fi

CMD=("${OSCAR[@]}" eval-recipe --recipe "$RECIPE")
if ((${#ARGS[@]} > 0)); then
  CMD+=("${ARGS[@]}")
fi
printf '%q' "${CMD[0]}"
printf ' %q' "${CMD[@]:1}"
printf '\n'
if ((DRY_RUN == 0)); then
  exec "${CMD[@]}"
fi
