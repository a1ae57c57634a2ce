"""MLA latent extend kernel (kernels.latent_extend) vs the oracle (reference.latent.latent_attention,
``output="latent_rotated"``, window mode "extend"), on the interpreter or the GPU (``device``); and
the property it exists for: a chunked prefill gives the bits of one prefill."""

from __future__ import annotations

import pytest
import torch
from _support.orthogonal import random_orthogonal
from kv_fixtures import build_latent_pool, fresh_seed, rel_l2
from sglang_oscar.config import OscarConfig
from sglang_oscar.kernels.latent_extend import latent_extend_attention
from sglang_oscar.reference.latent import latent_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LENS, H, R, P = [40, 70, 9], 6, 64, 16
SCALE = (R + P) ** -0.5 * 2.0


def _setup(device, quantizer="uniform", hp=torch.float32):
    fresh_seed()
    cfg = OscarConfig(group_size=32, sink_tokens=4, recent_tokens=8, quantizer=quantizer)
    rot = random_orthogonal(R)
    seqs, pool = build_latent_pool(LENS, R, P, cfg, rot, hp, device)
    q_nope = [torch.randn(n, H, R) for n in LENS]
    q_pe = [torch.randn(n, H, P) for n in LENS]
    return cfg, rot, seqs, pool, q_nope, q_pe


def _run(pool, q_nope, q_pe, rot, prefixes, device, cfg, **kw):
    """The kernel over each request's positions [prefix, L), all requests in one call."""
    q_abs = torch.cat([(q[p:] @ rot) for q, p in zip(q_nope, prefixes)]).to(device)
    qp = torch.cat([q[p:] for q, p in zip(q_pe, prefixes)]).to(device)
    new = [n - p for n, p in zip(LENS, prefixes)]
    qo = torch.tensor([0] + new).cumsum(0).to(torch.int32).to(device)
    planes = {k: pool[k] for k in ("codes", "pairs", "k_pe", "hp_latent", "hp_pe", "hp_index", "req_to_token",
                                   "req_pool_indices")}
    out = latent_extend_attention(q_abs, qp, **planes, qo_indptr=qo, prefix_lens=torch.tensor(prefixes).to(device),
                                  group_size=cfg.group_size, quantizer=cfg.quantizer, sink=cfg.sink_tokens,
                                  sm_scale=SCALE, max_extend_len=max(new), **kw)
    return out.cpu().split(new)


@pytest.mark.parametrize("quantizer,prefixes,tiles", [
    ("uniform", [0, 0, 0], dict(block_t=1, block_h=16)),  # one prefill per request
    ("lloyd-max", [13, 50, 2], dict(block_t=4, block_h=4)),  # chunks after a prefix, 4 tokens x 4 heads per tile
    ("uniform", [39, 69, 8], dict(block_t=2, block_h=8, block_n=32)),  # one new token each: decode-like
])
def test_latent_extend_matches_the_oracle(device, quantizer, prefixes, tiles):
    cfg, rot, seqs, pool, q_nope, q_pe = _setup(device, quantizer)
    eye = torch.eye(R).expand(H, R, R)
    outs = _run(pool, q_nope, q_pe, rot, prefixes, device, cfg, **tiles)
    for (c, kpe), qn, qp, p, o in zip(seqs, q_nope, q_pe, prefixes, outs):
        n = c.shape[0]
        ref = latent_attention(qn[p:], qp[p:], c, kpe, eye, eye, rot, cfg, softmax_scale=SCALE,
                               q_positions=torch.arange(p, n), window_mode="extend", hp_dtype=torch.float32,
                               output="latent_rotated")
        assert o.shape == ref.shape and rel_l2(o, ref) < 1e-4


def test_chunked_prefill_gives_the_bits_of_one_prefill(device):
    """Each row sums the same key tiles in the same order: a request prefilled as prefix + chunk gives
    exactly the rows of one prefill with the same tiles. Other token / head tiles change the dot
    products' shape (on the GPU another MMA instruction and K order; on the interpreter another BLAS
    blocking, seed 1915610337 differed in the last bits): equal to fp32 rounding."""
    cfg, rot, _, pool, q_nope, q_pe = _setup(device)
    whole = _run(pool, q_nope, q_pe, rot, [0, 0, 0], device, cfg, block_t=1, block_h=16)
    part = _run(pool, q_nope, q_pe, rot, [16, 33, 4], device, cfg, block_t=1, block_h=16)
    for w, pt, p in zip(whole, part, [16, 33, 4]):
        assert torch.equal(pt, w[p:])
    tiled = _run(pool, q_nope, q_pe, rot, [16, 33, 4], device, cfg, block_t=4, block_h=8)
    for w, pt, p in zip(whole, tiled, [16, 33, 4]):
        assert rel_l2(pt, w[p:]) < 1e-5  # summation order only; a tiling bug moves rows by > 1e-2


def test_latent_extend_rejects_bad_input():
    cfg, rot, _, pool, q_nope, q_pe = _setup("cpu")
    planes = {k: pool[k] for k in ("codes", "pairs", "k_pe", "hp_latent", "hp_pe", "hp_index", "req_to_token",
                                   "req_pool_indices")}
    q, qp = torch.randn(5, H, R), torch.randn(5, H, P)
    kw = dict(qo_indptr=torch.tensor([0, 5, 5, 5], dtype=torch.int32), prefix_lens=torch.zeros(3, dtype=torch.int32),
              group_size=32, quantizer="uniform", sink=4, sm_scale=0.1, max_extend_len=5)
    with pytest.raises(ValueError, match="block_t \\* block_h must be >= 16"):
        latent_extend_attention(q, qp, **planes, **kw, block_t=2, block_h=4)
    with pytest.raises(ValueError, match="qo_indptr"):
        latent_extend_attention(q, qp, **planes, **{**kw, "qo_indptr": torch.tensor([0, 5], dtype=torch.int32)})
    with pytest.raises(ValueError, match="share \\[T, H\\]"):
        latent_extend_attention(q, torch.randn(4, H, P), **planes, **kw)
    with pytest.raises(ValueError, match="'bf16' on a GPU only"):
        latent_extend_attention(q, qp, **planes, **kw, precision="bf16")
