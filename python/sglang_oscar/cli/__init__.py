"""The ``sglang-oscar`` command line (argument parsing only; work lives in the other parts)."""
