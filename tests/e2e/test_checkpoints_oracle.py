"""CPU tests of the device harness (``tests/e2e``): tiny checkpoints, rotation files and the oracle
references."""

from __future__ import annotations

import json
import os

import pytest
import torch

from . import checkpoints, client, config, oracle
from .tiny import TINY

# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_builder_is_seeded_and_loadable(tiny_qwen3, tmp_path):
    from safetensors.torch import load_file

    path, info = tiny_qwen3
    assert not info["reused"] and info["config"]["head_dim"] == 32
    assert info["sharpen"]["logit_std"] == pytest.approx(0.5, rel=0.05)
    assert info["sharpen"]["score_std"] == pytest.approx(1.5, rel=0.35)  # one gain for all layers
    again = checkpoints.build_checkpoint("qwen3", path, seed=3, **TINY)
    assert again["reused"]
    other = str(tmp_path / "same_seed")
    checkpoints.build_checkpoint("qwen3", other, seed=3, **TINY)
    a, b = load_file(os.path.join(path, "model.safetensors")), load_file(os.path.join(other, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    diff = str(tmp_path / "seed4")
    checkpoints.build_checkpoint("qwen3", diff, seed=4, **TINY)
    c = load_file(os.path.join(diff, "model.safetensors"))
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    model = checkpoints.load_hf(path, "cpu")
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.num_key_value_heads == 2
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["dtype"] == "bfloat16" and cfg["head_dim"] == 32 and cfg["vocab_size"] == 256


@pytest.mark.parametrize("name,cls", [("moe", "Qwen3MoeForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_other_families_build_and_load(tmp_path, name, cls):
    info = checkpoints.build_checkpoint(name, str(tmp_path), seed=0, **TINY)
    model = checkpoints.load_hf(str(tmp_path), "cpu")
    assert type(model).__name__ == cls
    assert info["sharpen"]["logit_std"] == pytest.approx(0.5, rel=0.05)
    lp = oracle.teacher_forced_logprobs(model, [checkpoints.random_prompt(24, 1, vocab=256)])[0]
    assert len(lp) == 23 and all(x <= 0 for x in lp)


def test_long_model_config():
    args = config.parse_args([])
    cfg = checkpoints.model_config("long", args)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 128, 32, 128)
    assert cfg.max_position_embeddings >= args.long_context + args.decode_tokens
    q = checkpoints.model_config("qwen3")
    assert (q.num_attention_heads, q.num_key_value_heads, q.head_dim, q.vocab_size) == (8, 2, 128, 2048)
    with pytest.raises(ValueError, match="unknown model"):
        checkpoints.model_config("gpt2")


# ----------------------------------------------------------------------------- oracle


@pytest.fixture(scope="module")
def oracle_setup(tiny_qwen3):
    from sglang_oscar.calibrate.model import geometry_of
    from sglang_oscar.rotation import RotationSet

    path, _ = tiny_qwen3
    model = checkpoints.load_hf(path, "cpu")  # bf16, as served
    ident = RotationSet.data_free(geometry_of(model.config), "identity")
    seq = checkpoints.random_prompt(96, 7, vocab=256)
    return model, ident, seq


def test_oracle_equals_bf16_model_when_windows_cover_everything(oracle_setup):
    from sglang_oscar.config import OscarConfig

    model, ident, seq = oracle_setup
    bf16 = oracle.teacher_forced_logprobs(model, [seq])[0]
    full = oracle.teacher_forced_logprobs(model, [seq], rotation=ident, config=OscarConfig(sink_tokens=len(seq)))[0]
    quant = oracle.teacher_forced_logprobs(model, [seq], rotation=ident,
                                        config=OscarConfig(sink_tokens=4, recent_tokens=8))[0]
    assert len(bf16) == len(full) == len(quant) == len(seq) - 1
    same = client.abs_diff_stats(bf16, full)
    q = client.abs_diff_stats(bf16, quant)
    # nothing quantized: only fp32-vs-bf16 attention arithmetic differs
    assert same["mean"] < 5e-3 and same["max"] < 5e-2
    # quantizing windows: INT2 moves the log-probs far more than that arithmetic noise
    assert q["mean"] > 10 * same["mean"] and q["mean"] > 1e-2
    # the first positions read only the BF16 sink (extend windows), so they match the full-window run
    assert client.abs_diff_stats(full[:3], quant[:3])["max"] < 1e-6


def test_oracle_prompt_split_uses_decode_windows_after_the_prompt(oracle_setup):
    from sglang_oscar.config import OscarConfig

    model, ident, seq = oracle_setup
    cfg = OscarConfig(sink_tokens=4, recent_tokens=16)
    ext = oracle.teacher_forced_logprobs(model, [seq], rotation=ident, config=cfg)[0]
    split = oracle.teacher_forced_logprobs(model, [seq], rotation=ident, config=cfg, prompt_lens=[60])[0]
    # causal: positions before the split are computed identically; later ones read the recent window in BF16
    assert ext[:59] == split[:59]
    assert client.abs_diff_stats(ext[59:], split[59:])["mean"] > 1e-3
    # recent window covering everything: decode windows read everything in BF16 like a full sink
    wide = oracle.teacher_forced_logprobs(model, [seq], rotation=ident, config=OscarConfig(sink_tokens=4, recent_tokens=512),
                                       prompt_lens=[4])[0]
    full = oracle.teacher_forced_logprobs(model, [seq], rotation=ident, config=OscarConfig(sink_tokens=512))[0]
    assert client.abs_diff_stats(wide, full)["max"] < 1e-6


def test_greedy_paths_agree_with_teacher_forcing(oracle_setup):
    from sglang_oscar.config import OscarConfig

    model, ident, seq = oracle_setup
    prompt = seq[:40]
    cfg = OscarConfig(sink_tokens=4, recent_tokens=8)
    for rotation, config in ((None, None), (ident, cfg)):
        (path,) = oracle.greedy_paths(model, [prompt], 5, rotation=rotation, config=config)
        assert len(path["tokens"]) == 5 and path["min_margin"] == min(path["margins"]) >= 0
        tf = oracle.teacher_forced_logprobs(model, [prompt + path["tokens"]], rotation=rotation, config=config,
                                         prompt_lens=[len(prompt)])[0]
        assert client.abs_diff_stats(path["logprobs"], tf[len(prompt) - 1:])["max"] < 2e-2
    picked = oracle.screen_prompts(model, [12, 20], 3, candidates=3, seed=5, vocab=256)
    assert [len(p["prompt"]) for p in picked] == [12, 20]
    for li, p in enumerate(picked):  # the chosen candidate has the largest minimum margin of its length
        seeds = [5 * 100003 + li * 1009 + c for c in range(3)]
        assert p["seed"] in seeds and p["prompt"] == checkpoints.random_prompt(len(p["prompt"]), p["seed"], 256)
        alone = [oracle.greedy_paths(model, [checkpoints.random_prompt(len(p["prompt"]), s_, 256)], 3)[0] for s_ in seeds]
        assert p["min_margin"] == max(p["candidate_min_margins"])
        assert p["min_margin"] >= max(c["min_margin"] for c in alone) - 0.05  # batched vs one-by-one arithmetic


def test_oracle_hp_dtype_fp32(tiny_qwen3, oracle_setup):
    """The fp32 references of check c (--c-fp32): the model loaded in fp32 and the oracle's HP tier
    in fp32 agree with the plain fp32 model to fp32 precision when nothing is quantized."""
    from sglang_oscar.config import OscarConfig

    path, _ = tiny_qwen3
    _, ident, seq = oracle_setup
    m32 = checkpoints.load_hf(path, "cpu", torch.float32)
    m64 = checkpoints.load_hf(path, "cpu", torch.float64)
    full = OscarConfig(sink_tokens=len(seq))
    plain = oracle.teacher_forced_logprobs(m32, [seq])[0]
    hp32 = oracle.teacher_forced_logprobs(m32, [seq], rotation=ident, config=full, hp_dtype=torch.float32)[0]
    hp16 = oracle.teacher_forced_logprobs(m32, [seq], rotation=ident, config=full)[0]  # default: BF16 HP tier
    assert client.abs_diff_stats(plain, hp32)["max"] < 1e-4  # fp32 end to end
    assert client.abs_diff_stats(plain, hp16)["mean"] > 10 * client.abs_diff_stats(plain, hp32)["mean"]  # BF16 rounding
    # an fp64-loaded model: the oracle still runs in fp32 (rotation, quantization, attention)
    hp64 = oracle.teacher_forced_logprobs(m64, [seq], rotation=ident, config=full, hp_dtype=torch.float32)[0]
    assert client.abs_diff_stats(hp32, hp64)["max"] < 1e-4
    # quantizing windows: the HP dtype reaches the quantizer (rows quantized from their fp32 values)
    cfg = OscarConfig(sink_tokens=4, recent_tokens=8)
    q32 = oracle.teacher_forced_logprobs(m32, [seq], rotation=ident, config=cfg, hp_dtype=torch.float32, prompt_lens=[60])[0]
    q16 = oracle.teacher_forced_logprobs(m32, [seq], rotation=ident, config=cfg, prompt_lens=[60])[0]
    assert len(q32) == len(seq) - 1 and client.abs_diff_stats(q32, plain)["mean"] > 1e-2
    assert q32 != q16 and client.abs_diff_stats(q32[:3], plain[:3])["max"] < 1e-4  # first positions read only the sink


def test_rotation_files(tiny_qwen3, tmp_path):
    from sglang_oscar.calibrate.model import geometry_of
    from sglang_oscar.rotation import RotationSet
    from sglang_oscar.rotation.rotation_set import RotationError

    path, _ = tiny_qwen3
    model = checkpoints.load_hf(path, "cpu", torch.float32)
    files = checkpoints.make_rotation_files(model, path, str(tmp_path), seqs=2, seq_len=64, min_tokens=64)
    geo = geometry_of(model.config)
    layer, head = RotationSet.load(files["layer"]), RotationSet.load(files["head"])
    layer.validate(geo)
    head.validate(geo)
    assert not layer.per_head and head.per_head and head.matrices(0, "k").shape == (2, 32, 32)
    assert layer.metadata["method"] == "oscar" and head.metadata["method"] == "oscar-perhead"
    assert torch.equal(RotationSet.load(files["identity"]).matrices(1, "v"), torch.eye(32))
    with pytest.raises(RotationError):
        RotationSet.load(files["mismatch"]).validate(geo)


# ----------------------------------------------------------------------------- sliding-window families


@pytest.fixture(scope="module", params=["gemma3", "gemma4"])
def tiny_swa(request, tmp_path_factory):
    from .tiny import TINY_SWA

    path = str(tmp_path_factory.mktemp(f"tiny_{request.param}"))
    return request.param, path, checkpoints.build_checkpoint(request.param, path, seed=3, **TINY_SWA)


def test_swa_families_build_and_match_sglang(tiny_swa):
    """The saved Gemma checkpoints: layer kinds, geometry, sharpening; and the config SGLang 0.5.16
    reads (with the harness's --json-model-override-args for gemma4)."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_oscar.rotation.geometry import ModelGeometry

    from .families import sglang_override_for

    name, path, info = tiny_swa
    model = checkpoints.load_hf(path, "cpu")
    assert type(model).__name__ == {"gemma3": "Gemma3ForCausalLM", "gemma4": "Gemma4ForCausalLM"}[name]
    assert info["config"]["layer_types"] == ["sliding_attention", "full_attention"] and info["config"]["sliding_window"] == 16
    assert info["sharpen"]["logit_std"] == pytest.approx(0.5, rel=0.05)
    assert info["sharpen"]["score_std"] == pytest.approx(1.5, rel=0.35)
    assert model.lm_head.weight is model.get_input_embeddings().weight  # tied: SGLang's Gemma3 reads no lm_head
    geo = ModelGeometry.from_hf_config(path)
    shapes = [(lay.layer_id, lay.num_kv_heads, lay.head_dim_k, lay.sliding_window, lay.v_shares_k_proj) for lay in geo.layers]
    full = (1, 1, 64, None, True) if name == "gemma4" else (1, 2, 32, None, False)
    assert shapes == [(0, 2, 32, 16, False), full]
    over = json.dumps(sglang_override_for(name, model.config))
    mc = ModelConfig(path, model_override_args=over)
    assert mc.is_hybrid_swa == mc.is_hybrid_swa_compress == (name == "gemma4")
    if name == "gemma4":  # SGLang's naming: base = full layers, swa_* = sliding layers
        assert (mc.swa_attention_layer_ids, mc.full_attention_layer_ids) == ([0], [1])
        assert (mc.head_dim, mc.v_head_dim, mc.get_num_kv_heads(1)) == (64, 64, 1)
        assert (mc.swa_head_dim, mc.swa_v_head_dim, mc.hf_text_config.swa_num_key_value_heads) == (32, 32, 2)
        plain = ModelConfig(path)  # without the override SGLang sees the sliding geometry everywhere
        assert plain.head_dim == 32 and not hasattr(plain.hf_text_config, "swa_num_key_value_heads")
    else:
        assert (mc.head_dim, mc.get_num_kv_heads(1)) == (32, 2)


def test_swa_oracle_and_rotation_files(tiny_swa, tmp_path):
    """The oracle on a sliding-window model equals the HF model when nothing is quantized (windows
    applied as the model applies them) and moves when quantizing; the rotation files validate;
    gemma4's one-head-dim file is refused naming its full layer."""
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet
    from sglang_oscar.rotation.geometry import ModelGeometry
    from sglang_oscar.rotation.rotation_set import RotationError

    name, path, _ = tiny_swa
    model = checkpoints.load_hf(path, "cpu")
    seq = checkpoints.random_prompt(64, 7, vocab=256)
    m32 = checkpoints.load_hf(path, "cpu", torch.float32)
    files = checkpoints.make_rotation_files(m32, path, str(tmp_path), seqs=2, seq_len=48, min_tokens=48)
    geo = ModelGeometry.from_hf_config(path)
    for key in ("layer", "head", "identity"):
        RotationSet.load(files[key]).validate(geo)
    with pytest.raises(RotationError):
        RotationSet.load(files["mismatch"]).validate(geo)
    assert ("onedim" in files) == (name == "gemma4")
    if name == "gemma4":
        with pytest.raises(RotationError, match=r"layer 1 \(full\).*head_dim 64"):
            RotationSet.load(files["onedim"]).validate(geo)
    ident = RotationSet.load(files["identity"])
    bf16 = oracle.teacher_forced_logprobs(model, [seq])[0]
    full = oracle.teacher_forced_logprobs(model, [seq], rotation=ident, config=OscarConfig(sink_tokens=len(seq)))[0]
    quant = oracle.teacher_forced_logprobs(model, [seq], rotation=ident, config=OscarConfig(sink_tokens=4, recent_tokens=8))[0]
    same, q = client.abs_diff_stats(bf16, full), client.abs_diff_stats(bf16, quant)
    assert same["mean"] < 1e-2 and same["max"] < 5e-2
    assert q["mean"] > 5 * same["mean"] and q["mean"] > 1e-2


# ----------------------------------------------------------------------------- attention sinks, linear-attention hybrids


def test_sink_and_hybrid_families_build_and_match_sglang(tiny_family):
    """gpt_oss (sliding + full layers, attention sinks, MoE) and qwen3_next (Gated-DeltaNet + full
    attention): the saved checkpoints, their geometry, and the config SGLang 0.5.16 reads (GPT-OSS:
    hybrid SWA with sinks and ``swiglu_limit``; Qwen3-Next: ``full_attention_interval`` kept)."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_oscar.rotation.geometry import ModelGeometry

    path, info = tiny_family("gpt_oss")
    model = checkpoints.load_hf(path, "cpu")
    assert type(model).__name__ == "GptOssForCausalLM" and info["config"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert info["sharpen"]["logit_std"] == pytest.approx(0.5, rel=0.05)
    assert info["sharpen"]["score_std"] == pytest.approx(1.5, rel=0.35)
    sinks = model.model.layers[0].self_attn.sinks.detach().float()
    assert float(sinks.mean()) > 1.0  # init_sinks: large enough to matter (transformers starts them near 0)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["swiglu_limit"] == 7.0  # SGLang's GptOssSparseMoeBlock reads it
    geo = ModelGeometry.from_hf_config(path)
    assert [(l.layer_id, l.num_kv_heads, l.head_dim_k, l.sliding_window, l.has_sinks) for l in geo.layers] == \
        [(0, 2, 64, 16, True), (1, 2, 64, None, True)]
    mc = ModelConfig(path)
    assert mc.is_hybrid_swa and mc.has_attention_sinks and (mc.swa_attention_layer_ids, mc.full_attention_layer_ids) == ([0], [1])
    assert (mc.head_dim, mc.get_num_kv_heads(1), mc.hf_config.sliding_window, mc.hf_config.swiglu_limit) == (64, 2, 16, 7.0)

    path, info = tiny_family("qwen3_next")
    model = checkpoints.load_hf(path, "cpu")
    assert type(model).__name__ == "Qwen3NextForCausalLM" and info["config"]["full_attention_interval"] == 2
    assert info["config"]["layer_types"] == ["linear_attention", "full_attention"]
    assert info["sharpen"]["logit_std"] == pytest.approx(0.5, rel=0.05)
    geo = ModelGeometry.from_hf_config(path)
    assert [(l.layer_id, l.num_kv_heads, l.head_dim_k) for l in geo.layers] == [(1, 2, 64)] and geo.linear_layer_ids == (0,)
    mc = ModelConfig(path)  # SGLang's Qwen3NextConfig: layer kinds from full_attention_interval alone
    h = mc.hf_config
    assert (h.full_attention_layer_ids, h.linear_layer_ids, mc.head_dim, mc.get_num_kv_heads(1)) == ([1], [0], 64, 2)
    assert not mc.is_hybrid_swa and not mc.has_attention_sinks
    assert (h.rope_theta, h.partial_rotary_factor) == (10000.0, 0.25)


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_next", "qwen3_5"])
def test_sink_and_hybrid_oracle_and_rotation_files(tiny_family, tmp_path, name):
    """The rotation files validate (qwen3_next, qwen3_5: attention layer only, fitted on the language
    model of qwen3_5's multimodal wrapper; gpt_oss: not centred); the
    family's bad file is refused by the launch preflight with the words check i expects; the
    oracle equals the HF model when nothing is quantized (GPT-OSS: only with the layer's sinks) and
    moves when quantizing."""
    from sglang_oscar.backend.rotations import served_rotation_set
    from sglang_oscar.calibrate.capture import attention_override
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet
    from sglang_oscar.rotation.geometry import ModelGeometry
    from sglang_oscar.rotation.rotation_set import RotationError

    from .check_i import BAD_INPUT_EXPECT

    path, _ = tiny_family(name)
    m32 = checkpoints.load_hf(path, "cpu", torch.float32)
    files = checkpoints.make_rotation_files(m32, path, str(tmp_path), seqs=2, seq_len=48, min_tokens=48)
    geo = ModelGeometry.from_hf_config(path)
    for key in ("layer", "head", "identity"):
        rs = RotationSet.load(files[key])
        rs.validate(geo)
        assert not rs.k_mean and not rs.v_mean and sorted(rs.k) == list(geo.layer_ids)
        served_rotation_set(OscarConfig(rotation_path=files[key]), geo, log=False, hf_config=path)
    with pytest.raises(RotationError):
        RotationSet.load(files["mismatch"]).validate(geo)
    kind, case = config.FAMILY_BAD_ROTATIONS[name]
    assert {k for k in files if k not in ("layer", "head", "identity", "mismatch")} == {kind}
    with pytest.raises(ValueError) as exc:
        served_rotation_set(OscarConfig(rotation_path=files[kind]), geo, log=False, hf_config=path)
    msg = str(exc.value).lower()
    assert all(any(w.lower() in msg for w in group) for group in BAD_INPUT_EXPECT[case]), msg

    model = checkpoints.load_hf(path, "cpu")
    seq = checkpoints.random_prompt(48, 7, vocab=256)
    ident = RotationSet.load(files["identity"])
    full_cfg = OscarConfig(sink_tokens=len(seq))
    bf16 = oracle.teacher_forced_logprobs(model, [seq])[0]
    full = oracle.teacher_forced_logprobs(model, [seq], rotation=ident, config=full_cfg)[0]
    quant = oracle.teacher_forced_logprobs(model, [seq], rotation=ident, config=OscarConfig(sink_tokens=4, recent_tokens=8))[0]
    same, q = client.abs_diff_stats(bf16, full), client.abs_diff_stats(bf16, quant)
    assert same["mean"] < 1e-2 and same["max"] < 5e-2
    assert q["mean"] > 5 * same["mean"] and q["mean"] > 1e-2
    ids = torch.tensor([seq])
    with torch.no_grad(), attention_override(m32, lambda call: None):  # observe only: the model's own attention
        observed = m32(input_ids=ids, use_cache=False).logits
    assert torch.allclose(observed, m32(input_ids=ids, use_cache=False).logits, atol=1e-5)
    if name == "gpt_oss":  # the handler passes the layer's sinks: without them the oracle is far off
        handler = oracle.oracle_handler(ident, full_cfg, len(seq))
        seen = []

        def no_sinks(call):
            seen.append(call.sinks is not None and torch.equal(call.sinks, call.module.sinks))
            call.sinks, call.module = None, object()
            return handler(call)

        with torch.no_grad(), attention_override(model, no_sinks):
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None]).squeeze(1).tolist()
        assert seen == [True, True] and client.abs_diff_stats(bf16, lp)["mean"] > 10 * same["mean"]


# ----------------------------------------------------------------------------- MiniMax-M2 (partial RoPE, cross-head QK norm)


def test_minimax_m2_builds_matches_sglang_and_its_oracle(tiny_family, tmp_path):
    """minimax_m2: the fields SGLang 0.5.16 reads are saved (partial RoPE on half of head_dim, q/k
    RMSNorm across heads, sigmoid routing with its bias); the plain MHA geometry; the rotation files
    pass the launch preflight; the oracle equals the HF model when nothing is quantized and moves
    when quantizing (the rotation acts on the cached post-RoPE, post-norm K, whole row)."""
    from sglang.srt.configs.model_config import ModelConfig

    from sglang_oscar.backend.rotations import served_rotation_set
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet
    from sglang_oscar.rotation.geometry import ModelGeometry
    from sglang_oscar.rotation.rotation_set import RotationError

    path, info = tiny_family("minimax_m2")
    model = checkpoints.load_hf(path, "cpu")
    assert type(model).__name__ == "MiniMaxM2ForCausalLM"
    assert info["sharpen"]["logit_std"] == pytest.approx(0.5, rel=0.05)
    assert info["sharpen"]["score_std"] == pytest.approx(1.5, rel=0.35)  # through the cross-head q/k norms
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    assert (saved["rotary_dim"], saved["use_qk_norm"], saved["qk_norm_type"], saved["scoring_func"],
            saved["use_routing_bias"], saved["rope_parameters"]["partial_rotary_factor"]) == (32, True, "per_layer",
                                                                                              "sigmoid", True, 0.5)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape[0] == 4 * 64 and attn.k_norm.weight.shape[0] == 2 * 64  # across heads
    mc = ModelConfig(path)
    assert (mc.head_dim, mc.get_num_kv_heads(1), mc.is_hybrid_swa, mc.hf_config.rotary_dim) == (64, 2, False, 32)
    geo = ModelGeometry.from_hf_config(path)
    assert [(l.layer_id, l.num_kv_heads, l.head_dim_k, l.sliding_window) for l in geo.layers] == \
        [(0, 2, 64, None), (1, 2, 64, None)]

    m32 = checkpoints.load_hf(path, "cpu", torch.float32)
    files = checkpoints.make_rotation_files(m32, path, str(tmp_path), seqs=2, seq_len=48, min_tokens=48)
    for key in ("layer", "head", "identity"):
        RotationSet.load(files[key]).validate(geo)
        served_rotation_set(OscarConfig(rotation_path=files[key]), geo, log=False, hf_config=path)
    with pytest.raises(RotationError):
        RotationSet.load(files["mismatch"]).validate(geo)

    seq = checkpoints.random_prompt(48, 7, vocab=256)
    ident, fitted = RotationSet.load(files["identity"]), RotationSet.load(files["layer"])
    bf16 = oracle.teacher_forced_logprobs(model, [seq])[0]
    full = oracle.teacher_forced_logprobs(model, [seq], rotation=fitted, config=OscarConfig(sink_tokens=len(seq)))[0]
    quant = oracle.teacher_forced_logprobs(model, [seq], rotation=ident, config=OscarConfig(sink_tokens=4, recent_tokens=8))[0]
    same, q = client.abs_diff_stats(bf16, full), client.abs_diff_stats(bf16, quant)
    assert same["mean"] < 1e-2 and same["max"] < 5e-2  # an orthogonal rotation of BF16 rows: rounding only
    assert q["mean"] > 5 * same["mean"] and q["mean"] > 1e-2
