"""The served MLA path: OscarMLATokenToKVPool (alone, or in a Kimi-Linear hybrid pool) +
OscarTritonLatentBackend vs the oracle, on CPU (and in BF16 on the GPU).

The backend is built without a model runner (:meth:`OscarTritonLatentBackend.setup_latent`) and
driven with SGLang-shaped forward batches as SGLang's absorbed MLA attention calls it
(``q = [q_abs | q_pe]``, ``k = [c_kv | k_pe]``; kernels under the Triton interpreter, SGLang's own
extend kernel for prefill). Checked against ``reference.latent.latent_attention`` (``output="latent"``,
``w_kc`` = identity so ``q_abs = q_nope``): prefill (window mode "extend") and decode ("decode")
in fp32 and BF16; chunked prefill and radix reuse equal a fresh run; an exhausted sink arena reads
like the oracle with a shorter sink.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from _support.forward import Mode
from _support.orthogonal import random_orthogonal
from sglang_oscar.backend.latent_backend import OscarTritonLatentBackend
from sglang_oscar.config import OscarConfig
from sglang_oscar.pool.latent_pool import OscarMLATokenToKVPool
from sglang_oscar.pool.linear_pool import OscarHybridLinearKVPool
from sglang_oscar.reference.latent import latent_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

H, R, P = 4, 64, 16  # q heads, kv_lora_rank, qk_rope_head_dim of the CPU cases
DSV3 = (8, 512, 64)  # DeepSeek-V3's latent (8 of its 128 heads): SGLang's extend kernel splits 512 + 64
SINK, RECENT = 4, 8
CTX = 96
SCALE = (32 + P) ** -0.5


def _layer(h=H, r=R, p=P, layer_id=0):
    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=h, tp_k_head_num=1, qk_head_dim=r + p, v_head_dim=r,
                           scaling=SCALE, logit_cap=0.0)


class Served:
    """One INT2 latent pool + backend, slots handed out in increasing order. One layer (id 0) with
    rotation ``rot``; or, with ``hybrid_layers``, the MLA layers of those global ids (``rot`` a dict
    by id) in an :class:`OscarHybridLinearKVPool` (Kimi-Linear: the others are linear attention), and
    ``extend`` / ``decode`` take and return dicts by layer id."""

    def __init__(self, config, rot, hp_dtype, sink_rows=None, max_reqs=4, slots=512, device="cpu", shape=(H, R, P),
                 hybrid_layers=None, dsa_topk=0):
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

        self.pool = OscarMLATokenToKVPool(
            slots, page_size=1, dtype=torch.uint8, kv_lora_rank=shape[1], qk_rope_head_dim=shape[2],
            layer_num=len(hybrid_layers or [0]), device=device, enable_memory_saver=False, oscar_config=config,
            hp_dtype=hp_dtype, max_reqs=max_reqs, sink_rows=SINK * 4 * max_reqs if sink_rows is None else sink_rows)
        self.layer_ids, rots = [0], {0: rot}
        if hybrid_layers is not None:
            self.inner, self.layer_ids, rots = self.pool, list(hybrid_layers), rot
            self.pool = OscarHybridLinearKVPool(
                full_kv_pool=self.inner, size=slots, dtype=torch.uint8, page_size=1, head_num=1,
                head_dim=shape[1] + shape[2], full_attention_layer_ids=self.layer_ids, device=device, mamba_pool=None,
                use_mla=True, kv_lora_rank=shape[1], qk_rope_head_dim=shape[2])
        self.hybrid = hybrid_layers is not None
        self.r2t = torch.zeros(max_reqs, CTX, dtype=torch.int32, device=device)
        self.device = device
        be = object.__new__(OscarTritonLatentBackend)
        be.extend_attention_fwd = extend_attention_fwd  # TritonAttnBackend.__init__ binds SGLang's kernel
        be.setup_latent(self.pool, {i: r.to(device) for i, r in rots.items()}, self.r2t, shape[0], num_sms=4,
                        dsa_topk=dsa_topk)
        self.shape = shape
        self.be = be
        self.next_slot = 1

    def _layers(self, seq, run):
        """``run(layer id, q, k)`` per layer, in layer order (one forward): a dict by id, or the one output."""
        seqs = seq if self.hybrid else {0: seq}
        outs = {i: run(i, *(x.to(self.device) for x in seqs[i])) for i in self.layer_ids}
        return outs if self.hybrid else outs[0]

    def _alloc(self, n):
        s = torch.arange(self.next_slot, self.next_slot + n, device=self.device)
        self.next_slot += n
        return s

    def extend(self, req, seq, start, end, slots=None):
        n = end - start
        slots = self._alloc(n) if slots is None else slots
        self.r2t[req, start:end] = slots.to(torch.int32)
        t = functools.partial(torch.tensor, device=self.device)
        fb = SimpleNamespace(forward_mode=Mode("extend"), batch_size=1, out_cache_loc=slots,
                             positions=torch.arange(start, end, device=self.device), req_pool_indices=t([req]),
                             seq_lens=t([end]), extend_seq_lens=t([n]), extend_prefix_lens=t([start]),
                             extend_prefix_lens_cpu=[start])
        self.be._windows_out_of_graph()
        self.be._windows_in_forward(fb)
        self.be.plan_extend(fb, n)
        return self._layers(seq, lambda i, q, k: self.be.forward_extend(
            q[start:end].reshape(n, -1), k[start:end].reshape(n, 1, -1), None, _layer(*self.shape, layer_id=i),
            fb).float().cpu().reshape(n, self.shape[0], self.shape[1]))

    def decode(self, req, seq, pos):
        slot = self._alloc(1)
        self.r2t[req, pos] = int(slot)
        t = functools.partial(torch.tensor, device=self.device)
        fb = SimpleNamespace(forward_mode=Mode("decode"), batch_size=1, out_cache_loc=slot, positions=t([pos]),
                             req_pool_indices=t([req]), seq_lens=t([pos + 1]))
        self.be._windows_out_of_graph()
        self.be._windows_in_forward(fb)
        self.be.plan_decode(fb)
        return self._layers(seq, lambda i, q, k: self.be.forward_decode(
            q[pos:pos + 1].reshape(1, -1), k[pos:pos + 1].reshape(1, 1, -1), None, _layer(*self.shape, layer_id=i),
            fb).float().cpu().reshape(1, self.shape[0], self.shape[1]))


def _data(dtype, t=56, seed=5, shape=(H, R, P)):
    """``(q [t, H, R + P], k [t, 1, R + P])`` as SGLang's absorbed path passes them, and a rotation."""
    h, r, p = shape
    gen = torch.Generator().manual_seed(seed)
    scale = torch.ones(r)
    scale[:4] = 6.0  # latent outlier channels
    q = torch.randn(t, h, r + p, generator=gen)
    k = torch.cat([torch.randn(t, r, generator=gen) * scale, torch.randn(t, p, generator=gen)], -1)
    return (q.to(dtype), k.unsqueeze(1).to(dtype)), random_orthogonal(r, 1, generator=gen)[0]


