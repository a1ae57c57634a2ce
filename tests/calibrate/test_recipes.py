"""Every recipe loads and matches its model's geometry as given in the spec (§5, §6, §10);
the wrappers print the exact commands; a recipe drives calibrate -> fit -> validate end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_oscar.calibrate import CalibrationError
from sglang_oscar.calibrate.model import geometry_of
from sglang_oscar.calibrate.recipes import (check_geometry, geometry_mismatches, load, oscar_config, rotation_kind,
                                            step_command, trust_remote_code)
from sglang_oscar.rotation.latent import LatentRotationSet

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"

# Spec §10 (and §5, §6.3): geometry, rotation kind and windows of each model.
SPEC = {
    "Qwen3-4B-Thinking-2507": dict(family="qwen3", layers=36, q=32, kv=8, d=128, method="oscar", tp=1, win=(64, 256), clip=(0.96, 0.92)),
    "Qwen3-8B": dict(family="qwen3", layers=36, q=32, kv=8, d=128, method="oscar", tp=1, win=(128, 2048), clip=(0.96, 0.92)),
    "Qwen3-32B": dict(family="qwen3", layers=64, q=64, kv=8, d=128, method="oscar", tp=2, win=(64, 256), clip=(0.96, 0.96)),
    "Qwen3-30B-A3B": dict(family="qwen3_moe", layers=48, q=32, kv=4, d=128, method="oscar-perhead", tp=2, win=(128, 1024), clip=(0.96, 0.92)),
    "Gemma-4-12B-it": dict(family="gemma4", layers=48, method="oscar", tp=1, win=(64, 512), clip=(0.96, 0.92)),
    "GLM-5.2-FP8": dict(family="glm_mla", method="oscar", tp=8, win=(64, 512), rank=512, rope=64),
    # the latent path of upstream's later recipe (spec §6.3 [L], §10); expanded MHA is not supported
    "Kimi-K3": dict(family="kimi_k3", layers=93, method="oscar", tp=8, win=(64, 256), rank=512, rope=64, mla_layers=24),
    "MiniMax-M2.7": dict(family="minimax_m2", layers=62, q=48, kv=8, d=128, method="oscar", tp=4, win=(128, 1024), clip=(0.96, 0.92)),
    "MiniMax-M3": dict(family="minimax_m3", q=64, kv=4, method="hadamard", win=(64, 256), clip=(0.96, 0.92)),
    # no upstream recipe: geometry from the models' configs, settings ours (``own``)
    "Gemma-3-27B-it": dict(family="gemma3", layers=62, q=32, kv=16, d=128, method="oscar", tp=1, win=(64, 512),
                           clip=(0.96, 0.92), own=True),
    "GPT-OSS-20B": dict(family="gpt_oss", layers=24, q=64, kv=8, d=64, method="oscar", tp=1, win=(64, 512),
                        clip=(0.96, 0.92), own=True),
}
SERVED_FAMILIES = {"qwen3", "qwen3_moe", "llama", "gemma3", "gemma4", "gpt_oss", "minimax_m2", "minimax_m3", "qwen3_5"}


def _hf_config(name: str, **over) -> dict:
    """A config.json-like dict with the spec geometry of ``name`` (what ModelGeometry reads)."""
    s = SPEC[name]
    if name == "Gemma-4-12B-it":
        types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(48)]
        d = dict(model_type="gemma4_text", num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                 global_head_dim=512, num_global_key_value_heads=1, sliding_window=1024, layer_types=types,
                 attention_k_eq_v=True)
    elif name == "GLM-5.2-FP8":
        d = dict(model_type="glm_moe_dsa", num_hidden_layers=78, num_attention_heads=64, num_key_value_heads=64,
                 kv_lora_rank=512, qk_rope_head_dim=64, hidden_size=6144)
    elif name == "Kimi-K3":
        # KDA + MLA hybrid: the KDA layers are listed 1-based (spec §3.6); 24 of 93 layers are MLA
        mla = set(range(4, 93, 4)) | {93}
        d = dict(model_type="kimi_k3", num_hidden_layers=93, num_attention_heads=64, num_key_value_heads=64,
                 kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, hidden_size=7168,
                 linear_attn_config={"kda_layers": [i for i in range(1, 94) if i not in mla]})
    elif name == "Gemma-3-27B-it":  # the language model's config (text_config of the -it checkpoint)
        types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(62)]
        d = dict(model_type="gemma3_text", num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16,
                 head_dim=128, sliding_window=1024, layer_types=types)
    elif name == "GPT-OSS-20B":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)]
        d = dict(model_type="gpt_oss", num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                 sliding_window=128, layer_types=types)
    elif name == "MiniMax-M3":
        d = dict(model_type="minimax_m3", num_hidden_layers=60, num_attention_heads=64, num_key_value_heads=4, head_dim=128)
    elif name == "MiniMax-M2.7":
        d = dict(model_type="minimax_m2", num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                 rotary_dim=64)
    else:
        d = dict(model_type=s["family"], num_hidden_layers=s.get("layers", 60), num_attention_heads=s["q"],
                 num_key_value_heads=s["kv"], head_dim=s["d"])
    d.update(over)
    return d


@pytest.mark.parametrize("name", sorted(SPEC))
def test_recipe_matches_spec(name):
    r = load(RECIPES / name / "recipe.toml")
    s = SPEC[name]
    g = r.geometry
    assert r.model.family == s["family"]
    assert r.model.served is (s["family"] in SERVED_FAMILIES)
    if not r.model.served:  # the note says why: no int2 path yet, H200 checks not passed or run, or a refused flag
        assert any(why in (r.model.notes or "") for why in (
            "not built yet", "have not passed yet", "not run on a GPU yet", "refused by the INT2 cache"))
    assert g.num_layers == s.get("layers")
    assert g.num_q_heads == s.get("q")
    assert g.num_kv_heads == s.get("kv")
    assert g.head_dim == s.get("d")
    assert (g.head_dim_k, g.head_dim_v) == (s.get("dk"), s.get("dv"))
    assert (g.kv_lora_rank, g.qk_rope_head_dim) in ((s.get("rank"), s.get("rope")), (512, 64))
    if name == "Gemma-4-12B-it":
        assert (g.sliding.num_kv_heads, g.sliding.head_dim, g.sliding.sliding_window) == (8, 256, 1024)
        assert (g.full.num_kv_heads, g.full.head_dim, g.full.k_eq_v) == (1, 512, True)
    assert r.rotation.method == s["method"]
    if s["method"] in ("oscar", "oscar-perhead"):
        assert r.rotation.path and r.rotation.calib_tokens and r.rotation.calib_data
    assert (r.quant.sink_tokens, r.quant.recent_tokens) == s["win"]
    if "clip" in s:
        assert (r.quant.k_clip_ratio, r.quant.v_clip_ratio) == s["clip"]
    if "tp" in s:
        assert r.serve.tp == s["tp"]
    cfg = oscar_config(r)  # the served settings form a valid OscarConfig
    for dim in filter(None, (g.head_dim, g.head_dim_k, g.head_dim_v, g.kv_lora_rank)):
        cfg.check_head_dims(dim)
    readme = (RECIPES / name / "README.md").read_text().lower()
    assert f"served: **{'yes' if r.model.served else 'no'}**" in readme  # the README states the flag
    if s.get("own"):  # no upstream numbers to quote: the README says the settings are ours
        assert "no upstream recipe" in readme and "ours" in readme
    else:
        assert "upstream" in readme and "not ours" in readme


@pytest.mark.parametrize("name", sorted(SPEC))
def test_recipe_geometry_checks_against_model_config(name):
    r = load(RECIPES / name / "recipe.toml")
    cfg = _hf_config(name)
    geo = geometry_of(cfg)
    assert geometry_mismatches(r, geo, cfg) == []
    check_geometry(r, geo, cfg)
    assert rotation_kind(r) == ("latent" if geo.attention_kind == "mla" else "kv")
    if "mla_layers" in SPEC[name]:
        assert len(geo.layers) == SPEC[name]["mla_layers"] and geo.num_hidden_layers == SPEC[name]["layers"]
    wrong = {"GLM-5.2-FP8": dict(kv_lora_rank=256), "Kimi-K3": dict(kv_lora_rank=256),
             "Gemma-4-12B-it": dict(sliding_window=512), "Gemma-3-27B-it": dict(sliding_window=512),
             "GPT-OSS-20B": dict(sliding_window=256)}.get(name, dict(num_key_value_heads=2))
    bad = _hf_config(name, **wrong)
    with pytest.raises(CalibrationError, match="does not match the recipe"):
        check_geometry(r, geometry_of(bad), bad)


def test_kimi_geometry_skips_kda_layers():
    """Kimi-K3's 24 MLA layers keep their global ids; the 1-based KDA list is honoured."""
    geo = geometry_of(_hf_config("Kimi-K3"))
    assert geo.attention_kind == "mla" and geo.kv_lora_rank == 512
    assert geo.layer_ids == [i - 1 for i in sorted(set(range(4, 93, 4)) | {93})]
    with pytest.raises(CalibrationError, match="outside the 1-based layers"):
        geometry_of(_hf_config("Kimi-K3", linear_attn_config={"kda_layers": [0, 1, 2]}))


