"""Launch checks of MLA models (DeepSeek-V3 family) with ``--kv-cache-dtype int2``, before weights load.

A tiny ``DeepseekV3Config`` directory goes through SGLang's ``ServerArgs`` with the plugin's hooks:
a fitting latent rotation file (or none: the data-free block Hadamard) passes; an MHA rotation file,
a latent file of another model, a group size that does not divide the rank and MHA-only flags stop
the launch with a message naming the fix (DSA models: ``test_dsa_serving.py``). The pool hook's sizing of the
latent cache and the dispatch hook's absorbed path are checked on stand-ins of SGLang's objects.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from _support.server_args import int2_server_args
from sglang_oscar.config import OscarConfig
from sglang_oscar.rotation import RotationSet
from sglang_oscar.rotation.geometry import ModelGeometry
from sglang_oscar.rotation.latent import LatentRotationSet


def _deepseek_dir(tmp_path, name, layers=2, rank=128, **extra):
    from transformers import DeepseekV3Config

    d = tmp_path / name
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=rank,
                           q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                           num_experts_per_tok=2, first_k_dense_replace=1, architectures=["DeepseekV3ForCausalLM"])
    for key, value in extra.items():
        setattr(cfg, key, value)
    cfg.save_pretrained(d)
    return str(d)


def test_latent_rotation_file_or_none_passes(hooked, tmp_path, monkeypatch):
    model = _deepseek_dir(tmp_path, "m")
    assert int2_server_args(model, monkeypatch).attention_backend == "triton"
    rot = str(tmp_path / "latent.safetensors")
    LatentRotationSet.data_free(ModelGeometry.from_hf_config(model)).save(rot)
    assert int2_server_args(model, monkeypatch, rotation_path=rot, group_size=64).kv_cache_dtype == "int2"


@pytest.mark.parametrize("case,match", [
    ("mha_file", r"does not fit this MLA model: .*not an sglang-oscar latent rotation file.*latent rotation file"),
    ("other_layers", r"does not fit this MLA model: .*cover 3 layers but the model .* has 2 MLA layers"),
    ("other_rank", r"does not fit this MLA model: .*expected \(128, 128\) for kv_lora_rank 128"),
    ("missing", r"--oscar-rotation: .*does not exist.*drop the flag"),
    ("upstream_dir", r"is upstream's per-layer latent folder .*reads one latent rotation .safetensors file: refit"),
    ("upstream_pt", r"layer_0.pt is a PyTorch .pt file.*reads one latent rotation .safetensors file: refit"),
    ("group", r"latent cache \(--kv-cache-quant-group-size\): group size 48 does not divide kv_lora_rank 128 \(the MLA "
              r"latent row is grouped along the rank\): pick 128 or 64 or 32, or leave it unset"),
    ("rank", r"latent cache: .*kv_lora_rank 192, not a width the INT2 latent kernels take .*--kv-cache-dtype auto "
             r"\(or --oscar-mla-storage expanded"),
    ("skip", r"--oscar-skip-layers applies to MHA/GQA models.*drop the flag"),
    ("v_file", r"SGLANG_OSCAR_V_ROTATION_PATH applies to MHA/GQA models.*drop the variable"),
    ("fold", r"--oscar-fold-rotations on applies to MHA/GQA models"),
    ("gluon", r"--oscar-decode-engine gluon applies to MHA/GQA models"),
    ("rotate_engine", r"--oscar-rotate-engine torch applies to MHA/GQA models"),
    ("v_clip", r"--oscar-v-clip-ratio applies to MHA/GQA models.*K's clip ratio"),
])
def test_bad_mla_input_stops_the_launch_with_a_named_fix(hooked, tmp_path, monkeypatch, case, match):
    model = _deepseek_dir(tmp_path, "m", **({"rank": 192} if case == "rank" else {}))
    rot = str(tmp_path / "rot.safetensors")
    cfg = {}
    if case == "mha_file":
        from transformers import Qwen3Config

        q = tmp_path / "qwen3"
        Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"]).save_pretrained(q)
        RotationSet.data_free(ModelGeometry.from_hf_config(str(q))).save(rot)
        cfg["rotation_path"] = rot
    elif case in ("other_layers", "other_rank"):
        other = _deepseek_dir(tmp_path, "o", **({"layers": 3} if case == "other_layers" else {"rank": 256}))
        LatentRotationSet.data_free(ModelGeometry.from_hf_config(other)).save(rot)
        cfg["rotation_path"] = rot
    elif case == "missing":
        cfg["rotation_path"] = str(tmp_path / "nope.safetensors")
    elif case.startswith("upstream"):  # what `fit --upstream-dir` writes: layer_<id>.pt per MLA layer
        up = tmp_path / "up"
        up.mkdir()
        for lid in (0, 1):
            torch.save(torch.eye(128), up / f"layer_{lid}.pt")
        cfg["rotation_path"] = str(up if case == "upstream_dir" else up / "layer_0.pt")
    elif case == "group":
        cfg["group_size"] = 48
    elif case == "rank":  # whatever the group: 64 divides 192, the kernels still cannot take it
        cfg["group_size"] = 64
    elif case == "skip":
        cfg["skip_layers"] = "0"
    elif case == "v_file":  # a valid latent K file with an MHA-style V file beside it
        LatentRotationSet.data_free(ModelGeometry.from_hf_config(model)).save(rot)
        cfg.update(rotation_path=rot, rotation_v_path=str(tmp_path / "v.safetensors"))
    elif case == "fold":
        cfg["fold_rotations"] = True
    elif case == "gluon":
        cfg["decode_engine"] = "gluon"
    elif case == "rotate_engine":
        cfg["rotate_engine"] = "torch"
    else:
        cfg["v_clip_ratio"] = 0.8
    with pytest.raises(ValueError, match=match):
        int2_server_args(model, monkeypatch, **cfg)


@pytest.mark.parametrize("arch", ["LongcatFlashForCausalLM", "BailingMoeV2_5ForCausalLM", "KimiK25ForConditionalGeneration"])
def test_mla_architectures_outside_the_served_family_are_refused(hooked, tmp_path, arch):
    """LongCat-Flash (two attention layers per decoder layer), Ring / Ling hybrids (linear layers the
    geometry does not see), Kimi-K2.5's wrapper: refused before weights load, naming the served ones."""
    model = _deepseek_dir(tmp_path, "m", architectures=[arch])
    with pytest.raises(ValueError, match=rf"serves the MLA latent cache of DeepseekV2ForCausalLM, "
                                         rf"DeepseekV3ForCausalLM, GlmMoeDsaForCausalLM, KimiLinearForCausalLM; {arch} .*--kv-cache-dtype auto"):
        hooked.preflight(SimpleNamespace(model_path=model, _oscar_config=OscarConfig()))