def _oracle(seq, config, rot, start, end, mode, hp_dtype):
    q, k = seq
    h, r = q.shape[1], rot.shape[0]
    eye = torch.eye(r).expand(h, r, r)
    return latent_attention(q[start:end, :, :r].float(), q[start:end, :, r:].float(), k[:end, 0, :r].float(),
                            k[:end, 0, r:].float(), eye, eye, rot, config, softmax_scale=SCALE,
                            q_positions=torch.arange(start, end), window_mode=mode, hp_dtype=hp_dtype,
                            output="latent")


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _prefill_then_decode(dtype, tol, device, shape=(H, R, P), group=32):
    config = OscarConfig(group_size=group, sink_tokens=SINK, recent_tokens=RECENT)
    seq, rot = _data(dtype, shape=shape)
    sv = Served(config, rot, dtype, device=device, shape=shape)
    o = sv.extend(1, seq, 0, 40)
    assert _rel(o, _oracle(seq, config, rot, 0, 40, "extend", dtype)) < tol
    for pos in range(40, 48):
        assert _rel(sv.decode(1, seq, pos), _oracle(seq, config, rot, pos, pos + 1, "decode", dtype)) < tol


def test_kimi_linear_hybrid_pool_serves_its_mla_layers_by_global_id():
    """Kimi-Linear: the latent pool of the MLA layers inside SGLang's HybridLinearKVPool (global layers
    1 and 3 at local indices 0 and 1, layers 0 and 2 linear attention), each with its own latents
    and rotation; the backend writes and reads them by global id in one forward (one decode plan for
    both), and prefill + decode of each equal its oracle in fp32 as the plain pool's do."""
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    (seq1, rot1), (seq3, rot3) = _data(torch.float32, seed=5), _data(torch.float32, seed=6)
    seqs, rots = {1: seq1, 3: seq3}, {1: rot1, 3: rot3}
    sv = Served(config, rots, torch.float32, hybrid_layers=[1, 3])
    assert [sv.pool.is_int2_layer(i) for i in range(4)] == [False, True, False, True]
    assert sv.pool.latent_buffers(3)["codes"].data_ptr() == sv.inner.codes[1].data_ptr()
    assert sv.pool.windows is sv.inner.windows and sv.pool.owns_windows
    outs = sv.extend(1, seqs, 0, 40)
    for i in (1, 3):
        assert _rel(outs[i], _oracle(seqs[i], config, rots[i], 0, 40, "extend", torch.float32)) < 1e-5
    for pos in range(40, 44):
        outs = sv.decode(1, seqs, pos)
        for i in (1, 3):
            assert _rel(outs[i], _oracle(seqs[i], config, rots[i], pos, pos + 1, "decode", torch.float32)) < 1e-5


