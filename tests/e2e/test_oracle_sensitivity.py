"""How much check c's reference itself moves when K/V change by rounding.

INT2 quantization is discontinuous: a BF16-level change of a key moves some codes by a whole step.
On the harness's tiny Qwen3 (same seed and sharpening as check c, rotations fitted per layer on
4 x 512 random tokens) and two random 300-token sequences, the oracle on the checkpoint loaded in
bf16 vs fp32 (HP tier BF16: what check c compares against) moves the log-probabilities far more
than BF16 rounding moves the plain model; at fp32 level (fp32 vs fp64 model, HP tier fp32, what
``--c-fp32`` compares against) that noise shrinks, which is why c's fp32 criterion tests the INT2
path rather than BF16 rounding. ``docs/serving.md`` ("Check c, read with the oracle's own
sensitivity") quotes these numbers.
"""

from __future__ import annotations

import pytest
import torch

from .checkpoints import build_checkpoint, load_hf, make_rotation_files, random_prompt
from .config import C_RECENT, C_SINK, parse_args
from .oracle import teacher_forced_logprobs


def mean_abs(x: list[list[float]], y: list[list[float]]) -> float:
    """Mean |a - b| over all positions of all sequences."""
    d = [abs(p - q) for s, t in zip(x, y) for p, q in zip(s, t)]
    return sum(d) / len(d)


@pytest.mark.slow
def test_oracle_sensitivity_to_kv_rounding(tmp_path):
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet

    args = parse_args(["--out", str(tmp_path / "out")])
    ckpt = str(tmp_path / "qwen3")
    build_checkpoint("qwen3", ckpt, seed=args.seed, args=args)
    rot = make_rotation_files(load_hf(ckpt, "cpu"), ckpt, str(tmp_path / "rot"), seqs=4, seq_len=512, min_tokens=1000)
    rotation = RotationSet.load(rot["layer"])
    cfg = OscarConfig(sink_tokens=C_SINK, recent_tokens=C_RECENT)
    seqs = [random_prompt(300, 7 + i) for i in range(2)]
    models = {dt: load_hf(ckpt, "cpu", dtype=dt) for dt in (torch.bfloat16, torch.float32, torch.float64)}

    def oracle(dtype, hp):
        return teacher_forced_logprobs(models[dtype], seqs, rotation=rotation, config=cfg, hp_dtype=hp)

    def plain(dtype):
        return teacher_forced_logprobs(models[dtype], seqs)

    o_bf16, o_fp32 = oracle(torch.bfloat16, torch.bfloat16), oracle(torch.float32, torch.bfloat16)
    oracle_bf16_level = mean_abs(o_bf16, o_fp32)  # measured 0.064-0.068
    plain_bf16_level = mean_abs(plain(torch.bfloat16), plain(torch.float32))  # 0.0030
    int2_effect = mean_abs(o_bf16, plain(torch.bfloat16))  # 0.13
    oracle_fp32_level = mean_abs(oracle(torch.float32, torch.float32), oracle(torch.float64, torch.float32))  # <= 0.004
    plain_fp32_level = mean_abs(plain(torch.float32), plain(torch.float64))  # 3.3e-7
    assert 0.03 < oracle_bf16_level < 0.13, oracle_bf16_level
    assert plain_bf16_level < 0.01 and oracle_bf16_level > 10 * plain_bf16_level, (plain_bf16_level, oracle_bf16_level)
    assert int2_effect > oracle_bf16_level, (int2_effect, oracle_bf16_level)
    assert oracle_fp32_level < oracle_bf16_level / 4, (oracle_fp32_level, oracle_bf16_level)
    assert plain_fp32_level < 1e-5, plain_fp32_level
