"""Helpers of the calibration tests: tiny seeded transformers models (no hub access) and prompt data."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

VOCAB_WORDS = 240
SEQ_LEN = 128


def _words() -> list[str]:
    cons, vows = "bdfgklmnprstvz", "aeiou"
    out = []
    rng = random.Random(7)
    while len(out) < VOCAB_WORDS:
        w = "".join(rng.choice(cons) + rng.choice(vows) for _ in range(rng.randint(1, 3)))
        if w not in out:
            out.append(w)
    return out


WORDS = _words()


def make_text(n_docs: int, words_per_doc: int, seed: int) -> list[str]:
    """Seeded pseudo-text: Zipf-ish word draws with some repeated phrases (attention has structure)."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) for i in range(len(WORDS))]
    docs = []
    for _ in range(n_docs):
        ws = rng.choices(WORDS, weights, k=words_per_doc)
        for _ in range(words_per_doc // 20):  # copy earlier spans: induction-style structure
            a = rng.randrange(0, max(1, len(ws) - 8))
            b = rng.randrange(0, len(ws))
            ws[b:b] = ws[a:a + 6]
        docs.append(" ".join(ws[:words_per_doc]))
    return docs


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in WORDS:
        vocab[w] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


VOCAB = VOCAB_WORDS + 4


def family_config(family: str, **over):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  max_position_embeddings=1024, tie_word_embeddings=False)
    if family == "qwen3":
        cfg = tf.Qwen3Config(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    elif family == "llama":
        cfg = tf.LlamaConfig(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True)
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(**common, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=24,
                                  layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=16)
    elif family == "deepseek_v2":
        cfg = tf.DeepseekV2Config(**common, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=64,
                                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=2, n_shared_experts=1)
    else:
        raise ValueError(family)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def build_model(family: str, seed: int = 0, **over):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, **over)).eval()
    # Larger-than-default init so attention is far from uniform (std 0.02 gives flat softmax).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight")):
                p.normal_(0.0, 0.25)
    return model


def save_model(model, tok, path: Path) -> Path:
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_prompts(path: Path, n_docs: int = 40, words: int = 160, seed: int = 0, jsonl: bool = False) -> Path:
    docs = make_text(n_docs, words, seed)
    if jsonl:
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    else:
        path.write_text("\n\n".join(docs) + "\n")
    return path