def test_served_decode_dequantizes_where_the_codes_engine_does_not_apply():
    """Lloyd-Max levels are uneven: the served plan runs the dequantizing engine, equal to the oracle."""
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT, quantizer="lloyd-max")
    seq, rot = _data(torch.float32)
    sv = Served(config, rot, torch.float32)
    assert sv.be._engine == "dequant"
    sv.extend(1, seq, 0, 40)
    for pos in range(40, 43):
        assert _rel(sv.decode(1, seq, pos), _oracle(seq, config, rot, pos, pos + 1, "decode", torch.float32)) < 1e-5


def test_prefill_then_decode_match_the_oracle():
    """Prefill of 40 tokens ("extend") then 8 decodes ("decode") in fp32: equal to rounding."""
    _prefill_then_decode(torch.float32, 1e-5, "cpu")


def test_served_decode_plan_takes_the_wide_tiles_from_32_heads():
    """32 q heads (DeepSeek-V3 at TP 4): the backend's decode plan runs the codes engine on 64 keys x
    32 heads x 8 warps (``latent_decode_tiles``), equal to the oracle in fp32."""
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    shape = (32, R, P)
    seq, rot = _data(torch.float32, shape=shape)
    sv = Served(config, rot, torch.float32, shape=shape)
    sv.extend(1, seq, 0, 40)
    for pos in range(40, 42):
        assert _rel(sv.decode(1, seq, pos), _oracle(seq, config, rot, pos, pos + 1, "decode", torch.float32)) < 1e-5
    plan = sv.be._decode_plans
    assert sv.be._engine == "codes" and plan.grid[1] == 1
    assert {k: plan._constexprs[k] for k in ("BLOCK_N", "BLOCK_H", "num_warps")} == dict(BLOCK_N=64, BLOCK_H=32,
                                                                                          num_warps=8)


