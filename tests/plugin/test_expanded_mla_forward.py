"""``--oscar-mla-storage expanded`` forward paths on CPU: ``prepare_prefill_qkv`` against SGLang's own
``forward_normal_prepare`` BF16 path on a seeded transformers DeepSeek-V3 attention layer, and the backend's
extend (fresh, chunked, with a radix prefix) and decode against the MHA oracle over ``expand_latent``'s K/V.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from _support.forward import Mode
from _support.orthogonal import random_orthogonal
from _support.served import cpu_backend
from sglang_oscar.config import OscarConfig
from sglang_oscar.pool.int2_pool import OscarMHATokenToKVPool
from sglang_oscar.reference.attention import oscar_attention
from sglang_oscar.reference.latent import expand_latent, split_kv_b_proj
from test_expanded_mla import DK, EXPANDED, N, P, V

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


# ------------------------------------------------------------------------------------------ prepare_prefill_qkv
class _TupleLinear(torch.nn.Module):
    """A linear layer with SGLang's calling convention (``(output, bias)``) over given weights."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)

    def forward(self, x):
        return x @ self.weight.T, None


def _interleaved_rope(positions, q_pe, k_pe, base=10000.0):
    """RoPE on adjacent pairs (DeepSeek's ``rope_interleave``), returning new tensors as SGLang's native RoPE."""
    p = q_pe.shape[-1]
    inv = base ** (-torch.arange(0, p, 2, dtype=torch.float32) / p)
    ang = positions.float()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rot(x):
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2).to(x.dtype)

    return rot(q_pe), rot(k_pe)