# a tiny Kimi-Linear: layers 0, 1 and 3 KDA (linear attention), layer 2 MLA (1-based lists, SGLang's rule)
KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "hidden_size": 64,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
    "kv_lora_rank": 128, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1, 2, 4], "num_heads": 4, "head_dim": 32},
}


def test_kimi_linear_serves_its_mla_layers_and_refuses_files_of_its_kda_layers(hooked, tmp_path):
    """Kimi-Linear (MLA + KDA linear-attention layers): the latent rotations cover its MLA layer only,
    from the data-free default or a fitting file; a file that also covers a KDA layer is refused,
    naming it as a linear-attention layer, also by the plugin's launch check on a config directory of
    SGLang's own KimiLinearConfig (transformers 5.12 has no Kimi-Linear class; SGLang's ServerArgs
    needs a GPU for linear-attention hybrids, so the check runs on its own)."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig

    from sglang_oscar.backend.rotations import served_latent_rotations

    geo = ModelGeometry.from_hf_config(KIMI_LINEAR)
    rs = served_latent_rotations(OscarConfig(), geo, log=False, architectures=KIMI_LINEAR["architectures"])
    assert rs.layer_ids == [2] and tuple(rs.matrix(2).shape) == (128, 128)
    good = str(tmp_path / "kimi.safetensors")
    rs.save(good)
    assert served_latent_rotations(OscarConfig(rotation_path=good), geo, log=False).layer_ids == [2]
    every_layer = {**KIMI_LINEAR, "linear_attn_config": {"full_attn_layers": [1, 2, 3, 4]}}
    bad = str(tmp_path / "all.safetensors")
    LatentRotationSet.data_free(ModelGeometry.from_hf_config(every_layer)).save(bad)
    with pytest.raises(ValueError, match=r"unexpected \[0, 1, 3\] \(layers \[0, 1, 3\] are linear-attention layers: "
                                         r"they have no latent cache\)"):
        served_latent_rotations(OscarConfig(rotation_path=bad), geo, log=False)
    model = tmp_path / "kimi"
    KimiLinearConfig(**{k: v for k, v in KIMI_LINEAR.items() if k != "model_type"}).save_pretrained(model)
    assert hooked.preflight(SimpleNamespace(model_path=str(model), _oscar_config=OscarConfig(rotation_path=good))) is None
    with pytest.raises(ValueError, match=r"layers \[0, 1, 3\] are linear-attention layers"):
        hooked.preflight(SimpleNamespace(model_path=str(model), _oscar_config=OscarConfig(rotation_path=bad)))


def test_latent_file_on_mha_model_is_refused(hooked, tmp_path, monkeypatch):
    """An MHA model given a latent rotation file is told it is an MLA file."""
    geo = ModelGeometry.from_hf_config(_deepseek_dir(tmp_path, "m"))
    from transformers import Qwen3Config

    q = tmp_path / "qwen3"
    Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"]).save_pretrained(q)
    rot = str(tmp_path / "latent.safetensors")
    LatentRotationSet.data_free(geo).save(rot)
    with pytest.raises(ValueError, match=r"is an MLA latent rotation file, but 'qwen3' is an MHA/GQA model"):
        int2_server_args(str(q), monkeypatch, rotation_path=rot)


def test_latent_sizing_and_windows_follow_the_pool(hooked):
    """The memory plan's groups of an MLA model are one latent group whose INT2 cell and BF16 window
    row equal what :class:`OscarMLATokenToKVPool` allocates per token."""
    from sglang_oscar.plugin import serving
    from sglang_oscar.pool.latent_pool import OscarMLATokenToKVPool
    from sglang_oscar.pool.sizing import hp_row_bytes, latent_cell_size

    kvc = SimpleNamespace(use_mla_backend=True, layer_info=SimpleNamespace(num_effective_layers=3, start_layer=0,
                                                                           end_layer=3),
                          model_config=SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64), mambaish_config=None)
    (group,) = serving._kv_groups(kvc)
    assert group == ("latent", 3, 1, 512, 64)
    # Kimi-Linear: only the MLA layers (SGLang's full_attention_layer_ids) hold a latent
    hybrid = SimpleNamespace(**{**vars(kvc), "mambaish_config": SimpleNamespace(full_attention_layer_ids=[2])})
    assert serving._kv_groups(hybrid) == [("latent", 1, 1, 512, 64)]
    config = OscarConfig(group_size=128, sink_tokens=4, recent_tokens=8)
    pool = OscarMLATokenToKVPool(32, page_size=1, dtype=torch.uint8, kv_lora_rank=512, qk_rope_head_dim=64,
                                 layer_num=3, device="cpu", enable_memory_saver=False, oscar_config=config,
                                 hp_dtype=torch.bfloat16, max_reqs=2, sink_rows=16)
    # the sizing hook's bytes per token = what the pool allocates per slot (planes minus windows and
    # the spare k_pe row of each layer, over size + 1 slots)
    per_slot = (pool.get_kv_size_bytes() - pool.hp_bytes() - 3 * 64 * 2) / (32 + 1)
    assert latent_cell_size(config, 512, 64, 3, torch.bfloat16) == per_slot == 3 * 272
    # no --kv-cache-quant-group-size: groups of 128 along the rank (not one pair per 512-wide latent)
    default = OscarMLATokenToKVPool(32, page_size=1, dtype=torch.uint8, kv_lora_rank=512, qk_rope_head_dim=64,
                                    layer_num=3, device="cpu", enable_memory_saver=False,
                                    oscar_config=OscarConfig(sink_tokens=4, recent_tokens=8), hp_dtype=torch.bfloat16,
                                    max_reqs=2, sink_rows=16)
    assert default.layout.k.group_size == 128 and default.int2_bytes_per_token() == 3 * 272
    # the window plan's rows (the sizing's per-row bytes) are what the pool allocates for its windows
    allocated = sum(t.numel() * t.element_size() for t in pool.hp_latent + pool.hp_pe) - 3 * 64 * 2  # - spare k_pe row
    assert hp_row_bytes(*group[2:], group[1], torch.bfloat16) * pool.windows.num_rows == allocated == pool.hp_bytes()


def test_dispatch_hook_takes_the_absorbed_path_only_for_int2(hooked):
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    from sglang_oscar.plugin import mla_serving, serving

    def handler(self, fb):
        self.current_attention_backend = "triton"  # what SGLang's dispatch sets before choosing
        return AttnForwardMethod.MHA

    old = serving._ACTIVE["recent"]
    try:
        attn = SimpleNamespace(current_attention_backend=None)
        serving._ACTIVE["recent"] = None
        assert mla_serving.around_mla_dispatch(handler, attn, None) == AttnForwardMethod.MHA
        serving._ACTIVE["recent"] = 8
        attn.current_attention_backend = None
        assert mla_serving.around_mla_dispatch(handler, attn, None) == AttnForwardMethod.MLA
        assert attn.current_attention_backend == "triton"  # SGLang's own dispatch still ran
    finally:
        serving._ACTIVE["recent"] = old


def test_backend_factory_picks_the_latent_backend_for_the_latent_pool(hooked, monkeypatch):
    """ATTENTION_BACKENDS["triton"] for an int2 runner: the latent backend over the INT2 latent pool,
    the MHA backend over any other pool; SGLang's own backend without int2."""
    from sglang.srt.layers.attention import attention_registry

    from sglang_oscar.backend import latent_backend, triton_backend
    from sglang_oscar.pool.latent_pool import OscarMLATokenToKVPool

    monkeypatch.setattr(latent_backend, "OscarTritonLatentBackend", lambda runner: ("latent", runner))
    monkeypatch.setattr(triton_backend, "OscarTritonAttnBackend", lambda runner: ("mha", runner))
    factory = attention_registry.ATTENTION_BACKENDS["triton"]
    pool = OscarMLATokenToKVPool(8, page_size=1, dtype=torch.uint8, kv_lora_rank=128, qk_rope_head_dim=16,
                                 layer_num=1, device="cpu", enable_memory_saver=False,
                                 oscar_config=OscarConfig(sink_tokens=2, recent_tokens=4), hp_dtype=torch.bfloat16,
                                 max_reqs=2, sink_rows=4)
    int2 = SimpleNamespace(kv_cache_dtype="int2")
    assert factory(SimpleNamespace(server_args=int2, token_to_kv_pool=pool))[0] == "latent"
    assert factory(SimpleNamespace(server_args=int2, token_to_kv_pool=object()))[0] == "mha"
    assert getattr(factory, "_oscar", False)  # the plugin's entry; "auto" servers get SGLang's (below)
    monkeypatch.setattr(attention_registry, "ATTENTION_BACKENDS", {"triton": lambda runner: ("sglang", runner)})
    from sglang_oscar.plugin import serving

    serving.install_backend_factory()
    wrapped = attention_registry.ATTENTION_BACKENDS["triton"]
    assert wrapped(SimpleNamespace(server_args=SimpleNamespace(kv_cache_dtype="auto")))[0] == "sglang"