@pytest.mark.gpu
@pytest.mark.parametrize("shape,group", [((H, R, P), 32), (DSV3, None), ((128, 512, 64), None)])
def test_prefill_then_decode_match_the_oracle_bf16_gpu(shape, group):
    """The same in BF16 on the GPU (the interpreter's tl.dot is wrong on BF16 operands), also at
    DeepSeek-V3's latent with the default group size (8 heads, and all 128 on the wide decode
    tiles of ``latent_decode_tiles``): within the model dtype's rounding of the
    query, the gathered rows, the BF16 decode dots and the output (2e-2 relative L2)."""
    _prefill_then_decode(torch.bfloat16, 2e-2, "cuda", shape, group)


def test_chunked_and_radix_reuse_equal_a_fresh_run():
    """A prompt prefilled in chunks of 16, or after a radix hit on another request's slots, gives
    the same outputs as one unchunked prefill (every key read through the same tiers)."""
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    seq, rot = _data(torch.float32)
    fresh = Served(config, rot, torch.float32)
    want = fresh.extend(1, seq, 0, 48)
    chunked = Served(config, rot, torch.float32)
    got = torch.cat([chunked.extend(1, seq, s, min(s + 16, 48)) for s in range(0, 48, 16)])
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # radix: request 2 reuses request 1's first 32 slots and prefills 32..48
    chunked.r2t[2, :32] = chunked.r2t[1, :32]
    reused = chunked.extend(2, seq, 32, 48)
    assert torch.allclose(reused, want[32:], atol=1e-5, rtol=1e-5)
    assert torch.allclose(chunked.decode(2, seq, 48), fresh.decode(1, seq, 48), atol=1e-5, rtol=1e-5)


def _selection(positions, k, gen):
    """A DSA top-k per query position: the token itself, sink position 1 (once visible), the rest at
    random among ``[0, pos]``, in shuffled slots, ``-1``-padded to ``k``."""
    out = torch.full((len(positions), k), -1, dtype=torch.int32)
    for t, pos in enumerate(positions):
        first = list(dict.fromkeys([pos, min(1, pos)]))
        rest = [x for x in torch.randperm(pos + 1, generator=gen).tolist() if x not in first]
        chosen = torch.tensor(first + rest)[:k]
        out[t, torch.randperm(k, generator=gen)[:chosen.numel()]] = chosen.to(torch.int32)
    return out


