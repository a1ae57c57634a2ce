"""The value-rotation fold (``backend/fold.py``) is exact: folded vs unfolded layer outputs in fp32.

An attention layer is SGLang's own ``QKVParallelLinear`` + ``RowParallelLinear`` (instantiated
on CPU with explicit ``tp_rank`` / ``tp_size``, no distributed init) inside a stand-in attention
module named like SGLang's ``Qwen3Attention``; its forward is the projection, RoPE on q/k, the
oracle (``reference.oscar_attention``) and the output projection. The unfolded layer runs the
run-time rotation (``(v - mu) R_v`` into the cache, ``o R_v^T + mu`` out); the folded layer's
cache gets the projected V rows as they are (identity rotation, no mean) and its output goes
to o_proj unrotated. ``RowParallelLinear.forward`` needs a TP group, so o_proj is applied as
its forward does without the all-reduce (the quant method's ``apply``, bias on rank 0 only) and
ranks are summed. Also: a seeded tiny transformers Qwen3 (HF keeps v_proj / o_proj separate)
folded with the same math gives the run-time-rotated model's logits.
"""

from __future__ import annotations

import threading

import pytest
import torch

from sglang_oscar.backend.fold import FoldReport, fold_o_projection, fold_v_projection, fold_value_rotations
from sglang_oscar.backend.rotations import rank_means, rank_rotations
from sglang_oscar.config import OscarConfig
from sglang_oscar.reference.attention import build_cache, oscar_attention, plain_attention
from sglang_oscar.reference.synthetic import apply_rope
from sglang_oscar.rotation import RotationSet
from sglang_oscar.rotation.geometry import ModelGeometry

linear = pytest.importorskip("sglang.srt.layers.linear")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

HIDDEN, HQ, HKV, D = 64, 8, 2, 16  # GQA 4:1
T = 24
LID = 3
CFG = OscarConfig(sink_tokens=2, recent_tokens=4)
GEOMETRY = ModelGeometry.from_hf_config({"model_type": "qwen3", "num_hidden_layers": LID + 1, "num_attention_heads": HQ,
                                         "num_key_value_heads": HKV, "head_dim": D, "hidden_size": HIDDEN})
RTOL = 1e-5


def _orth(d, gen, heads=None):
    def one():
        return torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float()
    return one() if heads is None else torch.stack([one() for _ in range(heads)])


def _rotation_set(per_head: bool, centered: bool, seed=0) -> RotationSet:
    gen = torch.Generator().manual_seed(seed)
    heads = HKV if per_head else None
    rs = {i: (_orth(D, gen, heads), _orth(D, gen, heads)) for i in range(LID + 1)}
    means = {}
    if centered:
        means = {i: (torch.randn(HKV, D, generator=gen), 2.0 + torch.randn(HKV, D, generator=gen))
                 for i in range(LID + 1)}
    return RotationSet(k={i: r[0] for i, r in rs.items()}, v={i: r[1] for i, r in rs.items()},
                       k_mean={i: m[0] for i, m in means.items()}, v_mean={i: m[1] for i, m in means.items()})


class Qwen3Attention(torch.nn.Module):
    """Stand-in for SGLang's ``Qwen3Attention``: the real ``qkv_proj`` / ``o_proj`` and ``attn.layer_id``."""

    def __init__(self, tp_rank=0, tp_size=1, bias=False, layer_id=LID):
        super().__init__()
        self.qkv_proj = linear.QKVParallelLinear(HIDDEN, D, HQ, HKV, bias=bias, params_dtype=torch.float32,
                                                 tp_rank=tp_rank, tp_size=tp_size)
        self.o_proj = linear.RowParallelLinear(HQ * D, HIDDEN, bias=bias, params_dtype=torch.float32,
                                               reduce_results=False, tp_rank=tp_rank, tp_size=tp_size)
        self.attn = type("RadixAttentionStandIn", (), {"layer_id": layer_id})()


class Model(torch.nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].self_attn = attn


def _random_layer(bias, seed=1) -> Qwen3Attention:
    gen = torch.Generator().manual_seed(seed)
    m = Qwen3Attention(bias=bias)
    with torch.no_grad():
        m.qkv_proj.weight.copy_(torch.randn(m.qkv_proj.weight.shape, generator=gen) * HIDDEN ** -0.5)
        m.o_proj.weight.copy_(torch.randn(m.o_proj.weight.shape, generator=gen) * (HQ * D) ** -0.5)
        if bias:
            m.qkv_proj.bias.copy_(torch.randn(m.qkv_proj.bias.shape, generator=gen))
            m.o_proj.bias.copy_(torch.randn(m.o_proj.bias.shape, generator=gen))
    return m


