"""int2 launch checks of hybrid sliding-window models: layers kept BF16 by --oscar-skip-layers (one
kind of SGLang's two pools, no rotation entry, no INT2 layout constraint), per-kind sizing, and
text-only Gemma-4 checkpoints that need SGLang's head remap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_oscar.config import OscarConfig
from sglang_oscar.rotation import RotationSet
from sglang_oscar.rotation.geometry import ModelGeometry
from test_preflight import _qwen3_dir


def test_skip_layers_must_be_one_kind_of_a_hybrid_pool_model():
    """--oscar-skip-layers: sliding / full / the ids of exactly one kind on a model SGLang serves with
    two pools (Gemma-4) are accepted; other ids, or any skip on a one-pool model (Gemma-3), are refused
    before weights load, naming what to pass instead."""
    from sglang_oscar.backend.rotations import model_geometry
    from sglang_oscar.plugin import skip_kind

    full = [5, 11]
    gemma4 = {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 12,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "global_head_dim": 256,
              "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 64, "hidden_size": 64,
              "layer_types": ["full_attention" if i in full else "sliding_attention" for i in range(12)]}
    geo = model_geometry(gemma4)

    def kind(spec, cfg=gemma4, g=geo):
        return skip_kind(OscarConfig(skip_layers=spec), g, cfg)

    assert (kind("none"), kind("sliding"), kind("full"), kind("11,5")) == ("none", "sliding", "full", "full")
    with pytest.raises(ValueError, match="must be all the sliding-window layers or all the full-attention.*10 sliding and 2 full"):
        kind("5")
    with pytest.raises(ValueError, match=r"names layers \[12\] that do not exist"):
        kind("5,12")
    gemma3 = {**gemma4, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
    with pytest.raises(ValueError, match="keeps all its layers in one SGLang KV pool.*pass none"):
        kind("sliding", gemma3, model_geometry(gemma3))
    with pytest.raises(ValueError, match="keeps all its layers in one SGLang KV pool.*pass none"):
        kind("0,1", gemma3, model_geometry(gemma3))  # ids on a one-pool model: the pool rule, not the kind rule
    qwen3 = {**gemma4, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}
    del qwen3["layer_types"], qwen3["sliding_window"]
    with pytest.raises(ValueError, match="has no sliding attention layers, so nothing would stay BF16"):
        kind("sliding", qwen3, model_geometry(qwen3))


def test_hybrid_swa_sizing_counts_int2_bytes_per_layer_kind():
    """HybridSWAPoolConfigurator after our hook: INT2 bytes per token of each kind in SGLang's formula
    full + ratio x sliding; the skipped kind at its BF16 row (SGLang seeded both at the int2 server's
    1-byte ``uint8`` element, half the BF16 sub-pool's real bytes)."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_oscar.plugin import serving

    gemma4 = {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 12,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "global_head_dim": 256,
              "num_global_key_value_heads": 1, "sliding_window": 64, "hidden_size": 64,
              "layer_types": ["full_attention" if i in (5, 11) else "sliding_attention" for i in range(12)]}

    def sized(skip):
        kvc = SimpleNamespace(
            server_args=SimpleNamespace(kv_cache_dtype="int2", _oscar_config=OscarConfig(group_size=64, skip_layers=skip)),
            model_dtype=torch.bfloat16,
            is_hybrid_swa_compress=True,
            model_config=SimpleNamespace(get_num_kv_heads=lambda tp: 1, head_dim=256, v_head_dim=256, swa_head_dim=128,
                                         swa_v_head_dim=128, hf_config=gemma4,
                                         hf_text_config=SimpleNamespace(swa_num_key_value_heads=2)))
        conf = SimpleNamespace(_full_layers_num=2, _swa_layers_num=10, _draft_full_layers_num=0,
                               _draft_swa_full_layers_num=0, _swa_full_tokens_ratio=0.5,
                               _full_per_token=1 * 512 * 1, _swa_per_token=2 * 256 * 1, _cell_size=None)
        with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
            serving.after_hybrid_swa_configurator_init(None, conf, kvc)
        return conf._full_per_token, conf._swa_per_token, conf._cell_size

    # full: 1 head x (2 x 64 code bytes + 2 x 4 groups x 2 fp16) = 160; sliding: 2 x (2 x 32 + 2 x 2 x 2 x 2) = 160
    assert sized("none") == (160, 160, 160 * 2 + 0.5 * 160 * 10)
    assert sized("sliding") == (160, 1024, 160 * 2 + 0.5 * 1024 * 10)
    assert sized("full") == (1024, 160, 1024 * 2 + 0.5 * 160 * 10)


def test_layers_kept_bf16_need_no_rotation_entry(hooked, tmp_path):
    """--oscar-skip-layers: a rotation file that covers only the INT2 layers passes the launch check
    (docs/format.md: layers kept BF16 need no entry); without the skip, or skipping the other kind,
    the same file is refused naming the missing layers."""
    import json

    full = [5, 11]
    gemma4 = {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 12,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "global_head_dim": 256,
              "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 64, "hidden_size": 64,
              "vocab_size": 128, "intermediate_size": 64,
              "layer_types": ["full_attention" if i in full else "sliding_attention" for i in range(12)]}
    model = tmp_path / "gemma4"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(gemma4))
    rs = RotationSet.data_free(ModelGeometry.from_hf_config(str(model)))
    rot = str(tmp_path / "full_only.safetensors")
    RotationSet({i: rs.k[i] for i in full}, {i: rs.v[i] for i in full}, dict(rs.metadata)).save(rot)

    def launch(skip):
        return hooked.preflight(SimpleNamespace(model_path=str(model),
                                                _oscar_config=OscarConfig(rotation_path=rot, skip_layers=skip)))

    assert launch("sliding") is None
    # SGLang's one-pool memory for every layer would silently serve the skipped kind INT2 too
    with pytest.raises(ValueError, match=r"--oscar-skip-layers sliding keeps one layer kind in the BF16 pool .* "
                                         r"--disable-hybrid-swa-memory turns off .*drop one of the two flags"):
        hooked.preflight(SimpleNamespace(model_path=str(model), disable_hybrid_swa_memory=True,
                                         _oscar_config=OscarConfig(rotation_path=rot, skip_layers="sliding")))
    for skip in ("none", "full"):
        with pytest.raises(ValueError, match=r"does not fit this model: .*missing \[0\.\.4, 6\.\.10\] \(10 layers\)") as err:
            launch(skip)
        # without a skip, the missing layers are exactly the sliding ones: the message names the flag
        assert ("pass --oscar-skip-layers sliding" in str(err.value)) == (skip == "none")
    # only where SGLang keeps two pools (the launch passes skip_hint): a one-pool model could not take the flag
    from sglang_oscar.backend.rotations import two_kv_pools
    from sglang_oscar.rotation.rotation_set import RotationError

    assert two_kv_pools(str(model)) and not two_kv_pools(_qwen3_dir(tmp_path, "one_pool"))
    with pytest.raises(RotationError) as err:
        RotationSet.load(rot).validate(ModelGeometry.from_hf_config(str(model)))
    assert "--oscar-skip-layers" not in str(err.value)


