import json

import pytest
import torch

from sglang_oscar.cli.main import main
from sglang_oscar.rotation import RotationSet, hadamard_matrix


@pytest.fixture
def config_path(tmp_path):
    cfg = {"model_type": "qwen3", "num_hidden_layers": 3, "num_attention_heads": 8,
           "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 512}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return str(p)


def test_hadamard_then_validate(tmp_path, config_path, capsys):
    out = str(tmp_path / "rot.safetensors")
    assert main(["hadamard", "--config", config_path, "--out", out]) == 0
    rs = RotationSet.load(out)
    assert rs.layer_ids == [0, 1, 2]
    assert torch.allclose(rs.k[1], hadamard_matrix(64).float())
    assert main(["validate", out, "--config", config_path]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] and report["layers"] == 3 and report["max_orthogonality_error"] < 1e-6
    assert "not_served" not in report


def test_validate_says_when_the_server_refuses_the_model_itself(tmp_path, capsys):
    """head_dim 32: the file fits the model ("ok"), and the report and stderr say that the INT2 kernels
    do not take that head_dim (a user reads "ok" as servable)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 128}))
    out = str(tmp_path / "rot.safetensors")
    assert main(["hadamard", "--config", str(cfg), "--out", out]) == 0
    capsys.readouterr()
    for verb in ("validate", "validate-rotation"):
        args = [verb, out, "--config", str(cfg)]
        assert main(args) == 0
        cap = capsys.readouterr()
        report = json.loads(cap.out.strip().splitlines()[-1])
        assert report["ok"] and "head_dim=32 is not supported by the INT2 kernels" in report["not_served"]
        assert "warning: the rotation fits this model, but --kv-cache-dtype int2 cannot serve 'qwen3'" in cap.err
        assert "--kv-cache-dtype auto" in cap.err
    # KV-shared layers (Gemma-3n, small Gemma-4) are refused at launch whatever the file: reported too
    cfg.write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 64, "hidden_size": 256,
                               "num_kv_shared_layers": 1}))
    assert main(["hadamard", "--config", str(cfg), "--out", out]) == 0
    capsys.readouterr()
    assert main(["validate", out, "--config", str(cfg)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "does not support KV-shared layers yet" in report["not_served"]


def test_validate_mismatch_exits_2_with_message(tmp_path, config_path, capsys):
    out = str(tmp_path / "rot.safetensors")
    assert main(["hadamard", "--config", config_path, "--out", out]) == 0
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model_type": "qwen3", "num_hidden_layers": 5, "num_attention_heads": 8,
                                 "num_key_value_heads": 2, "head_dim": 64}))
    assert main(["validate", out, "--config", str(other)]) == 2
    err = capsys.readouterr().err
    assert "missing [3, 4]" in err and "refit" in err
    assert main(["validate", str(tmp_path / "missing.safetensors"), "--config", config_path]) == 2


def test_convert_upstream_files(tmp_path, config_path):
    h = hadamard_matrix(64).float()
    for which in ("k", "v"):
        torch.save({"format_version": 1, "layers": {str(i): {"rotation": h} for i in range(3)}}, tmp_path / f"{which}.pt")
    out = str(tmp_path / "conv.safetensors")
    assert main(["convert", "--k", str(tmp_path / "k.pt"), "--v", str(tmp_path / "v.pt"), "--config", config_path, "--out", out]) == 0
    assert RotationSet.load(out).metadata["model_type"] == "qwen3"


def test_bpe(capsys):
    assert main(["bpe", "--head-dim", "128", "--group-size", "128", "--context", "131072"]) == 0
    out = capsys.readouterr().out
    assert "2.2891" in out and "2.2836" in out
    assert main(["bpe", "--head-dim", "128", "--group-size", "48"]) == 2


def test_demo_table(capsys):
    assert main(["demo", "--context", "1024"]) == 0
    out = capsys.readouterr().out
    rows = {line[:40].strip() + "|" + line[41:51].strip(): float(line[51:62]) for line in out.splitlines() if "sink/recent" in line or "naive" in line}
    assert rows["OSCAR + sink/recent|uniform"] < rows["Hadamard + sink/recent|uniform"] < rows["no rotation + sink/recent|uniform"]
    assert rows["no rotation + sink/recent|uniform"] < rows["naive INT2 (no rotation, no windows)|symmetric"]
    nowin = {line[:40].strip(): float(line[51:62]) for line in out.splitlines() if line.startswith(("Hadamard, no", "OSCAR, no"))}
    assert set(nowin) == {"Hadamard, no windows", "OSCAR, no windows"}
    bits = {line[:40].strip(): float(line[62:]) for line in out.splitlines() if line.startswith(("Hadamard, no", "OSCAR, no"))}
    assert bits["Hadamard, no windows"] == bits["OSCAR, no windows"] == 2.25  # equal bits: D=G=128, fp16 pairs
    assert rows["Hadamard + sink/recent|uniform"] < nowin["Hadamard, no windows"]  # the windows help
    assert rows["OSCAR + sink/recent|uniform"] < nowin["OSCAR, no windows"]
    assert main(["demo", "--context", "100"]) == 0  # shorter than the query count
    assert main(["demo", "--context", "0"]) == 2


def test_hub_id_config_is_refused_with_the_way_out(tmp_path, capsys):
    assert main(["hadamard", "--config", "NoOrg/NoSuchModel", "--out", str(tmp_path / "r.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "NoOrg/NoSuchModel does not exist" in err and "fit --method hadamard --config HUB_ID --out" in err
    assert not (tmp_path / "r.safetensors").exists()


def test_help_does_not_import_torch():
    """Building the parser (every verb's options) stays torch-free, so --help and usage errors are fast."""
    import subprocess
    import sys

    code = ("import sys; from sglang_oscar.cli.main import build_parser; p = build_parser(); "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(m for m in sys.modules if m in "
            "('torch', 'numpy')); print(' '.join(sorted(p._subparsers._group_actions[0].choices)))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert set(res.stdout.split()) == {  # every verb registered
        "hadamard", "validate", "convert", "bpe", "demo", "calibrate", "fit", "error", "ppl", "quality",
        "validate-rotation", "validate-latent", "recipe-cmd", "serve", "eval", "eval-recipe", "compare"}
