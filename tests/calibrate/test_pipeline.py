"""calibrate -> fit -> validate -> error -> ppl through the CLI, on a tiny model of every family."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sglang_oscar.calibrate.stats import CalibrationStats
from sglang_oscar.cli.main import main
from sglang_oscar.rotation import RotationSet, orthogonality_error
from sglang_oscar.rotation.latent import LatentRotationSet

FAMILIES = ["qwen3", "qwen3_moe", "llama", "gemma3", "deepseek_v2"]
TOKENS = 2048


def _run(argv, capsys):
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return cap.out


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline(family, model_dirs, prompt_files, tmp_path, capsys):
    mdir = model_dirs[family]
    stats = tmp_path / "stats.safetensors"
    rot = tmp_path / "rot.safetensors"
    mla = family == "deepseek_v2"
    quant = ["--sink", "4", "--recent", "16"] + (["--group-size", "32"] if mla else [])

    out = _run(["calibrate", "--model", mdir, "--prompts", prompt_files["calib"], "--tokens", TOKENS,
                "--seq-len", 128, "--out", stats, "--no-progress"], capsys)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["tokens_per_layer_min"] == summary["tokens_per_layer_max"] == TOKENS
    st = CalibrationStats.load(str(stats))
    assert st.complete and st.passes_done == (1 if mla else 2)
    assert st.meta["prompts"]["tokens"] == TOKENS and len(st.meta["prompts"]["sha256"]) == 64
    assert (tmp_path / "stats.config.json").exists()

    # the default minimum (4096 tokens/layer) refuses these small statistics ...
    assert main(["fit", "--stats", str(stats), "--out", str(rot)]) == 2
    assert "lesson 26" in capsys.readouterr().err
    # ... and lowering it explicitly works
    methods = ["oscar"] if mla else ["oscar", "oscar-perhead"]
    for method in methods:
        path = tmp_path / f"{method}.safetensors"
        _run(["fit", "--stats", stats, "--method", method, "--out", path, "--min-tokens", 1000,
              *(["--latent-block", 32] if mla else [])], capsys)
        if mla:
            rs = LatentRotationSet.load(str(path))
            mats = list(rs.r.values())
            assert all(m.shape == (64, 64) for m in mats)
            _run(["validate-latent", path, "--config", mdir], capsys)
        else:
            rs = RotationSet.load(str(path))
            assert rs.format_version == (2 if method == "oscar-perhead" else 1)
            mats = list(rs.k.values()) + list(rs.v.values())
            assert json.loads(_run(["validate", path, "--config", mdir], capsys))["ok"]
        assert rs.layer_ids == st.geometry.layer_ids
        assert max(orthogonality_error(m) for m in mats) < 1e-5
        assert rs.metadata["calibration"]["tokens_per_layer_min"] == TOKENS

    fitted = tmp_path / "oscar.safetensors"
    err_json = tmp_path / "error.json"
    _run(["error", "--model", mdir, "--prompts", prompt_files["heldout"], "--tokens", 768, "--seq-len", 128,
          "--rotation", f"fitted={fitted}", "--out", err_json, *quant], capsys)
    rep = json.loads(err_json.read_text())
    assert set(rep["layers"]) == {str(i) for i in st.geometry.layer_ids}
    assert "fitted" in rep["methods"] and "hadamard" in rep["methods"] and "naive" in rep["methods"]
    for m in rep["methods"]:
        assert math.isfinite(rep["overall_db"][m])
    int2 = [m for m in rep["methods"] if m != "bf16"]
    assert all(rep["overall_db"][m] < -3.0 for m in int2)  # INT2 with windows is far below 0 dB
    if not mla:
        assert rep["overall_db"]["bf16"] < min(rep["overall_db"][m] for m in int2) - 15.0
    assert 0.3 < rep["quantized_read_fraction"] < 1.0

    ppl_json = tmp_path / "ppl.json"
    out = _run(["ppl", "--model", mdir, "--prompts", prompt_files["heldout"], "--tokens", 512, "--seq-len", 128,
                "--rotation", fitted, "--out", ppl_json, *quant], capsys)
    assert "relative change" in out
    rep = json.loads(ppl_json.read_text())
    assert rep["bf16"]["ppl"] > 1 and rep["int2"]["ppl"] > 1
    assert rep["relative_change"] == pytest.approx(rep["int2"]["ppl"] / rep["bf16"]["ppl"] - 1)
    assert rep["relative_change"] != 0.0
    assert rep["tokens_scored"] == 512 - rep["sequences"]


def test_ppl_extend_mode_and_nothing_quantized(model_dirs, prompt_files, tmp_path, capsys):
    mdir = model_dirs["qwen3"]
    args = ["ppl", "--model", mdir, "--prompts", prompt_files["heldout"], "--tokens", 256, "--seq-len", 64]
    # default windows 64/256 cover every key of 64-token sequences: refused, not reported as INT2
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert "nothing would be quantized" in err and "sink 64 + recent 256" in err
    # extend mode reads everything past the sink in INT2: a larger change than decode mode
    changes = {}
    for mode in ("decode", "extend"):
        out = tmp_path / f"{mode}.json"
        _run([*args, "--sink", 4, "--recent", 8, "--window-mode", mode, "--out", out], capsys)
        rep = json.loads(out.read_text())
        changes[mode] = rep["quantized_read_fraction"]
        assert rep["rotation"]["centered"] == {"k": False, "v": False}  # the data-free Hadamard default
    assert changes["extend"] > changes["decode"] > 0
    from sglang_oscar.calibrate.ppl import format_report
    rep["rotation"]["centered"] = {"k": True, "v": False}
    assert "INT2 (hadamard + K/V means):" in format_report(rep)


def test_ppl_matches_native_attention_when_nothing_quantized_in_oracle(model_dirs, prompt_files, tokenizer):
    """The oracle override with identity rotation and window_mode none reproduces the model's logits."""
    from transformers import AutoModelForCausalLM

    from sglang_oscar.calibrate.capture import attention_override
    from sglang_oscar.calibrate.oracle import mha_output
    from sglang_oscar.config import OscarConfig

    model = AutoModelForCausalLM.from_pretrained(model_dirs["gemma3"], dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(open(prompt_files["calib"]).read().split("\n\n")[0])["input_ids"][:100]])
    ref = model(input_ids=ids, use_cache=False).logits

    def handler(call):
        return torch.stack([mha_output(call, b, None, None, OscarConfig(), "none") for b in range(call.query.shape[0])])

    with attention_override(model, handler):
        got = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
