"""The served path over each pool shape (CPU, kernels under the Triton interpreter) vs the oracle.

Sliding-window models, two pool shapes SGLang 0.5.16 builds for them:

* a single pool whose layers mix sliding and full attention (Gemma-3: SGLang does not treat it as
  hybrid, every layer's rows share one slot space and only the attention windows differ);
* :class:`~sglang_oscar.pool.swa_pool.OscarSWAKVPool` (Gemma-4, GPT-OSS): a full pool and a
  smaller sliding pool with their own geometry (here 2 kv heads x 64 sliding, 1 x 128 full), the
  slots handed out by SGLang's own ``SWATokenToKVPoolAllocator``, tokens that left the window
  freed from the sliding pool (``free_swa``) and their sliding slots reused by another request.

Linear-attention hybrids (Qwen3.5): :class:`~sglang_oscar.pool.linear_pool.OscarHybridLinearKVPool`,
the attention layers' INT2 pool inside SGLang's ``HybridLinearKVPool``, addressed by global layer id.

Each layer's prefill and decode outputs are compared with ``reference.oscar_attention`` over the
whole sequence with the layer's window (key ``j`` visible iff ``pos - j < window``), for a prompt
of 2.5 windows and two decode steps, so the INT2 tier, the BF16 sink (which leaves the window) and the recent ring
all cross the window's edge.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _support.forward import Mode as _Mode
from _support.orthogonal import random_orthogonal
from _support.served import cpu_backend
from sglang_oscar.backend.triton_backend import OscarTritonAttnBackend
from sglang_oscar.config import OscarConfig
from sglang_oscar.pool.int2_pool import OscarMHATokenToKVPool
from sglang_oscar.pool.linear_pool import OscarHybridLinearKVPool
from sglang_oscar.pool.swa_pool import OscarSWAKVPool
from sglang_oscar.reference.attention import oscar_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HQ, SINK, RECENT, WINDOW, CTX, T = 4, 4, 8, 16, 96, 42


def _layer(layer_id, hkv, d, window):
    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=HQ, tp_k_head_num=hkv, qk_head_dim=d, v_head_dim=d,
                           scaling=d ** -0.5, logit_cap=0.0, sliding_window_size=window - 1 if window else -1,
                           logit_capping_method="tanh", is_cross_attention=False)


def _backend(pool, config, layers, rotations, max_reqs):
    return cpu_backend(pool, config, layers, rotations, max_reqs=max_reqs, ctx=CTX)


class Served:
    """A pool + backend over ``layers``; ``alloc(n)`` hands out full slots (and sliding ones)."""

    def __init__(self, config, layers, rotations, *, hybrid, max_reqs=4, hp_dtype=torch.bfloat16):
        self.layers = layers
        if hybrid:
            from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

            full = [lay for lay in layers if not lay.sliding_window_size > -1]
            slid = [lay for lay in layers if lay.sliding_window_size > -1]
            self.pool = OscarSWAKVPool(
                size=256, size_swa=96, page_size=1, dtype=torch.uint8, head_num=full[0].tp_k_head_num,
                head_dim=full[0].qk_head_dim, v_head_dim=full[0].v_head_dim, swa_head_num=slid[0].tp_k_head_num,
                swa_head_dim=slid[0].qk_head_dim, swa_v_head_dim=slid[0].v_head_dim,
                swa_attention_layer_ids=[lay.layer_id for lay in slid],
                full_attention_layer_ids=[lay.layer_id for lay in full], device="cpu", oscar_config=config,
                hp_dtype=hp_dtype, max_reqs=max_reqs, sink_rows=SINK * 4 * max_reqs)
            self.allocator = SWATokenToKVPoolAllocator(256, 96, 1, torch.uint8, "cpu", self.pool, need_sort=False)
        else:
            lay = layers[0]
            self.pool = OscarMHATokenToKVPool(
                256, page_size=1, dtype=torch.uint8, head_num=lay.tp_k_head_num, head_dim=lay.qk_head_dim,
                v_head_dim=lay.v_head_dim, layer_num=len(layers), device="cpu", enable_memory_saver=False,
                enable_alt_stream=False, oscar_config=config, hp_dtype=hp_dtype, max_reqs=max_reqs,
                sink_rows=SINK * 4 * max_reqs)
            self.allocator = None
            self._next = 1
        self.be = _backend(self.pool, config, layers, rotations, max_reqs)
        self.r2t = self.be._int2_req_to_token

    def alloc(self, n):
        if self.allocator is not None:
            return self.allocator.alloc(n)
        s = torch.arange(self._next, self._next + n)
        self._next += n
        return s

    def _run(self, fb, seqs, start, end, mode):
        outs = {}
        self.be._windows_out_of_graph()
        self.be._windows_in_forward(fb)
        if mode == "extend":
            self.be.forward_metadata = SimpleNamespace(qo_indptr=torch.tensor([0, end - start]),
                                                       max_extend_len=end - start)
            self.be.plan_extend(fb, end - start)
        else:
            self.be.plan_decode(fb)
        for lay in self.layers:
            q, k, v = seqs[lay.layer_id]
            n = end - start
            fwd = self.be.forward_extend if mode == "extend" else self.be.forward_decode
            o = fwd(q[start:end].reshape(n, -1), k[start:end].reshape(n, -1), v[start:end].reshape(n, -1), lay, fb)
            outs[lay.layer_id] = o.float().reshape(n, HQ, lay.v_head_dim)
        return outs

    def extend(self, req, seqs, start, end):
        slots = self.alloc(end - start)
        self.r2t[req, start:end] = slots.to(torch.int32)
        fb = SimpleNamespace(forward_mode=_Mode("extend"), batch_size=1, out_cache_loc=slots,
                             positions=torch.arange(start, end), req_pool_indices=torch.tensor([req]),
                             seq_lens=torch.tensor([end]), extend_seq_lens=torch.tensor([end - start]),
                             extend_prefix_lens=torch.tensor([start]))
        return self._run(fb, seqs, start, end, "extend")

    def decode(self, req, seqs, pos):
        slot = self.alloc(1)
        self.r2t[req, pos] = slot.to(torch.int32)
        fb = SimpleNamespace(forward_mode=_Mode("decode"), batch_size=1, out_cache_loc=slot,
                             positions=torch.tensor([pos]), req_pool_indices=torch.tensor([req]),
                             seq_lens=torch.tensor([pos + 1]))
        return self._run(fb, seqs, pos, pos + 1, "decode")

    def evict_out_of_window(self, req, length):
        """SGLang's sliding eviction: free the sliding slots of positions that no query reads again."""
        if self.allocator is not None and length - WINDOW > 0:
            self.allocator.free_swa(self.r2t[req, : length - WINDOW].long())