def _shard(full: Qwen3Attention, rank: int, tp: int) -> Qwen3Attention:
    """The TP rank's layer with SGLang's sharding: q heads split, kv heads split (or replicated)."""
    bias = full.qkv_proj.bias is not None
    m = Qwen3Attention(rank, tp, bias=bias)
    hq, hkv = m.qkv_proj.num_heads, m.qkv_proj.num_kv_heads
    kv0 = rank * hkv if HKV >= tp else rank * HKV // tp
    q_rows = slice(rank * hq * D, (rank + 1) * hq * D)
    k_rows = slice(HQ * D + kv0 * D, HQ * D + (kv0 + hkv) * D)
    v_rows = slice((HQ + HKV) * D + kv0 * D, (HQ + HKV) * D + (kv0 + hkv) * D)
    with torch.no_grad():
        for src, dst in ((full.qkv_proj.weight, m.qkv_proj.weight), (full.qkv_proj.bias, m.qkv_proj.bias)):
            if src is not None:
                dst.copy_(torch.cat([src[q_rows], src[k_rows], src[v_rows]]))
        m.o_proj.weight.copy_(full.o_proj.weight[:, q_rows])
        if bias:
            m.o_proj.bias.copy_(full.o_proj.bias)
    return m


def _local(rs: RotationSet, rank=0, tp=1):
    return (rank_rotations(rs, GEOMETRY, rank, tp, "cpu", [LID]), rank_means(rs, GEOMETRY, rank, tp, "cpu", [LID]))


def _qkv(m: Qwen3Attention, x, pos):
    qkv, _ = m.qkv_proj(x)  # SGLang's own forward (ColumnParallelLinear, gather_output=False)
    hq, hkv = m.qkv_proj.num_heads, m.qkv_proj.num_kv_heads
    q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
    q = apply_rope(q.reshape(-1, hq, D), pos)
    k = apply_rope(k.reshape(-1, hkv, D), pos)
    return q, k, v.reshape(-1, hkv, D)


def _o_proj(m: Qwen3Attention, o):
    """``RowParallelLinear.forward`` before the reduction: bias on rank 0 only."""
    op = m.o_proj
    return op.quant_method.apply(op, o.reshape(o.shape[0], -1), bias=op.bias if op.tp_rank == 0 else None)


def _forward(m, x, rotations, means, folded, quantize=False, cache=None):
    """Layer output; unfolded = run-time rotation of V and of the output, folded = neither."""
    pos = torch.arange(x.shape[0])
    q, k, v = _qkv(m, x, pos)
    rk, rv = rotations[LID]
    mk, mv = means[LID]
    if folded:
        rv, mv = torch.eye(D), None
    o = oscar_attention(q, k, v, rk, rv, CFG, q_positions=pos, quantize=quantize, hp_dtype=torch.float32,
                        k_mean=mk, v_mean=mv, cache=cache)
    return _o_proj(m, o)


def _rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def _x(seed=5):
    return torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- the math itself