def test_pool_hook_builds_the_latent_pool_of_a_kimi_linear_model_inside_sglangs_hybrid_pool(hooked, monkeypatch):
    """``around_build_token_to_kv_pool`` for an MLA model with linear-attention layers: SGLang's own
    ``HybridLinearKVPool`` (its state pool untouched) around an INT2 latent pool of the MLA layers only,
    addressed by global id; the backend factory picks the latent backend for it."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.layers.attention import attention_registry

    from sglang_oscar.backend import latent_backend
    from sglang_oscar.plugin import serving
    from sglang_oscar.pool.latent_pool import OscarMLATokenToKVPool
    from sglang_oscar.pool.linear_pool import OscarHybridLinearKVPool

    hf = KimiLinearConfig(**{k: v for k, v in KIMI_LINEAR.items() if k != "model_type"})
    config = OscarConfig(group_size=32, sink_tokens=4, recent_tokens=8)
    server_args = SimpleNamespace(kv_cache_dtype="int2", page_size=1, enable_memory_saver=False, _oscar_config=config)
    kvc = SimpleNamespace(
        server_args=server_args, use_mla_backend=True, is_hybrid_swa=False, is_draft_worker=False, device="cpu",
        model_dtype=torch.bfloat16, mambaish_config=SimpleNamespace(full_attention_layer_ids=[2]),
        model_config=SimpleNamespace(hf_config=hf, kv_lora_rank=128, qk_rope_head_dim=16),
        layer_info=SimpleNamespace(num_effective_layers=4, start_layer=0, end_layer=4))
    mamba = object()
    req_pool = SimpleNamespace(req_to_token=torch.zeros(2, 64, dtype=torch.int32), mamba_pool=mamba)
    pool = serving.around_build_token_to_kv_pool(None, kvc, sizes=SimpleNamespace(max_total_num_tokens=48),
                                                 req_to_token_pool=req_pool)
    assert isinstance(pool, OscarHybridLinearKVPool) and isinstance(pool.full_kv_pool, OscarMLATokenToKVPool)
    assert pool.mamba_pool is mamba and pool.full_attention_layer_id_mapping == {2: 0}
    assert pool.full_kv_pool.layer_num == 1 and (pool.kv_lora_rank, pool.qk_rope_head_dim) == (128, 16)
    assert pool.latent_buffers(2)["codes"].shape == (49, 32)  # 48 slots + slot 0, R/4 code bytes
    assert pool.int2_bytes_per_token() == 32 + 2 * 4 * 2 + 16 * 2  # one layer: R/4 code bytes, 4 fp16 pairs, k_pe
    monkeypatch.setattr(latent_backend, "OscarTritonLatentBackend", lambda runner: ("latent", runner))
    factory = attention_registry.ATTENTION_BACKENDS["triton"]
    assert factory(SimpleNamespace(server_args=server_args, token_to_kv_pool=pool))[0] == "latent"


def test_malformed_latent_files_and_directories_name_the_problem(hooked, tmp_path, monkeypatch):
    """A latent file whose metadata is not JSON or not a JSON object is refused as such (not a raw
    JSONDecodeError / AttributeError), on an MLA model and on an MHA one; a directory holding one
    latent file is read like --oscar-rotation's MHA directories, one holding two is refused naming them."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    model = _deepseek_dir(tmp_path, "m")
    lr = LatentRotationSet.data_free(ModelGeometry.from_hf_config(model))
    tensors = {f"latent.{i}": lr.matrix(i).clone() for i in lr.layer_ids}
    bad_json, not_object = str(tmp_path / "bad_json.safetensors"), str(tmp_path / "list.safetensors")
    save_file(tensors, bad_json, metadata={"oscar": "{"})
    save_file(tensors, not_object, metadata={"oscar": "[1]"})
    with pytest.raises(ValueError, match=r"bad_json\.safetensors: 'oscar' metadata is not valid JSON"):
        int2_server_args(model, monkeypatch, rotation_path=bad_json)
    with pytest.raises(ValueError, match=r"list\.safetensors: 'oscar' metadata must be a JSON object, got list"):
        int2_server_args(model, monkeypatch, rotation_path=not_object)
    q = tmp_path / "qwen3"
    Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"]).save_pretrained(q)
    with pytest.raises(ValueError, match=r"list\.safetensors: 'oscar' metadata must be a JSON object"):
        int2_server_args(str(q), monkeypatch, rotation_path=not_object)
    one = tmp_path / "one"
    lr.save(str(one / "latent.safetensors"))
    assert int2_server_args(model, monkeypatch, rotation_path=str(one)).kv_cache_dtype == "int2"
    with pytest.raises(ValueError, match=r"is an MLA latent rotation file, but 'qwen3' is an MHA/GQA model"):
        int2_server_args(str(q), monkeypatch, rotation_path=str(one))
    lr.save(str(one / "other.safetensors"))
    with pytest.raises(ValueError, match=r"2 \.safetensors files \['latent\.safetensors', 'other\.safe"):
        int2_server_args(model, monkeypatch, rotation_path=str(one))