def test_expanded_mha_kimi_recipe_is_refused(tmp_path):
    """The PR-era Kimi recipe (K 192 / V 128 per-head dims on an MLA model) is refused instead of
    silently fitting a latent rotation under a K/V name."""
    text = (RECIPES / "Kimi-K3" / "recipe.toml").read_text().replace("num_layers = 93\n", "num_layers = 93\nhead_dim_k = 192\nhead_dim_v = 128\n")
    (tmp_path / "recipe.toml").write_text(text)
    r = load(tmp_path / "recipe.toml")
    cfg = _hf_config("Kimi-K3")
    bad = geometry_mismatches(r, geometry_of(cfg), cfg)
    assert [b.split(" =")[0] for b in bad] == ["head_dim_k", "head_dim_v"]
    assert "expanded-MHA storage is not supported" in bad[0]


def _recipe_with_geometry(tmp_path, base: str, geometry: str):
    """The recipe ``base`` with its [geometry] tables replaced by ``geometry`` (an MLA geometry drops
    the [quant] keys an MLA recipe may not have)."""
    lines, out, skip = (RECIPES / base / "recipe.toml").read_text().splitlines(), [], False
    mha_only = ("v_clip_ratio", "fold_rotations", "skip_layers") if "kv_lora_rank" in geometry else ()
    for line in lines:
        if line.startswith("["):
            skip = line.startswith("[geometry")
            if line == "[geometry]":
                out.append(geometry.strip())
        if not skip and not line.startswith(mha_only):
            out.append(line)
    (tmp_path / "recipe.toml").write_text("\n".join(out) + "\n")
    return load(tmp_path / "recipe.toml")


