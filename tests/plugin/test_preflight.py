"""int2 launch checks that run before any weights load, and the sizing / radix-cap hooks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _support.server_args import int2_server_args
from sglang_oscar.config import OscarConfig
from sglang_oscar.plugin import flags
from sglang_oscar.pool.sizing import (
    DEFAULT_MAX_RUNNING_REQUESTS,
    SINK_ROWS_PER_REQUEST,
    hp_row_bytes,
    int2_cell_size,
    plan_windows,
)
from sglang_oscar.rotation import RotationSet
from sglang_oscar.rotation.geometry import ModelGeometry


def _qwen3_dir(tmp_path, name, layers=2, kv=2, head_dim=128):
    from transformers import Qwen3Config

    d = tmp_path / name
    Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=kv, head_dim=head_dim,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(d)
    return str(d)


def test_good_launch_passes_and_defaults_to_triton(hooked, tmp_path, monkeypatch):
    model = _qwen3_dir(tmp_path, "m")
    rot = str(tmp_path / "rot.safetensors")
    RotationSet.data_free(ModelGeometry.from_hf_config(model)).save(rot)
    sa = int2_server_args(model, monkeypatch, rotation_path=rot)
    assert sa.attention_backend == "triton"


@pytest.mark.parametrize("case,match", [
    ("other_layers", r"--oscar-rotation .* does not fit this model"),
    ("other_heads", r"--oscar-rotation .* does not fit this model"),
    ("missing", r"--oscar-rotation \(or its environment alias SGLANG_OSCAR_K_ROTATION_PATH\): .*does not exist"),
    ("group", r"--kv-cache-quant-group-size 48"),
    ("truncated", r"--oscar-rotation .*rot\.safetensors: .*not a readable safetensors rotation file.*sglang-oscar validate"),
    ("empty_dir", r"--oscar-rotation .*empty: .*sglang-oscar validate"),
])
def test_bad_input_stops_the_launch_with_a_named_fix(hooked, tmp_path, monkeypatch, case, match):
    model = _qwen3_dir(tmp_path, "m")
    rot = str(tmp_path / "rot.safetensors")
    cfg = {}
    if case == "other_layers":
        RotationSet.data_free(ModelGeometry.from_hf_config(_qwen3_dir(tmp_path, "o", layers=3))).save(rot)
        cfg["rotation_path"] = rot
    elif case == "other_heads":
        geo = ModelGeometry.from_hf_config(_qwen3_dir(tmp_path, "o", kv=1))
        rs = RotationSet.data_free(geo)
        per_head = RotationSet({i: r.expand(1, 128, 128).clone() for i, r in rs.k.items()},
                               {i: r.expand(1, 128, 128).clone() for i, r in rs.v.items()}, dict(rs.metadata))
        per_head.save(rot)
        cfg["rotation_path"] = rot
    elif case == "missing":
        cfg["rotation_path"] = str(tmp_path / "nope.safetensors")
    elif case == "truncated":
        RotationSet.data_free(ModelGeometry.from_hf_config(model)).save(rot)
        with open(rot, "rb") as f:
            head = f.read(200)
        with open(rot, "wb") as f:
            f.write(head)
        cfg["rotation_path"] = rot
    elif case == "empty_dir":
        (tmp_path / "empty").mkdir()
        cfg["rotation_path"] = str(tmp_path / "empty")
    else:
        cfg["group_size"] = 48
    with pytest.raises(ValueError, match=match):
        int2_server_args(model, monkeypatch, **cfg)


def test_unsupported_flags_are_refused(hooked, tmp_path, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    model = _qwen3_dir(tmp_path, "m")
    monkeypatch.setenv(flags.CONFIG_ENV, flags.config_to_env(OscarConfig()))
    with pytest.raises(ValueError, match="--enable-mixed-chunk"):
        ServerArgs(model_path=model, kv_cache_dtype="int2", skip_tokenizer_init=True, device="cuda", enable_mixed_chunk=True)
    with pytest.raises(ValueError, match="--attention-backend 'flashinfer'"):
        ServerArgs(model_path=model, kv_cache_dtype="int2", skip_tokenizer_init=True, device="cuda",
                   attention_backend="flashinfer")


def test_cell_size_and_window_plan():
    cfg = OscarConfig(group_size=128)
    # Qwen3-8B geometry: 36 layers, 8 kv heads, D = 128: 72 B per kv head and layer (BF16: 512)
    assert int2_cell_size(cfg, 8, 128, 128, 36) == 36 * 8 * 72
    assert int2_cell_size(OscarConfig(group_size=32), 8, 128, 128, 1) == 8 * 2 * (32 + 4 * 4)
    row = hp_row_bytes(8, 128, 128, 36, torch.bfloat16)
    assert row == 36 * 8 * 256 * 2
    per_req = row * (256 + SINK_ROWS_PER_REQUEST * 64)
    # plenty of memory: default request bound, windows for bound + slot 0
    plan = plan_windows(OscarConfig(), 400 * per_req * 4, row, None)
    assert plan.max_running_requests == DEFAULT_MAX_RUNNING_REQUESTS
    assert plan.window_bytes == per_req * (DEFAULT_MAX_RUNNING_REQUESTS + 1)
    assert plan.int2_budget == 400 * per_req * 4 - plan.window_bytes
    # a user bound that does not fit in a quarter of the budget is reduced, and says so
    plan = plan_windows(OscarConfig(), 40 * per_req, row, 64)
    assert plan.max_running_requests == 10 and plan.reduced_from == 64
    with pytest.raises(ValueError, match="--oscar-recent-tokens"):
        plan_windows(OscarConfig(), per_req, row, None)


def test_cell_size_hook_and_radix_cap(hooked):
    from sglang.srt.runtime_context import get_parallel

    from sglang_oscar.plugin import serving

    kvc = SimpleNamespace(
        server_args=SimpleNamespace(kv_cache_dtype="int2", _oscar_config=OscarConfig(group_size=64)),
        model_config=SimpleNamespace(get_num_kv_heads=lambda tp: 8 // tp, head_dim=128, v_head_dim=128),
        use_mla_backend=False)
    with get_parallel().override(attn_tp_size=2, attn_tp_rank=0):
        got = serving.around_compute_cell_size(lambda *a: -1, None, kvc, 10)
    assert got == 10 * 4 * 2 * (32 + 2 * 2 * 2)
    # MLA (DeepSeek-V3 latent 512 + k_pe 64): codes 128 + 8 fp16 pairs 32 + BF16 k_pe 128 per layer
    mla = SimpleNamespace(server_args=kvc.server_args, use_mla_backend=True, model_dtype=torch.bfloat16,
                          model_config=SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64,
                                                       hf_config={"architectures": ["DeepseekV3ForCausalLM"]}))
    assert serving.around_compute_cell_size(lambda *a: -1, None, mla, 10) == 10 * (128 + 32 + 128)  # no DSA indexer
    kvc.server_args.kv_cache_dtype = "auto"
    assert serving.around_compute_cell_size(lambda *a: -1, None, kvc, 10) == -1
    # radix cap: only while an INT2 pool is active in this process
    old = serving._ACTIVE["recent"]
    try:
        serving._ACTIVE["recent"] = None
        assert serving.around_compute_max_prefix_len(lambda self, n: n - 1, None, 1000) == 999
        serving._ACTIVE["recent"] = 256
        assert serving.around_compute_max_prefix_len(lambda self, n: n - 1, None, 1000) == 744
        assert serving.around_compute_max_prefix_len(lambda self, n: n - 1, None, 100) == 0
    finally:
        serving._ACTIVE["recent"] = old


def test_gluon_engine_outside_its_scope_is_refused_at_launch(hooked, tmp_path, monkeypatch):
    """--oscar-decode-engine gluon with Lloyd-Max levels, head_dim 64 or fine groups: refused before any
    weights load, with the reason and the fix; auto (the default) launches."""
    model = _qwen3_dir(tmp_path, "m")
    for cfg, why in ((dict(quantizer="lloyd-max"), "Lloyd-Max levels"),
                     (dict(group_size=32), "more than one \\(scale, zero\\) group per row")):
        with pytest.raises(ValueError, match=f"--oscar-decode-engine gluon cannot decode .*{why}.*auto"):
            int2_server_args(model, monkeypatch, decode_engine="gluon", **cfg)
    with pytest.raises(ValueError, match="head_dim 64/64"):
        int2_server_args(_qwen3_dir(tmp_path, "m64", head_dim=64), monkeypatch, decode_engine="gluon")
    int2_server_args(model, monkeypatch, decode_engine="gluon")
    int2_server_args(model, monkeypatch, quantizer="lloyd-max")


def test_cli_flags_reach_the_preflight(hooked, tmp_path, monkeypatch):
    """The flags are resolved before ServerArgs runs __post_init__ (where the preflight runs)."""
    from sglang.srt.server_args import prepare_server_args

    model = _qwen3_dir(tmp_path, "m")
    monkeypatch.delenv(flags.CONFIG_ENV, raising=False)
    missing = str(tmp_path / "no_such_rotation.safetensors")
    with pytest.raises(ValueError, match="no_such_rotation.safetensors does not exist"):
        prepare_server_args(["--model-path", model, "--kv-cache-dtype", "int2", "--skip-tokenizer-init",
                             "--device", "cuda", "--oscar-rotation", missing])
    with pytest.raises(ValueError, match="--kv-cache-quant-group-size 48"):
        prepare_server_args(["--model-path", model, "--kv-cache-dtype", "int2", "--skip-tokenizer-init",
                             "--device", "cuda", "--kv-cache-quant-group-size", "48"])
    sa = prepare_server_args(["--model-path", model, "--kv-cache-dtype", "int2", "--skip-tokenizer-init",
                              "--device", "cuda", "--oscar-sink-tokens", "16"])
    assert sa._oscar_config.sink_tokens == 16 and flags.config_from_env().sink_tokens == 16


def test_rank_rotations_follow_sglang_kv_head_sharding():
    from sglang_oscar.backend.rotations import rank_rotations

    def per_head_set(layers, heads, d=8):
        k = {i: torch.stack([torch.eye(d) * (10 * i + h + 1) for h in range(heads)]) for i in range(layers)}
        v = {i: -t for i, t in k.items()}
        return RotationSet(k, v, {"method": "test"})

    geo = lambda heads: SimpleNamespace(layers=[SimpleNamespace(layer_id=i, num_kv_heads=heads) for i in range(2)])
    # 4 kv heads over TP 2: rank 1 owns global heads 2, 3
    out = rank_rotations(per_head_set(2, 4), geo(4), 1, 2, "cpu", [0, 1])
    rk, rv = out[1]
    assert rk.shape == (2, 8, 8) and [float(rk[j, 0, 0]) for j in range(2)] == [13.0, 14.0]
    assert torch.equal(rv, -rk)
    # 2 kv heads over TP 4 (replicated): rank 3 owns global head 3 * 2 // 4 = 1
    rk, _ = rank_rotations(per_head_set(2, 2), geo(2), 3, 4, "cpu", [0])[0]
    assert rk.shape == (1, 8, 8) and float(rk[0, 0, 0]) == 2.0
    # a per-layer set is broadcast to the local heads
    rs = RotationSet({0: torch.eye(8) * 3}, {0: torch.eye(8)}, {"method": "test"})
    rk, _ = rank_rotations(rs, SimpleNamespace(layers=[SimpleNamespace(layer_id=0, num_kv_heads=8)]), 0, 2, "cpu", [0])[0]
    assert rk.shape == (4, 8, 8) and bool((rk[:, 0, 0] == 3).all())


def test_rank_rotations_of_a_two_geometry_model_at_tp2():
    """Gemma-4-like at TP 2: a sliding layer's 8 kv heads (head_dim 16) are split 4 / 4, the full
    layer's one kv head (head_dim 32) is replicated: both ranks get that same head whole."""
    from sglang_oscar.backend.rotations import rank_rotations

    k = {0: torch.stack([torch.eye(16) * (h + 1) for h in range(8)]), 1: torch.eye(32).unsqueeze(0) * 9}
    rs = RotationSet(k, {i: -t for i, t in k.items()}, {"method": "test"})
    geo = SimpleNamespace(layers=[SimpleNamespace(layer_id=0, num_kv_heads=8), SimpleNamespace(layer_id=1, num_kv_heads=1)])
    ranks = [rank_rotations(rs, geo, r, 2, "cpu", [0, 1]) for r in (0, 1)]
    for r, out in enumerate(ranks):
        rk, rv = out[0]
        assert rk.shape == (4, 16, 16) and [float(rk[j, 0, 0]) for j in range(4)] == [4 * r + j + 1 for j in range(4)]
        assert torch.equal(rv, -rk)
        assert out[1][0].shape == (1, 32, 32) and float(out[1][0][0, 0, 0]) == 9.0
    assert torch.equal(ranks[0][1][0], ranks[1][1][0])


