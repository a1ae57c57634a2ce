"""Fixtures of the quality tests: the training script as a module, a synthetic text tree, a tiny
trained checkpoint and a tiny random checkpoint with disjoint calib/heldout documents."""

from __future__ import annotations

import pytest
import torch

from quality_helpers import TINY_MODEL, load_train_script, write_text_tree


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
