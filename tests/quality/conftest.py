"""Fixtures of the quality tests: the training script as a module, a synthetic text tree, a tiny
trained checkpoint and a tiny random checkpoint with disjoint calib/heldout documents."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

# a tiny model: every test here runs in well under a minute on two cores
TINY_MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
              "--intermediate", "128", "--vocab", "384", "--max-positions", "512"]


def load_train_script():
    """``scripts/train_small_lm.py`` imported as a module."""
    name = "train_small_lm"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / "train_small_lm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


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


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread avoids oversubscribing a busy 2-core box (restored after each
    module; module scope, so it is in place before the module-scoped fixtures that do the work)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def train_script():
    return load_train_script()


@pytest.fixture(scope="session")
def text_tree(tmp_path_factory):
    return write_text_tree(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory, text_tree, train_script):
    """A 3-second CPU training run: ``(out_dir, summary)``."""
    out = tmp_path_factory.mktemp("ckpt")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = train_script.main(["--out", str(out), "--device", "cpu", "--minutes", "0.05", *TINY_MODEL,
                                     "--seq-len", "128", "--batch", "4", "--no-system-text", "--text-dir", str(text_tree),
                                     "--heldout-frac", "0.2", "--log-every", "5", "--eval-every", "0", "--eval-seqs", "4",
                                     "--warmup-steps", "5", "--lr", "3e-3"])
    finally:
        torch.set_num_threads(n)
    return out, summary
