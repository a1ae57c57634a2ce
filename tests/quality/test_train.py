"""scripts/train_small_lm.py: corpus split, tokenizer, a tiny CPU training run and its checkpoint."""

from __future__ import annotations

import json
import math

import torch

from quality_helpers import TINY_MODEL


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_tiny_training_checkpoint(tiny_run, train_script):
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3ForCausalLM

    out, summary = tiny_run
    for name in ("config.json", "model.safetensors", "tokenizer.json", "calib.jsonl", "heldout.jsonl",
                 "train_log.jsonl", "train_summary.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "train_summary.json").read_text())["steps"] == summary["steps"] > 5

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert isinstance(model, Qwen3ForCausalLM) and isinstance(tok, PreTrainedTokenizerFast)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        2, 64, 4, 2, 32)
    assert cfg.vocab_size == len(tok) == summary["vocab_size"] <= 384
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == cfg.eos_token_id
    # byte-level BPE: lossless round trip, no special tokens added
    text = "def f(x):\n    return x  # ünïcode ✓\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text and tok.eos_token_id not in ids and len(ids) < len(text.encode())

    # the saved weights reproduce the held-out loss measured at the end of training (same windows)
    held = _records(out / "heldout.jsonl")
    assert summary["heldout_loss"] < math.log(cfg.vocab_size)  # learned something
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < losses[0] - 0.3, losses
    x = torch.tensor([tok(held[0]["text"])["input_ids"][:64]])
    with torch.no_grad():
        loss = float(model(input_ids=x, labels=x).loss)
    assert math.isfinite(loss) and loss < math.log(cfg.vocab_size)


def test_splits_disjoint_and_deterministic(tiny_run, train_script):
    out, summary = tiny_run
    calib, held = _records(out / "calib.jsonl"), _records(out / "heldout.jsonl")
    assert calib and held
    assert {r["split"] for r in calib} == {"train"} and {r["split"] for r in held} == {"heldout"}
    assert not {r["key"] for r in calib} & {r["key"] for r in held}
    assert not {r["text"] for r in calib} & {r["text"] for r in held}
    for r in calib + held:  # the split is a function of the key alone
        assert train_script.split_of(r["key"], 0.2) == r["split"]
    c = summary["corpus"]
    assert c["heldout_files"] == len(held) and c["train_files"] >= len(calib)
    # the 4 evenly spaced held-out loss windows of 128 tokens touch several held-out files (recorded)
    assert 2 <= c["heldout_eval_files"] <= min(c["heldout_files"], 8)
    assert 0.05 < c["heldout_files"] / (c["heldout_files"] + c["train_files"]) < 0.45


def test_collect_documents_dedup_and_keys(tmp_path, train_script):
    body = "\n".join(f"line {i} of a module" for i in range(40)) + "\n"
    (tmp_path / "a" / "_vendor" / "rich").mkdir(parents=True)
    (tmp_path / "rich").mkdir()
    (tmp_path / "rich" / "console.py").write_text(body + "# v1\n")
    (tmp_path / "a" / "_vendor" / "rich" / "console.py").write_text(body + "# v2\n")  # vendored copy, other content
    (tmp_path / "rich" / "dup.py").write_text(body)
    (tmp_path / "rich" / "dup2.py").write_text(body)  # identical content: kept once
    (tmp_path / "rich" / "data.txt").write_text("x" * 5000)  # one 5000-char line: not prose
    (tmp_path / "rich" / "bin.py").write_bytes(b"\x00\x01" * 100)
    for i in range(30):
        (tmp_path / f"m{i}.md").write_text(body + f"doc {i}\n")
    docs = train_script.collect_documents([str(tmp_path)], max_bytes=10**9, heldout_frac=0.3, seed=0)
    keys = [d["key"] for d in docs]
    assert keys.count("rich/console.py") == 2
    assert len({d["split"] for d in docs if d["key"] == "rich/console.py"}) == 1
    assert sum(k in ("rich/dup.py", "rich/dup2.py") for k in keys) == 1
    assert "rich/data.txt" not in keys and "rich/bin.py" not in keys
    assert len({d["text"] for d in docs}) == len(docs)
    again = train_script.collect_documents([str(tmp_path)], max_bytes=10**9, heldout_frac=0.3, seed=0)
    assert [(d["key"], d["split"]) for d in again] == [(d["key"], d["split"]) for d in docs]
    # a byte budget stops early
    few = train_script.collect_documents([str(tmp_path)], max_bytes=3000, heldout_frac=0.3, seed=0)
    assert 2 <= len(few) < len(docs)


