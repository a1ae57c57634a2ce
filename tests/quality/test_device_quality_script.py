"""``device/quality.sh`` in two stages on CPU (``STAGE=train`` then ``STAGE=eval``), the
way a 10-minute training is split over two device calls; and its argument checks."""

from __future__ import annotations

import json
import os
import subprocess

from quality_helpers import REPO, TINY_MODEL, write_text_tree

SCRIPT = str(REPO / "device" / "quality.sh")
QUALITY_ARGS = ("--seq-len 128 --calib-tokens 2048 --eval-tokens 512 --sink 4 --recent 16 --kivi-residual 16 "
                "--kivi-group 16 --min-tokens 1000")


def _run(env_extra: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, DEVICE="cpu", OMP_NUM_THREADS="1", **{"PREFLIGHT": "0", **env_extra})
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(["bash", SCRIPT, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_stage_train_then_eval(tmp_path):
    text = write_text_tree(tmp_path / "text", n_files=40, seed=3)
    dirs = {"OUT": str(tmp_path / "out"), "CKPT": str(tmp_path / "ckpt"), "WORK": str(tmp_path / "work")}
    tr = _run(dict(dirs, STAGE="train"), "0.2", "--max-steps", "3", *TINY_MODEL, "--seq-len", "128", "--batch",
              "4", "--no-system-text", "--text-dir", str(text), "--heldout-frac", "0.2", "--eval-every", "0",
              "--eval-seqs", "4")
    assert tr.returncode == 0, tr.stdout[-2000:] + tr.stderr[-2000:]
    assert "STAGE=train: checkpoint in" in tr.stdout
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert not (tmp_path / "out" / "quality.json").exists()  # stopped after training
    summary = json.loads((tmp_path / "out" / "train_summary.json").read_text())
    assert summary["steps"] == 3

    ev = _run(dict(dirs, STAGE="eval", PREFLIGHT="1", QUALITY_ARGS=QUALITY_ARGS))
    assert ev.returncode == 0, ev.stdout[-2000:] + ev.stderr[-2000:]
    assert "STAGE=eval: using the checkpoint" in ev.stdout and "(3 steps," in ev.stdout
    assert "training done" not in ev.stdout  # no second training
    assert "preflight ok" not in ev.stdout and not (tmp_path / "out" / "preflight.log").exists()
    q = json.loads((tmp_path / "out" / "quality.json").read_text())
    names = {r["name"] for r in q["rows"]}
    assert {"bf16", "naive-int2", "hadamard", "oscar-layer+win", "oscar-head+win"} <= names
    db = {r["name"]: r["error_db"] for r in q["rows"]}
    assert db["naive-int2"] > db["hadamard+win"] + 3.0  # windows + rotation: clearly less attention error


def test_stage_errors(tmp_path):
    bad = _run({"STAGE": "bogus", "OUT": str(tmp_path / "o")})
    assert bad.returncode == 2 and "STAGE must be all, train or eval" in bad.stdout
    missing = _run({"STAGE": "eval", "OUT": str(tmp_path / "o"), "CKPT": str(tmp_path / "none"),
                    "WORK": str(tmp_path / "w")})
    assert missing.returncode == 2 and "no finished checkpoint in" in missing.stdout
    # an unfinished checkpoint (config.json written, no train_summary.json) is refused too
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / "config.json").write_text("{}")
    part = _run({"STAGE": "eval", "OUT": str(tmp_path / "o"), "CKPT": str(tmp_path / "part"),
                 "WORK": str(tmp_path / "w")})
    assert part.returncode == 2 and "no finished checkpoint in" in part.stdout
    assert not (tmp_path / "o" / "gpu.txt").exists()  # refused before any work
    root = _run({"STAGE": "train", "OUT": str(tmp_path / "o"), "CKPT": "/"})
    assert root.returncode == 2 and "CKPT must name a checkpoint directory" in root.stdout
