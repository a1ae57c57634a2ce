"""Recipe loader: schema, defaults, strictness."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from sglang_oscar.evals.recipe import RecipeError, load_recipe
from sglang_oscar.evals.tasks import TASKS

FULL = """
[model]
hf_id = "Qwen/Qwen3-8B"
family = "qwen3"
served = true
notes = "test recipe"
json_model_override_args = { rope_scaling = { rope_type = "yarn", factor = 4.0, original_max_position_embeddings = 32768 }, max_position_embeddings = 131072 }

[geometry]
num_layers = 36
num_q_heads = 32
num_kv_heads = 8
head_dim = 128

[rotation]
method = "oscar"
path = "rot.safetensors"
calib_tokens = 20000
calib_data = "prompts.jsonl"

[quant]
group_size = 128
k_clip_ratio = 0.96
v_clip_ratio = 0.9
sink_tokens = 128
recent_tokens = 2048
quantizer = "lloyd-max"
scale_dtype = "float16"

[serve]
tp = 2
port = 31057
host = "127.0.0.1"
mem_fraction_static = 0.8
max_running_requests = 64
context_length = 131072
extra_args = ["--trust-remote-code", "--cuda-graph-max-bs", "32"]
env = { SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN = "1" }

[eval]
tasks = ["gpqa", "aime25"]
seeds = [0, 1, 2]
max_tokens = 65536
temperature = 0.6
top_p = 0.95
top_k = 20
threads = 16
n_examples = 48
"""

MINIMAL = """
[model]
hf_id = "Qwen/Qwen3-4B-Thinking-2507"
family = "qwen3"
served = true
"""


def write(tmp_path: Path, text: str, name: str = "recipe.toml") -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_text(textwrap.dedent(text))
    return p


def test_full_recipe_values(tmp_path):
    r = load_recipe(write(tmp_path, FULL))
    assert r.model.hf_id == "Qwen/Qwen3-8B" and r.model.family == "qwen3" and r.model.served
    assert r.model.json_model_override_args["max_position_embeddings"] == 131072
    assert r.geometry.num_layers == 36 and r.geometry.head_dim == 128
    assert r.rotation.method == "oscar"
    assert r.rotation_path == (tmp_path / "m" / "rot.safetensors").resolve()
    assert r.quant.group_size == 128 and r.quant.v_clip_ratio == 0.9
    assert r.quant.quantizer == "lloyd-max" and r.quant.scale_dtype == "float16"
    assert r.serve.tp == 2 and r.serve.port == 31057 and r.serve.mem_fraction_static == 0.8
    assert r.serve.extra_args == ["--trust-remote-code", "--cuda-graph-max-bs", "32"]
    assert r.serve.env == {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
    assert r.context_length == 131072
    assert r.eval.tasks == ["gpqa", "aime25"] and r.eval.seeds == [0, 1, 2]
    assert r.eval.top_k == 20 and r.eval.n_examples == 48 and r.eval.temperature == 0.6
    assert r.name == "m"


def test_minimal_recipe_defaults(tmp_path):
    r = load_recipe(write(tmp_path, MINIMAL))
    assert r.quant.k_clip_ratio == 0.96 and r.quant.v_clip_ratio == 0.92
    assert r.quant.sink_tokens == 64 and r.quant.recent_tokens == 256
    assert r.quant.group_size is None and r.quant.quantizer is None and r.quant.scale_dtype is None
    assert r.serve.port == 30000 and r.serve.host == "127.0.0.1" and r.serve.tp == 1
    assert r.serve.extra_args == [] and r.serve.env == {}
    assert r.rotation.method == "oscar" and r.rotation_path is None
    assert r.eval.tasks == ["gpqa"] and r.eval.seeds == [0] and r.eval.max_tokens == 32768
    assert r.context_length is None


def test_heterogeneous_geometry(tmp_path):
    text = MINIMAL.replace('family = "qwen3"', 'family = "gemma4"') + """
[geometry]
num_layers = 48
num_q_heads = 16

[geometry.sliding]
num_kv_heads = 8
head_dim = 256
sliding_window = 1024
layers = [0, 1, 2, 3, 4]