def _tiny_mla_layer(dtype):
    """A seeded transformers DeepSeek-V3 attention layer (q_lora_rank unset: ``q_proj``) in the shape of SGLang's
    ``DeepseekV2AttentionMLA`` (its MHA mixin's methods, the attributes ``forward_normal_prepare`` reads)."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_mha import DeepseekMHAForwardMixin
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    h, r = 4, 64
    cfg = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=h, num_key_value_heads=h, kv_lora_rank=r, q_lora_rank=None,
                           qk_rope_head_dim=P, qk_nope_head_dim=N, v_head_dim=V, first_k_dense_replace=1,
                           initializer_range=0.08)
    torch.manual_seed(11)
    hf = DeepseekV3ForCausalLM(cfg).model.layers[0].self_attn.to(dtype)

    class TinyMLA(torch.nn.Module, DeepseekMHAForwardMixin):
        pass

    layer = TinyMLA()
    layer.q_proj, layer.kv_a_proj_with_mqa = _TupleLinear(hf.q_proj.weight), _TupleLinear(hf.kv_a_proj_with_mqa.weight)
    layer.kv_b_proj, layer.kv_a_layernorm = _TupleLinear(hf.kv_b_proj.weight), hf.kv_a_layernorm
    layer.rotary_emb = _interleaved_rope
    layer.attn_mha = SimpleNamespace(layer_id=0)
    for key, value in dict(q_lora_rank=None, num_local_heads=h, qk_nope_head_dim=N, qk_rope_head_dim=P,
                           qk_head_dim=DK, v_head_dim=V, kv_lora_rank=r, use_dsa=False,
                           current_attention_backend="triton", kv_cache_dtype="int2").items():
        setattr(layer, key, value)
    return layer, cfg.hidden_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepare_prefill_qkv_equals_sglangs_own_mha_path(dtype):
    """SGLang's ``forward_normal_prepare`` run on the same layer and inputs twice: with a backend without the
    hook (SGLang's BF16 path: RoPE, its latent write, ``kv_b_proj``, ``_concat_and_cast_mha_k``) and with the
    expanded backend (its ``prepare_prefill_qkv``): the same q / k / v bit for bit, and the hook wrote nothing
    (the INT2 pool stays zero; its ``set_kv_buffer`` would raise). K / V equal the oracle's ``expand_latent``
    of the normalised latent and the rotated ``k_pe``."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_mha import DeepseekMHAForwardMixin

    from sglang_oscar.backend.expanded_backend import OscarExpandedMLABackend

    layer, hidden = _tiny_mla_layer(dtype)
    t = 12
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    positions = torch.arange(5, 5 + t)
    fb = SimpleNamespace(out_cache_loc=torch.arange(1, t + 1), mha_one_shot=False, extend_prefix_lens_cpu=[5])
    written = []
    sglang_backend = SimpleNamespace(token_to_kv_pool=SimpleNamespace(
        set_kv_buffer=lambda lay, loc, k, v: written.append(k.clone())))
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=sglang_backend)):
        q_ref, k_ref, v_ref, _ = DeepseekMHAForwardMixin.forward_normal_prepare(layer, positions, x, fb, None)
    assert len(written) == 1 and written[0].shape == (t, 1, 64 + P)  # SGLang's path writes the BF16 latent
    config = OscarConfig(sink_tokens=2, recent_tokens=4, **EXPANDED)
    pool = OscarMHATokenToKVPool(16, page_size=1, dtype=torch.uint8, head_num=4, head_dim=DK, v_head_dim=V,
                                 layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
                                 oscar_config=config, hp_dtype=dtype, max_reqs=2, sink_rows=4)
    be = object.__new__(OscarExpandedMLABackend)
    be.token_to_kv_pool = pool
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=be)):
        q, k, v, fb_out = DeepseekMHAForwardMixin.forward_normal_prepare(layer, positions, x, fb, None)
    assert fb_out is fb and q.dtype == k.dtype == v.dtype == dtype
    assert q.shape == (t, 4, DK) and k.shape == (t, 4, DK) and v.shape == (t, 4, V)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert all(not b.any() for b in pool.k_buffer + pool.v_buffer + pool.k_pair_buffer + pool.hp_k_buffer)
    # the oracle's expanded K / V of the same latent
    with torch.no_grad():
        lat = layer.kv_a_proj_with_mqa(x)[0]
        c = layer.kv_a_layernorm(lat[:, :64])
        k_pe = _interleaved_rope(positions, torch.zeros(t, 1, P, dtype=dtype), lat[:, None, 64:])[1]
    w_kc, w_vc = split_kv_b_proj(layer.kv_b_proj.weight.float(), 4, N, V)
    k_or, v_or = expand_latent(c, k_pe[:, 0], w_kc, w_vc)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((k.float() - k_or).norm() / k_or.norm()) < tol
    assert float((v.float() - v_or).norm() / v_or.norm()) < tol


# ------------------------------------------------------------------------------------------ served path
H = 2  # heads of the served-path cases (DeepSeek-V3's per-head sizes)
SINK, RECENT, CTX = 4, 8, 96
SCALE = DK ** -0.5


def _mha_layer(layer_id=0):
    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=H, tp_k_head_num=H, qk_head_dim=DK, v_head_dim=V,
                           scaling=SCALE, logit_cap=0.0, sliding_window_size=-1, logit_capping_method="tanh",
                           is_cross_attention=False)