def test_models_the_int2_server_cannot_serve_are_refused_from_the_config(hooked, tmp_path, monkeypatch):
    from transformers import Gemma3TextConfig, GptOssConfig, Qwen3Config

    # sliding-window + full layers (Gemma-3) are served: the preflight passes
    gemma = tmp_path / "gemma3"
    Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=128, sliding_window=64,
                     architectures=["Gemma3ForCausalLM"]).save_pretrained(gemma)
    assert int2_server_args(str(gemma), monkeypatch).kv_cache_dtype == "int2"
    # linear-attention hybrids (Qwen3-Next / Qwen3.5) are served: their attention layers in INT2
    from transformers import Qwen3NextConfig

    nxt = tmp_path / "qwen3_next"
    Qwen3NextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, num_experts=4, architectures=["Qwen3NextForCausalLM"]
                    ).save_pretrained(nxt)
    from sglang_oscar.backend.rotations import model_geometry, served_rotation_set

    # (SGLang's own ServerArgs needs a GPU for this architecture: check the preflight's rotation set)
    geo = model_geometry(str(nxt))
    assert served_rotation_set(OscarConfig(), geo, log=False, hf_config=str(nxt)).validate(geo) is None
    # learned attention sinks (GPT-OSS) are served, but not with a centred rotation (the sink logit is
    # not shifted by the key mean): that file is refused, naming the layers and the fix
    oss = tmp_path / "gpt_oss"
    GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, sliding_window=32, num_local_experts=4,
                 architectures=["GptOssForCausalLM"]).save_pretrained(oss)
    assert int2_server_args(str(oss), monkeypatch).kv_cache_dtype == "int2"
    rs = RotationSet.data_free(ModelGeometry.from_hf_config(str(oss)))
    rs.k_mean = {i: torch.zeros(2, 64) for i in (0, 1)}
    rs.v_mean = {i: torch.zeros(2, 64) for i in (0, 1)}
    centred = str(tmp_path / "centred.safetensors")
    rs.save(centred)
    with pytest.raises(ValueError, match=r"layers \[0, 1\] have attention-sink logits.*refit the rotation without --center"):
        int2_server_args(str(oss), monkeypatch, rotation_path=centred)
    # KV-shared layers (Gemma-3n / small Gemma-4: k is None in the last layers) are refused too
    shared = tmp_path / "kv_shared"
    cfg = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=128, sliding_window=64,
                           architectures=["Gemma3ForCausalLM"])
    cfg.num_kv_shared_layers = 2
    cfg.save_pretrained(shared)
    with pytest.raises(ValueError, match="KV-shared layers yet .*the last 2 layers"):
        int2_server_args(str(shared), monkeypatch)
    small = tmp_path / "hd32"
    Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, architectures=["Qwen3ForCausalLM"]).save_pretrained(small)
    with pytest.raises(ValueError, match="head_dim=32 is not supported by the INT2 kernels"):
        int2_server_args(str(small), monkeypatch)


