"""CPU tests of benchmarks/served_models.py: the Qwen3.5-35B-A3B config as SGLang and the plugin
read it, its parameter counts, the model folder with its offline processor, and its server commands."""

from __future__ import annotations

import shlex
import sys
import tomllib

from test_bench_served import REPO, _load_script

models = sys.modules.get("served_models") or _load_script("served_models")
bs = sys.modules.get("bench_served") or _load_script("bench_served")
QWEN35 = "qwen3.5-35b-a3b"


def test_qwen3_5_shape_is_the_recipe_geometry(tmp_path):
    """The saved config loads as transformers' Qwen3.5 wrapper with the recipe's geometry (40 layers,
    every 4th full attention with 16 q / 2 kv heads x 256); the plugin's own reader finds the same
    10 K/V layers and 30 linear ones; ~35B parameters, ~3B per token (the "35B-A3B")."""
    from transformers import AutoConfig

    from sglang_oscar.rotation.geometry import ModelGeometry

    recipe = tomllib.loads((REPO / "recipes" / "Qwen3.5-35B-A3B" / "recipe.toml").read_text())["geometry"]
    path = models.write_model_dir(QWEN35, tmp_path / "m")
    cfg = AutoConfig.from_pretrained(str(path))
    text = cfg.get_text_config()
    assert type(cfg).__name__ == "Qwen3_5MoeConfig" and cfg.architectures == ["Qwen3_5MoeForConditionalGeneration"]
    assert (text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, text.head_dim) == \
        (recipe["num_layers"], recipe["num_q_heads"], recipe["num_kv_heads"], recipe["head_dim"])
    full = [i for i, t in enumerate(text.layer_types) if t == "full_attention"]
    assert full == list(range(3, 40, 4)) and text.full_attention_interval == 4  # SGLang reads the interval
    assert text.rope_parameters["mrope_section"] == [11, 11, 10] and text.max_position_embeddings >= 131072 + 4096
    assert min(cfg.image_token_id, cfg.video_token_id) >= text.vocab_size  # no random prompt id is a vision token
    geo = ModelGeometry.from_hf_config(str(path))
    assert list(geo.layer_ids) == full and sorted(geo.linear_layer_ids) == sorted(set(range(40)) - set(full))
    s = models.Shape.load(QWEN35)
    assert (s.layers, s.all_layers, s.kv_heads, s.head_dim, s.experts, s.topk) == (10, 40, 2, 256, 256, 8)
    assert 34e9 < s.params < 36e9 and 2.7e9 < s.matmul_params < 3.3e9
    assert s.kv_bytes(16.0) == 10 * 2 * 256 * 2 * 2  # BF16 K and V of the 10 attention layers: 20 KB per token


def test_qwen3_5_folder_has_the_processor_sglang_loads(tmp_path):
    """SGLang loads a processor for every multimodal model, --skip-tokenizer-init included: the folder
    has one whose vision tokens sit at the config's ids; the Qwen3 folders hold the config alone."""
    from transformers import AutoConfig, AutoProcessor

    path = models.write_model_dir(QWEN35, tmp_path / "q")
    cfg = AutoConfig.from_pretrained(str(path))
    tok = AutoProcessor.from_pretrained(str(path)).tokenizer
    assert tok.convert_tokens_to_ids(["<|image_pad|>", "<|video_pad|>"]) == [cfg.image_token_id, cfg.video_token_id]
    assert sorted(p.name for p in models.write_model_dir("qwen3-8b", tmp_path / "d").iterdir()) == ["config.json"]


def test_qwen3_5_is_opt_in_and_planned_like_the_others(capsys):
    """Not among the default models; named, its servers load its folder and the plan counts only its
    10 K/V layers: int2 holds ~7x BF16's estimated tokens."""
    assert QWEN35 not in bs.parse_args([]).models and QWEN35 in bs.ALL_MODELS
    assert bs.main(["--dry-run", "--models", QWEN35, "--formats", "bf16,int2"]) == 0
    cmds = [shlex.split(line[2:]) for line in capsys.readouterr().out.splitlines() if line.startswith("$ ")]
    assert len(cmds) == 2 and all(c[c.index("--model-path") + 1].endswith(QWEN35) for c in cmds)
    plans = bs.make_plan(bs.parse_args(["--models", QWEN35, "--formats", "bf16,int2"]))
    bf16, int2 = (p.est_pool_tokens for p in plans)
    assert 6.0 < int2 / bf16 < 7.2