class Served:
    """One expanded INT2 pool + ``OscarExpandedMLABackend`` (one layer), slots handed out in increasing order;
    called as SGLang's ``forward_normal_core`` calls ``attn_mha``: ``save_kv_cache=False``."""

    def __init__(self, config, rk, rv, device="cpu"):
        from sglang_oscar.backend.expanded_backend import OscarExpandedMLABackend

        self.pool = OscarMHATokenToKVPool(
            512, page_size=1, dtype=torch.uint8, head_num=H, head_dim=DK, v_head_dim=V, layer_num=1, device=device,
            enable_memory_saver=False, enable_alt_stream=False, oscar_config=config, hp_dtype=torch.bfloat16,
            max_reqs=4, sink_rows=SINK * 4 * 4)
        self.be = cpu_backend(self.pool, config, [_mha_layer()], {0: (rk.to(device), rv.to(device))}, max_reqs=4,
                              ctx=CTX, cls=OscarExpandedMLABackend)
        self.be._int2_req_to_token = self.r2t = self.be._int2_req_to_token.to(device)
        self.device = device
        self.next_slot = 1

    def alloc(self, n):
        s = torch.arange(self.next_slot, self.next_slot + n, device=self.device)
        self.next_slot += n
        return s

    def _t(self, x):
        return torch.tensor(x, device=self.device)

    def extend(self, req, seq, start, end):
        n = end - start
        slots = self.alloc(n)
        self.r2t[req, start:end] = slots.to(torch.int32)
        fb = SimpleNamespace(forward_mode=Mode("extend"), batch_size=1, out_cache_loc=slots,
                             positions=torch.arange(start, end, device=self.device), req_pool_indices=self._t([req]),
                             seq_lens=self._t([end]), extend_seq_lens=self._t([n]), extend_prefix_lens=self._t([start]))
        self.be.forward_metadata = SimpleNamespace(qo_indptr=self._t([0, n]), max_extend_len=n)
        self.be._windows_out_of_graph()
        self.be._windows_in_forward(fb)
        self.be.plan_extend(fb, n)
        q, k, v = (x[start:end].to(self.device) for x in seq)
        o = self.be.forward_extend(q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1), _mha_layer(), fb,
                                   save_kv_cache=False)
        return o.float().cpu().reshape(n, H, V)

    def decode(self, req, seq, pos):
        slot = self.alloc(1)
        self.r2t[req, pos] = int(slot)
        fb = SimpleNamespace(forward_mode=Mode("decode"), batch_size=1, out_cache_loc=slot,
                             positions=self._t([pos]), req_pool_indices=self._t([req]), seq_lens=self._t([pos + 1]))
        self.be._windows_out_of_graph()
        self.be._windows_in_forward(fb)
        self.be.plan_decode(fb)
        q, k, v = (x[pos:pos + 1].to(self.device) for x in seq)
        o = self.be.forward_decode(q.reshape(1, -1), k.reshape(1, -1), v.reshape(1, -1), _mha_layer(), fb,
                                   save_kv_cache=False)
        return o.float().cpu().reshape(1, H, V)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def setup():
    """Per-head K / V of a seeded latent through ``expand_latent`` (the layer's ``kv_b_proj``), BF16 as served,
    with latent and ``k_pe`` outlier channels; per-head rotations; group 64."""
    gen = torch.Generator().manual_seed(20261204)
    t, r = 56, 64
    scale = torch.ones(r)
    scale[:3] = 6.0
    c = torch.randn(t, r, generator=gen) * scale
    k_pe = torch.randn(t, P, generator=gen)
    w_kc, w_vc = split_kv_b_proj(torch.randn(H * (N + V), r, generator=gen) / math.sqrt(r), H, N, V)
    k, v = expand_latent(c, k_pe, w_kc, w_vc)
    q = torch.randn(t, H, DK, generator=gen)
    seq = (q.bfloat16(), k.bfloat16(), v.bfloat16())
    config = OscarConfig(sink_tokens=SINK, recent_tokens=RECENT, **EXPANDED)
    return seq, config, random_orthogonal(DK, H, generator=gen), random_orthogonal(V, H, generator=gen)


def _oracle(seq, config, rk, rv, start, end, mode):
    q, k, v = seq
    return oscar_attention(q[start:end].float(), k[:end].float(), v[:end].float(), rk, rv, config,
                           q_positions=torch.arange(start, end), window_mode=mode, sm_scale=SCALE)


# Chunking changes the rotation GEMM's batch shape, whose fp32 rounding can move a rotated BF16 row by one
# ulp (test_backend.py's SAME): equal up to that, far below the INT2 error
SAME = 2e-3


