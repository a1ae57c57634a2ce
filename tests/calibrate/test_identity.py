"""Statistics and rotations belong to one model (fingerprint, not only geometry); error/ppl use
held-out prompts; a recipe's missing rotation file is an error, not a silent Hadamard."""

from __future__ import annotations

import json

import pytest

from calib_tiny import build_model, make_text, save_model
from sglang_oscar.calibrate import CalibrationError, NotHeldOutWarning
from sglang_oscar.calibrate.model import config_fingerprint, geometry_of
from sglang_oscar.calibrate.stats import CalibrationStats
from sglang_oscar.cli.main import main


def _ok(argv, capsys) -> str:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return cap.out


def _fails(argv, capsys) -> str:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    return err


@pytest.fixture(scope="module")
def twin(tmp_path_factory, tokenizer):
    """A second tiny Qwen3 with the same attention geometry as model_dirs['qwen3'] but another MLP."""
    model = build_model("qwen3", seed=1, intermediate_size=96)
    return save_model(model, tokenizer, tmp_path_factory.mktemp("twin") / "other-qwen3")


@pytest.fixture(scope="module")
def fitted(model_dirs, tmp_path_factory, tokenizer):
    """Statistics and a fitted rotation of the tiny Qwen3, calibrated on all 16 JSONL documents of 120 tokens (one sequence each)."""
    d = tmp_path_factory.mktemp("fitted")
    docs = make_text(16, 120, 11)
    calib = d / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    stats, rot = d / "stats.safetensors", d / "rot.safetensors"
    assert main(["calibrate", "--model", str(model_dirs["qwen3"]), "--prompts", str(calib), "--tokens", "1920",
                 "--seq-len", "128", "--out", str(stats), "--no-progress"]) == 0
    assert main(["fit", "--stats", str(stats), "--min-tokens", "1", "--out", str(rot)]) == 0
    return {"stats": stats, "rot": rot, "docs": docs, "dir": d}


def test_fingerprint_is_recorded(model_dirs, fitted, twin):
    st = CalibrationStats.load(str(fitted["stats"]))
    fp = st.meta["model"]["fingerprint"]
    assert fp == config_fingerprint(json.loads((model_dirs["qwen3"] / "config.json").read_text()), str(model_dirs["qwen3"]))
    assert fp["intermediate_size"] == 128 and fp["name"] == model_dirs["qwen3"].name.lower()
    other = json.loads((twin / "config.json").read_text())
    assert geometry_of(other).to_dict() == st.geometry.to_dict()  # same geometry: the old check passed
    assert config_fingerprint(other, str(twin))["intermediate_size"] == 96


def test_statistics_of_another_model_with_the_same_geometry(fitted, twin, tmp_path, capsys):
    out = tmp_path / "r.safetensors"
    err = _fails(["fit", "--stats", fitted["stats"], "--config", twin, "--min-tokens", 1, "--out", out], capsys)
    assert "another model" in err and "intermediate_size: 128 vs 96" in err and "--allow-other-model" in err
    assert not out.exists()
    _ok(["fit", "--stats", fitted["stats"], "--config", twin, "--min-tokens", 1, "--out", out, "--allow-other-model"], capsys)


def test_rotation_of_another_model_with_the_same_geometry(model_dirs, fitted, twin, prompt_files, capsys):
    rot = fitted["rot"]
    err = _fails(["validate-rotation", rot, "--config", twin], capsys)
    assert "another model" in err and "intermediate_size" in err
    assert json.loads(_ok(["validate-rotation", rot, "--config", model_dirs["qwen3"]], capsys))["ok"]
    args = ["--prompts", prompt_files["heldout"], "--tokens", 256, "--seq-len", 128, "--sink", 4, "--recent", 8]
    for verb, flag in (("error", "--rotation"), ("ppl", "--rotation")):
        err = _fails([verb, "--model", twin, flag, rot, *args], capsys)
        assert "another model" in err and "name: " in err, err
        _ok([verb, "--model", twin, flag, rot, *args, "--allow-other-model"], capsys)
        _ok([verb, "--model", model_dirs["qwen3"], flag, rot, *args], capsys)


