"""Torch-free constants shared by the library and the CLI (importing this module must stay cheap:
``sglang-oscar --help`` builds every verb's parser from them)."""

# Largest accepted ``max |R R^T - I|`` of a rotation matrix (rotation files, fits, conversions).
DEFAULT_ORTHO_TOL = 1e-3