@pytest.mark.parametrize("geometry, expect", [
    # top-level keys apply to every attention layer, also next to sub-tables
    ("[geometry]\nnum_layers = 48\nnum_kv_heads = 8\n[geometry.sliding]\nnum_kv_heads = 8\n", "num_kv_heads: recipe 8, model [1, 8]"),
    ("[geometry]\nhead_dim = 256\n[geometry.full]\nhead_dim = 512\n", "head_dim_k: recipe 256, model [256, 512]"),
    ("[geometry]\n[geometry.sliding]\nnum_q_heads = 8\n", "sliding.num_q_heads: recipe 8, model 16"),
    ("[geometry]\n[geometry.full]\nk_eq_v = false\n", "full.k_eq_v: recipe False, model True"),
    ("[geometry]\n[geometry.sliding]\nk_eq_v = true\n", "sliding.k_eq_v: recipe True, model False"),
    ("[geometry]\n[geometry.full]\nsliding_window = 1024\n", "full attention layers have no sliding window"),
    ("[geometry]\npartial_rotary_dim = 64\n", "per layer type"),
    ("[geometry]\nkv_lora_rank = 512\n", "kv_lora_rank: recipe 512, but the model is not MLA"),
])
def test_every_geometry_key_is_checked_gemma(tmp_path, geometry, expect):
    r = _recipe_with_geometry(tmp_path, "Gemma-4-12B-it", geometry)
    cfg = _hf_config("Gemma-4-12B-it")
    bad = geometry_mismatches(r, geometry_of(cfg), cfg)
    assert any(expect in b for b in bad), bad


