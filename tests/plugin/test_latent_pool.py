"""The INT2 MLA latent pool (``pool.latent_pool.OscarMLATokenToKVPool``) on CPU: sizes, refusals of
BF16 access, and rows written through :meth:`write_latent` with the windows' HP rows, read by the
latent decode kernel, equal to the oracle (``reference.latent.latent_attention``)."""

from __future__ import annotations

import pytest
import torch

from _support.orthogonal import random_orthogonal
from sglang_oscar.config import OscarConfig
from sglang_oscar.kernels.latent_plan import latent_decode_attention
from sglang_oscar.pool.latent_pool import OscarMLATokenToKVPool
from sglang_oscar.reference.latent import latent_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

R, P, H = 64, 16, 4
SINK, RECENT = 4, 8


def _pool(cfg, hp_dtype=torch.float32, size=256, layers=2, max_reqs=4, r=R, p=P):
    return OscarMLATokenToKVPool(size, page_size=1, dtype=torch.uint8, kv_lora_rank=r, qk_rope_head_dim=p,
                                 layer_num=layers, device="cpu", enable_memory_saver=False, oscar_config=cfg,
                                 hp_dtype=hp_dtype, max_reqs=max_reqs, sink_rows=cfg.sink_tokens * 4 * max_reqs)


def test_latent_pool_sizes_and_refusals():
    """DeepSeek-V3's latent (R 512, P 64) at G 128, fp16 pairs, BF16 k_pe: 272 bytes per token and
    layer, 4.2x fewer than SGLang's 1,152; BF16 accessors refuse, getters are meta of the logical shape."""
    cfg = OscarConfig(group_size=128, sink_tokens=SINK, recent_tokens=RECENT)
    pool = _pool(cfg, torch.bfloat16, size=64, layers=3, r=512, p=64)
    assert pool.int2_bytes_per_token() == 3 * (128 + 16 + 128) and 3 * 1152 / pool.int2_bytes_per_token() > 4.2
    assert pool.hp_bytes() == pool.windows.num_rows * 3 * 576 * 2
    assert pool.get_kv_size_bytes() == 65 * 3 * 272 + pool.hp_bytes() + 3 * 64 * 2  # + the spare k_pe row
    assert pool.get_key_buffer(0).device.type == "meta" and tuple(pool.get_key_buffer(0).shape) == (65, 1, 576)
    assert pool.get_value_buffer(0).shape[-1] == 512
    for call in (lambda: pool.set_kv_buffer(None, None, None, None), lambda: pool.set_mla_kv_buffer(None),
                 lambda: pool.get_mla_kv_buffer(None, None), lambda: pool.move_kv_cache(None, None),
                 lambda: pool.get_cpu_copy(None), lambda: pool.get_contiguous_buf_infos()):
        with pytest.raises(RuntimeError, match="int2|INT2"):
            call()
    with pytest.raises(ValueError, match="page-size 1"):
        OscarMLATokenToKVPool(64, 16, torch.uint8, 512, 64, layer_num=1, device="cpu", enable_memory_saver=False,
                              oscar_config=cfg, hp_dtype=torch.bfloat16, max_reqs=2, sink_rows=8)
    with pytest.raises(ValueError, match="DSA"):
        OscarMLATokenToKVPool(64, 1, torch.uint8, 512, 64, layer_num=1, device="cpu", enable_memory_saver=False,
                              use_dsa=True, oscar_config=cfg, hp_dtype=torch.bfloat16, max_reqs=2, sink_rows=8)


@pytest.mark.parametrize("hp_dtype", [torch.float32, torch.bfloat16])
def test_latent_pool_rows_decode_like_the_oracle(hp_dtype):
    """Two requests prefilled through write_latent (one forward each, HP rows from HPWindows.assign),
    then one decode token each: the latent decode over the pool's planes equals the oracle."""
    gen = torch.Generator().manual_seed(7)
    cfg = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT, quantizer="lloyd-max")
    rot = random_orthogonal(R, generator=gen)
    pool = _pool(cfg, hp_dtype)
    layer = 1
    lens = [30, 17]
    r2t = torch.zeros(4, 64, dtype=torch.int32)
    next_slot, seqs = 1, []
    for req, n in zip((1, 3), lens):
        c_kv = torch.randn(n + 1, R, generator=gen) * (torch.rand(R, generator=gen) + 0.5)
        k_pe = torch.randn(n + 1, P, generator=gen)
        seqs.append((c_kv, k_pe))
        for start, end in ((0, n), (n, n + 1)):  # prefill, then the decode token
            loc = torch.arange(next_slot, next_slot + end - start)
            next_slot += end - start
            r2t[req, start:end] = loc.to(torch.int32)
            pos = torch.arange(start, end)
            rows = pool.windows.assign(loc, pos, torch.full_like(pos, req), torch.full_like(pos, end))
            pool.write_latent(layer, loc, (c_kv[start:end] @ rot).to(hp_dtype), k_pe[start:end], rows)
    rpi = torch.tensor([1, 3], dtype=torch.int32)
    pool.windows.refresh(rpi, r2t)
    scale = 0.3
    eye = torch.eye(R).expand(H, R, R)
    q_nope, q_pe = torch.randn(2, H, R, generator=gen), torch.randn(2, H, P, generator=gen)
    ref = torch.stack([latent_attention(q_nope[i:i + 1], q_pe[i:i + 1], c, kpe, eye, eye, rot, cfg, softmax_scale=scale,
                                        hp_dtype=hp_dtype, output="latent_rotated")[0]
                       for i, (c, kpe) in enumerate(seqs)])
    out = latent_decode_attention(q_nope @ rot, q_pe, **pool.latent_buffers(layer), hp_index=pool.windows.hp_index,
                                  req_to_token=r2t, req_pool_indices=rpi, seq_lens=torch.tensor([31, 18]),
                                  sink_lens=pool.windows.sink_lens, group_size=32, quantizer="lloyd-max", sink=SINK,
                                  recent=RECENT, sm_scale=scale, num_splits=2)
    err = float((out - ref).norm() / ref.norm())
    assert err < 1e-4, err  # the oracle's rows exactly (BF16 windows on both sides), fp32 math
    # the other layer was never written: its planes are still zero
    assert not pool.codes[0].any() and not pool.k_pe[0].any()
