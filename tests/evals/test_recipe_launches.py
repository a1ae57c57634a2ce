"""Every served recipe's int2 launch passes the plugin's launch checks.

The parser tests (test_evals_launcher.py) only prove SGLang accepts the argv. Here each served
recipe's int2 argv goes through the refusals (architectures, sparse-attention keys, block-FP8
expert widths, the prefill CUDA-graph backend) and the preflight (geometry, group size, skipped
layers, decode engine), on a config.json with its model's published geometry. The prefill backend
is SGLang's CUDA default, ``breakable``, unless the argv disables the prefill graph
(``srt/model_executor/cuda_graph_config.py`` ``default_prefill_backend``). Recipes with a fitted
rotation are checked with the data-free one: the files are per-user and checked by validate. Both
arms' argv then build SGLang's real ``ServerArgs``, whose ``__post_init__`` holds SGLang's own launch
asserts besides the plugin's hooks.
"""

from __future__ import annotations

import glob
import json
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from _support.server_args import oscar_server_parser
from sglang_oscar.cli.main import main
from sglang_oscar.evals.recipe import load_recipe
from sglang_oscar.plugin.flags import CONFIG_ENV, FLAGS, resolve_config
from sglang_oscar.plugin.refusals import refusal_messages

REPO = Path(__file__).resolve().parents[2]


def _every(n: int, full_every: int) -> list[str]:
    return ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(n)]


