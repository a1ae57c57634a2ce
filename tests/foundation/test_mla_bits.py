"""Bytes per token and layer of MLA storage, checked against hand arithmetic (DeepSeek-V3 sizes)."""

from __future__ import annotations

import pytest

from sglang_oscar.quant.bits import (
    bytes_per_token_per_head,
    mla_bf16_bytes_per_token,
    mla_expanded_bytes_per_token,
    mla_latent_bytes_per_token,
    mla_latent_bytes_per_token_at,
)


def test_bf16_mla_row():
    assert mla_bf16_bytes_per_token() == (512 + 64) * 2 == 1152
    assert mla_bf16_bytes_per_token(512, 64, "float32") == 2304


@pytest.mark.parametrize("group, scale, expected", [
    (None, "float16", 128 + 1 * 2 * 2 + 128),    # 260: one (scale, zero) pair per latent
    (128, "float16", 128 + 4 * 2 * 2 + 128),     # 272
    (64, "float16", 128 + 8 * 2 * 2 + 128),      # 288
    (32, "float16", 128 + 16 * 2 * 2 + 128),     # 320
    (16, "float16", 128 + 32 * 2 * 2 + 128),     # 384
    (128, "float32", 128 + 4 * 2 * 4 + 128),     # 288
    (64, "float32", 128 + 8 * 2 * 4 + 128),      # 320
])
def test_packed_latent_row(group, scale, expected):
    # 512 codes / 4 per byte = 128 bytes; k_pe 64 BF16 = 128 bytes; pairs in between
    assert mla_latent_bytes_per_token(512, 64, group, scale) == expected


def test_issue_target_of_3_5x():
    """>= 3.5x fewer bytes than BF16 MLA with k_pe BF16: float16 pairs need G >= 32, float32 pairs G >= 64."""
    ratio = {(g, s): 1152 / mla_latent_bytes_per_token(512, 64, g, s)
             for g in (None, 16, 32, 64, 128, 256) for s in ("float16", "float32")}
    assert ratio[(128, "float16")] == pytest.approx(4.235, abs=1e-3)
    assert ratio[(64, "float16")] == 4.0 and ratio[(32, "float16")] == 3.6
    assert ratio[(16, "float16")] == 3.0 and ratio[(32, "float32")] < 3.5 <= ratio[(64, "float32")]
    # codes alone would be 9x; k_pe in BF16 bounds the ratio below 1152 / (128 + 128) = 4.5
    assert max(ratio.values()) < 4.5


def test_windows_amortised():
    # 320 window tokens keep the full BF16 row [c_kv | k_pe]
    assert mla_latent_bytes_per_token_at(131072, group_size=128) == pytest.approx(272 + 320 * 1152 / 131072)
    assert mla_latent_bytes_per_token_at(4096, group_size=128) == pytest.approx(272 + 90.0)
    assert mla_latent_bytes_per_token_at(100, group_size=128) == 272 + 1152  # short: every token in both tiers
    with pytest.raises(ValueError):
        mla_latent_bytes_per_token_at(0)


def test_expanded_storage():
    # per head: K 192 -> 48 code bytes + 3 pairs * 4; V 128 -> 32 + 2 pairs * 4
    assert bytes_per_token_per_head(192, 128, 64) == 48 + 12 + 32 + 8 == 100
    assert mla_expanded_bytes_per_token(128, 128, 64, 128, 64) == 12800
    assert mla_expanded_bytes_per_token(128, 128, 64, 128, None) == 128 * (48 + 4 + 32 + 4)
    assert mla_expanded_bytes_per_token(16, group_size=64) == 1600  # TP 8: 16 heads per rank
    with pytest.raises(ValueError, match="does not divide"):
        mla_expanded_bytes_per_token(128, group_size=128)


def test_bad_arguments():
    with pytest.raises(ValueError, match="does not divide"):
        mla_latent_bytes_per_token(512, 64, 96)
    with pytest.raises(ValueError):
        mla_bf16_bytes_per_token(512, 64, "int8")
