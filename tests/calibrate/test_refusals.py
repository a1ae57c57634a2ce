"""Bad input to calibrate / fit / validate-rotation: a clear error naming the problem and the fix,
never a traceback, a silent fallback or a file built from garbage. And the MLA default that
refused a valid model."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from calib_tiny import build_model, make_text, save_model
from sglang_oscar.calibrate import CalibrationError, ShortDataWarning
from sglang_oscar.calibrate.model import geometry_of
from sglang_oscar.calibrate.prompts import Documents, build_prompt_set, load_documents
from sglang_oscar.calibrate.run import calibrate_model
from sglang_oscar.calibrate.stats import CalibrationStats
from sglang_oscar.cli.main import main
from sglang_oscar.rotation.latent import LatentRotationSet

UNWRITABLE = "/proc/sglang-oscar-test/out.safetensors"  # Linux: no file can be created there, not even by root


def _prompts(tokenizer, budget=600, seq_len=96):
    docs = Documents(make_text(20, 120, 0), "text", "mem", "0" * 64)
    return build_prompt_set(tokenizer, "mem", budget=budget, seq_len=seq_len, documents=docs)


@pytest.fixture(scope="module")
def qwen3_stats(tokenizer, tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_stats")
    path = str(d / "s.safetensors")
    calibrate_model(build_model("qwen3"), _prompts(tokenizer), path, progress=False)
    return path


def _rewrite(src: str, dst, edit_tensors=None, edit_meta=None) -> str:
    with safe_open(src, framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = dict(f.metadata())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        meta["oscar_stats"] = edit_meta(meta["oscar_stats"])
    save_file(tensors, str(dst), metadata=meta)
    return str(dst)


def test_fit_default_latent_block_follows_the_served_rule(tokenizer, tmp_path, capsys):
    """Without --latent-block (and no recipe) fit takes the server's rule: the whole latent when
    kv_lora_rank is narrower than 128, so every method, identity included, fits such a model."""
    model = build_model("deepseek_v2")  # kv_lora_rank 64
    mdir = save_model(model, tokenizer, tmp_path / "m")
    stats = str(tmp_path / "s.safetensors")
    calibrate_model(model, _prompts(tokenizer), stats, progress=False)
    served = LatentRotationSet.served_data_free(geometry_of(model.config))
    for method in ("oscar", "hadamard", "identity"):
        out = str(tmp_path / f"{method}.safetensors")
        args = ["fit", "--stats", stats, "--method", method, "--min-tokens", "1", "--out", out]
        assert main(args) == 0, capsys.readouterr().err
        rs = LatentRotationSet.load(out)
        assert rs.metadata.get("hadamard_block", 64) == 64, method
    assert torch.equal(LatentRotationSet.load(str(tmp_path / "hadamard.safetensors")).r[0], served.r[0])
    # data-free from the config alone
    out = str(tmp_path / "cfg.safetensors")
    assert main(["fit", "--method", "hadamard", "--config", str(mdir), "--out", out]) == 0, capsys.readouterr().err
    assert LatentRotationSet.load(out).metadata["hadamard_block"] == 64


def test_fit_refusals_before_anything_is_written(qwen3_stats, tmp_path, capsys):
    # --min-tokens must be > 0 (0 would switch the minimum off)
    for bad in ("0", "-5"):
        with pytest.raises(SystemExit) as exc:
            main(["fit", "--stats", qwen3_stats, "--min-tokens", bad, "--out", str(tmp_path / "r.safetensors")])
        assert exc.value.code == 2
        assert "--min-tokens: must be a positive integer" in capsys.readouterr().err
    # --upstream-dir on an MHA model: refused before the rotation file is written
    out = tmp_path / "r.safetensors"
    assert main(["fit", "--stats", qwen3_stats, "--min-tokens", "1", "--out", str(out),
                 "--upstream-dir", str(tmp_path / "up")]) == 2
    assert "--upstream-dir applies to MLA" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "up").exists()
    # --out = --stats (swapped or mistyped flags) is refused: the rotation would replace the statistics
    copy = tmp_path / "stats.safetensors"
    copy.write_bytes(open(qwen3_stats, "rb").read())
    assert main(["fit", "--stats", str(copy), "--min-tokens", "1", "--out", str(tmp_path / "." / copy.name)]) == 2
    assert "is the statistics file itself" in capsys.readouterr().err
    CalibrationStats.load(str(copy))  # intact


def test_calibrate_counts_are_checked_before_the_model_loads(tmp_path, capsys):
    for flag in ("--batch-size", "--checkpoint-every"):
        with pytest.raises(SystemExit) as exc:
            main(["calibrate", "--model", str(tmp_path / "no-model"), "--prompts", "x.txt", flag, "0",
                  "--out", str(tmp_path / "s.safetensors")])
        assert exc.value.code == 2 and f"{flag}: must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_unwritable_outputs(qwen3_stats, tmp_path, capsys):
    """An output path that cannot be written is refused, naming it, before any work (calibrate before pass 1)."""
    assert main(["fit", "--stats", qwen3_stats, "--min-tokens", "1", "--out", UNWRITABLE]) == 2
    err = capsys.readouterr().err
    assert f"--out {UNWRITABLE} cannot be written" in err
    missing_model = str(tmp_path / "no-model")  # the check comes first: no model is loaded
    assert main(["calibrate", "--model", missing_model, "--prompts", "x.txt", "--out", UNWRITABLE]) == 2
    assert "cannot be written" in capsys.readouterr().err


def test_model_config_that_is_not_json(qwen3_stats, tmp_path, capsys):
    """Printed only "Expecting value: line 1 column 1 (char 0)", naming no file."""
    bad = tmp_path / "notes.txt"
    bad.write_text("not a config\n")
    assert main(["fit", "--stats", qwen3_stats, "--min-tokens", "1", "--config", str(bad),
                 "--out", str(tmp_path / "r.safetensors")]) == 2
    err = capsys.readouterr().err
    assert f"model config {bad} is not a JSON file" in err
    rot = str(tmp_path / "r.safetensors")
    assert main(["fit", "--stats", qwen3_stats, "--min-tokens", "1", "--out", rot]) == 0
    capsys.readouterr()
    assert main(["validate-rotation", rot, "--config", str(bad)]) == 2
    assert f"model config {bad} is not a JSON file" in capsys.readouterr().err


def test_non_finite_or_damaged_statistics(qwen3_stats, tmp_path, capsys):
    """A statistics file with NaN/Inf in any sum, a missing tensor or damaged metadata is refused at load,
    naming the file, the tensor and the fix."""

    def nan_in(name):
        def edit(t):
            t[name] = t[name].clone()
            t[name].view(-1)[0] = float("nan")
        return edit

    for name in ("q_sum.0", "k_sum.1", "w_sum.0"):
        path = _rewrite(qwen3_stats, tmp_path / f"{name}.safetensors", edit_tensors=nan_in(name))
        with pytest.raises(CalibrationError, match=rf"tensor '{name}' contains NaN/Inf.*--dtype"):
            CalibrationStats.load(path)
        assert main(["fit", "--stats", path, "--min-tokens", "1", "--out", str(tmp_path / "r.safetensors")]) == 2
        assert f"tensor '{name}' contains NaN/Inf" in capsys.readouterr().err
    assert not (tmp_path / "r.safetensors").exists()
    path = _rewrite(qwen3_stats, tmp_path / "missing.safetensors", edit_tensors=lambda t: t.pop("q_sum.1"))
    with pytest.raises(CalibrationError, match=r"tensor 'q_sum.1' is missing .* damaged"):
        CalibrationStats.load(path)

    def drop_geometry(raw):
        meta = json.loads(raw)
        del meta["geometry"]
        return json.dumps(meta)

    for edit, what in ((drop_geometry, "its geometry cannot be read"), (lambda raw: "{oops", "not valid JSON"),
                       (lambda raw: "[1]", "not an object")):
        path = _rewrite(qwen3_stats, tmp_path / "meta.safetensors", edit_meta=edit)
        assert main(["fit", "--stats", path, "--min-tokens", "1", "--out", str(tmp_path / "r.safetensors")]) == 2
        err = capsys.readouterr().err
        assert "metadata is damaged" in err and what in err and "Traceback" not in err


@pytest.mark.parametrize("family, param", [("qwen3", "layers.1.self_attn.v_proj.weight"),
                                           ("deepseek_v2", "layers.1.self_attn.kv_a_proj_with_mqa.weight")])
def test_non_finite_activations_stop_calibration(family, param, tokenizer, tmp_path):
    """A layer whose K/V (MHA) or latent (MLA) turns NaN: MHA failed with "v contains NaN or Inf" (no
    layer), MLA wrote a statistics file of NaN."""
    model = build_model(family)
    with torch.no_grad():
        dict(model.named_parameters())[f"model.{param}"][0, 0] = float("nan")
    out = tmp_path / "s.safetensors"
    with pytest.raises(CalibrationError, match=r"layer 1: the captured (value|latent) of pass 1 contains NaN/Inf"):
        calibrate_model(model, _prompts(tokenizer, budget=200), str(out), progress=False)
    assert not out.exists()


def test_prompt_files_of_the_wrong_format(tokenizer, tmp_path):
    # a JSONL text that is not a string was calibrated on as its str(): "None", "5"
    for value, kind in ((None, "null"), (5, "number"), (["a"], "array")):
        p = tmp_path / "a.jsonl"
        p.write_text(json.dumps({"text": value}) + "\n")
        with pytest.raises(CalibrationError, match=rf"a.jsonl:1: the 'text' field is a JSON {kind}, not a string"):
            load_documents(str(p))
    # a .json file is a JSON array of records (or JSON Lines), never plain text
    docs = make_text(3, 20, 1)
    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([{"text": d} for d in docs]))
    lines = tmp_path / "b.json"
    lines.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for p in (arr, lines):
        got = load_documents(str(p))
        assert got.texts == docs and got.kind == "jsonl"
    pretty = tmp_path / "c.json"
    pretty.write_text(json.dumps({"text": docs[0]}, indent=2))
    with pytest.raises(CalibrationError, match="JSON array of objects or one JSON object per line"):
        load_documents(str(pretty))
    # bytes that are not UTF-8 are refused with their offset (never decoded with replacement characters)
    binary = tmp_path / "data.txt"
    binary.write_bytes(b"ba de \xff\xfe\x00 fi")
    with pytest.raises(CalibrationError, match=r"data.txt is not UTF-8 text \(byte 6"):
        load_documents(str(binary))


def test_short_data_warning_says_documents_were_cut(tokenizer, tmp_path):
    """One long JSONL document under --seq-len: "has only 64 tokens" although it holds far more."""
    p = tmp_path / "one.jsonl"
    p.write_text(json.dumps({"text": " ".join(make_text(1, 300, 0))}) + "\n")
    with pytest.warns(ShortDataWarning, match=r"only 64 tokens .*1 documents were longer than --seq-len 64 and were cut"):
        build_prompt_set(tokenizer, str(p), budget=500, seq_len=64)


def test_statistics_of_an_mha_model_against_an_mla_config(qwen3_stats, tmp_path, capsys):
    """The MLA side of a geometry mismatch is described by its latent (kv_lora_rank), not as one fake head."""
    from calib_tiny import family_config

    family_config("deepseek_v2").save_pretrained(tmp_path / "mla")
    assert main(["fit", "--stats", qwen3_stats, "--min-tokens", "1", "--config", str(tmp_path / "mla"),
                 "--out", str(tmp_path / "r.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "cannot be used" in err and "MLA latent kv_lora_rank 64" in err and "head_dims [32]" in err


@pytest.mark.parametrize("rank", [32, 96, 192])
def test_latent_rotations_for_a_rank_no_int2_cache_serves_are_refused(tmp_path, capsys, rank):
    """fit and validate-latent refuse a kv_lora_rank the INT2 latent kernels do not take (a quarter of it
    must be a power of two, at least 16): such a file would never be served; the message says so and
    names the fix, where fit used to suggest a --latent-block that was never given."""
    from calib_tiny import family_config

    mdir = tmp_path / f"r{rank}"
    family_config("deepseek_v2", kv_lora_rank=rank).save_pretrained(mdir)
    out = str(tmp_path / "latent.safetensors")
    assert main(["fit", "--method", "hadamard", "--config", str(mdir), "--out", out]) == 2
    err = capsys.readouterr().err
    assert f"kv_lora_rank {rank}, not a width the INT2 latent kernels take" in err and "--kv-cache-dtype auto" in err
    assert "--latent-block" not in err and not os.path.exists(out)
    # a file of the model's own rank (written without fit's check) is refused by validate-latent alike
    LatentRotationSet.data_free(geometry_of(family_config("deepseek_v2", kv_lora_rank=rank)), "hadamard", None).save(out)
    assert main(["validate-latent", out, "--config", str(mdir)]) == 2
    err = capsys.readouterr().err
    assert f"kv_lora_rank {rank}, not a width the INT2 latent kernels take" in err and "--kv-cache-dtype auto" in err


def test_a_missing_config_path_is_not_taken_for_a_hub_id(tmp_path):
    """--config /abs/missing, ./rel or x.json that does not exist: a missing file, not a Hub id lookup."""
    from sglang_oscar.calibrate.verb_inputs import read_config

    for path in (str(tmp_path / "none"), "./none", "none.json"):
        with pytest.raises(FileNotFoundError, match=r"does not exist \(a path, not a Hub id\)"):
            read_config(path, hub=True)


def test_a_group_size_that_does_not_fit_the_rotation_is_refused_before_the_model_loads(tmp_path, capsys):
    """error / ppl name the latent rank (not a head_dim) of an MLA file, and the head_dims of a K/V file,
    before any model is loaded (the model path here does not exist)."""
    from calib_tiny import family_config

    from sglang_oscar.rotation import RotationSet

    latent = str(tmp_path / "latent.safetensors")
    LatentRotationSet.served_data_free(geometry_of(family_config("deepseek_v2"))).save(latent)  # kv_lora_rank 64
    kv = str(tmp_path / "kv.safetensors")
    RotationSet.data_free(geometry_of(family_config("qwen3"))).save(kv)  # head_dim 32
    missing = str(tmp_path / "no-model")
    for verb in ("error", "ppl"):
        assert main([verb, "--model", missing, "--rotation", latent, "--prompts", "x.txt", "--group-size", "48"]) == 2
        err = capsys.readouterr().err
        assert "group size 48 does not divide kv_lora_rank 64" in err and "pick 64 or 32 or 16" in err, err
        assert main([verb, "--model", missing, "--rotation", kv, "--prompts", "x.txt", "--group-size", "48"]) == 2
        assert "group_size=48 does not divide head_dim=32" in capsys.readouterr().err


def test_validate_latent_says_when_the_server_refuses_the_model(tmp_path, capsys):
    """A latent file that fits a DeepSeek-V3.2 config validates, and the report and stderr say that the
    int2 server does not serve that architecture."""
    from calib_tiny import family_config

    mdir = tmp_path / "v32"
    family_config("deepseek_v2").save_pretrained(mdir)
    out = str(tmp_path / "latent.safetensors")
    assert main(["fit", "--method", "hadamard", "--config", str(mdir), "--out", out]) == 0
    capsys.readouterr()
    assert main(["validate-latent", out, "--config", str(mdir)]) == 0
    cap = capsys.readouterr()
    assert "not_served" not in json.loads(cap.out.strip().splitlines()[-1]) and "warning" not in cap.err
    cfg = json.loads((mdir / "config.json").read_text())
    (mdir / "config.json").write_text(json.dumps({**cfg, "architectures": ["DeepseekV32ForCausalLM"]}))
    assert main(["validate-latent", out, "--config", str(mdir)]) == 0
    cap = capsys.readouterr()
    report = json.loads(cap.out.strip().splitlines()[-1])
    assert report["ok"] and "DeepseekV32ForCausalLM ('deepseek_v2') is not among them yet" in report["not_served"]
    assert "warning: the rotation fits this model, but --kv-cache-dtype int2 serves the MLA latent cache of" in cap.err


def test_statistics_of_another_model_name_the_first_difference():
    """Statistics of a hybrid against a plain model with the same layer count, heads and head_dim: the
    summaries read alike on both sides, so the message names what differs (the attention layer ids here)."""
    import dataclasses

    from sglang_oscar.rotation import ModelGeometry

    plain = ModelGeometry.from_hf_config(dict(model_type="qwen3", num_hidden_layers=4, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=64))
    hybrid = dataclasses.replace(plain, layers=tuple(dataclasses.replace(x, layer_id=2 * x.layer_id + 1)
                                                     for x in plain.layers[:2]))
    stats = CalibrationStats(hybrid, {"path": "s.safetensors", "model": {"id": "hybrid"}})
    with pytest.raises(CalibrationError, match=r"they differ in the attention layer ids \(\[1, 3\] vs \[0, 1, 2, 3\]\)"):
        stats.check_model(plain)
    windowed = dataclasses.replace(plain, layers=tuple(dataclasses.replace(x, sliding_window=32) for x in plain.layers))
    with pytest.raises(CalibrationError, match=r"they differ at attention layer 0: sliding window 32 vs None"):
        CalibrationStats(windowed, {"model": {"id": "w"}}).check_model(plain)