@pytest.mark.parametrize("device,dtype,tol", [
    ("cpu", torch.float32, 1e-5),
    pytest.param("cuda", torch.bfloat16, 2e-2, marks=pytest.mark.gpu),  # BF16 dots and rows, as served
])
def test_dsa_layers_attend_to_their_selection(device, dtype, tol):
    """GLM-5's DSA calling convention (``q`` = ``q_abs``, ``k`` = ``c_kv``, ``q_rope`` / ``k_rope`` beside
    them, each layer's ``topk_indices`` as positions): prefill in two chunks and decodes each attend
    to their own selection, as the oracle's ``topk_indices`` (window modes "extend" / "decode"); the
    selection matters, and a selection of the wrong width is refused naming the layer."""
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    (q, k), rot = _data(dtype)
    gen = torch.Generator().manual_seed(3)
    topk = _selection(range(56), 20, gen)
    sv = Served(config, rot, dtype, device=device, dsa_topk=20)
    fb_calls = []

    def split(start, end):  # the DSA layer's arguments for positions [start, end)
        return dict(q=q[start:end, :, :R], k=k[start:end, :, :R], q_rope=q[start:end, :, R:],
                    k_rope=k[start:end, :, R:], topk_indices=topk[start:end])

    def run(mode, start, end):
        a = split(start, end)
        n = end - start
        slots = sv._alloc(n)
        sv.r2t[1, start:end] = slots.to(torch.int32)
        t = functools.partial(torch.tensor, device=device)
        fb = SimpleNamespace(forward_mode=Mode(mode), batch_size=1, out_cache_loc=slots,
                             positions=torch.arange(start, end, device=device), req_pool_indices=t([1]),
                             seq_lens=t([end]), extend_seq_lens=t([n]), extend_prefix_lens=t([start]),
                             extend_prefix_lens_cpu=[start])
        fb_calls.append(fb)
        sv.be._windows_out_of_graph()
        sv.be._windows_in_forward(fb)
        if mode == "decode":
            sv.be.plan_decode(fb)
            fwd = sv.be.forward_decode
        else:
            sv.be.plan_extend(fb, n)
            fwd = sv.be.forward_extend
        dev = {k: v.to(device) for k, v in a.items()}
        out = fwd(dev["q"].reshape(n, -1), dev["k"], None, _layer(), fb, q_rope=dev["q_rope"], k_rope=dev["k_rope"],
                  topk_indices=dev["topk_indices"])
        return out.float().cpu().reshape(n, H, R)

    def oracle(start, end, mode):
        eye = torch.eye(R).expand(H, R, R)
        return latent_attention(q[start:end, :, :R].float(), q[start:end, :, R:].float(), k[:end, 0, :R].float(),
                                k[:end, 0, R:].float(), eye, eye, rot, config, softmax_scale=SCALE,
                                q_positions=torch.arange(start, end), window_mode=mode, hp_dtype=dtype,
                                output="latent", topk_indices=topk[start:end])

    for start, end in ((0, 24), (24, 40)):
        o = run("extend", start, end)
        assert _rel(o, oracle(start, end, "extend")) < tol
        # the selection matters (fp32: 0.18 and 0.55 for the two chunks)
        assert _rel(o, _oracle((q, k), config, rot, start, end, "extend", dtype)) > 5 * tol
    for pos in range(40, 44):
        assert _rel(run("decode", pos, pos + 1), oracle(pos, pos + 1, "decode")) < tol
    with pytest.raises(ValueError, match=r"layer 0: topk_indices \(1, 8\), expected \[tokens, 20\]"):
        sv.be.forward_decode(q[44:45, :, :R].reshape(1, -1).to(device), k[44:45, :, :R].to(device), None, _layer(),
                             fb_calls[-1], q_rope=q[44:45, :, R:].to(device), k_rope=k[44:45, :, R:].to(device),
                             topk_indices=topk[44:45, :8].contiguous().to(device), save_kv_cache=False)


def test_exhausted_sink_arena_reads_like_a_shorter_sink():
    """With room for 2 sink rows (sink 4), positions 2, 3 are read through INT2 in both extend and
    decode: the oracle with sink 2 and the same recent window (which never covers them here)."""
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    seq, rot = _data(torch.float32)
    sv = Served(config, rot, torch.float32, sink_rows=2)
    short = OscarConfig(group_size=32, sink_tokens=2, recent_tokens=RECENT)
    o = sv.extend(1, seq, 0, 32)
    assert _rel(o, _oracle(seq, short, rot, 0, 32, "extend", torch.float32)) < 1e-5
    assert _rel(o, _oracle(seq, config, rot, 0, 32, "extend", torch.float32)) > 1e-4  # the sink matters here
    # decode: positions 2, 3 sit below max(sink, L - recent) either way, so only the sink length differs
    d = sv.decode(1, seq, 32)
    assert _rel(d, _oracle(seq, short, rot, 32, 33, "decode", torch.float32)) < 1e-5