def _seqs(layers, gen):
    out = {}
    for lay in layers:
        d, hkv = lay.qk_head_dim, lay.tp_k_head_num
        scale = torch.ones(d)
        scale[:4] = 8.0  # outlier channels, as post-RoPE keys have
        out[lay.layer_id] = (torch.randn(T, HQ, d, generator=gen).bfloat16(),
                             (torch.randn(T, hkv, d, generator=gen) * scale).bfloat16(),
                             torch.randn(T, hkv, d, generator=gen).bfloat16())
    return out


def _oracle(lay, seq, rot, config, start, end, mode):
    q, k, v = seq
    window = lay.sliding_window_size + 1 if lay.sliding_window_size > -1 else None
    return oscar_attention(q[start:end].float(), k[:end].float(), v[:end].float(), rot[0], rot[1], config,
                           q_positions=torch.arange(start, end), sliding_window=window, window_mode=mode,
                           sm_scale=lay.scaling)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("hybrid", [False, True], ids=["single-pool", "hybrid-pool"])
def test_sliding_and_full_layers_match_the_oracle(hybrid):
    gen = torch.Generator().manual_seed(7)
    if hybrid:  # Gemma-4-like: sliding 2 kv heads x 64, full 1 kv head x 128
        layers = [_layer(0, 1, 128, 0), _layer(1, 2, 64, WINDOW)]
    else:  # Gemma-3-like: one geometry, windows differ
        layers = [_layer(0, 2, 64, WINDOW), _layer(1, 2, 64, 0)]
    rotations = {lay.layer_id: (random_orthogonal(lay.qk_head_dim, lay.tp_k_head_num, generator=gen),
                                random_orthogonal(lay.v_head_dim, lay.tp_k_head_num, generator=gen))
                 for lay in layers}
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    seqs = _seqs(layers, gen)
    sv = Served(config, layers, rotations, hybrid=hybrid)
    # another request first, so that the sliding slots request 1 gets back are reused ones
    other = _seqs(layers, gen)
    sv.extend(2, other, 0, WINDOW + 8)
    sv.evict_out_of_window(2, WINDOW + 8)
    prompt = 2 * WINDOW + 8
    outs = sv.extend(1, seqs, 0, prompt)
    for lay in layers:
        ref = _oracle(lay, seqs[lay.layer_id], rotations[lay.layer_id], config, 0, prompt, "extend")
        assert _rel(outs[lay.layer_id], ref) < 1e-2, lay.layer_id
    sv.evict_out_of_window(1, prompt)
    for pos in range(prompt, T):
        outs = sv.decode(1, seqs, pos)
        sv.evict_out_of_window(1, pos + 1)
        for lay in layers:
            ref = _oracle(lay, seqs[lay.layer_id], rotations[lay.layer_id], config, pos, pos + 1, "decode")
            assert _rel(outs[lay.layer_id], ref) < 1e-2, (lay.layer_id, pos)
    # the window matters at these lengths: the sliding layer without it would be far from its output
    slid = next(lay for lay in layers if lay.sliding_window_size > -1)
    unwindowed = _oracle(_layer(slid.layer_id, slid.tp_k_head_num, slid.qk_head_dim, 0), seqs[slid.layer_id],
                         rotations[slid.layer_id], config, T - 1, T, "decode")
    assert _rel(outs[slid.layer_id], unwindowed) > 0.05
    if hybrid:
        # the sliding pool holds only what the window needs: the evicted positions' slots are free
        assert sv.allocator.swa_attn_allocator.available_size() == 96 - 2 * WINDOW