[geometry.full]
num_kv_heads = 1
head_dim = 512
layers = [5, 11]
k_eq_v = true
"""
    r = load_recipe(write(tmp_path, text))
    assert r.geometry.sliding.sliding_window == 1024 and r.geometry.sliding.layers == [0, 1, 2, 3, 4]
    assert r.geometry.full.head_dim == 512 and r.geometry.full.k_eq_v is True
    assert r.geometry.num_kv_heads is None


def test_recipe_tasks_match_eval_tasks(tmp_path):
    """The tasks a recipe accepts are exactly the choices of `sglang-oscar eval --task`, and
    each has a dataset source and a prompt."""
    import argparse
    import json

    from sglang_oscar.cli.main import build_parser
    from sglang_oscar.evals.datasets import HUB_SOURCES

    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    cli_tasks = next(a.choices for a in verbs.choices["eval"]._actions if a.dest == "task")
    assert list(cli_tasks) == ["gpqa", "aime25", "math500", "humaneval"]
    r = load_recipe(write(tmp_path, MINIMAL + f"\n[eval]\ntasks = {json.dumps(list(cli_tasks))}\n"))
    assert r.eval.tasks == list(cli_tasks)
    with pytest.raises(RecipeError, match="'mmlu' is not one of"):
        load_recipe(write(tmp_path, MINIMAL + '\n[eval]\ntasks = ["mmlu"]\n'))
    assert sorted(HUB_SOURCES) == sorted(cli_tasks) == sorted(TASKS)


@pytest.mark.parametrize(
    "section, key",
    [("model", "hf_idd"), ("geometry", "num_heads"), ("rotation", "file"), ("quant", "group"),
     ("serve", "tp_size"), ("eval", "seed")],
)
def test_unknown_key_names_file_key_and_allowed(tmp_path, section, key):
    text = MINIMAL + f"\n[{section}]\n{key} = 1\n" if section != "model" else MINIMAL + f"{key} = 1\n"
    p = write(tmp_path, text)
    with pytest.raises(RecipeError) as ei:
        load_recipe(p)
    msg = str(ei.value)
    assert str(p.resolve()) in msg
    assert f"unknown key '{key}' in [{section}]" in msg
    assert "allowed keys:" in msg


def test_unknown_key_message_lists_allowed_keys(tmp_path):
    p = write(tmp_path, MINIMAL + "\n[quant]\nk_clip = 0.9\n")
    with pytest.raises(RecipeError, match="k_clip_ratio, v_clip_ratio, sink_tokens"):
        load_recipe(p)


def test_unknown_key_in_geometry_subtable(tmp_path):
    p = write(tmp_path, MINIMAL + "\n[geometry.sliding]\nwindow = 1024\n")
    with pytest.raises(RecipeError, match=r"unknown key 'window' in \[geometry.sliding\]"):
        load_recipe(p)


def test_unknown_section(tmp_path):
    p = write(tmp_path, MINIMAL + "\n[server]\ntp = 1\n")
    with pytest.raises(RecipeError, match=r"unknown section \[server\].*\[serve\]"):
        load_recipe(p)


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ("\n[serve]\ntp = \"2\"\n", r"\[serve\].tp must be an integer"),
        ("\n[serve]\ntp = true\n", r"\[serve\].tp must be an integer"),
        ("\n[serve]\nport = 70000\n", r"\[serve\].port must be a TCP port"),
        ("\n[serve]\nextra_args = \"--trust-remote-code\"\n", r"extra_args must be a list"),
        ("\n[serve]\nextra_args = [\"--a\", \"\"]\n", r"empty string"),
        ("\n[serve]\nextra_args = [\"--cuda-graph-max-bs 32\"]\n", r"one element"),
        ("\n[serve]\nextra_args = [\"--cuda-graph-max-bs\\t32\"]\n", r"one element"),
        ("\n[eval]\ntemperature = nan\n", r"temperature must be a finite number"),
        ("\n[eval]\ntop_p = nan\n", r"top_p must be a finite number"),
        ("\n[quant]\nk_clip_ratio = inf\n", r"k_clip_ratio must be a finite number"),
        ("\n[serve]\nenv = { X = 1 }\n", r"\[serve\].env.X must be a string"),
        ("\n[serve]\nenv = { SGLANG_COQUANT_ROTATION_MODE = \"coquant\" }\n", r"dead legacy name"),
        ("\n[serve]\nmem_fraction_static = 1.5\n", r"mem_fraction_static must be in"),
        ("\n[quant]\nquantizer = \"lloydmax\"\n", r"not one of: uniform, lloyd-max"),
        ("\n[quant]\nk_clip_ratio = 1.2\n", r"must be in \[0, 1\]"),
        ("\n[quant]\nscale_dtype = \"fp8\"\n", r"not one of: float32, float16, bfloat16"),
        ("\n[quant]\nskip_layers = \"sliding,3\"\n", r"skip_layers: --oscar-skip-layers must be one of none"),
        ("\n[quant]\nskip_layers = true\n", r"skip_layers must be a string"),
        ("\n[quant]\nskip_layers = []\n", r"skip_layers must be a string"),
        ("\n[quant]\nskip_layers = [1, -2]\n", r"skip_layers: --oscar-skip-layers must be one of"),
        ("\n[geometry]\nnum_layers = 24\n[quant]\nskip_layers = \"0,99\"\n",
         r"skip_layers names layers \[99\] beyond \[geometry\].num_layers = 24 \(ids run 0..23\)"),
        ("\n[rotation]\nmethod = \"quarot\"\n", r"not one of: oscar, oscar-perhead"),
        ("\n[eval]\ntasks = [\"mmlu\"]\n", r"'mmlu' is not one of: gpqa, aime25, math500, humaneval"),
        ("\n[eval]\nseeds = [0, 0]\n", r"duplicates"),
        ("\n[eval]\nseeds = []\n", r"must not be empty"),
        ("\n[eval]\ntop_p = 0\n", r"top_p must be in"),
        ("\n[geometry]\nhead_dim = 0\n", r"positive integer"),
        ("\n[geometry.full]\nlayers = [1, \"x\"]\n", r"layers\[1\] must be an integer"),
        ("context_length = 32768\n[serve]\ncontext_length = 65536\n", r"disagree"),
        ("\n[geometry.sliding]\nhead_dim = 256\n[geometry.full]\nhead_dim = 512\n[quant]\ngroup_size = 96\n",
         r"group_size = 96 does not divide \[geometry.sliding\].head_dim 256; pick a divisor"),
        ("context_length = 40960\n[eval]\nmax_tokens = 65536\n",
         r"max_tokens = 65536 leaves no room for the prompt in the context of 40960 tokens"),
        ("\n[geometry]\nkv_lora_rank = 512\n[quant]\ngroup_size = 96\n",
         r"group_size = 96 does not divide \[geometry\].kv_lora_rank 512"),
    ],
)
def test_bad_values(tmp_path, extra, pattern):
    p = write(tmp_path, MINIMAL + extra)
    with pytest.raises(RecipeError, match=pattern) as ei:
        load_recipe(p)
    assert str(p.resolve()) in str(ei.value)


def test_missing_required_and_family(tmp_path):
    p = write(tmp_path, '[model]\nhf_id = "x"\nfamily = "qwen3"\n')
    with pytest.raises(RecipeError, match="missing the required key 'served'"):
        load_recipe(p)
    p = write(tmp_path, '[model]\nhf_id = "x"\nfamily = "mistral"\nserved = true\n')
    with pytest.raises(RecipeError, match="not one of: qwen3, qwen3_moe, llama"):
        load_recipe(p)
    p = write(tmp_path, '[serve]\ntp = 1\n')
    with pytest.raises(RecipeError, match=r"\[model\] section is required"):
        load_recipe(p)


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.toml")
    p = write(tmp_path, "[model\nhf_id=1")
    with pytest.raises(RecipeError, match="not valid TOML"):
        load_recipe(p)


def test_extra_args_flag_with_spaced_value_after_equals_is_fine(tmp_path):
    p = write(tmp_path, MINIMAL + '\n[serve]\nextra_args = ["--chat-template=a b", "--x", "1 2"]\n')
    assert load_recipe(p).serve.extra_args == ["--chat-template=a b", "--x", "1 2"]


def test_recipe_error_is_a_value_error():
    assert issubclass(RecipeError, ValueError)


def test_unknown_key_via_cli_exits_2_with_one_line(tmp_path, capsys):
    from sglang_oscar.cli.main import main

    p = write(tmp_path, MINIMAL + "\n[serve]\nportt = 1\n")
    assert main(["serve", "--recipe", str(p), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "unknown key 'portt' in [serve]" in err[0] and str(p.resolve()) in err[0]


# ----------------------------------------------------------------------------- wrappers

REPO = Path(__file__).resolve().parent.parent.parent
WRAPPERS = sorted((REPO / "recipes").glob("*/eval_gpqa.sh"))


def test_nine_eval_gpqa_wrappers_exist():
    assert len(WRAPPERS) >= 9, WRAPPERS


@pytest.mark.parametrize("script", WRAPPERS, ids=lambda p: p.parent.name)
def test_eval_gpqa_wrapper_resolves_relative_paths_against_the_caller(script, tmp_path):
    import shlex
    import subprocess

    caller = tmp_path / "work dir"
    caller.mkdir()
    res = subprocess.run(
        ["bash", str(script), "--dry-run", "--", "--arms", "int2", "--out", "runs/x",
         "--data-file", "gpqa=data/gpqa.csv", "--data-file=aime25=a.jsonl", "--out=/abs/y"],
        cwd=caller, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    words = shlex.split(res.stdout.strip())
    name = script.parent.name
    assert words[1:] == [
        "eval-recipe", "--recipe", f"recipes/{name}/recipe.toml", "--arms", "int2",
        "--out", f"{caller}/runs/x", "--data-file", f"gpqa={caller}/data/gpqa.csv",
        f"--data-file=aime25={caller}/a.jsonl", "--out=/abs/y",
    ]


def test_every_public_function_and_class_of_the_harness_has_a_docstring():
    import importlib
    import inspect
    import pkgutil

    import sglang_oscar.evals as pkg

    def undocumented(obj) -> bool:
        doc = (obj.__doc__ or "").strip()
        if inspect.isclass(obj) and doc.startswith(obj.__name__ + "("):  # dataclass default
            return True
        return not doc

    missing = []
    modules = [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix="sglang_oscar.evals.")]
    assert len(modules) >= 15
    for name in modules:
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if undocumented(obj):
                missing.append(f"{name}.{attr}")
            if inspect.isclass(obj):
                for meth, m in vars(obj).items():
                    f = m.fget if isinstance(m, property) else m
                    if not meth.startswith("_") and inspect.isfunction(f) and undocumented(f):
                        missing.append(f"{name}.{attr}.{meth}")
    assert missing == []