def test_same_checkpoint_under_a_hub_name_matches(model_dirs, fitted):
    """The name is compared by its last component, so a local copy of a Hub checkpoint matches."""
    st = CalibrationStats.load(str(fitted["stats"]))
    cfg = json.loads((model_dirs["qwen3"] / "config.json").read_text())
    st.check_model(geometry_of(cfg), fingerprint=config_fingerprint(cfg, f"someorg/{model_dirs['qwen3'].name}"))
    with pytest.raises(CalibrationError, match="another model"):
        st.check_model(geometry_of(cfg), fingerprint=config_fingerprint(cfg, "someorg/another-name"))


def _recipe(tmp_path, model_dir, calib, rotation="rot.safetensors"):
    folder = tmp_path / "recipes" / "tiny"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "recipe.toml").write_text(f"""
[model]
hf_id = "{model_dir}"
family = "qwen3"
served = true

[geometry]
num_layers = 2
num_q_heads = 4
num_kv_heads = 2
head_dim = 32

[rotation]
method = "oscar"
path = "{rotation}"
calib_tokens = 1920
calib_data = "{calib}"

[quant]
sink_tokens = 4
recent_tokens = 8
""")
    return folder / "recipe.toml"


def test_error_and_ppl_need_held_out_prompts(model_dirs, fitted, tmp_path, capsys):
    recipe = _recipe(tmp_path, model_dirs["qwen3"], fitted["dir"] / "calib.jsonl", fitted["rot"])
    for verb in ("error", "ppl"):
        err = _fails([verb, "--recipe", recipe, "--tokens", 256, "--seq-len", 128], capsys)
        assert "needs held-out prompts" in err and "calib.jsonl" in err


def test_overlap_with_the_calibration_data_is_counted(model_dirs, fitted, tmp_path, capsys):
    """Held-out data that shares 3 documents (sequences) with the calibration data: warned with the count."""
    mixed = tmp_path / "mixed.jsonl"
    docs = fitted["docs"][:3] + make_text(5, 120, 12)
    mixed.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    args = ["--model", model_dirs["qwen3"], "--rotation", fitted["rot"], "--prompts", mixed, "--tokens", 960,
            "--seq-len", 128, "--sink", 4, "--recent", 8]
    for verb in ("error", "ppl"):
        with pytest.warns(NotHeldOutWarning, match="3 of 8 held-out sequences were also calibration sequences"):
            _ok([verb, *args], capsys)
    # the same source file: no identical sequence (other seed), but a warning that documents may overlap
    with pytest.warns(NotHeldOutWarning, match="same source as the calibration data"):
        _ok(["error", *args[:4], "--prompts", fitted["dir"] / "calib.jsonl", "--tokens", 300, "--seq-len", 64,
             "--sink", 4, "--recent", 8], capsys)


def test_missing_recipe_rotation_is_an_error(model_dirs, prompt_files, tmp_path, capsys):
    recipe = _recipe(tmp_path, model_dirs["qwen3"], prompt_files["calib"], "not_fitted.safetensors")
    missing = tmp_path / "recipes" / "tiny" / "not_fitted.safetensors"
    for verb in ("error", "ppl"):
        err = _fails([verb, "--recipe", recipe, "--prompts", prompt_files["heldout"], "--tokens", 256,
                      "--seq-len", 128], capsys)
        assert str(missing) in err and "compute_rotation.sh" in err and "sglang-oscar fit" in err


def test_a_multimodal_config_and_its_text_model_are_one_model():
    """A rotation fitted on a wrapper checkpoint's language model (model_type ``qwen3_5_moe_text``) checked
    against the checkpoint's own config (``qwen3_5_moe``) is the same model; other types still differ."""
    from sglang_oscar.calibrate.model import check_same_model, fingerprint_mismatches

    text = {"model_type": "qwen3_5_moe_text", "hidden_size": 64, "name": "qwen3.5-35b-a3b"}
    wrapper = {**text, "model_type": "qwen3_5_moe"}
    assert fingerprint_mismatches(text, wrapper) == []
    check_same_model(text, wrapper, "rotation", "the checkpoint")
    other = {**text, "model_type": "qwen3_moe"}
    assert fingerprint_mismatches(text, other) == ["model_type: 'qwen3_5_moe_text' vs 'qwen3_moe'"]
    with pytest.raises(CalibrationError, match="another model"):
        check_same_model(text, {**wrapper, "hidden_size": 128}, "rotation", "the checkpoint")