def test_rotation_env_aliases_are_consistent():
    with pytest.raises(ValueError, match="need both"):
        flags.resolve_config({}, environ={"SGLANG_OSCAR_K_ROTATION_PATH": "/a/k.pt"})
    cfg, _ = flags.resolve_config({}, environ={"SGLANG_OSCAR_K_ROTATION_PATH": "/a/rot.safetensors"})
    assert cfg.rotation_path == "/a/rot.safetensors" and cfg.rotation_v_path is None
    with pytest.raises(ValueError, match="is not an upstream K .pt file"):
        flags.resolve_config({}, environ={"SGLANG_OSCAR_K_ROTATION_PATH": "/a/dir", "SGLANG_OSCAR_V_ROTATION_PATH": "/a/dir"})
    with pytest.raises(ValueError, match="is not an upstream K .pt file"):
        flags.resolve_config({}, environ={"SGLANG_OSCAR_V_ROTATION_PATH": "/a/v.pt"})


def test_invalid_settings_name_the_flag_or_alias_that_set_them():
    """An OscarConfig error names the fields in its own terms; the message adds where each value came from."""
    with pytest.raises(ValueError, match=r"got 1\.5 \(INT2 settings given: --oscar-k-clip-ratio 1\.5\)"):
        flags.resolve_config({"oscar_k_clip_ratio": 1.5}, {})
    with pytest.raises(ValueError, match=r"SGLANG_MIXED_KV_PREFIX_TOKENS=-1 \(alias of --oscar-sink-tokens\)"):
        flags.resolve_config({}, {"SGLANG_MIXED_KV_PREFIX_TOKENS": "-1"})