def test_data_free_latent_rotation_of_a_rank_64_latent(hooked, tmp_path, monkeypatch):
    """kv_lora_rank 64 (narrower than the default 128-wide Hadamard block): the launch takes the
    data-free rotation as one 64-wide block instead of failing on a block the user cannot set."""
    from sglang_oscar.backend.rotations import served_latent_rotations
    from sglang_oscar.rotation.rotation_set import orthogonality_error

    model = _deepseek_dir(tmp_path, "r64", rank=64)
    assert int2_server_args(model, monkeypatch).kv_cache_dtype == "int2"
    rs = served_latent_rotations(OscarConfig(), ModelGeometry.from_hf_config(model), log=False)
    assert rs.layer_ids == [0, 1] and tuple(rs.matrix(0).shape) == (64, 64) and orthogonality_error(rs.matrix(0)) < 1e-5
    # one rule for the server and the offline error / ppl baselines: blocks of 128 (whatever the group size),
    # the whole latent when it is narrower
    for rank, block in ((64, 64), (256, 128)):
        geo = ModelGeometry.from_hf_config(_deepseek_dir(tmp_path, f"b{rank}", rank=rank))
        served = served_latent_rotations(OscarConfig(group_size=64), geo, log=False)
        offline = LatentRotationSet.served_data_free(geo)
        assert served.metadata["hadamard_block"] == offline.metadata["hadamard_block"] == block
        assert torch.equal(served.matrix(1), offline.matrix(1))


def test_a_latent_file_fitted_for_another_network_is_refused(hooked, tmp_path, monkeypatch):
    """As the K/V files: a fitted latent file whose recorded sizes differ from the served model's is refused
    at launch, however well its shapes fit."""
    from sglang_oscar.calibrate.model import config_fingerprint
    from sglang_oscar.rotation.geometry import _as_dict

    model = _deepseek_dir(tmp_path, "m")
    base = LatentRotationSet.data_free(ModelGeometry.from_hf_config(model))
    rot = str(tmp_path / "latent.safetensors")
    fingerprint = {**config_fingerprint(_as_dict(model)), "num_hidden_layers": 61}
    LatentRotationSet(base.r, {**base.metadata, "method": "oscar", "model_fingerprint": fingerprint}).save(rot)
    with pytest.raises(ValueError, match=r"was fitted for another model \(num_hidden_layers: 61 vs 2"):
        int2_server_args(model, monkeypatch, rotation_path=rot, group_size=64)
