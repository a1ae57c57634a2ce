"""Bad input to the core verbs (hadamard, validate, convert): one clear line and exit 2, never a
traceback, a silently wrong file or a file of nothing."""

from __future__ import annotations

import os

import pytest
import torch

from _support.configs import write_config
from sglang_oscar.cli.main import main
from sglang_oscar.rotation import ModelGeometry
from sglang_oscar.rotation.latent import LatentRotationSet

QWEN3 = {"model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "hidden_size": 128}
# a DeepSeek-V3 whose latent (64) is narrower than the served Hadamard block of 128
NARROW_MLA = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32,
              "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}
# exists on Linux; no file can be created in it, not even by root
UNWRITABLE = "/proc/sglang-oscar-test/out.safetensors"
needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


def test_hadamard_latent_file_of_a_latent_narrower_than_128(tmp_path, capsys):
    """`hadamard --mla-storage latent` writes what the server uses without a file (the whole latent
    when kv_lora_rank < 128)."""
    cfg = write_config(tmp_path, NARROW_MLA)
    out = str(tmp_path / "h.safetensors")
    assert main(["hadamard", "--config", cfg, "--mla-storage", "latent", "--out", out]) == 0, capsys.readouterr().err
    rs = LatentRotationSet.load(out)
    served = LatentRotationSet.served_data_free(ModelGeometry.from_hf_config(NARROW_MLA))
    assert rs.metadata["hadamard_block"] == 64 and torch.equal(rs.r[1], served.r[1])
    assert main(["validate", out, "--config", cfg, "--mla-storage", "latent"]) == 0


def test_validate_a_latent_file_against_an_mha_config(tmp_path, capsys):
    """A latent file checked against an MHA config is named as a latent file, with the command that checks it."""
    mla, mha = write_config(tmp_path, NARROW_MLA, "mla.json"), write_config(tmp_path, QWEN3, "qwen3.json")
    latent = str(tmp_path / "latent.safetensors")
    assert main(["hadamard", "--config", mla, "--mla-storage", "latent", "--out", latent]) == 0
    capsys.readouterr()
    assert main(["validate", latent, "--config", mha]) == 2
    err = capsys.readouterr().err
    assert "is an MLA latent rotation file" in err and "validate-rotation" in err and "unexpected tensor" not in err
    # and the other way round: a K/V file given to validate-latent names what it is
    kv = str(tmp_path / "kv.safetensors")
    assert main(["hadamard", "--config", mha, "--out", kv]) == 0
    capsys.readouterr()
    assert main(["validate-latent", kv, "--config", mla]) == 2
    err = capsys.readouterr().err
    assert "is a K/V rotation file" in err and "not an sglang-oscar latent rotation file" in err
    assert "metadata format None" not in err


def test_convert_of_empty_upstream_files_writes_nothing(tmp_path, capsys):
    """An upstream pair with empty 'layers' dicts is refused; nothing is written."""
    for which in ("k", "v"):
        torch.save({"format_version": 1, "layers": {}}, tmp_path / f"{which}.pt")
    out = tmp_path / "o.safetensors"
    assert main(["convert", "--k", str(tmp_path / "k.pt"), "--v", str(tmp_path / "v.pt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "k.pt holds no layers" in err and not out.exists()


@needs_proc
def test_unwritable_output_is_an_error_not_a_traceback(tmp_path, capsys):
    """An unwritable output folder is a named CLI error (safetensors would raise its own exception type)."""
    cfg = write_config(tmp_path, QWEN3)
    assert main(["hadamard", "--config", cfg, "--out", UNWRITABLE]) == 2
    err = capsys.readouterr().err
    assert f"--out {UNWRITABLE} cannot be written" in err and "Traceback" not in err
    h = torch.eye(32)
    for which in ("k", "v"):
        torch.save({"layers": {i: {"rotation": h} for i in range(2)}}, tmp_path / f"{which}.pt")
    assert main(["convert", "--k", str(tmp_path / "k.pt"), "--v", str(tmp_path / "v.pt"), "--out", UNWRITABLE]) == 2
    assert "cannot be written" in capsys.readouterr().err
    # a path below a file, and a directory given as the output file
    assert main(["hadamard", "--config", cfg, "--out", os.path.join(cfg, "r.safetensors")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert main(["hadamard", "--config", cfg, "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