def test_key_means_on_a_soft_capped_model_are_refused_at_launch(hooked, tmp_path, monkeypatch):
    """A rotation file with key means (fit --center) launches on a model without a logit cap and is
    refused, naming the fix, on one whose config soft-caps the attention logits."""
    import json

    model = _qwen3_dir(tmp_path, "m")
    geo = ModelGeometry.from_hf_config(model)
    base = RotationSet.data_free(geo)
    means = {i: torch.randn(2, 128) for i in base.layer_ids}
    rot = str(tmp_path / "rot.safetensors")
    RotationSet(base.k, base.v, dict(base.metadata), k_mean=means, v_mean=means).save(rot)
    assert int2_server_args(model, monkeypatch, rotation_path=rot).attention_backend == "triton"
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["attn_logit_softcapping"] = 50.0
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"centres the keys/values \(k_mean / v_mean\) but this model caps .*"
                                         r"attn_logit_softcapping 50.*without --center"):
        int2_server_args(model, monkeypatch, rotation_path=rot)
    # value means alone commute with the cap
    RotationSet(base.k, base.v, dict(base.metadata), v_mean=means).save(rot)
    assert int2_server_args(model, monkeypatch, rotation_path=rot).attention_backend == "triton"


def _minimax_m2_dir(tmp_path, fp8=True):
    """A tiny MiniMax-M2 config with the real expert width (1536) and block-FP8 quantization."""
    import json

    d = tmp_path / "minimax_m2"
    d.mkdir(exist_ok=True)
    cfg = {"model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "vocab_size": 128,
           "hidden_size": 64, "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 48,
           "num_key_value_heads": 8, "head_dim": 128, "rotary_dim": 64, "num_local_experts": 8,
           "num_experts_per_tok": 2, "use_qk_norm": True, "qk_norm_type": "per_layer"}
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_minimax_tp_split_of_block_fp8_experts_is_refused(tmp_path):
    """MiniMax-M2's experts are 1536 wide in 128x128 FP8 blocks: tp / ep must leave whole blocks per
    rank (1536/8 = 192 is not), and attention must split (48 q / 8 kv heads). Refused with --tp and
    the sizes that work, before any weights load."""
    from sglang_oscar.plugin.refusals import minimax_tp_message, refusal_messages

    model = _minimax_m2_dir(tmp_path)
    sa = lambda tp, ep=1: SimpleNamespace(model_path=model, tp_size=tp, ep_size=ep, moe_dp_size=1)  # noqa: E731
    for tp, ep in ((1, 1), (2, 1), (4, 1), (8, 2), (8, 8)):
        assert refusal_messages(sa(tp, ep)) == [], (tp, ep)
    (msg,) = refusal_messages(sa(8))
    assert msg.startswith("--tp 8 does not fit this MiniMax checkpoint") and "1536/8 = 192" in msg
    assert "multiple of 128" in msg and "Use --tp 1 / 2 / 4 without expert parallelism" in msg
    assert "with --tp 8 add --ep 2 / 4 / 8" in msg
    (msg,) = refusal_messages(sa(16))
    assert "1536/16 = 96" in msg and "add --ep 4 / 8 / 16" in msg
    # BF16 weights: no blocks to align; other models and Hub ids: not this rule's business
    (tmp_path / "bf16").mkdir()
    assert refusal_messages(SimpleNamespace(model_path=_minimax_m2_dir(tmp_path / "bf16", fp8=False), tp_size=8)) == []
    assert refusal_messages(SimpleNamespace(model_path="MiniMaxAI/MiniMax-M2", tp_size=8)) == []
    assert minimax_tp_message({"architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 1536,
                               "quantization_config": {"weight_block_size": [128, 128]}}, 8) is None


