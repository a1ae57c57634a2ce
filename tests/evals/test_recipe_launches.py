"""Every served recipe's int2 launch passes the plugin's launch refusals.

The parser tests (test_evals_launcher.py) only prove SGLang accepts the argv; the refusals also read
the model's config (architectures, sparse-attention keys, block-FP8 expert widths) and the prefill
CUDA-graph backend SGLang resolves (``breakable`` on CUDA unless ``--disable-prefill-cuda-graph``).
Each family gets the config keys those refusals read, with the published values of its model.
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
from sglang_oscar.plugin.refusals import refusal_messages

REPO = Path(__file__).resolve().parents[2]

# What the refusals read of each served family's config.json (MiniMax-M2.7: block-FP8 experts 1536
# wide, 48 query / 8 kv heads; MiniMax-M3: its sparse-attention block of 128).
FAMILY_CONFIGS = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"]},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"]},
    "qwen3_5": {"architectures": ["Qwen3_5MoeForConditionalGeneration"]},
    "gemma3": {"architectures": ["Gemma3ForConditionalGeneration"]},
    "gemma4": {"architectures": ["Gemma4ForConditionalGeneration"]},
    "gpt_oss": {"architectures": ["GptOssForCausalLM"]},
    "minimax_m2": {"architectures": ["MiniMaxM2ForCausalLM"], "num_attention_heads": 48, "num_key_value_heads": 8,
                   "intermediate_size": 1536,
                   "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
    "minimax_m3": {"architectures": ["MiniMaxM3SparseForConditionalGeneration"],
                   "text_config": {"model_type": "minimax_m2", "num_attention_heads": 64, "num_key_value_heads": 4,
                                   "sparse_attention_config": {"sparse_block_size": 128}}},
}


def _served_recipes() -> list[str]:
    return sorted(p for p in glob.glob(str(REPO / "recipes" / "*" / "recipe.toml")) if load_recipe(p).model.served)


def test_every_served_family_has_a_config():
    families = {load_recipe(p).model.family for p in _served_recipes()}
    assert len(families) >= 8 and families <= set(FAMILY_CONFIGS), families - set(FAMILY_CONFIGS)


@pytest.mark.parametrize("recipe_path", _served_recipes(), ids=lambda p: Path(p).parent.name)
def test_served_recipe_int2_launch_is_not_refused(recipe_path, tmp_path, capsys, monkeypatch):
    recipe = load_recipe(recipe_path)
    assert main(["serve", "--recipe", recipe_path, "--kv", "int2", "--dry-run"]) == 0
    words = shlex.split(capsys.readouterr().out.strip())
    args = oscar_server_parser(allow_abbrev=False).parse_args(words[words.index("sglang.launch_server") + 1:])
    (tmp_path / "config.json").write_text(json.dumps(FAMILY_CONFIGS[recipe.model.family]))
    args.model_path = str(tmp_path)  # the Hub id's config, as the refusals read a local one
    backend = "disabled" if args.disable_prefill_cuda_graph else "breakable"  # SGLang's CUDA default
    args.cuda_graph_config = SimpleNamespace(prefill=SimpleNamespace(backend=backend))
    monkeypatch.delenv("SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE", raising=False)
    assert refusal_messages(args) == []