# One published config per served family (what the checks read of it; a family's other recipes differ
# in sizes only): Qwen3-8B, Qwen3-30B-A3B, Qwen3.5-35B-A3B, Gemma-3-27B-it, Gemma-4-12B-it,
# gpt-oss-20b, MiniMax-M2.7 (block-FP8 experts 1536 wide), MiniMax-M3 (its sparse layers' index
# branch: 4 heads x 128, index V disabled, blocks of 128; expert width and quantization left out).
FAMILY_CONFIGS = {
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 36,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096},
    "qwen3_moe": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 2048},
    "qwen3_5": {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                "text_config": {"model_type": "qwen3_5_moe_text", "num_hidden_layers": 40, "num_attention_heads": 16,
                                "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048,
                                "full_attention_interval": 4}},
    "gemma3": {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
               "text_config": {"model_type": "gemma3_text", "num_hidden_layers": 62, "num_attention_heads": 32,
                               "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376, "sliding_window": 1024,
                               "layer_types": _every(62, 6)}},
    "gemma4": {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"],
               "text_config": {"model_type": "gemma4_text", "num_hidden_layers": 48, "num_attention_heads": 16,
                               "num_key_value_heads": 8, "head_dim": 256, "global_head_dim": 512,
                               "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 1024,
                               "hidden_size": 3840, "layer_types": _every(48, 6)}},
    "gpt_oss": {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "num_hidden_layers": 24,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880,
                "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 12},
    "minimax_m2": {"model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "num_hidden_layers": 62,
                   "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64,
                   "hidden_size": 3072, "intermediate_size": 1536,
                   "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
    "minimax_m3": {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
                   "text_config": {"model_type": "minimax_m2", "num_hidden_layers": 60, "num_attention_heads": 64,
                                   "num_key_value_heads": 4, "head_dim": 128, "sparse_attention_config": {
                                       "sparse_attention_freq": [0, 1, 1] * 20, "sparse_disable_index_value": [1] * 60,
                                       "sparse_num_index_heads": 4, "sparse_index_dim": 128, "sparse_block_size": 128,
                                       "sparse_topk_blocks": 16, "sparse_init_block": 1, "sparse_local_block": 1}}},
}


def _served_recipes() -> list[str]:
    return sorted(p for p in glob.glob(str(REPO / "recipes" / "*" / "recipe.toml")) if load_recipe(p).model.served)


def test_every_served_family_has_a_config():
    families = {load_recipe(p).model.family for p in _served_recipes()}
    assert len(families) >= 8 and families <= set(FAMILY_CONFIGS), families - set(FAMILY_CONFIGS)


@pytest.mark.parametrize("recipe_path", _served_recipes(), ids=lambda p: Path(p).parent.name)
def test_served_recipe_int2_launch_passes_the_launch_checks(recipe_path, tmp_path, capsys, monkeypatch):
    import sglang_oscar.plugin as plugin

    recipe = load_recipe(recipe_path)
    assert main(["serve", "--recipe", recipe_path, "--kv", "int2", "--dry-run"]) == 0
    words = shlex.split(capsys.readouterr().out.strip())
    args = oscar_server_parser(allow_abbrev=False).parse_args(words[words.index("sglang.launch_server") + 1:])
    (tmp_path / "config.json").write_text(json.dumps(FAMILY_CONFIGS[recipe.model.family]))
    args.model_path = str(tmp_path)  # the Hub id's config, read as the checks read a local one
    backend = "disabled" if args.disable_prefill_cuda_graph else "breakable"
    args.cuda_graph_config = SimpleNamespace(prefill=SimpleNamespace(backend=backend))
    monkeypatch.delenv("SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE", raising=False)
    assert refusal_messages(args) == []
    config, _ = resolve_config({f.dest: getattr(args, f.dest) for f in FLAGS if f.dest != "oscar_rotation"}, environ={})
    args._oscar_config = config
    assert plugin.preflight(args) is None
    assert config.sink_tokens == recipe.quant.sink_tokens and config.group_size == recipe.quant.group_size


# What SGLang's own ModelConfig reads beyond FAMILY_CONFIGS: the Qwen contexts (published; the recipes pass
# --context-length up to them) and MiniMax-M3's sizes (any values: no check reads them).
SGLANG_KEYS = {"qwen3": {"max_position_embeddings": 40960}, "qwen3_moe": {"max_position_embeddings": 40960},
               "qwen3_5": {"max_position_embeddings": 262144},
               "minimax_m3": {"hidden_size": 3072, "vocab_size": 200064}}


@pytest.mark.parametrize("kv", ["bf16", "int2"])
@pytest.mark.parametrize("recipe_path", _served_recipes(), ids=lambda p: Path(p).parent.name)
def test_served_recipe_argv_builds_sglangs_server_args(recipe_path, kv, tmp_path, capsys, monkeypatch):
    """Both arms' argv through SGLang's real ServerArgs (its __post_init__ and the plugin's hooks), which
    also holds SGLang's own launch asserts (a mamba radix-cache strategy without the overlap schedule
    it needs). SGLang's CPU-only refusal of the extra_buffer strategy is lifted, as on the GPU."""
    from sglang.srt.server_args import ServerArgs

    recipe = load_recipe(recipe_path)
    assert main(["serve", "--recipe", recipe_path, "--kv", kv, "--dry-run"]) == 0
    words = shlex.split(capsys.readouterr().out.strip())
    argv = words[words.index("sglang.launch_server") + 1:]
    if "--oscar-rotation" in argv:  # per-user files, checked by validate
        i = argv.index("--oscar-rotation")
        del argv[i:i + 2]
    cfg = json.loads(json.dumps(FAMILY_CONFIGS[recipe.model.family]))
    cfg.get("text_config", cfg).update(SGLANG_KEYS.get(recipe.model.family, {}))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    argv[argv.index("--model-path") + 1] = str(tmp_path)
    monkeypatch.setenv(CONFIG_ENV, "")  # the int2 hook exports its config here: restored after the test
    monkeypatch.delenv("SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE", raising=False)
    monkeypatch.setattr("sglang.srt.server_args.is_cuda", lambda: True)
    args = oscar_server_parser(allow_abbrev=False).parse_args(argv)
    args.device = "cuda"
    server_args = ServerArgs.from_cli_args(args)
    assert server_args.kv_cache_dtype == ("int2" if kv == "int2" else "auto")