@pytest.mark.parametrize("device,tol", [("cpu", 1e-2), pytest.param("cuda", 2e-2, marks=pytest.mark.gpu)])
def test_extend_and_decode_match_the_mha_oracle(setup, device, tol):
    """Prefill 0..40 (window mode "extend"), a prefix-carrying extend 40..48, then decodes 48..52 ("decode"):
    each within 1e-2 of the MHA oracle over the expanded K / V (test_backend.py's bound; on the GPU 2e-2, the
    latent GPU test's, for its BF16 dots); every K row's INT2 bytes equal the reference quantizer's on the
    rotated BF16 row (groups of 64: 3 pairs per K row, 2 per V)."""
    from sglang_oscar.quant.int2 import quantize_rows

    seq, config, rk, rv = setup
    sv = Served(config, rk, rv, device)
    assert _rel(sv.extend(1, seq, 0, 40), _oracle(seq, config, rk, rv, 0, 40, "extend")) < tol
    assert _rel(sv.extend(1, seq, 40, 48), _oracle(seq, config, rk, rv, 40, 48, "extend")) < tol
    for pos in range(48, 52):
        assert _rel(sv.decode(1, seq, pos), _oracle(seq, config, rk, rv, pos, pos + 1, "decode")) < tol, pos
    kc, kp, vc, vp, _, _ = sv.pool.int2_buffers(0)
    assert kc.shape == (513, H, 48) and kp.shape == (513, H, 6) and vc.shape == (513, H, 32) and vp.shape == (513, H, 4)
    k_rot = torch.einsum("thd,hde->the", seq[1][:52].float(), rk).bfloat16()
    ref = quantize_rows(k_rot, **config.quant_kwargs("k"))
    slots = sv.r2t[1, :52].long()
    assert (kc[slots].cpu() == ref.codes).float().mean() > 0.99  # a rotated row may differ by one BF16 ulp


def test_chunked_and_radix_reuse_equal_a_fresh_run(setup):
    """A prompt prefilled in chunks of 17 and 23, or after a radix hit on another request's first 32 slots, gives
    the outputs of one prefill, and the decodes after it equal the fresh run's."""
    seq, config, rk, rv = setup
    fresh = Served(config, rk, rv)
    want = fresh.extend(1, seq, 0, 40)
    want_d = [fresh.decode(1, seq, p) for p in range(40, 43)]
    ch = Served(config, rk, rv)
    assert _rel(torch.cat([ch.extend(1, seq, 0, 17), ch.extend(1, seq, 17, 40)]), want) < SAME
    for i, p in enumerate(range(40, 43)):
        assert _rel(ch.decode(1, seq, p), want_d[i]) < SAME
    m = 40 - RECENT  # the capped radix match
    rx = Served(config, rk, rv)
    rx.extend(1, seq, 0, 40)
    rx.r2t[2, :m] = rx.r2t[1, :m]
    assert _rel(rx.extend(2, seq, m, 40), want[m:]) < SAME
    for i, p in enumerate(range(40, 43)):
        assert _rel(rx.decode(2, seq, p), want_d[i]) < SAME


def test_absorbed_layer_or_extra_inputs_are_refused(setup):
    """An ``attn_mqa``-shaped call (1 kv head over the latent) or split-rope inputs reaching the expanded backend
    are errors that name the cause."""
    seq, config, rk, rv = setup
    sv = Served(config, rk, rv)
    mqa = SimpleNamespace(layer_id=0, tp_q_head_num=H, tp_k_head_num=1, qk_head_dim=64 + P, v_head_dim=64,
                          scaling=SCALE, logit_cap=0.0)
    with pytest.raises(NotImplementedError, match=r"an absorbed \(MLA\) forward reached the backend"):
        sv.be.forward_decode(torch.zeros(1, H * (64 + P)), torch.zeros(1, 64 + P), torch.zeros(1, 64), mqa, None)
    with pytest.raises(NotImplementedError, match=r"per-head q / k / v only, not \['q_rope'\]"):
        sv.be.forward_extend(torch.zeros(1, H * DK), torch.zeros(1, H * DK), torch.zeros(1, H * V), _mha_layer(), None,
                             q_rope=torch.zeros(1, H, P))