def test_skip_sliding_keeps_a_bf16_sliding_pool_and_routes_its_layers_to_sglang(monkeypatch):
    """``--oscar-skip-layers sliding``: the sliding sub-pool is SGLang's BF16 ``MHATokenToKVPool`` (its
    bytes per token BF16's), the full one INT2 and still the owner of the windows; the backend plans
    only the INT2 layers and hands the sliding ones to SGLang's own ``TritonAttnBackend``."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    config = OscarConfig(group_size=64, sink_tokens=SINK, recent_tokens=RECENT)
    full, slid = _layer(0, 1, 128, 0), _layer(1, 2, 64, WINDOW)
    pool = OscarSWAKVPool(size=64, size_swa=32, page_size=1, dtype=torch.uint8, head_num=1, head_dim=128,
                          v_head_dim=128, swa_head_num=2, swa_head_dim=64, swa_v_head_dim=64,
                          swa_attention_layer_ids=[1], full_attention_layer_ids=[0], device="cpu",
                          oscar_config=config, hp_dtype=torch.bfloat16, max_reqs=2, sink_rows=8, skip="sliding")
    assert type(pool.swa_kv_pool) is MHATokenToKVPool and pool.swa_kv_pool.store_dtype == torch.bfloat16
    assert isinstance(pool.full_kv_pool, OscarMHATokenToKVPool)
    assert [pool.is_int2_layer(i) for i in (0, 1)] == [True, False]
    # full: 1 kv head x (128/4 code bytes + 2 fp16 pair words) x K and V; sliding: BF16 2 x (64 + 64) x 2 bytes
    assert pool.int2_bytes_per_token() == (2 * (32 + 2 * 2 * 2), 2 * 128 * 2)
    assert pool.full_kv_pool.owns_windows and pool.full_kv_pool.windows is pool.windows
    assert not pool.swa_kv_pool.owns_windows
    assert (pool.start_layer, pool.end_layer) == (0, 1)  # the backend's layer range (global ids)
    rotations = {0: (random_orthogonal(128, 1), random_orthogonal(128, 1))}
    be = _backend(pool, config, [lay for lay in (full, slid) if pool.is_int2_layer(lay.layer_id)], rotations, 2)
    assert set(be._layer_geometry) == {0}
    calls = []
    monkeypatch.setattr(TritonAttnBackend, "forward_decode", lambda self, q, k, v, layer, fb, *a: calls.append(layer.layer_id) or "bf16")
    assert be.forward_decode(None, None, None, slid, None) == "bf16" and calls == [1]
    # an SGLang that built its sub-pools in another order would keep the wrong kind BF16: refused
    from sglang_oscar.pool import swa_pool

    monkeypatch.setattr(swa_pool, "SUB_POOL_ORDER", ("full", "sliding"))
    with pytest.raises(RuntimeError, match="the sliding sub-pool is INT2, but --oscar-skip-layers is 'sliding'"):
        OscarSWAKVPool(size=64, size_swa=32, page_size=1, dtype=torch.uint8, head_num=1, head_dim=128,
                       v_head_dim=128, swa_head_num=2, swa_head_dim=64, swa_v_head_dim=64,
                       swa_attention_layer_ids=[1], full_attention_layer_ids=[0], device="cpu",
                       oscar_config=config, hp_dtype=torch.bfloat16, max_reqs=2, sink_rows=8, skip="sliding")


def test_gemma3_bidirectional_layers_pass_while_upstream_runs_them_causally():
    """SGLang's Gemma-3 layers are ``AttentionType.DECODER_BIDIRECTIONAL``; upstream's Triton backend
    computes them causally unless CUDA graphs are fully off and chunked prefill is -1
    (``allow_bidirectional_attention_in_extend``): the INT2 backend takes them exactly then."""
    from sglang.srt.layers.radix_attention import AttentionType

    be = object.__new__(OscarTritonAttnBackend)
    be.means = {0: (None, None)}
    layer = _layer(0, 2, 64, 16)
    layer.attn_type = AttentionType.DECODER_BIDIRECTIONAL
    be.allow_bidirectional_attention_in_extend = False
    be._check_layer(layer, None, None)
    layer.attn_type = AttentionType.DECODER
    be._check_layer(layer, None, None)
    be.allow_bidirectional_attention_in_extend = True
    be._check_layer(layer, None, None)
    layer.attn_type = AttentionType.DECODER_BIDIRECTIONAL
    with pytest.raises(NotImplementedError, match="causal decoder attention only.*chunked prefill"):
        be._check_layer(layer, None, None)
    layer.attn_type = AttentionType.ENCODER_ONLY
    be.allow_bidirectional_attention_in_extend = False
    with pytest.raises(NotImplementedError, match="causal decoder attention only"):
        be._check_layer(layer, None, None)


def test_linear_hybrid_pool_serves_its_attention_layers_by_global_id():
    """Qwen3.5-like: layers 0 and 2 are linear attention (SGLang's state pool), 1 and 3 attention. The
    INT2 pool holds the two attention layers at local indices 0 / 1; the backend reads and writes them
    by global id, and a prefill + decode of layer 3 matches the oracle."""
    gen = torch.Generator().manual_seed(11)
    config = OscarConfig(group_size=64, sink_tokens=SINK, recent_tokens=RECENT)
    layers = [_layer(1, 2, 64, 0), _layer(3, 2, 64, 0)]
    inner = OscarMHATokenToKVPool(128, page_size=1, dtype=torch.uint8, head_num=2, head_dim=64, v_head_dim=64,
                                  layer_num=2, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
                                  oscar_config=config, hp_dtype=torch.bfloat16, max_reqs=4, sink_rows=SINK * 16)
    pool = OscarHybridLinearKVPool(full_kv_pool=inner, size=128, dtype=torch.uint8, page_size=1, head_num=2,
                                   head_dim=64, full_attention_layer_ids=[1, 3], device="cpu", mamba_pool=None)
    assert [pool.is_int2_layer(i) for i in range(4)] == [False, True, False, True]
    assert pool.int2_buffers(3)[0] is inner.k_buffer[1] and pool.windows is inner.windows and pool.owns_windows
    assert (pool.start_layer, pool.end_layer) == (0, 3)
    rotations = {lay.layer_id: (random_orthogonal(64, 2, generator=gen), random_orthogonal(64, 2, generator=gen))
                 for lay in layers}
    sv = Served.__new__(Served)
    sv.layers, sv.pool, sv.allocator, sv._next = layers[1:], pool, None, 1
    sv.be = _backend(pool, config, layers, rotations, 4)
    sv.r2t = sv.be._int2_req_to_token
    seqs = _seqs(layers[1:], gen)
    outs = sv.extend(1, seqs, 0, 24)
    assert _rel(outs[3], _oracle(layers[1], seqs[3], rotations[3], config, 0, 24, "extend")) < 1e-2
    outs = sv.decode(1, seqs, 24)
    assert _rel(outs[3], _oracle(layers[1], seqs[3], rotations[3], config, 24, 25, "decode")) < 1e-2
    assert inner.k_buffer[0].abs().sum() == 0  # layer 1 (local 0) was never written
