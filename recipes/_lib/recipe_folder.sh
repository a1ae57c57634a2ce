#!/usr/bin/env bash
# Sourced by the _lib scripts as `source recipe_folder.sh LIB_NAME FOLDER`: checks that FOLDER is a
# recipes/<model> folder holding recipe.toml (else names LIB_NAME and exits 2), then sets HERE (its
# absolute path), NAME (the model folder's name) and RECIPE (recipes/NAME/recipe.toml, relative to
# the repository root).
if (($# < 2)) || [[ ! -f "$2/recipe.toml" ]]; then
  echo "$1: the first argument must be a recipes/<model> folder holding recipe.toml" >&2
  exit 2
fi
HERE="$(cd "$2" && pwd)"
NAME="$(basename "$HERE")"
RECIPE="recipes/$NAME/recipe.toml"
