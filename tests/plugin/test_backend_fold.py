"""``--oscar-fold-rotations on`` on the served path on CPU, with test_backend.py's ``Served`` pool + backend.

A stand-in layer with SGLang's own ``qkv_proj`` / ``o_proj``, folded by ``backend.step.fold_model``: folded
and unfolded layers agree (bf16 noise; 1e-5 in fp32), folded outputs are planned in the model dtype, a folded
layer rotates q and K in one launch, and a layer the fold keeps runs the unfolded path bit for bit.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch

from _support.orthogonal import random_orthogonal
from sglang_oscar.config import OscarConfig
from test_backend import HKV, HQ, RECENT, SINK, D, Served, _rel

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# --------------------------------------------------------------------------- --oscar-fold-rotations
HIDDEN = 96
FOLD_T = 44  # prefill 0..40, then decode 40..44


class Qwen3Attention(torch.nn.Module):
    """Stand-in named like SGLang's ``Qwen3Attention`` (``fold.FOLDABLE_ATTENTION``) with SGLang's own
    ``qkv_proj`` / ``o_proj`` (CPU, ``tp_size`` 1) and ``attn.layer_id``."""

    def __init__(self, dtype, seed=3):
        super().__init__()
        linear = pytest.importorskip("sglang.srt.layers.linear")
        self.qkv_proj = linear.QKVParallelLinear(HIDDEN, D, HQ, HKV, bias=False, params_dtype=dtype,
                                                 tp_rank=0, tp_size=1)
        self.o_proj = linear.RowParallelLinear(HQ * D, HIDDEN, bias=False, params_dtype=dtype, reduce_results=False,
                                               tp_rank=0, tp_size=1)
        self.attn = SimpleNamespace(layer_id=0)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.qkv_proj.weight.copy_(torch.randn(self.qkv_proj.weight.shape, generator=gen) * HIDDEN ** -0.5)
            self.o_proj.weight.copy_(torch.randn(self.o_proj.weight.shape, generator=gen) * (HQ * D) ** -0.5)

    def qkv(self, x):
        """``(q, k, v)`` ``[T, H, D]`` of the projection (as the model feeds the backend; no RoPE needed here)."""
        out, _ = self.qkv_proj(x.to(self.qkv_proj.weight.dtype))
        q, k, v = out.split([HQ * D, HKV * D, HKV * D], dim=-1)
        return q.reshape(-1, HQ, D), k.reshape(-1, HKV, D), v.reshape(-1, HKV, D).contiguous()

    def out(self, o):
        """``o_proj`` as ``RowParallelLinear.forward`` computes it on rank 0 (no reduction: one rank)."""
        op = self.o_proj
        return op.quant_method.apply(op, o.to(op.weight.dtype).reshape(o.shape[0], -1), bias=op.bias).float()


def _fold_case(per_head, centered, dtype, seed=21):
    gen = torch.Generator().manual_seed(seed)
    if per_head:
        rk, rv = random_orthogonal(D, HKV, generator=gen), random_orthogonal(D, HKV, generator=gen)
    else:  # one matrix per layer, broadcast to the kv heads (rank_rotations)
        rk, rv = (random_orthogonal(D, generator=gen).expand(HKV, D, D).contiguous() for _ in range(2))
    x = torch.randn(FOLD_T, HIDDEN, generator=gen) + 2.0 * torch.randn(HIDDEN, generator=gen)  # offset: K/V means
    ref = Qwen3Attention(dtype)
    mk = mv = None
    if centered:  # calibrated means: the layer's own mean rows, a little off (calibration is never exact)
        _, k, v = ref.qkv(x)
        mk = k.float().mean(0) + 0.05 * torch.randn(HKV, D, generator=gen)
        mv = v.float().mean(0) + 0.05 * torch.randn(HKV, D, generator=gen)
    return x, rk, rv, mk, mv


def _serve_layer(model, x, config, rk, rv, mk, mv, folded, hp_dtype, seq=None, prefill=40, end=FOLD_T,
                 output_folded=None):
    """Prefill 0..``prefill`` then decode ``prefill``..``end`` of one request through the backend
    (``seq``: the backend's q / k / v inputs, default the model's projections); the layer outputs
    after o_proj."""
    sv = Served(config, rk, rv, mk=mk, mv=mv, folded=folded, hp_dtype=hp_dtype, output_folded=output_folded)
    seq = model.qkv(x) if seq is None else seq
    outs = [sv.extend(1, seq, 0, prefill)] + [sv.decode(1, seq, p) for p in range(prefill, end)]
    return model.out(torch.cat(outs)), sv


# Checks that hold exactly (fp32 to 1e-5, bit for bit, launch counts) at any length serve a shorter
# request: prefill 0..20 (4 sink, 8 INT2 and 8 recent rows), then decode 20..22 (rows move to INT2).
SHORT = dict(prefill=20, end=22)


def _fp32_twin(model):
    """The same layer (its bf16 weights, folded or not, exactly) in fp32."""
    twin = Qwen3Attention(torch.float32)
    with torch.no_grad():
        for name in ("qkv_proj", "o_proj"):
            a, b = getattr(twin, name), getattr(model, name)
            a.weight.copy_(b.weight.float())
            if b.bias is not None:
                a.bias = torch.nn.Parameter(b.bias.detach().float(), requires_grad=False)
    return twin


@functools.lru_cache(maxsize=None)
def _unfolded_torch_output(per_head, centered):
    """The output of the unfolded bf16 layer of ``_fold_case(per_head, centered)`` served with the
    run-time rotation (--oscar-rotate-engine torch, fold off); computed once per case."""
    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT, rotate_engine="torch")
    x, rk, rv, mk, mv = _fold_case(per_head, centered, torch.bfloat16)
    out, _ = _serve_layer(Qwen3Attention(torch.bfloat16), x, config, rk, rv, mk, mv, frozenset(), torch.bfloat16)
    return out


# bf16 with the same cache contents: the folded output rounds o' to bf16 where the run-time path rounds
# o' R^T + mu, and o_proj's folded weights are W R rounded once to bf16: a few bf16 units (2^-8)
FOLD_BF16 = 1e-2


# three of the eight combinations: each axis is varied at least once, so the CPU suite stays short
@pytest.mark.parametrize("per_head, centered, rotate_engine", [
    (False, False, "triton"), (True, True, "triton"), (True, True, "torch")],
    ids=["per-layer-plain-triton", "per-head-centred-triton", "per-head-centred-torch"])
def test_folded_layer_matches_the_runtime_rotation(per_head, centered, rotate_engine):
    """--oscar-fold-rotations on, bf16: the fold (backend.step.fold_model on SGLang's own qkv_proj /
    o_proj) plus the backend's folded path (V written as projected, no output counter-rotation)
    give the unfolded layer's output, prefill and decode:

    * fed the V rows the run-time path writes (same cache), within bf16 rounding (FOLD_BF16);
    * fed its own folded projection, whose bf16 V rows differ from the run-time path's by bf16
      rounding and so flip a few INT2 codes: about as close to the fp32 computation of the same
      layer as the run-time path is (both differ from it by such flips, a few percent; torch engine).
    """
    import dataclasses

    from sglang_oscar.backend.step import fold_model
    from sglang_oscar.kernels.rotate import rotate_heads_reference

    config = dataclasses.replace(OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT),
                                 rotate_engine=rotate_engine)
    x, rk, rv, mk, mv = _fold_case(per_head, centered, torch.bfloat16)
    par = SimpleNamespace(attn_tp_rank=0, attn_tp_size=1)
    ref, m = Qwen3Attention(torch.bfloat16), Qwen3Attention(torch.bfloat16)
    assert fold_model(config, m, {0: (rk, rv)}, {0: (mk, mv)}, par) == (frozenset(), frozenset())  # off: nothing
    assert torch.equal(m.o_proj.weight, ref.o_proj.weight)
    folded, out_folded = fold_model(dataclasses.replace(config, fold_rotations=True), m, {0: (rk, rv)}, {0: (mk, mv)},
                                    par)
    assert folded == out_folded == frozenset({0})
    # same cache: V rotated as the torch engine's run-time path does it, one forward's rows at a time
    q, k, v = ref.qkv(x)
    v_rt = torch.cat([rotate_heads_reference(v[a:b], rv, torch.bfloat16, sub_mean=mv)
                      for a, b in [(0, 40)] + [(p, p + 1) for p in range(40, FOLD_T)]])
    same_cache, _ = _serve_layer(m, x, config, rk, rv, mk, mv, folded, torch.bfloat16, seq=(q, k, v_rt))
    # the unfolded layer served with run-time rotations (torch engine; shared by the cases of this input)
    want = _unfolded_torch_output(per_head, centered)
    assert _rel(same_cache, want) < FOLD_BF16, _rel(same_cache, want)
    if rotate_engine == "triton":
        return  # the end-to-end part below is the same arithmetic (torch: faster under the interpreter)
    # the folded projection end to end, against the fp32 served computation of the same (unfolded) layer;
    # the folded V carries one more bf16 rounding (of the folded weights R^T W), hence the factor 2
    got, sv = _serve_layer(m, x, config, rk, rv, mk, mv, folded, torch.bfloat16)
    truth, _ = _serve_layer(_fp32_twin(ref), x, config, rk, rv, mk, mv, frozenset(), torch.float32)
    runtime_err, folded_err = _rel(want, truth), _rel(got, truth)
    assert runtime_err < 0.1 and folded_err < 2 * runtime_err, (runtime_err, folded_err)
    # the folded pool holds the projected V rows as they came (cast only)
    from sglang_oscar.quant.int2 import quantize_rows
    _, _, vc, _, _, _ = sv.pool.int2_buffers(0)
    slots = sv.r2t[1, :FOLD_T].long()
    assert torch.equal(vc[slots], quantize_rows(m.qkv(x)[2], **config.quant_kwargs("v")).codes)


class Gemma4Attention(Qwen3Attention):
    """Named like SGLang's ``Gemma4Attention`` (``fold.OUTPUT_FOLDABLE_ATTENTION``: a v_norm between
    ``qkv_proj`` and the cache, so only ``o_proj`` folds)."""


@pytest.mark.parametrize("cls,per_head,centered", [
    (Qwen3Attention, False, False), (Qwen3Attention, False, True), (Qwen3Attention, True, False),
    (Qwen3Attention, True, True), (Gemma4Attention, True, False), (Gemma4Attention, True, True)],
    ids=["per-layer", "per-layer-centred", "per-head", "per-head-centred", "output-only", "output-only-centred"])
def test_folded_layer_in_fp32_is_exact(cls, per_head, centered):
    """In fp32 (model and HP windows fp32, --oscar-rotate-engine torch) the folded and unfolded layers
    agree to 1e-5: the fold is exact, only fp32 summation orders differ. Gemma-4's layers fold the
    output side only: qkv_proj untouched, V rotated at run time and written as the unfolded path
    writes it (the same cache, bit for bit), no output counter-rotation."""
    import dataclasses

    from sglang_oscar.backend.step import fold_model

    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT, rotate_engine="torch",
                         fold_rotations=True)
    x, rk, rv, mk, mv = _fold_case(per_head, centered, torch.float32)
    ref, m = cls(torch.float32), cls(torch.float32)
    folded, out_folded = fold_model(config, m, {0: (rk, rv)}, {0: (mk, mv)},
                                    SimpleNamespace(attn_tp_rank=0, attn_tp_size=1))
    output_only = cls is Gemma4Attention
    assert (folded, out_folded) == ((frozenset(), frozenset({0})) if output_only else (frozenset({0}),) * 2)
    assert torch.equal(m.qkv_proj.weight, ref.qkv_proj.weight) == output_only
    assert (m.o_proj.bias is not None) == centered  # the mean term
    unfolded = dataclasses.replace(config, fold_rotations=False)
    want, sw = _serve_layer(ref, x, unfolded, rk, rv, mk, mv, frozenset(), torch.float32, **SHORT)
    got, sg = _serve_layer(m, x, config, rk, rv, mk, mv, folded, torch.float32, output_folded=out_folded, **SHORT)
    assert _rel(got, want) < 1e-5, _rel(got, want)
    if output_only:
        assert all(torch.equal(a, b) for a, b in zip(sw.pool.int2_buffers(0), sg.pool.int2_buffers(0)))


def test_folded_output_plans_write_the_model_dtype(monkeypatch):
    """A layer whose o_proj took R_v gets plans that write the model (HP) dtype: prefill and decode
    outputs carry the bits of fp32 plans cast afterwards (the merge and the extend kernel round as
    the cast does), without the cast's launch; an unfolded layer's plans stay fp32."""
    from sglang_oscar.backend.triton_backend import OscarTritonAttnBackend

    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    x, rk, rv, mk, mv = _fold_case(True, False, torch.bfloat16)
    m = Qwen3Attention(torch.bfloat16)
    seq = m.qkv(x)

    def serve(output_folded):
        sv = Served(config, rk, rv, output_folded=output_folded)
        outs = [sv.extend(1, seq, 0, 20)] + [sv.decode(1, seq, p) for p in range(20, 23)]
        return outs, sv

    got, sv = serve({0})
    assert {p.out_dtype for p in sv.be._decode_plans.values()} == {torch.bfloat16}
    assert {p.out_dtype for p in sv.be._extend_plans.values()} == {torch.bfloat16}
    monkeypatch.setattr(OscarTritonAttnBackend, "_out_dtype", lambda self, geo: torch.float32)
    want, _ = serve({0})
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    monkeypatch.undo()
    _, plain = serve(set())
    assert {p.out_dtype for p in plain.be._decode_plans.values()} == {torch.float32}


def test_folded_layer_rotates_q_and_k_in_one_launch(monkeypatch):
    """With --oscar-rotate-engine triton a folded layer rotates q and K in one rotate_qkv launch of two
    products (v=None, IEEE fp32) and launches nothing for the output."""
    import dataclasses

    from sglang_oscar.backend import step
    from sglang_oscar.kernels import rotate as rotate_mod

    calls, picks = [], []
    for name in ("rotate_heads", "rotate_qkv"):
        real = getattr(step, name)
        monkeypatch.setattr(step, name, lambda *a, _n=name, _r=real, **k: calls.append((_n, a[2] is None,
                                                                                      k.get("precision"))) or _r(*a, **k))
    real_auto = rotate_mod.auto_block_n
    monkeypatch.setattr(rotate_mod, "auto_block_n", lambda *a, **k: picks.append(k.get("products", 1)) or real_auto(*a, **k))
    config = dataclasses.replace(OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT), fold_rotations=True)
    x, rk, rv, mk, mv = _fold_case(True, True, torch.bfloat16)
    sv = Served(config, rk, rv, mk=mk, mv=mv, folded=frozenset({0}))
    seq = Qwen3Attention(torch.bfloat16).qkv(x)
    sv.extend(1, seq, 0, SHORT["prefill"])
    sv.decode(1, seq, SHORT["prefill"])
    assert calls == [("rotate_qkv", True, None)] * 2 and picks == [2] * 2


class Fp8LinearMethod:
    """Stand-in for SGLang's FP8 linear method (its class name and an fp8 weight are what the fold checks)."""