def test_text_only_gemma4_needs_the_head_remap_sglang_applies_to_the_multimodal_config(hooked, tmp_path):
    """A gemma4_text checkpoint (Gemma4ForCausalLM), whose full layers SGLang would build with the sliding
    head sizes and fail to load, is refused before weights load, naming the remap; the remapped config
    (the e2e harness's override) passes."""
    import json

    from sglang_oscar.plugin.refusals import gemma4_text_message, refusal_messages

    text = {"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 6,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "global_head_dim": 256,
            "num_global_key_value_heads": 1, "attention_k_eq_v": True, "sliding_window": 64,
            "layer_types": ["full_attention" if i == 5 else "sliding_attention" for i in range(6)]}
    model = tmp_path / "gemma4_text"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(text))
    (msg,) = refusal_messages(SimpleNamespace(model_path=str(model), tp_size=1))
    remap = '{"head_dim":256,"num_key_value_heads":1,"swa_head_dim":128,"swa_v_head_dim":128,"swa_num_key_value_heads":2}'
    assert "head_dim 128 / 2 kv heads" in msg and f"--json-model-override-args '{remap}'" in msg
    # the config SGLang serves with that override passes, and so do configs with nothing to remap
    assert gemma4_text_message({**text, **json.loads(remap)}) is None
    assert gemma4_text_message({**text, "global_head_dim": 128, "num_global_key_value_heads": 2}) is None
    assert gemma4_text_message({**text, "model_type": "gemma4"}) is None
    # and the geometry the launch check then reads is the one of the file written for config.json
    remapped = ModelGeometry.from_hf_config({**text, **json.loads(remap)})
    assert remapped.layers == ModelGeometry.from_hf_config(text).layers


def test_layers_kept_bf16_do_not_constrain_the_int2_layout(hooked, tmp_path):
    """A group size or the Gluon engine that only the BF16 (skipped) layers cannot take is accepted: the
    checks look at the INT2 layers only, and still refuse what those cannot take."""
    import json

    text = {"model_type": "gemma4_text", "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 128, "global_head_dim": 256, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
            "sliding_window": 64, "layer_types": ["full_attention" if i == 5 else "sliding_attention" for i in range(6)]}
    cfg = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text}
    model = tmp_path / "gemma4"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))

    def launch(**kw):
        return hooked.preflight(SimpleNamespace(model_path=str(model), _oscar_config=OscarConfig(**kw)))

    assert launch(group_size=256, skip_layers="sliding") is None  # only the 256-wide full layer is INT2
    with pytest.raises(ValueError, match=r"group-size 256 does not fit .*head_dims are \[128, 256\]"):
        launch(group_size=256)
    with pytest.raises(ValueError, match=r"group-size 256 does not fit .*head_dims \(INT2 layers\) are \[128\]"):
        launch(group_size=256, skip_layers="full")
    assert launch(decode_engine="gluon", skip_layers="full") is None  # the 128-wide sliding layers take Gluon
    with pytest.raises(ValueError, match="--oscar-decode-engine gluon cannot decode"):
        launch(decode_engine="gluon", skip_layers="sliding")
