"""MLA latent decode kernel (kernels.latent) vs the oracle (reference.latent.latent_attention,
``output="latent_rotated"``, window mode "decode"), on the interpreter or the GPU (``device``).

Each request's latents are quantized by the oracle (``build_latent_cache``), its codes, pairs and
``k_pe`` scattered to random non-contiguous slots and its sink / recent rows to random HP rows;
every other slot and row is poisoned (0xAB codes, NaN pairs and rows), so a wrong read shows.
"""

from __future__ import annotations

import pytest
import torch
from _support.orthogonal import random_orthogonal
from kv_fixtures import build_latent_pool, fresh_seed, rel_l2
from sglang_oscar.config import OscarConfig
from sglang_oscar.kernels.latent import latent_decode_attention
from sglang_oscar.reference.latent import latent_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("lens,h,r,p,group,quantizer,sink,recent,hp", [
    ([40, 9, 3], 4, 64, 16, 32, "uniform", 4, 8, torch.float32),  # windows, short requests, 2 groups
    ([33, 70], 20, 128, 32, 128, "lloyd-max", 2, 16, torch.float32),  # H > BLOCK_H, one group per row
    ([65], 3, 64, 16, 16, "uniform", 0, 0, torch.float32),  # INT2 only
    ([50, 21], 8, 64, 16, 32, "uniform", 4, 8, torch.bfloat16),  # BF16 windows and k_pe
])
def test_latent_decode_matches_the_oracle(device, lens, h, r, p, group, quantizer, sink, recent, hp):
    fresh_seed()
    cfg = OscarConfig(group_size=group, sink_tokens=sink, recent_tokens=recent, quantizer=quantizer)
    rot = random_orthogonal(r)
    seqs, pool = build_latent_pool(lens, r, p, cfg, rot, hp, device)
    scale = (r + p) ** -0.5 * 2.0
    eye = torch.eye(r).expand(h, r, r)  # w_kc = w_vc = I: q_abs = q_nope, o = o_latent
    q_nope, q_pe = torch.randn(len(lens), h, r), torch.randn(len(lens), h, p)
    ref = torch.stack([latent_attention(q_nope[i:i + 1], q_pe[i:i + 1], c, kpe, eye, eye, rot, cfg, softmax_scale=scale,
                                        window_mode="decode", hp_dtype=hp, output="latent_rotated")[0]
                       for i, (c, kpe) in enumerate(seqs)])
    q_abs = (q_nope @ rot).to(device)
    for splits in (1, 3):
        out = latent_decode_attention(q_abs, q_pe.to(device), **pool, group_size=group, quantizer=quantizer, sink=sink,
                                      recent=recent, sm_scale=scale, num_splits=splits)
        assert out.shape == (len(lens), h, r) and torch.isfinite(out).all()
        assert rel_l2(out.cpu(), ref) < (1e-4 if hp == torch.float32 else 1e-2), splits


def test_latent_decode_rejects_bad_shapes():
    cfg = OscarConfig(group_size=32, sink_tokens=2, recent_tokens=4)
    _, pool = build_latent_pool([10], 64, 16, cfg, torch.eye(64), torch.float32, "cpu")
    q, qp = torch.randn(1, 2, 64), torch.randn(1, 2, 16)
    kw = dict(group_size=32, quantizer="uniform", sink=2, recent=4, sm_scale=0.1)
    with pytest.raises(ValueError, match="multiple of 64"):
        latent_decode_attention(torch.randn(1, 2, 48), qp, **pool, **kw)
    with pytest.raises(ValueError, match="pairs"):
        latent_decode_attention(q, qp, **{**pool, "pairs": pool["pairs"][:, :2]}, **kw)
    with pytest.raises(ValueError, match="hp_index"):
        latent_decode_attention(q, qp, **pool, **{**kw, "recent": 64})
