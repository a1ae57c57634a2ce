"""Helpers shared by the quality tests (imported by name: ``from quality_helpers import ...``;
a ``from conftest import`` would depend on which of the suite's conftest modules pytest loaded last)."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# a tiny model: every test here runs in well under a minute on two cores
TINY_MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
              "--intermediate", "128", "--vocab", "384", "--max-positions", "512"]


def load_script(name: str):
    """``scripts/<name>.py`` imported as a module (once; cached in ``sys.modules``)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_train_script():
    """``scripts/train_small_lm.py`` imported as a module."""
    return load_script("train_small_lm")


def _words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    cons, vows = "bdfgklmnprstvz", "aeiou"
    out: list[str] = []
    while len(out) < n:
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 3)))
        if w not in out:
            out.append(w)
    return out


def write_text_tree(root: Path, n_files: int = 60, seed: int = 0) -> Path:
    """Seeded pseudo-code files (``pkgN/modM.py`` and ``.md``): Zipf-ish identifiers, repeated
    spans (so attention has structure), indentation."""
    rng = random.Random(seed)
    words = _words(200, seed)
    weights = [1.0 / (i + 1) for i in range(len(words))]
    for f in range(n_files):
        lines = []
        for _ in range(rng.randint(40, 80)):
            ws = rng.choices(words, weights, k=rng.randint(3, 9))
            indent = "    " * rng.randint(0, 2)
            if rng.random() < 0.3:
                lines.append(f"{indent}def {ws[0]}_{ws[1]}({', '.join(ws[2:])}):")
            elif rng.random() < 0.3 and lines:
                lines.append(lines[rng.randrange(len(lines))])  # copied line
            else:
                lines.append(indent + " ".join(ws))
        ext = ".md" if f % 7 == 0 else ".py"
        path = root / f"pkg{f % 6}" / f"mod{f}{ext}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    return root
