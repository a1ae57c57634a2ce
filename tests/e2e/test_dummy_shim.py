"""The harness's scaled dummy weights (``tests.e2e.dummy_shim``), on CPU modules."""

from __future__ import annotations

import torch

from .dummy_shim import DUMMY_ENV, DUMMY_SHIM_TARGET, dummy_register, scaled_dummy_weights


def _model():
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.embed = torch.nn.Embedding(512, 256)
    m.q_proj = torch.nn.Linear(256, 512, bias=True)
    m.k_proj = torch.nn.Linear(256, 512, bias=False)
    m.input_layernorm = torch.nn.Module()
    m.input_layernorm.weight = torch.nn.Parameter(torch.zeros(256))
    m.fp8 = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float8_e4m3fn), requires_grad=False)
    return m


def test_scaled_dummy_weights_keep_unit_scale_and_differ_by_name():
    """Norm weights 1, matrices N(0, 1/fan_in) (a unit input keeps its scale), 1-D params small,
    same-shape matrices of other names different, a second init the same, FP8 left alone."""
    a, b = _model(), _model()
    with torch.no_grad():
        scaled_dummy_weights(a)
        scaled_dummy_weights(b)
    assert torch.equal(a.input_layernorm.weight, torch.ones(256))
    for w in (a.q_proj.weight, a.k_proj.weight):
        assert abs(float(w.std()) * 256 ** 0.5 - 1.0) < 0.02 and abs(float(w.mean())) < 0.01
    assert 0 < float(a.q_proj.bias.abs().max()) <= 1e-3
    assert not torch.equal(a.q_proj.weight, a.k_proj.weight)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not a.fp8.float().any()
    y = a.q_proj(torch.randn(64, 256, generator=torch.Generator().manual_seed(1)))
    assert 0.9 < float(y.std()) < 1.1


def test_dummy_shim_registers_only_when_asked(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(HookRegistry, "_hooks", {})
    monkeypatch.delenv(DUMMY_ENV, raising=False)
    dummy_register()
    assert DUMMY_SHIM_TARGET not in HookRegistry._hooks
    monkeypatch.setenv(DUMMY_ENV, "1")
    monkeypatch.setattr(HookRegistry, "register", lambda target, hook, kind: HookRegistry._hooks.setdefault(
        target, []).append((target, hook, kind)))
    dummy_register()
    dummy_register()  # idempotent
    assert len(HookRegistry._hooks[DUMMY_SHIM_TARGET]) == 1


def test_the_hook_completes_kimi_linear_after_the_draw():
    """The AROUND hook draws SGLang's weights, rescales them, and runs Kimi-Linear's weight-free
    ``load_weights([])`` (which derives w_kc / w_vc); a norm bias is not a norm weight."""
    from .dummy_shim import _around_dummy_init

    calls = []

    class KimiLinearForCausalLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.o_norm = torch.nn.LayerNorm(8)

        def load_weights(self, weights):
            calls.append(list(weights))

    model = KimiLinearForCausalLM()
    _around_dummy_init(lambda m: calls.append("sglang"), model)
    assert calls == ["sglang", []]
    assert torch.equal(model.o_norm.weight, torch.ones(8)) and float(model.o_norm.bias.abs().max()) <= 1e-3


def test_every_norm_scales_by_one_gemma_style_ones_included(monkeypatch):
    """SGLang's Gemma-style norms (``1 + weight``: GemmaRMSNorm, Gemma3RMSNorm, MiniMax-M3's per-head
    MultiHeadRMSNorm with ``apply_layernorm_1p``) and plain ones (1-D, and the 2-D weight of a
    ``multi_head`` MultiHeadRMSNorm) all return ``x / rms(x)`` after the shim; GemmaRMSNorm's precomputed ``1 + weight`` is 1."""
    import types

    import sglang.srt.models.minimax_m3 as m3
    from sglang.srt.layers.layernorm import Gemma3RMSNorm, GemmaRMSNorm, RMSNorm

    monkeypatch.setattr(m3, "get_parallel", lambda: types.SimpleNamespace(attn_tp_size=1, attn_tp_rank=0))
    model = torch.nn.Module()
    model.input_layernorm = GemmaRMSNorm(128)
    model.post_attention_layernorm = Gemma3RMSNorm(128)
    model.q_norm = m3.MultiHeadRMSNorm(1, 128, apply_layernorm_1p=True)
    model.k_norm = m3.MultiHeadRMSNorm(1, 128, apply_layernorm_1p=False)
    model.norm = RMSNorm(128)
    with torch.no_grad():
        for p in model.parameters():  # a loaded checkpoint's non-neutral values: the shim must reset them
            p.fill_(0.5)
        model.input_layernorm.gemma_weight.fill_(1.5)
        scaled_dummy_weights(model)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    unit = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    for name in ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "norm"):
        norm = getattr(model, name)
        y = norm(x) if isinstance(norm, m3.MultiHeadRMSNorm) else norm.forward_native(x)
        torch.testing.assert_close(y, unit, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(model.input_layernorm.gemma_weight, torch.ones(128))
