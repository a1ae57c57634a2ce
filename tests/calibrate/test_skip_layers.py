"""``skip_layers`` in the offline reports: ``error`` and ``ppl`` give the layers the server keeps in
SGLang's BF16 cache the BF16 path, so a recipe with ``skip_layers`` is measured as it is served."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from calib_tiny import VOCAB, make_text
from sglang_oscar.calibrate import CalibrationError
from sglang_oscar.calibrate.error import format_report, functional_error
from sglang_oscar.calibrate.oracle import RotationCache, mha_output
from sglang_oscar.calibrate.ppl import perplexity
from sglang_oscar.calibrate.prompts import Documents, build_prompt_set
from sglang_oscar.config import OscarConfig
from sglang_oscar.rotation import RotationSet

SEQ = 48
CFG = OscarConfig(group_size=16, sink_tokens=2, recent_tokens=4)


@pytest.fixture(scope="module")
def gpt_oss():
    """A tiny GPT-OSS: layer 0 sliding (window 16, shorter than the prompts), layer 1 full, sinks."""
    import transformers as tf

    cfg = tf.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                          num_local_experts=2, num_experts_per_tok=1, max_position_embeddings=256)
    torch.manual_seed(0)
    model = tf.GptOssForCausalLM(cfg).eval()
    model.set_attn_implementation("eager")
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    return model


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return build_prompt_set(tokenizer, "mem", budget=2 * SEQ, seq_len=SEQ,
                            documents=Documents(make_text(10, 60, 3), "text", "mem", "0" * 64))


def test_error_gives_skipped_layers_the_bf16_floor(gpt_oss, prompts):
    """Skipping the sliding layer: its row is the BF16 floor for every method, the full layer's row
    is unchanged, and fewer key reads are INT2."""
    base = functional_error(gpt_oss, prompts, {}, CFG, progress=False)
    rep = functional_error(gpt_oss, prompts, {}, dataclasses.replace(CFG, skip_layers="sliding"), progress=False)
    assert rep["skipped_layers"] == [0] and base["skipped_layers"] == []
    floor = base["layers"]["0"]["bf16"]
    assert floor < base["layers"]["0"]["hadamard"] - 10.0  # INT2 is well above the floor there
    assert all(v == pytest.approx(floor, abs=1e-9) for v in rep["layers"]["0"].values())
    assert rep["layers"]["1"] == pytest.approx(base["layers"]["1"], abs=1e-9)
    assert 0.0 < rep["quantized_read_fraction"] < base["quantized_read_fraction"]
    assert rep["overall_db"]["hadamard"] < base["overall_db"]["hadamard"]
    assert "(BF16: skip_layers)" in format_report(rep).splitlines()[2]  # the row of layer 0


def test_ppl_runs_skipped_layers_through_the_bf16_cache(gpt_oss, prompts):
    """``skip_layers = full``: the INT2 run equals the oracle on layer 0 composed by hand with
    BF16-rounded K/V on layer 1 (the public pieces: ``output_fn``)."""
    cfg = dataclasses.replace(CFG, skip_layers="full")
    rep = perplexity(gpt_oss, prompts, None, cfg, progress=False)
    assert rep["skipped_layers"] == [1]
    from sglang_oscar.calibrate.model import geometry_of

    geometry = geometry_of(gpt_oss.config)
    had = RotationCache(RotationSet.data_free(geometry, "hadamard"))
    ident = RotationCache(RotationSet.data_free(geometry, "identity"))

    def by_hand(call, b):
        if call.layer_id == 1:
            dev = call.query.device
            return mha_output(call, b, ident.get(1, "k", dev), ident.get(1, "v", dev), CFG, "decode", quantize=False)
        return had.mha(call, b, CFG, "decode")

    ref = perplexity(gpt_oss, prompts, None, CFG, progress=False, output_fn=by_hand)
    full = perplexity(gpt_oss, prompts, None, CFG, progress=False)
    assert rep["int2"]["nll"] == pytest.approx(ref["int2"]["nll"], rel=1e-6)
    assert rep["bf16"]["nll"] == pytest.approx(full["bf16"]["nll"], rel=1e-9)
    assert rep["int2"]["nll"] != pytest.approx(full["int2"]["nll"], rel=1e-6)  # skipping layer 1 changed it
    assert rep["quantized_read_fraction"] < full["quantized_read_fraction"]


def test_output_functions_take_the_floor_on_skipped_layers_too(gpt_oss, prompts):
    """Every method, output functions included, is served BF16 on a skipped layer; without the
    baselines the floor still applies there; a rotation cannot take the floor's name."""
    def exact(call, b):
        return mha_output(call, b, None, None, CFG, "decode")

    cfg = dataclasses.replace(CFG, skip_layers="sliding")
    base = functional_error(gpt_oss, prompts, {}, CFG, progress=False, outputs={"exact": exact})
    assert base["layers"]["0"]["exact"] < -250.0  # exact vs exact: the -300 dB floor of _db
    rep = functional_error(gpt_oss, prompts, {}, cfg, progress=False, include_baselines=False, outputs={"exact": exact})
    assert rep["methods"] == ["exact"]
    assert rep["layers"]["0"]["exact"] == pytest.approx(base["layers"]["0"]["bf16"], abs=1e-9)
    assert rep["layers"]["1"]["exact"] < -250.0
    with pytest.raises(CalibrationError, match="rotation name 'bf16' is already a method"):
        functional_error(gpt_oss, prompts, {"bf16": RotationSet.data_free(rep_geometry(gpt_oss), "identity")}, CFG,
                         progress=False)


def test_oracle_keeps_the_attention_sinks(gpt_oss, prompts):
    """Exact attention through the oracle (no INT2, no rotation) reproduces the model's own eager
    attention, GPT-OSS's learned sinks included (dropping them moves the NLL by ~1e-3)."""
    def exact(call, b):
        assert call.sinks is not None
        return mha_output(call, b, None, None, CFG, "decode")

    rep = perplexity(gpt_oss, prompts, None, CFG, progress=False, output_fn=exact)
    assert rep["int2"]["nll"] == pytest.approx(rep["bf16"]["nll"], rel=2e-6)


def rep_geometry(model):
    from sglang_oscar.calibrate.model import geometry_of

    return geometry_of(model.config)


def test_skips_the_server_refuses(gpt_oss, prompts, tokenizer):
    with pytest.raises(CalibrationError, match=r"names layers \[7\] that do not exist"):
        functional_error(gpt_oss, prompts, {}, dataclasses.replace(CFG, skip_layers="1,7"), progress=False)
    with pytest.raises(CalibrationError, match="must be all the sliding-window layers or all the full-attention"):
        perplexity(gpt_oss, prompts, None, dataclasses.replace(CFG, skip_layers="0,1"), progress=False)
    from calib_tiny import build_model

    gemma3 = build_model("gemma3")  # sliding and full layers in one SGLang pool
    with pytest.raises(CalibrationError, match="keeps all its layers in one SGLang KV pool"):
        perplexity(gemma3, prompts, None, dataclasses.replace(CFG, skip_layers="sliding"), progress=False)