def test_partial_rotary_dim_is_checked(tmp_path):
    r = load(RECIPES / "MiniMax-M2.7" / "recipe.toml")
    assert r.geometry.partial_rotary_dim == 64
    full_rope = _hf_config("MiniMax-M2.7", rotary_dim=None)
    assert geometry_mismatches(r, geometry_of(full_rope), full_rope) == ["partial_rotary_dim: recipe 64, model 128"]
    factor = {**_hf_config("MiniMax-M2.7", rotary_dim=None), "partial_rotary_factor": 0.5}
    assert geometry_mismatches(r, geometry_of(factor), factor) == []
    # a key that needs the config is reported, not skipped, when the config is not given
    assert geometry_mismatches(r, geometry_of(factor)) == ["partial_rotary_dim: cannot be checked without the model config"]
    r = _recipe_with_geometry(tmp_path, "GLM-5.2-FP8", "[geometry]\nkv_lora_rank = 512\nnum_kv_heads = 1\n")
    cfg = _hf_config("GLM-5.2-FP8")
    assert "num_kv_heads = 1: the model is MLA" in geometry_mismatches(r, geometry_of(cfg), cfg)[0]


def _sh(script: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(SPEC))
def test_wrappers_help_and_dry_run(name, tmp_path):
    folder = RECIPES / name
    r = load(folder / "recipe.toml")
    for script in ("compute_rotation.sh", "eval_gpqa.sh"):
        res = _sh(folder / script, "--help")
        assert res.returncode == 0 and "Usage" in res.stdout and "--dry-run" in res.stdout
        assert _sh(folder / script, "--bogus").returncode == 2
    res = _sh(folder / "eval_gpqa.sh", "--dry-run", cwd=tmp_path)  # works from any directory
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"sglang-oscar eval-recipe --recipe recipes/{name}/recipe.toml"]
    res = _sh(folder / "compute_rotation.sh", "--dry-run", "--model", "/models/x", "--", "--batch-size", "4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    rec = f"recipes/{name}/recipe.toml"
    stats = f"recipes/{name}/calib/stats.safetensors"
    rot = f"recipes/{name}/{r.rotation.path or 'rotation.safetensors'}"
    remote = " --trust-remote-code" if trust_remote_code(r) else ""
    if r.rotation.method == "hadamard":
        assert lines[0].startswith("# calibrate: skipped")
        assert lines[1] == f"sglang-oscar fit --recipe {rec} --method hadamard --out {rot} --config /models/x{remote}"
        # fit copies the config next to the rotation; validate reads that local copy (a Hub id works)
        assert lines[2] == f"sglang-oscar validate-rotation {rot} --config {rot.removesuffix('.safetensors')}.config.json"
        return
    assert lines[0] == f"sglang-oscar calibrate --recipe {rec} --model /models/x --out {stats}{remote} --batch-size 4"
    assert lines[1] == f"sglang-oscar fit --recipe {rec} --method {r.rotation.method} --out {rot} --stats {stats}"
    # validate-rotation validates the file as what it holds (K/V or latent)
    assert lines[2] == f"sglang-oscar validate-rotation {rot} --config recipes/{name}/calib/stats.config.json"
    assert step_command(r, "calibrate", model="/models/x")[1:] == lines[0].split()[1:-2]
    if name in ("GLM-5.2-FP8", "Kimi-K3"):
        assert rotation_kind(r) == "latent" and "latent" in rot
    for step in ("error", "ppl"):  # never the calibration data by default
        with pytest.raises(CalibrationError, match="held-out prompts"):
            step_command(r, step)
        assert step_command(r, step, data="held.jsonl")[-2 - len(remote.split()):][:2] == ["--prompts", "held.jsonl"]


def test_recipe_drives_the_pipeline(model_dirs, prompt_files, tmp_path):
    """compute_rotation.sh for real, on a temporary recipe of the tiny Qwen3 model."""
    root = tmp_path / "repo"
    folder = root / "recipes" / "tiny-qwen3"
    folder.mkdir(parents=True)
    shutil.copy(RECIPES / "Qwen3-8B" / "compute_rotation.sh", folder)
    shutil.copytree(RECIPES / "_lib", root / "recipes" / "_lib")
    (folder / "recipe.toml").write_text(f"""
[model]
hf_id = "{model_dirs['qwen3']}"
family = "qwen3"
served = true

[geometry]
num_layers = 2
num_q_heads = 4
num_kv_heads = 2
head_dim = 32

[rotation]
method = "oscar-perhead"
path = "perhead.safetensors"
calib_tokens = 4096
calib_data = "{prompt_files['calib']}"
center = true

[quant]
sink_tokens = 4
recent_tokens = 16
""")
    res = _sh(folder / "compute_rotation.sh", "--", "--seq-len", "256", "--no-progress", cwd=root)
    assert res.returncode == 0, res.stderr + res.stdout
    assert (folder / "perhead.safetensors").exists() and (folder / "calib" / "stats.config.json").exists()
    assert '"ok": true' in res.stdout and '"format_version": 2' in res.stdout
    # [rotation].center = true: the fitted file carries the key / value means of every layer
    from sglang_oscar.rotation import RotationSet
    rs = RotationSet.load(str(folder / "perhead.safetensors"))
    assert rs.centered and sorted(rs.k_mean) == sorted(rs.v_mean) == rs.layer_ids
    assert '"centered": {"k": true, "v": true}' in res.stdout  # validate-rotation reports it
    assert tuple(rs.mean(rs.layer_ids[0], "k").shape) == (2, 32)
    # the recipe's geometry is checked against the model it calibrates
    (folder / "recipe.toml").write_text((folder / "recipe.toml").read_text().replace("num_kv_heads = 2", "num_kv_heads = 8"))
    res = _sh(folder / "compute_rotation.sh", "--", "--seq-len", "256", cwd=root)
    assert res.returncode != 0 and "does not match the recipe" in res.stderr


def test_wrapper_resolves_relative_paths_against_the_callers_directory(tmp_path):
    """compute_rotation.sh runs the steps from the repository root: relative --model/--data/--out-dir
    are made absolute first (a Hub id or a datasets name that is not a local path stays as it is)."""
    (tmp_path / "mymodel").mkdir()
    (tmp_path / "calib.txt").write_text("some text\n")
    script = RECIPES / "Qwen3-8B" / "compute_rotation.sh"
    res = _sh(script, "--dry-run", "--model", "mymodel", "--data", "calib.txt", "--out-dir", "out", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    calib, fit, _ = res.stdout.splitlines()
    assert f"--model {tmp_path}/mymodel " in calib and calib.endswith(f"--prompts {tmp_path}/calib.txt")
    assert f"--out {tmp_path}/out/calib/stats.safetensors" in calib
    assert f"--out {tmp_path}/out/oscar_qqt_sst.safetensors" in fit
    res = _sh(script, "--dry-run", "--model", "Qwen/Qwen3-8B", "--data", "task:gpqa", cwd=tmp_path)
    assert "--model Qwen/Qwen3-8B " in res.stdout and res.stdout.splitlines()[0].endswith("--prompts task:gpqa")


def test_kimi_latent_recipe_runs_end_to_end(model_dirs, prompt_files, tmp_path):
    """The Kimi-K3 recipe (latent-only) through compute_rotation.sh on a tiny MLA model: calibrate ->
    fit writes a latent file under the recipe's latent name -> validate-rotation validates it as latent."""
    root = tmp_path / "repo"
    folder = root / "recipes" / "tiny-kimi"
    folder.mkdir(parents=True)
    shutil.copy(RECIPES / "Kimi-K3" / "compute_rotation.sh", folder)
    shutil.copytree(RECIPES / "_lib", root / "recipes" / "_lib")
    text = (RECIPES / "Kimi-K3" / "recipe.toml").read_text()
    text = (text.replace('hf_id = "moonshotai/Kimi-K3"', f'hf_id = "{model_dirs["deepseek_v2"]}"')
            .replace("num_layers = 93", "num_layers = 2").replace("kv_lora_rank = 512", "kv_lora_rank = 64")
            .replace("qk_rope_head_dim = 64", "qk_rope_head_dim = 8").replace("group_size = 128", "group_size = 16")
            .replace("calib_tokens = 8192", "calib_tokens = 4096")
            .replace('calib_data = "Salesforce/wikitext:wikitext-2-raw-v1:test"', f'calib_data = "{prompt_files["calib"]}"'))
    (folder / "recipe.toml").write_text(text)
    res = _sh(folder / "compute_rotation.sh", "--", "--seq-len", "256", "--no-progress", cwd=root)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "validate-rotation recipes/tiny-kimi/oscar_latent.safetensors" in res.stdout
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["kind"] == "latent" and report["kv_lora_rank"] == 64 and report["layers"] == 2
    rs = LatentRotationSet.load(str(folder / "oscar_latent.safetensors"))
    assert rs.metadata["hadamard_block"] == 16 and rs.metadata["composition"] == "r_p_hblock"


def _fake_hub(cache, repo_id: str, model_dir) -> None:
    """A Hugging Face cache holding only ``config.json`` of ``repo_id`` (read with HF_HUB_OFFLINE=1)."""
    snap = "0" * 40
    base = cache / ("models--" + repo_id.replace("/", "--"))
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(snap)
    (base / "snapshots" / snap).mkdir(parents=True)
    shutil.copy(Path(model_dir) / "config.json", base / "snapshots" / snap / "config.json")


def test_data_free_recipe_validates_with_a_hub_id(model_dirs, tmp_path):
    """A data-free recipe (MiniMax-M3 style) with its default hf_id: fit reads the config from the Hub
    and copies it next to the rotation; validate reads the local copy (it used to get the Hub id)."""
    cache = tmp_path / "hub"
    _fake_hub(cache, "oscar-test/tiny-qwen3", model_dirs["qwen3"])
    root = tmp_path / "repo"
    folder = root / "recipes" / "tiny-m3"
    folder.mkdir(parents=True)
    shutil.copy(RECIPES / "MiniMax-M3" / "compute_rotation.sh", folder)
    shutil.copytree(RECIPES / "_lib", folder.parent / "_lib")
    text = (RECIPES / "MiniMax-M3" / "recipe.toml").read_text()
    text = (text.replace('hf_id = "MiniMaxAI/MiniMax-M3"', 'hf_id = "oscar-test/tiny-qwen3"').replace('family = "minimax_m3"', 'family = "qwen3"')
            .replace("num_q_heads = 64", "num_q_heads = 4").replace("num_kv_heads = 4", "num_kv_heads = 2"))
    (folder / "recipe.toml").write_text(text)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(["bash", str(folder / "compute_rotation.sh")], cwd=root, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 0, res.stderr + res.stdout
    assert (folder / "rotation.config.json").exists()
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["kind"] == "kv" and report["method"] == "hadamard"
    # an id that is neither local nor reachable: a clear message naming the way out
    (folder / "recipe.toml").write_text(text.replace("oscar-test/tiny-qwen3", "oscar-test/not-there"))
    res = subprocess.run(["bash", str(folder / "compute_rotation.sh")], cwd=root, capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode == 2 and "--model LOCAL_DIR" in res.stderr and "oscar-test/not-there" in res.stderr


def test_data_free_recipe_on_a_multimodal_wrapper_config(tmp_path):
    """MiniMax-M3's own compute_rotation.sh on a config-only MiniMax-M3 in transformers' VL format (a
    wrapper whose attention geometry sits in text_config): fit --config must not refuse the file it
    builds as "another model" (the wrapper's model_type vs its text model's)."""
    from transformers import MiniMaxM3VLConfig

    r = load(RECIPES / "MiniMax-M3" / "recipe.toml")
    model = tmp_path / "m3"
    MiniMaxM3VLConfig(text_config=dict(num_hidden_layers=2, hidden_size=64, vocab_size=256, bos_token_id=1,
                                       eos_token_id=2, num_attention_heads=r.geometry.num_q_heads,
                                       num_key_value_heads=r.geometry.num_kv_heads)).save_pretrained(model)
    res = _sh(RECIPES / "MiniMax-M3" / "compute_rotation.sh", "--model", str(model), "--out-dir", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr + res.stdout
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["method"] == "hadamard" and report["layers"] == 2
    assert not (RECIPES / "MiniMax-M3" / "rotation.safetensors").exists()


def test_kimi_readme_keeps_project_choices_out_of_upstream_findings():
    text = (RECIPES / "Kimi-K3" / "README.md").read_text()
    upstream = text.split("## Upstream findings", 1)[1]
    assert "64-blocks" not in upstream and "block Hadamard" not in upstream
    ours = text.split("## This project's choices", 1)[1].split("## Upstream findings", 1)[0]
    assert "(G 128, Lloyd-Max" in ours and "(G 128, Lloyd-Max" not in upstream


def test_center_needs_a_fitted_method(tmp_path):
    """[rotation].center with a data-free method (no calibrate step) is refused when the recipe loads."""
    from sglang_oscar.evals.recipe import RecipeError, load_recipe

    base = (RECIPES / "Qwen3-8B" / "recipe.toml").read_text()
    p = tmp_path / "recipe.toml"
    p.write_text(base.replace("[rotation]\n", "[rotation]\ncenter = true\n", 1).replace('method = "oscar"', 'method = "hadamard"'))
    with pytest.raises(RecipeError, match=r"center = true needs calibration statistics.*data-free"):
        load_recipe(p)
    p.write_text(base.replace("[rotation]\n", "[rotation]\ncenter = true\n", 1))
    r = load_recipe(p)
    assert r.rotation.center and "--center" in step_command(r, "fit")
    assert "--center" not in step_command(load_recipe(RECIPES / "Qwen3-8B" / "recipe.toml"), "fit")


@pytest.mark.parametrize("name,backend", [("GLM-5.2-FP8", "dsa"), ("Kimi-K3", "triton")])
def test_mla_recipes_int2_command_passes_the_latent_launch_checks(name, backend):
    """An MLA recipe's int2 command (built as if served) carries no MHA-only flag: SGLang's parser reads
    it into a config that the latent launch checks accept for the recipe's geometry (rotation file
    aside, which calibration writes); a DSA model gets SGLang's dsa backend in both arms."""
    import dataclasses

    from _support.server_args import oscar_server_parser

    from sglang_oscar.backend.rotations import served_latent_rotations
    from sglang_oscar.evals.launcher import build_server_command
    from sglang_oscar.plugin.flags import resolve_config
    from sglang_oscar.rotation.geometry import ModelGeometry

    r = load(RECIPES / name / "recipe.toml")
    r = dataclasses.replace(r, model=dataclasses.replace(r.model, served=True))
    parser = oscar_server_parser()
    for kv in ("int2", "bf16"):
        args = build_server_command(r, kv, check_files=False).server_args
        assert args.count("--attention-backend") == 1 and args[args.index("--attention-backend") + 1] == backend
        assert "--oscar-v-clip-ratio" not in args
    args = build_server_command(r, "int2", check_files=False).server_args
    if "--pp-size" in args:  # Kimi-K3's, refused on its own
        i = args.index("--pp-size")
        args = args[:i] + args[i + 2:]
    ns = parser.parse_args(args)
    config, _ = resolve_config(vars(ns), environ={})
    assert config.k_clip_ratio == r.quant.k_clip_ratio == 0.0 and config.group_size == r.quant.group_size
    geo = ModelGeometry.from_hf_config(_hf_config(name))
    rs = served_latent_rotations(dataclasses.replace(config, rotation_path=None), geo, log=False)
    assert sorted(rs.r) == list(geo.layer_ids)


@pytest.mark.parametrize("key,value", [("v_clip_ratio", "0.0"), ("fold_rotations", "true"), ("skip_layers", '"0"')])
def test_mla_recipe_refuses_mha_only_quant_keys(tmp_path, key, value):
    """[quant] keys of the MHA/GQA K/V cache are refused in an MLA recipe (the server would refuse them
    at launch), naming the key; their off values and an MHA recipe pass."""
    from sglang_oscar.evals.recipe import RecipeError

    text = (RECIPES / "Kimi-K3" / "recipe.toml").read_text().replace("[quant]\n", f"[quant]\n{key} = {value}\n")
    (tmp_path / "recipe.toml").write_text(text)
    with pytest.raises(RecipeError, match=rf"\[quant\]\.{key} applies to MHA/GQA .*drop the key"):
        load(tmp_path / "recipe.toml")
    off = {"fold_rotations": "false", "skip_layers": '"none"'}
    if key in off:
        (tmp_path / "recipe.toml").write_text(text.replace(f"{key} = {value}", f"{key} = {off[key]}"))
        assert load(tmp_path / "recipe.toml").geometry.kv_lora_rank == 512
    mha = (RECIPES / "Qwen3-8B" / "recipe.toml").read_text().replace("[quant]\n", f"[quant]\n{key} = {value}\n", 1)
    (tmp_path / "recipe.toml").write_text(mha.replace("v_clip_ratio = 0.92\n", "") if key == "v_clip_ratio" else mha)
    assert load(tmp_path / "recipe.toml").geometry.kv_lora_rank is None
