#!/usr/bin/env bash
# Fit this model's OSCAR rotation from its recipe: calibrate -> fit -> validate.
# A thin wrapper: every setting lives in recipe.toml; `sglang-oscar recipe-cmd` expands it into
# the exact argv of each step, which is printed (shell-quoted) and then executed.
set -euo pipefail

# Shared body of recipes/<model>/compute_rotation.sh; the wrapper passes its own folder first.
# shellcheck source=recipe_folder.sh
source "$(dirname "${BASH_SOURCE[0]}")/recipe_folder.sh" compute_rotation_lib.sh "${1:-}"
shift

# User paths are taken relative to the directory the script is called from; the steps run from
# the repository root, so they are made absolute first: an existing --model/--data path (a Hub
# id or datasets name is left as it is) and always --out-dir.
abs_path() {
  case "$1" in
    /*) printf '%s' "$1" ;;
    *) printf '%s/%s' "$PWD" "$1" ;;
  esac
}

usage() {
  cat <<USAGE
Usage: recipes/$NAME/compute_rotation.sh [--model PATH] [--data SOURCE] [--out-dir DIR] [--dry-run] [--help] [-- CALIBRATE_ARGS...]

Runs, from the repository root, with the settings of $RECIPE:
  1. sglang-oscar calibrate  (post-RoPE Q/K/V statistics, fp64, resumable; skipped for data-free methods)
  2. sglang-oscar fit        (statistics -> validated rotation file at [rotation].path)
  3. sglang-oscar validate-rotation  (the rotation file, K/V or latent, against the model's config)

  --model PATH     local checkpoint directory (default: the recipe's hf_id)
  --data SOURCE    calibration prompts: text/JSONL file, task:<name> or a datasets name
                   (default: the recipe's calib_data)
  --out-dir DIR    write statistics and rotation under DIR instead of recipes/$NAME
  --dry-run        print the exact commands and exit
  -- ARGS          extra arguments for the calibrate step (e.g. -- --batch-size 4 --dtype bfloat16);
                   paths among them are read from the repository root

Relative --model/--data/--out-dir paths are relative to the current directory.
USAGE
}

DRY_RUN=0
RC_ARGS=()
EXTRA=()
while (($#)); do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --dry-run) DRY_RUN=1; shift ;;
    --model|--data|--out-dir)
      if (($# < 2)); then echo "compute_rotation.sh: $1 needs a value" >&2; exit 2; fi
      value="$2"
      if [[ "$1" == --out-dir || -e "$value" ]]; then value="$(abs_path "$value")"; fi
      RC_ARGS+=("$1" "$value"); shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "compute_rotation.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
cd "$HERE/../.."

if command -v sglang-oscar >/dev/null 2>&1; then
  OSCAR=(sglang-oscar)
else
  OSCAR=("${PYTHON:-python3}" -m sglang_oscar.cli)
fi

run_step() {
  local step="$1" out
  out="$("${OSCAR[@]}" recipe-cmd --recipe "$RECIPE" --step "$step" ${RC_ARGS[@]+"${RC_ARGS[@]}"})"
  if [[ -z "$out" ]]; then
    echo "# $step: skipped (data-free rotation method in $RECIPE)"
    return 0
  fi
  local -a cmd
  mapfile -t cmd <<<"$out"
  cmd=("${OSCAR[@]}" "${cmd[@]:1}")
  if [[ "$step" == calibrate && ${#EXTRA[@]} -gt 0 ]]; then
    cmd+=("${EXTRA[@]}")
  fi
  printf '%q' "${cmd[0]}"
  printf ' %q' "${cmd[@]:1}"
  printf '\n'
  if ((DRY_RUN == 0)); then
    "${cmd[@]}"
  fi
}

run_step calibrate
run_step fit
run_step validate
