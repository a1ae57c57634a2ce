"""Every recipe loads and matches its model's geometry as given in the spec (§5, §6, §10);
the wrappers print the exact commands; a recipe drives calibrate -> fit -> validate end to end."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from sglang_oscar.calibrate import CalibrationError
from sglang_oscar.calibrate.recipes import check_geometry, geometry_mismatches, load, oscar_config, step_command
from sglang_oscar.rotation.geometry import ModelGeometry

REPO = Path(__file__).resolve().parents[2]
ROT = REPO / "rotation"

# Spec §10 (and §5, §6.3): geometry, rotation kind and windows of each model.
SPEC = {
    "Qwen3-4B-Thinking-2507": dict(family="qwen3", layers=36, q=32, kv=8, d=128, method="oscar", tp=1, win=(64, 256), clip=(0.96, 0.92)),
    "Qwen3-8B": dict(family="qwen3", layers=36, q=32, kv=8, d=128, method="oscar", tp=1, win=(128, 2048), clip=(0.96, 0.92)),
    "Qwen3-32B": dict(family="qwen3", layers=64, q=64, kv=8, d=128, method="oscar", tp=2, win=(64, 256), clip=(0.96, 0.96)),
    "Qwen3-30B-A3B": dict(family="qwen3_moe", layers=48, q=32, kv=4, d=128, method="oscar-perhead", tp=2, win=(128, 1024), clip=(0.96, 0.92)),
    "Gemma-4-12B-it": dict(family="gemma4", layers=48, method="oscar", tp=1, win=(64, 512), clip=(0.96, 0.92)),
    "GLM-5.2-FP8": dict(family="glm_mla", method="oscar", tp=8, win=(64, 512), rank=512, rope=64),
    "Kimi-K3": dict(family="kimi_k3", layers=93, method="oscar", tp=8, win=(64, 256), clip=(0.96, 0.92), dk=192, dv=128),
    "MiniMax-M2.7": dict(family="minimax_m2", layers=62, q=48, kv=8, d=128, method="oscar", tp=4, win=(128, 1024), clip=(0.96, 0.92)),
    "MiniMax-M3": dict(family="minimax_m3", q=64, kv=4, method="hadamard", win=(64, 256), clip=(0.96, 0.92)),
}
SERVED_FAMILIES = {"qwen3", "qwen3_moe", "llama"}


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
    else:
        d = dict(model_type=s["family"], num_hidden_layers=s.get("layers", 60), num_attention_heads=s["q"],
                 num_key_value_heads=s["kv"], head_dim=s["d"])
    d.update(over)
    return d


@pytest.mark.parametrize("name", sorted(SPEC))
def test_recipe_matches_spec(name):
    r = load(ROT / name / "recipe.toml")
    s = SPEC[name]
    g = r.geometry
    assert r.model.family == s["family"]
    assert r.model.served is (s["family"] in SERVED_FAMILIES)
    if not r.model.served:
        assert "not built yet" in (r.model.notes or "")
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
    readme = (ROT / name / "README.md").read_text()
    assert "upstream" in readme.lower() and "not ours" in readme.lower()


@pytest.mark.parametrize("name", sorted(n for n in SPEC if n not in ("Kimi-K3", "MiniMax-M3")))
def test_recipe_geometry_checks_against_model_config(name):
    r = load(ROT / name / "recipe.toml")
    geo = ModelGeometry.from_hf_config(_hf_config(name))
    assert geometry_mismatches(r, geo) == []
    check_geometry(r, geo)
    wrong = {"GLM-5.2-FP8": dict(kv_lora_rank=256), "Gemma-4-12B-it": dict(sliding_window=512)}.get(name, dict(num_key_value_heads=2))
    with pytest.raises(CalibrationError, match="does not match the recipe"):
        check_geometry(r, ModelGeometry.from_hf_config(_hf_config(name, **wrong)))


def _sh(script: Path, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(SPEC))
def test_wrappers_help_and_dry_run(name, tmp_path):
    folder = ROT / name
    r = load(folder / "recipe.toml")
    for script in ("compute_rotation.sh", "eval_gpqa.sh"):
        res = _sh(folder / script, "--help")
        assert res.returncode == 0 and "Usage" in res.stdout and "--dry-run" in res.stdout
        assert _sh(folder / script, "--bogus").returncode == 2
    res = _sh(folder / "eval_gpqa.sh", "--dry-run", cwd=tmp_path)  # works from any directory
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [f"sglang-oscar eval-recipe --recipe rotation/{name}/recipe.toml"]
    res = _sh(folder / "compute_rotation.sh", "--dry-run", "--model", "/models/x", "--", "--batch-size", "4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    rec = f"rotation/{name}/recipe.toml"
    stats = f"rotation/{name}/calib/stats.safetensors"
    rot = f"rotation/{name}/{r.rotation.path or 'rotation.safetensors'}"
    if r.rotation.method == "hadamard":
        assert lines[0].startswith("# calibrate: skipped")
        assert lines[1] == f"sglang-oscar fit --recipe {rec} --method hadamard --out {rot} --config /models/x"
        assert lines[2] == f"sglang-oscar validate {rot} --config /models/x"
        return
    assert lines[0] == f"sglang-oscar calibrate --recipe {rec} --model /models/x --out {stats} --batch-size 4"
    assert lines[1] == f"sglang-oscar fit --recipe {rec} --method {r.rotation.method} --out {rot} --stats {stats}"
    verb = "validate-latent" if name == "GLM-5.2-FP8" else "validate"
    assert lines[2] == f"sglang-oscar {verb} {rot} --config rotation/{name}/calib/stats.config.json"
    assert step_command(r, "calibrate", model="/models/x")[1:] == lines[0].split()[1:-2]


def test_recipe_drives_the_pipeline(model_dirs, prompt_files, tmp_path):
    """compute_rotation.sh for real, on a temporary recipe of the tiny Qwen3 model."""
    root = tmp_path / "repo"
    folder = root / "rotation" / "tiny-qwen3"
    folder.mkdir(parents=True)
    shutil.copy(ROT / "Qwen3-8B" / "compute_rotation.sh", folder)
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

[quant]
sink_tokens = 4
recent_tokens = 16
""")
    res = _sh(folder / "compute_rotation.sh", "--", "--seq-len", "256", "--no-progress", cwd=root)
    assert res.returncode == 0, res.stderr + res.stdout
    assert (folder / "perhead.safetensors").exists() and (folder / "calib" / "stats.config.json").exists()
    assert '"ok": true' in res.stdout and '"format_version": 2' in res.stdout
    # the recipe's geometry is checked against the model it calibrates
    (folder / "recipe.toml").write_text((folder / "recipe.toml").read_text().replace("num_kv_heads = 2", "num_kv_heads = 8"))
    res = _sh(folder / "compute_rotation.sh", "--", "--seq-len", "256", cwd=root)
    assert res.returncode != 0 and "does not match the recipe" in res.stderr