def test_gpt_oss_20b_shape(tmp_path):
    """gpt-oss-20b: transformers reads a GptOss config with 24 layers alternating a 128-key window and
    full attention, 32 experts top-4, sinks (the plugin's reader), positions for a 128K prompt; ~21B
    parameters, ~3.3B per token; the plan counts the 12 full layers' K/V."""
    from transformers import AutoConfig

    from sglang_oscar.rotation.geometry import ModelGeometry

    path = models.write_model_dir("gpt-oss-20b", tmp_path / "g")
    cfg = AutoConfig.from_pretrained(str(path))
    assert type(cfg).__name__ == "GptOssConfig" and cfg.swiglu_limit == 7.0 and cfg.max_position_embeddings >= 135168
    moe = (cfg.num_hidden_layers, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.sliding_window)
    assert moe == (24, 32, 4, 128)
    geo = ModelGeometry.from_hf_config(str(path))
    groups = {g.kind: g for g in geo.groups()}
    assert groups["sliding"].layer_ids == tuple(range(0, 24, 2)) and groups["full"].layer_ids == tuple(range(1, 24, 2))
    assert groups["sliding"].sliding_windows == (128,) and all(geo.layer(i).has_sinks for i in range(24))
    s = models.Shape.load("gpt-oss-20b")
    assert (s.layers, s.all_layers, s.kv_heads, s.head_dim, s.experts, s.topk) == (12, 24, 8, 64, 32, 4)
    assert abs(s.params - 20.9e9) / 20.9e9 < 0.01 and 3.5e9 < s.matmul_params < 3.7e9  # published: 21B, 3.6B active


def test_gpt_oss_servers_take_its_recipe_flags(capsys):
    """As recipes/GPT-OSS-20B serves it: every server sizes SGLang's sliding pool at 0.02 sliding tokens
    per full one, the int2 server keeps the sliding layers BF16; the Qwen3 servers get neither."""
    recipe = tomllib.loads((REPO / "recipes" / "GPT-OSS-20B" / "recipe.toml").read_text())
    extra = recipe["serve"]["extra_args"]
    assert extra[extra.index("--swa-full-tokens-ratio") + 1] == "0.02" and recipe["quant"]["skip_layers"] == "sliding"
    assert bs.main(["--dry-run", "--models", "gpt-oss-20b,qwen3-8b", "--formats", "bf16-t64,int2"]) == 0
    cmds = [shlex.split(line[2:]) for line in capsys.readouterr().out.splitlines() if line.startswith("$ ")]
    got = {(c[c.index("--model-path") + 1].rsplit("/", 1)[1], c[c.index("--kv-cache-dtype") + 1]):
           (c[c.index("--swa-full-tokens-ratio") + 1] if "--swa-full-tokens-ratio" in c else None,
            c[c.index("--oscar-skip-layers") + 1] if "--oscar-skip-layers" in c else None) for c in cmds}
    assert got == {("gpt-oss-20b", "auto"): ("0.02", None), ("gpt-oss-20b", "int2"): ("0.02", "sliding"),
                   ("qwen3-8b", "auto"): (None, None), ("qwen3-8b", "int2"): (None, None)}


def test_sglang_reads_the_hybrid_configs(tmp_path):
    """SGLang's own ModelConfig: both take 128K prompts plus new tokens; GPT-OSS is a hybrid
    sliding-window model over its even layers, Qwen3.5 not (its hybrid is linear attention)."""
    from sglang.srt.configs.model_config import ModelConfig

    oss = ModelConfig(model_path=str(models.write_model_dir("gpt-oss-20b", tmp_path / "g")), dtype="bfloat16")
    q35 = ModelConfig(model_path=str(models.write_model_dir(QWEN35, tmp_path / "q")), dtype="bfloat16")
    assert oss.context_len >= 131072 + 4096 and q35.context_len >= 131072 + 4096
    assert oss.is_hybrid_swa and list(oss.swa_attention_layer_ids) == list(range(0, 24, 2)) and not q35.is_hybrid_swa