def test_layer_kept_by_the_fold_uses_the_runtime_path(caplog):
    """A layer the fold keeps (fp8 qkv_proj stand-in) is reported in the log and served with the
    run-time rotation: the same output, bit for bit, as with --oscar-fold-rotations off."""
    from sglang_oscar.backend.step import fold_model

    config = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT, fold_rotations=True)
    x, rk, rv, mk, mv = _fold_case(True, True, torch.bfloat16)
    ref, m = Qwen3Attention(torch.bfloat16), Qwen3Attention(torch.bfloat16)
    m.qkv_proj.quant_method = Fp8LinearMethod()
    m.qkv_proj.weight = torch.nn.Parameter(m.qkv_proj.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    with caplog.at_level("INFO", logger="sglang_oscar"):
        folded, out_folded = fold_model(config, m, {0: (rk, rv)}, {0: (mk, mv)},
                                        SimpleNamespace(attn_tp_rank=0, attn_tp_size=1))
    assert folded == out_folded == frozenset()
    assert "layer 0: qkv_proj weights are float8_e4m3fn (Fp8LinearMethod): value rotation stays at run time" in caplog.text
    assert "folded into the weights of 0 layers, kept at run time in 1" in caplog.text
    assert torch.equal(m.o_proj.weight, ref.o_proj.weight) and m.o_proj.bias is None
    off = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)
    want, _ = _serve_layer(ref, x, off, rk, rv, mk, mv, frozenset(), torch.bfloat16, **SHORT)
    got, _ = _serve_layer(ref, x, config, rk, rv, mk, mv, folded, torch.bfloat16, **SHORT)
    assert torch.equal(got, want)
