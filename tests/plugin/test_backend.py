"""The served path on CPU: OscarMHATokenToKVPool + OscarTritonAttnBackend forward paths vs the oracle.

The backend's SGLang-side ``__init__`` needs a GPU model runner, so the tests build the backend
object directly with the attributes ``__init__`` sets, then drive ``init_forward_metadata``'s
window bookkeeping and ``forward_extend`` / ``forward_decode`` with SGLang-shaped forward batches
(kernels under the Triton interpreter). Checked: prefill and decode match the oracle
(``reference.oscar_attention``, window modes "extend" / "decode"); chunked prefill and radix
reuse give the same outputs as a fresh unchunked run; an exhausted sink arena degrades to the
oracle with a shorter sink, never to garbage; freed slots give their sink rows back. The
``--oscar-fold-rotations on`` tests are in test_backend_fold.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _support.forward import Mode as _Mode
from _support.orthogonal import random_orthogonal
from _support.served import cpu_backend
from sglang_oscar.config import OscarConfig
from sglang_oscar.pool.int2_pool import OscarMHATokenToKVPool
from sglang_oscar.reference.attention import oscar_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HQ, HKV, D = 4, 2, 64
SINK, RECENT = 4, 8
CTX = 96


def _layer():
    return SimpleNamespace(layer_id=0, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                           scaling=D ** -0.5, logit_cap=0.0, sliding_window_size=-1, logit_capping_method="tanh",
                           is_cross_attention=False)


class Served:
    """One INT2 pool + backend (one layer) and a slot allocator handing out increasing slots."""

    def __init__(self, config, rk, rv, sink_rows=None, max_reqs=4, slots=512, mk=None, mv=None,
                 folded=frozenset(), hp_dtype=torch.bfloat16, output_folded=None):
        self.pool = OscarMHATokenToKVPool(
            slots, page_size=1, dtype=torch.uint8, head_num=HKV, head_dim=D, v_head_dim=D, layer_num=1,
            device="cpu", enable_memory_saver=False, enable_alt_stream=False, oscar_config=config,
            hp_dtype=hp_dtype, max_reqs=max_reqs,
            sink_rows=SINK * 4 * max_reqs if sink_rows is None else sink_rows)
        be = cpu_backend(self.pool, config, [_layer()], {0: (rk, rv)}, max_reqs=max_reqs, ctx=CTX,
                         means={0: (mk, mv)}, folded=folded, output_folded=output_folded)
        self.be = be
        self.r2t = be._int2_req_to_token
        self.next_slot = 1

    def alloc(self, n):
        s = torch.arange(self.next_slot, self.next_slot + n)
        self.next_slot += n
        return s

    def extend(self, req, seq, start, end, slots=None):
        n = end - start
        slots = self.alloc(n) if slots is None else slots
        self.r2t[req, start:end] = slots.to(torch.int32)
        fb = SimpleNamespace(forward_mode=_Mode("extend"), batch_size=1, out_cache_loc=slots,
                             positions=torch.arange(start, end), req_pool_indices=torch.tensor([req]),
                             seq_lens=torch.tensor([end]), extend_seq_lens=torch.tensor([n]),
                             extend_prefix_lens=torch.tensor([start]))
        self.be.forward_metadata = SimpleNamespace(qo_indptr=torch.tensor([0, n]), max_extend_len=n)
        self.be._windows_out_of_graph()
        self.be._windows_in_forward(fb)
        self.be.plan_extend(fb, n)  # init_forward_metadata's extend plan
        q, k, v = seq
        o = self.be.forward_extend(q[start:end].reshape(n, -1), k[start:end].reshape(n, -1),
                                   v[start:end].reshape(n, -1), _layer(), fb)
        return o.float().reshape(n, HQ, D)

    def decode(self, req, seq, pos):
        slot = self.alloc(1)
        self.r2t[req, pos] = int(slot)
        fb = SimpleNamespace(forward_mode=_Mode("decode"), batch_size=1, out_cache_loc=slot,
                             positions=torch.tensor([pos]), req_pool_indices=torch.tensor([req]),
                             seq_lens=torch.tensor([pos + 1]))
        self.be._windows_out_of_graph()
        self.be._windows_in_forward(fb)
        self.be.plan_decode(fb)  # init_forward_metadata's decode plan
        q, k, v = seq
        o = self.be.forward_decode(q[pos:pos + 1].reshape(1, -1), k[pos:pos + 1].reshape(1, -1),
                                   v[pos:pos + 1].reshape(1, -1), _layer(), fb)
        return o.float().reshape(1, HQ, D)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def setup():
    """One sequence, config and rotation pair for the module (seeded: the same data every run)."""
    gen = torch.Generator().manual_seed(20240611)
    t = 60
    scale = torch.ones(D)
    scale[:4] = 8.0  # outlier channels, as post-RoPE keys have
    seq = (torch.randn(t, HQ, D, generator=gen).bfloat16(),
           (torch.randn(t, HKV, D, generator=gen) * scale).bfloat16(),
           torch.randn(t, HKV, D, generator=gen).bfloat16())
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    return seq, config, random_orthogonal(D, HKV, generator=gen), random_orthogonal(D, HKV, generator=gen)


def _oracle(seq, config, rk, rv, start, end, mode):
    q, k, v = seq
    return oscar_attention(q[start:end].float(), k[:end].float(), v[:end].float(), rk, rv, config,
                           q_positions=torch.arange(start, end), window_mode=mode, sm_scale=D ** -0.5)


@pytest.fixture(scope="module")
def fresh(setup):
    """The default configuration served fresh (computed once, read by several tests): request 1
    prefilled 0..40 in one extend, then decoded 40..52. ``(served, prefill output, decode outputs)``."""
    seq, config, rk, rv = setup
    sv = Served(config, rk, rv)
    o = sv.extend(1, seq, 0, 40)
    return sv, o, [sv.decode(1, seq, pos) for pos in range(40, 52)]


def test_prefill_then_decode_match_the_oracle(setup, fresh):
    seq, config, rk, rv = setup
    sv, o, decoded = fresh
    assert _rel(o, _oracle(seq, config, rk, rv, 0, 40, "extend")) < 1e-2
    for pos, o in zip(range(40, 52), decoded, strict=True):
        assert _rel(o, _oracle(seq, config, rk, rv, pos, pos + 1, "decode")) < 1e-2, pos
    # the INT2 bytes of every written slot equal the reference quantizer's on the rotated rows
    from sglang_oscar.quant.int2 import quantize_rows
    kc, kp, _, _, _, _ = sv.pool.int2_buffers(0)
    k_rot = torch.einsum("thd,hde->the", seq[1][:52].float(), rk).bfloat16()
    ref = quantize_rows(k_rot, **config.quant_kwargs("k"))
    slots = sv.r2t[1, :52].long()
    assert torch.equal(kc[slots], ref.codes)


def test_decode_engine_flag_reaches_the_kernels(setup, fresh):
    """--oscar-decode-engine: "triton" decodes as "auto" does on this CPU box (both run Triton here);
    "gluon" reaches the decode plan, which refuses it here with the reason (no Gluon under the
    interpreter), when the first decode batch is planned."""
    import dataclasses

    seq, config, rk, rv = setup
    assert config.decode_engine == "auto"
    outs = {"auto": fresh[2][0]}  # the default configuration's first decode step (pos 40)
    sv = Served(dataclasses.replace(config, decode_engine="triton"), rk, rv)
    sv.extend(1, seq, 0, 40)
    outs["triton"] = sv.decode(1, seq, 40)
    assert torch.equal(outs["auto"], outs["triton"])
    assert _rel(outs["triton"], _oracle(seq, config, rk, rv, 40, 41, "decode")) < 1e-2
    sv = Served(dataclasses.replace(config, decode_engine="gluon"), rk, rv)
    sv.extend(1, seq, 0, 16)  # a prefill with sink, INT2 and recent rows; the plan refuses any context
    with pytest.raises(ValueError, match=r"Gluon engine\) cannot run this decode call: TRITON_INTERPRET"):
        sv.decode(1, seq, 16)


def test_decode_planned_during_a_capture_is_kept_with_the_graph(setup, monkeypatch):
    """A decode forward nobody planned ahead plans its batch at its first layer; during a CUDA-graph
    capture those plans are kept beside the batch size's first ones (the graph replays both plans'
    launches, so their workspace views must outlive the capture)."""
    seq, config, rk, rv = setup
    sv = Served(config, rk, rv)
    sv.extend(1, seq, 0, 40)
    be = sv.be
    first = be.plan_decode(SimpleNamespace(req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([41])))
    be._graph_plans[1] = [first]  # init_forward_metadata_out_graph(in_capture=True)'s plans
    be._layer_geometry = {}  # a layer the model scan missed: not planned ahead
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    slot = sv.alloc(1)
    sv.r2t[1, 40] = int(slot)
    fb = SimpleNamespace(forward_mode=_Mode("decode"), batch_size=1, out_cache_loc=slot, positions=torch.tensor([40]),
                         req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([41]))
    be._windows_in_forward(fb)
    q, k, v = seq
    o = be.forward_decode(q[40:41].reshape(1, -1), k[40:41].reshape(1, -1), v[40:41].reshape(1, -1), _layer(), fb)
    assert len(be._graph_plans[1]) == 2 and be._graph_plans[1][0] is first
    assert be._graph_plans[1][1] is be._decode_plans  # the late plans, kept
    assert _rel(o.float().reshape(1, HQ, D), _oracle(seq, config, rk, rv, 40, 41, "decode")) < 1e-2


@pytest.mark.parametrize("hp_dtype,mode,want", [(torch.bfloat16, "extend", "tf32x3"), (torch.float16, "extend", "tf32x3"),
                                                  (torch.bfloat16, "decode", "ieee"), (torch.float32, "extend", "ieee")])
def test_output_rotation_precision(hp_dtype, mode, want):
    """TF32x3 for the output rotation of a 16-bit model's extend batches only: decode batches and fp32
    models (the fp32 servers check c compares with the oracle at fp32 noise) stay IEEE."""
    from sglang_oscar.backend.triton_backend import OscarTritonAttnBackend

    be = SimpleNamespace(pool=SimpleNamespace(hp_dtype=hp_dtype))
    assert OscarTritonAttnBackend._output_precision(be, SimpleNamespace(forward_mode=_Mode(mode))) == want


def test_rotate_engine_flag_reaches_the_backend(setup, monkeypatch):
    """--oscar-rotate-engine triton: the backend rotates q / K / V in one kernels.rotate.rotate_qkv
    launch and the output with rotate_heads (both counted, block_n "auto"; the output at TF32x3 for
    the BF16 pool's extend, whose launch shape is fixed, else IEEE fp32), and prefill + decode
    outputs equal the torch engine's up to the fp32 summation order (a rotated BF16 row may move by
    one ulp), within 1e-2 of the oracle."""
    import dataclasses

    from sglang_oscar.backend import step as triton_backend  # the backend's per-layer rotations

    from sglang_oscar.kernels import rotate as rotate_mod

    calls = []
    for name in ("rotate_heads", "rotate_qkv"):
        real = getattr(triton_backend, name)
        monkeypatch.setattr(triton_backend, name,
                            lambda *a, _n=name, _r=real, **k: calls.append((_n, k.get("block_n", "default"),
                                                                            k.get("precision"))) or _r(*a, **k))
    picks = []  # the kernels' "auto" choice is what runs (auto_block_n asked once per launch)
    real_auto = rotate_mod.auto_block_n
    monkeypatch.setattr(rotate_mod, "auto_block_n", lambda *a, **k: picks.append(k.get("products", 1)) or real_auto(*a, **k))
    seq, config, rk, rv = setup
    outs = {}
    for engine in ("torch", "triton"):
        calls.clear()
        picks.clear()
        sv = Served(dataclasses.replace(config, rotate_engine=engine), rk, rv)
        o = sv.extend(1, seq, 0, 40)
        outs[engine] = (o, sv.decode(1, seq, 40))
        # per forward (two): q / K / V in one launch, then the output, both with the default block_n
        assert calls == ([] if engine == "torch" else [("rotate_qkv", "default", None), ("rotate_heads", "default",
                                                       "tf32x3"), ("rotate_qkv", "default", None),
                                                       ("rotate_heads", "default", "ieee")])
        assert picks == ([] if engine == "torch" else [3, 3, 1])  # auto_block_n: all but the extend output
    for a, b in zip(outs["torch"], outs["triton"]):
        assert _rel(b, a) < SAME
    assert _rel(outs["triton"][1], _oracle(seq, config, rk, rv, 40, 41, "decode")) < 1e-2


# Chunking changes the batch shape of the rotation GEMM, whose fp32 rounding can move a rotated
# BF16 row by one ulp (as SGLang's own QKV GEMMs do): equal up to that, far below INT2 error.
SAME = 2e-3


def test_chunked_and_radix_reuse_equal_a_fresh_run(setup, fresh):
    seq, config, rk, rv = setup
    _, o_fresh, d_fresh = fresh  # prefill 0..40 in one extend, then decode 40..
    # chunked prefill 0..17, 17..40
    ch = Served(config, rk, rv)
    o1 = ch.extend(1, seq, 0, 17)
    o2 = ch.extend(1, seq, 17, 40)
    assert _rel(torch.cat([o1, o2]), o_fresh) < SAME
    for i, p in enumerate(range(40, 44)):
        assert _rel(ch.decode(1, seq, p), d_fresh[i]) < SAME
    # radix reuse: request 2 borrows request 1's first 40 - RECENT slots (the capped match) and
    # recomputes the rest; request 1's slots are then freed except the shared prefix
    m = 40 - RECENT
    rx = Served(config, rk, rv)
    rx.extend(1, seq, 0, 40)
    shared = rx.r2t[1, :m].clone()
    rx.r2t[2, :m] = shared
    o_tail = rx.extend(2, seq, m, 40)
    assert _rel(o_tail, o_fresh[m:]) < SAME
    rx.pool.windows.release(rx.r2t[1, m:40].long())  # the donor finished; its unshared tail is freed
    for i, p in enumerate(range(40, 44)):
        assert _rel(rx.decode(2, seq, p), d_fresh[i]) < SAME


def test_exhausted_sink_arena_reads_like_a_shorter_sink(setup):
    seq, config, rk, rv = setup
    sv = Served(config, rk, rv, sink_rows=2)
    o = sv.extend(1, seq, 0, 40)
    short = OscarConfig(group_size=32, sink_tokens=2, recent_tokens=RECENT)
    assert sv.pool.windows.sink_lens[1].item() == 2 and int(sv.pool.windows.missed) == 2
    assert _rel(o, _oracle(seq, short, rk, rv, 0, 40, "extend")) < 1e-2
    d = sv.decode(1, seq, 40)
    assert _rel(d, _oracle(seq, short, rk, rv, 40, 41, "decode")) < 1e-2
    # freeing the request's slots returns both rows
    sv.pool.windows.release(sv.r2t[1, :41].long())
    sv.pool.windows.process_releases()
    assert sv.pool.windows.free_sink_rows == 2


def test_pool_refuses_bf16_access_and_reports_true_sizes(setup):
    _, config, rk, rv = setup
    sv = Served(config, rk, rv)
    pool = sv.pool
    assert pool.get_value_buffer(0).shape == (513, HKV, D) and pool.get_value_buffer(0).is_meta
    with pytest.raises(RuntimeError, match="--attention-backend triton"):
        pool.set_kv_buffer(None, torch.tensor([1]), torch.zeros(1, HKV, D), torch.zeros(1, HKV, D))
    # D=64, G=32, fp16 pairs: code plane + pair plane: 16 code bytes + 2 groups x 2 x 2 bytes = 24 per head, K and V
    assert pool.k_buffer[0].shape == (513, HKV, 16) and pool.int2_bytes_per_token() == 2 * 24 * HKV
    # head-major memory: one kv head's entries at consecutive slots are adjacent
    assert pool.k_buffer[0].stride() == (16, 513 * 16, 1) and pool.v_buffer[0].stride() == (16, 513 * 16, 1)
    kc, kp, vc, vp, _, _ = pool.int2_buffers(0)
    assert kc is pool.k_buffer[0] and kp is pool.k_pair_buffer[0] and vp is pool.v_pair_buffer[0]
    assert kp.dtype == torch.float16 and kp.shape == (513, HKV, 4) and kp.stride() == (4, 513 * 4, 1)
    with pytest.raises(RuntimeError, match="cannot move KV slots"):
        pool.move_kv_cache(torch.tensor([3]), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="no CPU copy"):
        pool.get_cpu_copy(torch.tensor([3]))
    from sglang_oscar.pool.sizing import int2_cell_size
    assert int2_cell_size(config, HKV, D, D, 1) == pool.int2_bytes_per_token()
    # byte rows and HP arenas are what get_kv_size_bytes reports
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    hp_rows = pool.windows.num_rows
    assert k_bytes == 513 * HKV * 24 + hp_rows * HKV * D * 2 == v_bytes


@pytest.mark.parametrize("rotate_engine", ["torch", "triton"])
def test_centred_rotation_matches_the_centred_oracle(setup, rotate_engine):
    """A centred rotation set: the pool holds (x - mean) R, the output gets mean_v back; prefill and
    decode match the oracle with the same means, and a logit-capped layer is refused (both
    --oscar-rotate-engine values: the means go through kernels.rotate too)."""
    import dataclasses

    seq, config, rk, rv = setup
    config = dataclasses.replace(config, rotate_engine=rotate_engine)
    gen = torch.Generator().manual_seed(11)
    # keys / values with a static offset, as the means of a real model's keys carry
    q, k, v = seq
    k_off = (8.0 * torch.randn(HKV, D, generator=gen)).bfloat16()
    v_off = (4.0 * torch.randn(HKV, D, generator=gen)).bfloat16()
    seq = (q, k + k_off, v + v_off)
    mk, mv = k_off.float() + 0.1, v_off.float() - 0.1  # calibration means are never exact
    sv = Served(config, rk, rv, mk=mk, mv=mv)

    def oracle(start, end, mode):
        return oscar_attention(seq[0][start:end].float(), seq[1][:end].float(), seq[2][:end].float(), rk, rv,
                               config, q_positions=torch.arange(start, end), window_mode=mode, sm_scale=D ** -0.5,
                               k_mean=mk, v_mean=mv)

    o = sv.extend(1, seq, 0, 40)
    assert _rel(o, oracle(0, 40, "extend")) < 1e-2
    for pos in range(40, 46):
        assert _rel(sv.decode(1, seq, pos), oracle(pos, pos + 1, "decode")) < 1e-2, pos
    # the uncentred oracle is a different cache (the offsets widen every row's range)
    assert _rel(o, _oracle(seq, config, rk, rv, 0, 40, "extend")) > 2 * _rel(o, oracle(0, 40, "extend"))
    from sglang_oscar.quant.int2 import quantize_rows
    kc, _, _, _, _, _ = sv.pool.int2_buffers(0)
    if rotate_engine == "triton":  # the rows the backend wrote (one-ulp differences from the einsum change codes)
        from sglang_oscar.kernels.rotate import rotate_heads

        k_rot = rotate_heads(seq[1][:46], rk, torch.bfloat16, sub_mean=mk)
    else:
        k_rot = torch.einsum("thd,hde->the", seq[1][:46].float() - mk, rk).bfloat16()
    slots = sv.r2t[1, :46].long()
    assert torch.equal(kc[slots], quantize_rows(k_rot, **config.quant_kwargs("k")).codes)
    capped = _layer()
    capped.logit_cap = 30.0
    with pytest.raises(NotImplementedError, match="centres the keys"):
        sv.be._check_layer(capped, None, None)