def test_non_absorbed_layer_is_refused():
    """An MHA-shaped (non-absorbed) layer reaching the latent backend is an error naming the shapes."""
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    seq, rot = _data(torch.float32)
    sv = Served(config, rot, torch.float32)
    layer = SimpleNamespace(layer_id=0, tp_q_head_num=H, tp_k_head_num=H, qk_head_dim=48, v_head_dim=32,
                            scaling=SCALE, logit_cap=0.0)  # (SGLang's attn_mha: per-head K 48, V 32)
    with pytest.raises(NotImplementedError, match="absorbed MLA"):
        sv.be.forward_extend(torch.zeros(2, H * 48), torch.zeros(2, H * 48), torch.zeros(2, H * 32), layer, None)
    # the split-rope calling convention of SGLang's FlashInfer / FA3 MLA backends is not taken
    with pytest.raises(NotImplementedError, match=r"not \['k_rope', 'q_rope'\]"):
        sv.be.forward_decode(torch.zeros(1, H * R), torch.zeros(1, 1, R), None, _layer(), None,
                             q_rope=torch.zeros(1, H, P), k_rope=torch.zeros(1, 1, P))


def test_seeded_model_latents_match_the_oracle():
    """Latents of a seeded transformers DeepSeek-V3 (layer 1's ``c_kv`` after ``kv_a_layernorm``,
    post-RoPE ``k_pe``, the absorbed ``q_nope W_UK``), served through prefill and decode with the
    block-Hadamard latent rotation, equal the oracle in fp32 (relative L2 < 1e-5)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from e2e.mla_oracle import capture_latent_inputs
    from sglang_oscar.rotation.latent import latent_hadamard

    cfg = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=R, q_lora_rank=64,
                           qk_rope_head_dim=P, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2,
                           initializer_range=0.08)
    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(cfg).eval()
    ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    x = capture_latent_inputs(model, ids, layer=1)
    q_abs = torch.einsum("thn,hnr->thr", x["q_nope"], x["w_kc"])
    seq = (torch.cat([q_abs, x["q_pe"]], -1), torch.cat([x["c_kv"], x["k_pe"]], -1).unsqueeze(1))
    rot = latent_hadamard(R, 32).float()
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    sv = Served(config, rot, torch.float32)
    got = torch.cat([sv.extend(1, seq, 0, 40)] + [sv.decode(1, seq, pos) for pos in range(40, 48)])
    eye = torch.eye(R).expand(H, R, R)

    def oracle(c, rotation, mode):
        return torch.cat([latent_attention(seq[0][:40, :, :R], seq[0][:40, :, R:], seq[1][:40, 0, :R], seq[1][:40, 0, R:],
                                           eye, eye, rotation, c, softmax_scale=SCALE, q_positions=torch.arange(40),
                                           window_mode="extend" if mode == "int2" else "none", hp_dtype=torch.float32,
                                           output="latent")]
                         + [latent_attention(seq[0][p:p + 1, :, :R], seq[0][p:p + 1, :, R:], seq[1][:p + 1, 0, :R],
                                             seq[1][:p + 1, 0, R:], eye, eye, rotation, c, softmax_scale=SCALE,
                                             window_mode="decode" if mode == "int2" else "none",
                                             hp_dtype=torch.float32, output="latent") for p in range(40, 48)])
    assert _rel(got, oracle(config, rot, "int2")) < 1e-5
    assert _rel(got, oracle(config, rot, "none")) > 1e-2  # the INT2 tier was read (not only the windows)


def test_backend_init_over_a_kimi_linear_hybrid_pool(monkeypatch):
    """``OscarTritonLatentBackend.__init__`` (SGLang's own ``__init__`` stubbed) on a Kimi-Linear model
    with kv_lora_rank 128 (a multiple of the data-free block-Hadamard's block): the data-free latent
    rotations of its MLA layers 1 and 3 only, found for the model's attention
    layers, the decode plans over layer 1's planes; a model whose attention layers are others is
    refused, naming them."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    import sglang.srt.runtime_context as rc

    hf = KimiLinearConfig(vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=H, q_lora_rank=None,
                          kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=P, v_head_dim=16,
                          linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": H,
                                              "head_dim": 16}, architectures=["KimiLinearForCausalLM"])
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    inner = OscarMLATokenToKVPool(64, page_size=1, dtype=torch.uint8, kv_lora_rank=128, qk_rope_head_dim=P, layer_num=2,
                                  device="cpu", enable_memory_saver=False, oscar_config=config,
                                  hp_dtype=torch.float32, max_reqs=4, sink_rows=16)
    pool = OscarHybridLinearKVPool(full_kv_pool=inner, size=64, dtype=torch.uint8, page_size=1, head_num=1,
                                   head_dim=128 + P, full_attention_layer_ids=[1, 3], device="cpu", mamba_pool=None,
                                   use_mla=True, kv_lora_rank=128, qk_rope_head_dim=P)
    monkeypatch.setattr(TritonAttnBackend, "__init__", lambda self, *a, **k: None)
    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(attn_tp_rank=0, attn_tp_size=1))

    def runner(attention_layer_ids):
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList()
        for i in attention_layer_ids:
            m = torch.nn.Module()
            for name, value in vars(_layer(r=128, layer_id=i)).items():
                setattr(m, name, value)
            model.layers.append(m)
        return SimpleNamespace(token_to_kv_pool=pool, model=model, device="cpu",
                               model_config=SimpleNamespace(hf_config=hf, num_attention_heads=H),
                               req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, CTX, dtype=torch.int32)))

    be = OscarTritonLatentBackend(runner([1, 3]))
    assert sorted(be.rotations) == [1, 3] and be._plan_layer == 1 and be._heads == H and be._engine == "codes"
    # TP 2 (issue 29's check): each rank holds the whole latent and its rotation, half the q heads
    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(attn_tp_rank=1, attn_tp_size=2))
    be2 = OscarTritonLatentBackend(runner([1, 3]))
    assert be2._heads == H // 2 and all(torch.equal(be2.rotations[i], be.rotations[i]) for i in (1, 3))
    with pytest.raises(RuntimeError, match=r"attention layers \[0, 2\] of Module have no latent rotation"):
        OscarTritonLatentBackend(runner([0, 2]))


