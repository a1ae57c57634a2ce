"""Fixtures of the calibration tests (helpers in calib_tiny.py)."""

from __future__ import annotations

import pytest

from calib_tiny import build_model, make_tokenizer, save_model, write_prompts


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tokenizer):
    """Saved tiny models of every family: {family: directory}."""
    out = {}
    for fam in ("qwen3", "qwen3_moe", "llama", "gemma3", "deepseek_v2"):
        d = tmp_path_factory.mktemp(f"model_{fam}")
        save_model(build_model(fam), tokenizer, d)
        out[fam] = d
    return out


@pytest.fixture(scope="session")
def prompt_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    return {
        "calib": write_prompts(d / "calib.txt", n_docs=40, words=160, seed=0),
        "heldout": write_prompts(d / "heldout.jsonl", n_docs=12, words=200, seed=99, jsonl=True),
    }