def test_default_text_dirs_include_stdlib(train_script):
    import sysconfig

    assert sysconfig.get_paths()["stdlib"] in train_script.default_text_dirs()


def test_moe_variant(tmp_path, text_tree, train_script):
    from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

    out = tmp_path / "moe"
    summary = train_script.main(["--out", str(out), "--device", "cpu", "--max-steps", "3", "--moe", "--experts", "4",
                                 "--experts-per-tok", "2", "--moe-intermediate", "32", *TINY_MODEL, "--seq-len", "64",
                                 "--batch", "2", "--no-system-text", "--text-dir", str(text_tree), "--heldout-frac", "0.2",
                                 "--eval-every", "0", "--eval-seqs", "2", "--max-mb", "0.1"])
    assert summary["steps"] == 3 and summary["model_type"] == "qwen3_moe"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, Qwen3MoeForCausalLM) and model.config.num_experts == 4


def test_eval_windows_and_their_files(train_script):
    starts = train_script.eval_starts(1000, 100, 4)
    assert starts.tolist() == [0, 299, 599, 899]  # evenly spaced over [0, 900)
    assert train_script.eval_starts(100, 100, 4).numel() == 0
    # documents of 10, 5 and 20 tokens: [0, 10), [10, 15), [15, 35)
    assert train_script.window_files([0], 4, [10, 5, 20]) == 1
    assert train_script.window_files([8], 4, [10, 5, 20]) == 2  # tokens 8..11
    assert train_script.window_files([8], 8, [10, 5, 20]) == 3  # tokens 8..15
    assert train_script.window_files([0, 31], 4, [10, 5, 20]) == 2
    assert train_script.window_files([12, 13], 2, [10, 5, 20]) == 1


def test_llama_variant_has_no_qk_norm(tmp_path, text_tree, train_script, capsys):
    """``--arch llama``: the same sizes as the Qwen3 default, without QK-norm (the ablation of
    docs/quality.md); the checkpoint loads as a Llama model; ``--moe`` with it is refused."""
    import pytest
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    out = tmp_path / "llama"
    common = [*TINY_MODEL, "--seq-len", "64", "--batch", "2", "--no-system-text", "--text-dir", str(text_tree),
              "--heldout-frac", "0.2", "--eval-every", "0", "--eval-seqs", "2", "--max-mb", "0.1"]
    summary = train_script.main(["--out", str(out), "--device", "cpu", "--max-steps", "3", "--arch", "llama", *common])
    assert summary["steps"] == 3 and summary["model_type"] == "llama"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, LlamaForCausalLM) and model.config.head_dim == 32
    assert not any("q_norm" in n or "k_norm" in n for n, _ in model.named_parameters())
    qwen = AutoModelForCausalLM.from_config(train_script.build_config(
        train_script.parse_args(["--out", str(out), *TINY_MODEL]), _Tok()))
    assert any("k_norm" in n for n, _ in qwen.named_parameters())  # the default keeps QK-norm
    with pytest.raises(SystemExit):
        train_script.parse_args(["--out", str(tmp_path / "x"), "--arch", "llama", "--moe"])
    assert "--moe" in capsys.readouterr().err


class _Tok:
    """The tokenizer attributes ``build_config`` reads."""

    eos_token_id = 0
    pad_token_id = 0

    def __len__(self):
        return 384
