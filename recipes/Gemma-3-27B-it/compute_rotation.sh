#!/usr/bin/env bash
# Fit this model's OSCAR rotation from recipe.toml: calibrate -> fit -> validate (--help for options).
# Every setting lives in recipe.toml; the steps are in ../_lib/compute_rotation_lib.sh.
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$HERE/../_lib/compute_rotation_lib.sh" "$HERE" "$@"