@pytest.mark.parametrize("per_head", [False, True])
def test_projection_math_is_the_runtime_rotation(per_head):
    gen = torch.Generator().manual_seed(0)
    r = _orth(D, gen, HKV if per_head else None)
    mean = torch.randn(HKV, D, generator=gen)
    w_v, b_v = torch.randn(HKV * D, HIDDEN, generator=gen), torch.randn(HKV * D, generator=gen)
    x = torch.randn(7, HIDDEN, generator=gen)
    w2, b2 = fold_v_projection(w_v, b_v, r, mean)
    want = torch.einsum("thd,hde->the", (x @ w_v.T + b_v).reshape(7, HKV, D) - mean,
                        r if per_head else r.expand(HKV, D, D))
    torch.testing.assert_close((x @ w2.T + b2).reshape(7, HKV, D), want, rtol=RTOL, atol=1e-5)
    w_o = torch.randn(HIDDEN, HQ * D, generator=gen)
    o_rot = torch.randn(7, HQ, D, generator=gen)
    w3, term = fold_o_projection(w_o, r, mean, HQ)
    rq = (r if per_head else r.expand(HKV, D, D)).repeat_interleave(HQ // HKV, dim=0)
    o = torch.einsum("the,hde->thd", o_rot, rq) + mean.repeat_interleave(HQ // HKV, dim=0)
    torch.testing.assert_close(o_rot.reshape(7, -1) @ w3.T + term, o.reshape(7, -1) @ w_o.T, rtol=RTOL, atol=1e-5)


# --------------------------------------------------------------------------- SGLang layers, TP=1
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("centered", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-layer", "per-head"])
def test_fold_is_exact(per_head, centered, bias):
    rs = _rotation_set(per_head, centered)
    rots, means = _local(rs)
    ref = _random_layer(bias)
    m = _random_layer(bias)
    x = _x()
    report = fold_value_rotations(Model(m), rots, means)
    assert report.folded == [LID] and not report.kept
    assert len(report.created_bias) == (2 if centered and not bias else 0)
    # q and k rows are untouched
    qk = (HQ + HKV) * D
    assert torch.equal(m.qkv_proj.weight[:qk], ref.qkv_proj.weight[:qk])
    # unquantized oracle: folded == run-time rotation == the unrotated model
    want = _forward(ref, x, rots, means, folded=False)
    got = _forward(m, x, rots, means, folded=True)
    assert _rel(got, want) < RTOL
    pos = torch.arange(T)
    q, k, v = _qkv(ref, x, pos)
    assert _rel(got, _o_proj(ref, plain_attention(q, k, v))) < RTOL
    # INT2: the cache holds the unfolded path's rotated rows; the folded projection gives the same rows
    rk, rv = rots[LID]
    mk, mv = means[LID]
    cache = build_cache(k, v, rk, rv, CFG, torch.float32, k_mean=mk, v_mean=mv)
    _, _, v_folded = _qkv(m, x, pos)
    torch.testing.assert_close(v_folded, cache.v_hp, rtol=RTOL, atol=1e-5)
    want = _forward(ref, x, rots, means, folded=False, quantize=True, cache=cache)
    got = _forward(m, x, rots, means, folded=True, quantize=True, cache=cache)
    assert _rel(got, want) < RTOL
    assert _rel(want, _forward(ref, x, rots, means, folded=False)) > 1e-3  # INT2 really was read


def test_fold_rounds_once_to_bf16():
    rs = _rotation_set(True, True)
    rots, means = _local(rs)
    m32 = _random_layer(True)
    m16 = _random_layer(True).to(torch.bfloat16)
    fold_value_rotations(Model(m32), rots, means)
    fold_value_rotations(Model(m16), rots, means)
    for a, b in ((m32.qkv_proj.weight, m16.qkv_proj.weight), (m32.o_proj.weight, m16.o_proj.weight),
                 (m32.qkv_proj.bias, m16.qkv_proj.bias), (m32.o_proj.bias, m16.o_proj.bias)):
        assert b.dtype == torch.bfloat16
        # the bf16 model's fold is computed in fp32 from its bf16 weights and rounded once: within one
        # bf16 rounding of the fp32 fold of the (slightly different) fp32 weights
        torch.testing.assert_close(b.float(), a, rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "v-offset-bias"])
def test_bf16_fold_is_within_bf16_noise(bias):
    """In bf16 (the served dtype) the folded layer is as close to the fp32 truth as the run-time
    rotated bf16 layer, with a calibrated mean (the layer's own mean value row). A mean far from
    the values would make the folded o_proj add two large, cancelling bf16 terms (W'o' and the
    bias W mu) where the run-time path cancels o' R^T + mu in fp32 first."""
    def layer():
        m = _random_layer(bias)
        if bias:
            with torch.no_grad():
                m.qkv_proj.bias.zero_()
                m.qkv_proj.bias[-HKV * D:] = 2.0  # a value offset, so the centering matters
        return m

    ref, ref16, m16 = layer(), layer().to(torch.bfloat16), layer().to(torch.bfloat16)
    x, pos = _x(), torch.arange(T)
    rs = _rotation_set(True, True)
    rs.v_mean = {i: _qkv(ref, x, pos)[2].mean(0) for i in rs.v_mean}
    rots, means = _local(rs)
    fold_value_rotations(Model(m16), rots, means)

    def bf16(mod, folded):
        q, k, v = _qkv(mod, x.bfloat16(), pos)
        rk, rv = rots[LID]
        mk, mv = means[LID]
        if folded:
            rv, mv = torch.eye(D), None
        o = oscar_attention(q, k, v, rk, rv, CFG, q_positions=pos, quantize=False, hp_dtype=torch.bfloat16,
                            k_mean=mk, v_mean=mv)
        return _o_proj(mod, o.bfloat16()).float()

    truth = _forward(ref, x, rots, means, folded=False)
    runtime, folded = _rel(bf16(ref16, False), truth), _rel(bf16(m16, True), truth)
    assert runtime < 1e-2 and folded < 1.5 * runtime, (runtime, folded)


# --------------------------------------------------------------------------- tensor parallelism
def _fold_ranks(full, rs, tp, with_reduce=True, shards=None, expect_errors=False):
    """Fold each rank's shard in its own thread; ``all_reduce`` sums over the threads."""
    shards = shards or [_shard(full, r, tp) for r in range(tp)]
    slots, barrier = [None] * tp, threading.Barrier(tp, timeout=60)  # a rank failing early times the others out
    reports, errors = [None] * tp, []

    def run(rank):
        def all_reduce(t):
            slots[rank] = t.clone()  # one call per rank: no slot is rewritten after the barrier
            barrier.wait()
            return sum(slots)
        try:
            rots, means = _local(rs, rank, tp)
            reports[rank] = fold_value_rotations(Model(shards[rank]), rots, means, rank, tp,
                                                 all_reduce=all_reduce if with_reduce else None)
        except BaseException as exc:  # surfaced below (no barrier.abort: it would race the released ranks)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if expect_errors:
        return errors
    assert not errors, errors
    return shards, reports


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2-split", "tp4-replicated"])
@pytest.mark.parametrize("centered", [False, True], ids=["plain", "centred"])
@pytest.mark.parametrize("per_head", [False, True], ids=["per-layer", "per-head"])
def test_tp_shards_fold_like_tp1(per_head, centered, tp):
    rs = _rotation_set(per_head, centered, seed=7)
    full = _random_layer(bias=False, seed=8)
    ref = _random_layer(bias=False, seed=8)
    shards, reports = _fold_ranks(full, rs, tp)
    assert all(r.folded == [LID] for r in reports)
    fold_value_rotations(Model(full), *_local(rs))
    if tp <= HKV:  # split kv heads: the ranks' shards concatenated are the TP=1 fold
        hq, hkv = HQ // tp, HKV // tp
        parts = [[s.qkv_proj.weight[: hq * D] for s in shards],
                 [s.qkv_proj.weight[hq * D:(hq + hkv) * D] for s in shards],
                 [s.qkv_proj.weight[(hq + hkv) * D:] for s in shards]]
        torch.testing.assert_close(torch.cat([torch.cat(p) for p in parts]), full.qkv_proj.weight, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([s.o_proj.weight for s in shards], dim=1), full.o_proj.weight,
                                   rtol=0, atol=0)
    for rank, s in enumerate(shards):  # every rank holds the same full o_proj bias (only rank 0 adds it)
        if centered:
            torch.testing.assert_close(s.o_proj.bias, full.o_proj.bias, rtol=RTOL, atol=1e-5)
            hkv = s.qkv_proj.num_kv_heads
            kv0 = rank * hkv if tp <= HKV else rank * HKV // tp
            v_bias = full.qkv_proj.bias[-HKV * D:].reshape(HKV, D)[kv0:kv0 + hkv].reshape(-1)
            torch.testing.assert_close(s.qkv_proj.bias[-hkv * D:], v_bias, rtol=0, atol=0)
        else:
            assert s.o_proj.bias is None and s.qkv_proj.bias is None
    # the ranks' summed outputs equal the unfolded TP=1 layer's
    x = _x(9)
    rots1, means1 = _local(rs)
    want = _forward(ref, x, rots1, means1, folded=False)
    got = sum(_forward(s, x, *_local(rs, r, tp), folded=True) for r, s in enumerate(shards))
    assert _rel(got, want) < RTOL


def test_tp_centred_without_all_reduce_is_kept():
    rs = _rotation_set(True, True)
    full = _random_layer(bias=False)
    shards, reports = _fold_ranks(full, rs, 2, with_reduce=False)
    for r in reports:
        assert r.folded == [] and "all_reduce" in r.kept[LID]
    ref = _shard(_random_layer(bias=False), 0, 2)
    assert torch.equal(shards[0].qkv_proj.weight, ref.qkv_proj.weight)


def test_tp_ranks_that_disagree_are_an_error():
    """A layer folded on one rank and kept on another would mix frames: both ranks raise."""
    rs = _rotation_set(True, True)
    full = _random_layer(bias=False)
    shards = [_shard(full, r, 2) for r in range(2)]
    shards[1].qkv_proj.quant_method = Fp8LinearMethod()
    errors = _fold_ranks(full, rs, 2, shards=shards, expect_errors=True)
    assert len(errors) == 2 and all("folded on 1 of 2" in str(e) for e in errors)


# --------------------------------------------------------------------------- refusals
class Fp8LinearMethod:
    """Stand-in for SGLang's FP8 linear method (only its class name and an fp8 weight matter)."""


def test_quantized_weights_keep_the_runtime_rotation(caplog):
    rs = _rotation_set(True, True)
    rots, means = _local(rs)
    m = _random_layer(bias=False)
    w8 = m.qkv_proj.weight.detach().to(torch.float8_e4m3fn)
    m.qkv_proj.quant_method = Fp8LinearMethod()
    m.qkv_proj.weight = torch.nn.Parameter(w8, requires_grad=False)
    o_before = m.o_proj.weight.clone()
    report = fold_value_rotations(Model(m), rots, means)
    assert report.folded == [] and report.folded_layers == frozenset()
    assert report.kept[LID] == "qkv_proj weights are float8_e4m3fn (Fp8LinearMethod)"
    assert torch.equal(m.o_proj.weight, o_before) and m.o_proj.bias is None  # all or nothing per layer
    assert torch.equal(m.qkv_proj.weight.view(torch.uint8), w8.view(torch.uint8))
    with caplog.at_level("INFO", logger="sglang_oscar"):
        report.log()
    assert f"layer {LID}: qkv_proj weights are float8_e4m3fn (Fp8LinearMethod): value rotation stays at run time" \
        in caplog.text


def test_other_refusals():
    rs = _rotation_set(False, True)
    rots, means = _local(rs)

    class Qwen3NextAttention(Qwen3Attention):  # an output gate between the attention and o_proj
        pass

    rep = fold_value_rotations(Model(Qwen3NextAttention()), rots, means)
    assert "Qwen3NextAttention" in rep.kept[LID] and not rep.output_only

    class Gemma4Attention(Qwen3Attention):  # a v_norm between qkv_proj and the cache: o_proj only
        pass

    g, g_ref = Gemma4Attention(), _random_layer(bias=False)
    g.load_state_dict(g_ref.state_dict())
    rep = fold_value_rotations(Model(g), rots, means)
    assert rep.output_only == [LID] and not rep.folded and rep.folded_layers == frozenset()
    assert rep.output_folded_layers == frozenset({LID}) and rep.created_bias == ["layers.0.self_attn.o_proj"]
    assert torch.equal(g.qkv_proj.weight, g_ref.qkv_proj.weight)
    w_o, term = fold_o_projection(g_ref.o_proj.weight, rots[LID][1], means[LID][1], HQ)
    assert torch.equal(g.o_proj.weight, w_o) and torch.allclose(g.o_proj.bias, term)
    assert fold_value_rotations(Model(g), rots, means).output_only == [LID]  # a second backend: not refolded
    assert torch.equal(g.o_proj.weight, w_o)
    with pytest.raises(ValueError, match="folded into the weights already"):
        fold_value_rotations(Model(g), *_local(_rotation_set(False, True, seed=4)))
    m = _random_layer(bias=False)
    m.o_proj.skip_bias_add = True  # a created bias would be returned to a caller that drops it
    rep = fold_value_rotations(Model(m), rots, means)
    assert "skip_bias_add" in rep.kept[LID]
    # without a mean no bias is needed: folds
    plain = _rotation_set(False, False)
    rep = fold_value_rotations(Model(m), *_local(plain))
    assert rep.folded == [LID]
    w = m.qkv_proj.weight.clone()
    rep = fold_value_rotations(Model(m), *_local(plain))  # a second backend: reported folded, not refolded
    assert rep.folded == [LID] and torch.equal(m.qkv_proj.weight, w)
    with pytest.raises(ValueError, match="folded into the weights already"):
        fold_value_rotations(Model(m), *_local(_rotation_set(False, False, seed=4)))
    # layers without a rotation (BF16 layers) are not touched and not reported
    m2 = _random_layer(bias=False)
    rep = fold_value_rotations(Model(m2), {}, {})
    assert rep == FoldReport()
    # the wrong rank
    rep = fold_value_rotations(Model(_random_layer(bias=False)), rots, means, tp_rank=1, tp_size=2,
                               all_reduce=lambda t: t)
    assert "rank 0 of 1" in rep.kept[LID]


# --------------------------------------------------------------------------- transformers Qwen3
def test_hf_qwen3_logits_match_the_runtime_rotation():
    transformers = pytest.importorskip("transformers")
    from transformers import AttentionInterface, Qwen3Config, Qwen3ForCausalLM

    layers = 2
    cfg = Qwen3Config(vocab_size=96, hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, max_position_embeddings=64)
    geom = ModelGeometry.from_hf_config(cfg.to_dict())
    state = {}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        lid = module.layer_idx
        rk, rv = state["rot"][lid]
        mk, mv = state["mean"][lid]
        if state["folded"]:
            rv, mv = torch.eye(D), None
        q, k, v = (t[0].transpose(0, 1).float() for t in (query, key, value))
        o = oscar_attention(q, k, v, rk, rv, CFG, quantize=False, hp_dtype=torch.float32, sm_scale=scaling,
                            k_mean=mk, v_mean=mv)
        return o.unsqueeze(0).to(query.dtype), None

    AttentionInterface.register("oscar_fold_test", attention)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(11)
    base = Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        plain = base(ids).logits
    for per_head in (False, True):
        for centered in (False, True):
            gen = torch.Generator().manual_seed(13)
            heads = HKV if per_head else None
            rs = RotationSet(
                k={i: _orth(D, gen, heads) for i in range(layers)}, v={i: _orth(D, gen, heads) for i in range(layers)},
                k_mean={i: torch.randn(HKV, D, generator=gen) for i in range(layers)} if centered else {},
                # means of the size of the values (HF init: v ~ 0.1); a mean 20x the values would cancel
                # ~4 bits of fp32 in v - mean, on both paths alike
                v_mean={i: 0.1 + 0.1 * torch.randn(HKV, D, generator=gen) for i in range(layers)} if centered else {})
            state["rot"] = rank_rotations(rs, geom, 0, 1, "cpu", range(layers))
            state["mean"] = rank_means(rs, geom, 0, 1, "cpu", range(layers))
            model = Qwen3ForCausalLM(cfg).float().eval()
            model.load_state_dict(base.state_dict())
            model.config._attn_implementation = "oscar_fold_test"
            state["folded"] = False
            with torch.no_grad():
                runtime = model(ids).logits
                for lid, layer in enumerate(model.model.layers):  # HF: separate v_proj / o_proj
                    att = layer.self_attn
                    _, rv = state["rot"][lid]
                    mv = state["mean"][lid][1]
                    w_v, b_v = fold_v_projection(att.v_proj.weight, att.v_proj.bias, rv, mv)
                    w_o, term = fold_o_projection(att.o_proj.weight, rv, mv, HQ)
                    att.v_proj.weight.copy_(w_v)
                    att.o_proj.weight.copy_(w_o)
                    if b_v is not None:
                        att.v_proj.bias = torch.nn.Parameter(b_v)
                        att.o_proj.bias = torch.nn.Parameter(term)
                state["folded"] = True
                folded = model(ids).logits
            assert _rel(folded, runtime) < RTOL, (per_head, centered)
            assert _rel(runtime, plain) < RTOL, (per_head, centered)


_GLOO_CHILD = r"""
import sys, torch, torch.distributed as dist
from sglang_oscar.backend.fold import cpu_all_reduce
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t = torch.full((3, 5), float(rank + 1)) + torch.arange(5.0)
out = cpu_all_reduce(dist.group.WORLD)(t)
assert torch.equal(out, torch.full((3, 5), 3.0) + 2 * torch.arange(5.0)), out
assert torch.equal(t, torch.full((3, 5), float(rank + 1)) + torch.arange(5.0))  # input untouched
dist.destroy_process_group()
print("ok", rank)
"""


def test_cpu_all_reduce_sums_over_a_gloo_group():
    """The helper the backend passes as ``all_reduce``: two real processes, one gloo group."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(__import__("pathlib").Path(__file__).resolve().parents[2]
                                                           / "python"), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", _GLOO_CHILD, str(r), str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
