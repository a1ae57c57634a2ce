#!/usr/bin/env python
"""Thin driver of ``sglang-oscar quality`` that works without installing the package.

    python scripts/quality.py --model CKPT_DIR --out-dir RESULTS [--work-dir DIR] [options]

Same arguments as ``sglang-oscar quality --help`` (docs/quality.md).
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "python"))

from sglang_oscar.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["quality", *sys.argv[1:]]))