def test_hybrid_pool_and_backend_refuse_mismatched_setups():
    """A latent pool handed over without ``use_mla=True`` (or a GQA pool with it), and a backend given
    no MLA layer to serve, are refused with messages that say what is wrong."""
    from sglang_oscar.pool.int2_pool import OscarMHATokenToKVPool

    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    latent = OscarMLATokenToKVPool(16, page_size=1, dtype=torch.uint8, kv_lora_rank=R, qk_rope_head_dim=P, layer_num=1,
                                   device="cpu", enable_memory_saver=False, oscar_config=config,
                                   hp_dtype=torch.float32, max_reqs=2, sink_rows=4)
    common = dict(size=16, dtype=torch.uint8, page_size=1, head_num=1, head_dim=R + P, full_attention_layer_ids=[1],
                  device="cpu", mamba_pool=None)
    with pytest.raises(ValueError, match="use_mla=None but the inner pool is OscarMLATokenToKVPool"):
        OscarHybridLinearKVPool(full_kv_pool=latent, **common)
    mha = OscarMHATokenToKVPool(16, page_size=1, dtype=torch.uint8, head_num=1, head_dim=64, v_head_dim=64, layer_num=1,
                                device="cpu", enable_memory_saver=False, enable_alt_stream=False, oscar_config=config,
                                hp_dtype=torch.float32, max_reqs=2, sink_rows=4)
    with pytest.raises(ValueError, match="use_mla=True but the inner pool is OscarMHATokenToKVPool"):
        OscarHybridLinearKVPool(full_kv_pool=mha, use_mla=True, kv_lora_rank=R, qk_rope_head_dim=P, **common)
    be = object.__new__(OscarTritonLatentBackend)
    with pytest.raises(RuntimeError, match="this rank serves no MLA layer"):
        be.setup_latent(latent, {}, torch.zeros(2, 8, dtype=torch.int32), H, num_sms=4)