def test_minimax_tp_refusal_stops_the_launch(hooked, tmp_path, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    model = _minimax_m2_dir(tmp_path)
    monkeypatch.setenv(flags.CONFIG_ENV, flags.config_to_env(OscarConfig()))
    with pytest.raises(ValueError, match=r"--tp 8 does not fit this MiniMax checkpoint.*--tp 1 / 2 / 4"):
        ServerArgs(model_path=model, kv_cache_dtype="int2", skip_tokenizer_init=True, device="cuda", tp_size=8)


def test_minimax_m3_sparse_attention_is_served_from_the_config(tmp_path, monkeypatch):
    """MiniMax-M3's sparse layers are served (INT2 main K/V, SGLang's BF16 index pools and indexer:
    test_minimax_sparse*.py), so its config alone is no longer refused; what the INT2 path cannot
    honour is (here: SGLang's dense sparse decode env), naming the fix."""
    import json

    from sglang_oscar.plugin.refusals import refusal_messages

    d = tmp_path / "m3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
        "text_config": {"model_type": "minimax_m2", "num_hidden_layers": 2, "num_attention_heads": 64,
                        "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 3072}}))
    monkeypatch.delenv("SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE", raising=False)
    assert refusal_messages(SimpleNamespace(model_path=str(d), tp_size=8)) == []
    monkeypatch.setenv("SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE", "1")
    (msg,) = refusal_messages(SimpleNamespace(model_path=str(d), tp_size=8))
    assert "MiniMax-M3 with SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE=1" in msg and "unset" in msg


def test_preflight_checks_the_config_sglang_serves(hooked, tmp_path, monkeypatch):
    """The launch check reads the config SGLang serves: with --json-model-override-args the overridden
    one (a per-head file for config.json's 2 kv heads is refused when the override leaves 1, before any
    weights load, not by the backend after), and for a Hub id the whole config, so a multimodal
    Gemma-4 wrapper keeps its architecture and --oscar-skip-layers sliding is accepted as on a local copy."""
    import json

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs

    model = _qwen3_dir(tmp_path, "m")
    rs = RotationSet.data_free(ModelGeometry.from_hf_config(model))
    rot = str(tmp_path / "per_head.safetensors")
    RotationSet({i: r.expand(2, 128, 128).clone() for i, r in rs.k.items()},
                {i: r.expand(2, 128, 128).clone() for i, r in rs.v.items()}, dict(rs.metadata)).save(rot)
    monkeypatch.setenv(flags.CONFIG_ENV, flags.config_to_env(OscarConfig(rotation_path=rot)))
    launch = dict(model_path=model, kv_cache_dtype="int2", skip_tokenizer_init=True, device="cuda")
    assert ServerArgs(**launch).kv_cache_dtype == "int2"
    with pytest.raises(ValueError, match=r"does not fit this model: .*expected .*\(1, 128, 128\) \(per kv head\)"):
        ServerArgs(**launch, json_model_override_args=json.dumps({"num_key_value_heads": 1}))

    text = dict(model_type="gemma4_text", vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=128, global_head_dim=256,
                num_global_key_value_heads=1, sliding_window=64, attention_k_eq_v=True,
                layer_types=["full_attention" if i == 5 else "sliding_attention" for i in range(6)])
    local = tmp_path / "gemma4"
    local.mkdir()
    (local / "config.json").write_text(json.dumps(dict(model_type="gemma4", text_config=text,
                                                       architectures=["Gemma4ForConditionalGeneration"])))
    monkeypatch.setattr(ModelConfig, "from_server_args", staticmethod(lambda server_args, **kw: ModelConfig(str(local))))
    for path in (str(local), "google/gemma-4-hub-id"):
        assert hooked.preflight(SimpleNamespace(model_path=path, _oscar_config=OscarConfig(skip_layers="sliding"))) is None


def test_a_file_fitted_for_another_network_is_refused(hooked, tmp_path, monkeypatch, caplog):
    """A fitted file records its model (``model_fingerprint``); one of another network with the same
    attention geometry (here hidden size 128 vs 64, as Qwen3-4B's file on Qwen3-8B) passes every shape
    check, so the launch compares the recorded sizes. Another name or vocabulary only logs; data-free
    files (no statistics) are not compared."""
    import logging

    from sglang_oscar.calibrate.model import config_fingerprint
    from sglang_oscar.rotation.geometry import _as_dict

    model = _qwen3_dir(tmp_path, "m")
    base = RotationSet.data_free(ModelGeometry.from_hf_config(model))
    served = config_fingerprint(_as_dict(model), "Qwen/Qwen3-8B")

    def launch(method, **recorded):
        rot = str(tmp_path / f"{method}-{len(recorded)}.safetensors")
        RotationSet(base.k, base.v, {"method": method, "model_fingerprint": {**served, **recorded}}).save(rot)
        return int2_server_args(model, monkeypatch, rotation_path=rot)

    with pytest.raises(ValueError, match=r"was fitted for another model \(hidden_size: 128 vs 64; recorded vs served"
                                         r"\).*compute_rotation\.sh.*drop the flag"):
        launch("oscar", hidden_size=128)
    with caplog.at_level(logging.WARNING, logger="sglang_oscar"):
        assert launch("oscar", name="qwen3-8b-instruct", vocab_size=256).kv_cache_dtype == "int2"
    assert "records another model type, name or vocabulary" in caplog.text
    assert launch("hadamard", hidden_size=128).kv_cache_dtype == "int2"  # data-free: the geometry is all it needs


def test_windows_past_the_context_are_refused_before_weights_load(hooked, tmp_path, monkeypatch):
    """sink + recent above the context SGLang derived (here max_position_embeddings 4096) would reserve BF16
    rows no request fills: refused at launch; equal to it passes (a window covering everything is allowed)."""
    from transformers import Qwen3Config

    d = tmp_path / "ctx"
    Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(d)
    assert int2_server_args(str(d), monkeypatch, sink_tokens=64, recent_tokens=4032).kv_cache_dtype == "int2"
    with pytest.raises(ValueError, match=r"--oscar-sink-tokens 64 \+ --oscar-recent-tokens 4033 exceed the model's "
                                         r"context of 4096 tokens.*lower them"):
        int2_server_args(str(d), monkeypatch, sink_tokens=64, recent_tokens=4033)
