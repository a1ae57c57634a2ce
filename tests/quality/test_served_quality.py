"""``python -m tests.e2e.served_quality``, PyTorch side (--no-server): oracle vs BF16 on a tiny trained
checkpoint. It stays beside the fixture ``tiny_run``; the module is imported as ``e2e.served_quality``
(``tests/`` is on ``sys.path`` under pytest's default import mode)."""

from __future__ import annotations

import json
import math

from e2e import served_quality


def test_oracle_side_of_the_served_check(tiny_run, tmp_path):
    ckpt, _ = tiny_run
    sq = served_quality
    common = ["--model", str(ckpt), "--no-server", "--device", "cpu", "--seqs", "2", "--seq-len", "96",
              "--calib-tokens", "2048"]
    # windows covering the whole sequence: nothing is quantized, the oracle reproduces BF16
    assert sq.main(common + ["--out", str(tmp_path / "full"), "--sink", "128", "--recent", "0"]) == 0
    full_rep = json.loads((tmp_path / "full" / "served_quality.json").read_text())
    full = full_rep["pytorch"]
    # the held-out sequences come from different held-out files, the calibration from train files
    held_keys = {json.loads(line)["key"] for line in (ckpt / "heldout.jsonl").read_text().splitlines() if line.strip()}
    names = [name for seq in full_rep["heldout_sources"] for name, _, _ in seq]
    assert full_rep["sequences"] == 2 and full_rep["heldout_files"] == len(set(names)) >= 2
    assert set(names) <= held_keys and full_rep["calib_files"] >= 2048 // 96
    assert f"2 held-out sequences x 96 tokens from {full_rep['heldout_files']} held-out files" in (
        tmp_path / "full" / "served_quality.md").read_text()
    assert abs(full["int2_oracle_ppl"] / full["bf16_ppl"] - 1) < 5e-3
    assert full["int2_effect_mean_abs_dlogprob"] < 5e-3
    assert math.isfinite(full["bf16_ppl"]) and full["bf16_ppl"] > 1
    # small windows: INT2 is read and changes the log-probs; the fitted rotation file is reused
    rot = str(tmp_path / "full" / "rot_oscar.safetensors")
    assert sq.main(common + ["--out", str(tmp_path / "small"), "--sink", "4", "--recent", "8", "--rotation", rot]) == 0
    small = json.loads((tmp_path / "small" / "served_quality.json").read_text())["pytorch"]
    assert small["bf16_ppl"] == full["bf16_ppl"]
    assert small["int2_effect_mean_abs_dlogprob"] > 10 * full["int2_effect_mean_abs_dlogprob"]
    assert "served" not in json.loads((tmp_path / "small" / "served_quality.json").read_text())
