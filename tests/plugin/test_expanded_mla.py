"""``--oscar-mla-storage expanded``: DeepSeek-V2/V3 layers cached as per-head INT2 K/V rows, on CPU.

Checked: the flag (parsing, config, environment round trip) and every launch refusal before weights load
(message names the problem and the fix); the sizing hook's bytes per token = the pool's real bytes at TP 1
and a simulated TP 8 (SGLang's own ``ModelConfig`` and pool configurator); the dispatch hook (plain MHA for
every forward mode with expanded storage, absorbed MLA with the latent); the backend factory; the backend's
``__init__`` (SGLang's own stubbed) at TP 8 (rotations of the rank's heads, ``attn_mha`` layers only, no
split-KV scratch). The forward paths (``prepare_prefill_qkv``, extend and decode) are in
test_expanded_mla_forward.py.
"""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from _support.orthogonal import random_orthogonal
from _support.server_args import int2_server_args, oscar_server_parser
from sglang_oscar.cli.main import main as cli
from sglang_oscar.config import OscarConfig
from sglang_oscar.pool.int2_pool import OscarMHATokenToKVPool
from sglang_oscar.rotation import RotationSet
from sglang_oscar.rotation.geometry import ModelGeometry
from sglang_oscar.rotation.latent import LatentRotationSet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

N, P, V = 128, 64, 128  # DeepSeek-V3's per-head sizes: K 192, V 128
DK = N + P
EXPANDED = dict(mla_storage="expanded", group_size=64)


def _deepseek_dir(tmp_path, name="m", layers=2, heads=4, rank=128, **extra):
    """A DeepSeek-V3 config directory with DeepSeek-V3's per-head sizes (the launch reads only config.json)."""
    from transformers import DeepseekV3Config

    d = tmp_path / name
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                           num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                           kv_lora_rank=rank, q_lora_rank=64, qk_rope_head_dim=P, qk_nope_head_dim=N, v_head_dim=V,
                           n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                           architectures=["DeepseekV3ForCausalLM"])
    for key, value in extra.items():
        setattr(cfg, key, value)
    cfg.save_pretrained(d)
    return str(d)


def _qwen3_dir(tmp_path):
    from transformers import Qwen3Config

    q = tmp_path / "qwen3"
    Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=128, architectures=["Qwen3ForCausalLM"]).save_pretrained(q)
    return str(q)


# ------------------------------------------------------------------------------------------ the flag
def test_flag_parses_into_the_config_and_travels_to_subprocesses(monkeypatch):
    from sglang_oscar.plugin import flags

    parser = oscar_server_parser()
    ns = parser.parse_args(["--model-path", "m", "--kv-cache-dtype", "int2", "--oscar-mla-storage", "expanded"])
    config, _ = flags.resolve_config({f.dest: getattr(ns, f.dest) for f in flags.FLAGS}, environ={})
    assert config.mla_storage == "expanded"
    assert flags.config_from_env({flags.CONFIG_ENV: flags.config_to_env(config)}).mla_storage == "expanded"
    ns = parser.parse_args(["--model-path", "m", "--kv-cache-dtype", "int2"])
    assert flags.resolve_config({f.dest: getattr(ns, f.dest) for f in flags.FLAGS}, environ={})[0].mla_storage \
        == "latent"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--kv-cache-dtype", "int2", "--oscar-mla-storage", "full"])
    with pytest.raises(ValueError, match=r"mla_storage must be one of \('latent', 'expanded'\), got 'full'"):
        OscarConfig(mla_storage="full")
    # like every OSCAR flag, refused without --kv-cache-dtype int2
    import sglang_oscar.plugin as plugin

    ns = parser.parse_args(["--model-path", "m", "--oscar-mla-storage", "expanded"])
    with pytest.raises(ValueError, match=r"--oscar-mla-storage: OSCAR flags apply only with --kv-cache-dtype int2"):
        plugin._around_from_cli_args(lambda cls, args: None, None, ns)


# ------------------------------------------------------------------------------------------ launch checks
def test_fitting_expanded_launches_pass(hooked, tmp_path, monkeypatch):
    """No file (the data-free Hadamard of K 192 / V 128), one group per row, or a file of the expanded
    geometry written by ``sglang-oscar hadamard --mla-storage expanded`` (which ``validate`` accepts)."""
    model = _deepseek_dir(tmp_path)
    assert int2_server_args(model, monkeypatch, **EXPANDED).attention_backend == "triton"
    assert int2_server_args(model, monkeypatch, mla_storage="expanded").kv_cache_dtype == "int2"
    rot = str(tmp_path / "expanded.safetensors")
    assert cli(["hadamard", "--config", model, "--mla-storage", "expanded", "--out", rot]) == 0
    rs = RotationSet.load(rot)
    assert rs.layer_ids == [0, 1] and rs.k[0].shape == (DK, DK) and rs.v[1].shape == (V, V)
    assert rs.metadata["mla_storage"] == "expanded"
    assert cli(["validate", rot, "--config", model, "--mla-storage", "expanded"]) == 0
    assert int2_server_args(model, monkeypatch, rotation_path=rot, **EXPANDED).kv_cache_dtype == "int2"


@pytest.mark.parametrize("case,match", [
    ("group128", r"--kv-cache-quant-group-size 128 does not fit --oscar-mla-storage expanded: groups must divide both "
                 r"the K rows \(192 = qk_nope_head_dim \+ qk_rope_head_dim\) and the V rows \(128\); pass "
                 r"--kv-cache-quant-group-size 64"),
    ("latent_file", r"is an MLA latent rotation file, but --oscar-mla-storage expanded caches per-head K \(192\) / V "
                    r"\(128\) rows: .*hadamard --config CONFIG.json --mla-storage expanded.*"
                    r"or drop --oscar-mla-storage"),
    ("other_model_file", r"--oscar-mla-storage expanded: --oscar-rotation .* does not fit this model: .*head_dim.*"
                         r"expanded storage takes per-head K \[192\] / V \[128\] rotations"),
    ("skip", r"--oscar-skip-layers does not apply with --oscar-mla-storage expanded \(SGLang keeps every MLA layer "
             r"in one pool.*drop the flag"),
    ("fold", r"--oscar-fold-rotations on does not apply with --oscar-mla-storage expanded \(the value rotation is "
             r"not folded into kv_b_proj / o_proj\): drop the flag"),
    ("gluon", r"--oscar-decode-engine gluon does not apply with --oscar-mla-storage expanded \(the Gluon kernel "
              r"takes head_dim 128, not K 192\): drop the flag"),
    ("mha_model", r"--oscar-mla-storage expanded applies to MLA models \(DeepSeek-V2/V3\); 'qwen3' is an MHA/GQA "
                  r"model.*drop the flag"),
    ("latent_server_expanded_file", r"holds per-head K/V rotations of this model's expanded MLA storage, but the "
                                    r"server caches the latent.*pass --oscar-mla-storage expanded"),
])
def test_bad_expanded_input_stops_the_launch_with_a_named_fix(hooked, tmp_path, monkeypatch, case, match):
    model = _deepseek_dir(tmp_path)
    rot = str(tmp_path / "rot.safetensors")
    cfg = dict(EXPANDED)
    if case == "group128":
        cfg["group_size"] = 128
    elif case == "latent_file":
        LatentRotationSet.data_free(ModelGeometry.from_hf_config(model)).save(rot)
        cfg["rotation_path"] = rot
    elif case == "other_model_file":
        RotationSet.data_free(ModelGeometry.from_hf_config(_qwen3_dir(tmp_path))).save(rot)
        cfg["rotation_path"] = rot
    elif case == "skip":
        cfg["skip_layers"] = "0"
    elif case == "fold":
        cfg["fold_rotations"] = True
    elif case == "gluon":
        cfg["decode_engine"] = "gluon"
    elif case == "mha_model":
        model = _qwen3_dir(tmp_path)
    else:
        RotationSet.data_free(ModelGeometry.from_hf_config(model).expanded()).save(rot)
        cfg = dict(rotation_path=rot, group_size=64)  # the default --oscar-mla-storage latent
    with pytest.raises(ValueError, match=match):
        int2_server_args(model, monkeypatch, **cfg)


def test_dsa_kimi_linear_and_other_mla_architectures_are_refused(hooked, tmp_path):
    """DSA (a DeepSeek-V3 config with ``index_topk``: DeepSeek-V3.2; GLM-5), Kimi-Linear and MLA architectures
    outside DeepSeek-V2/V3 stop the launch naming the flag and the fix (the latent storage)."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig

    config = OscarConfig(**EXPANDED)
    dsa = _deepseek_dir(tmp_path, "dsa", index_topk=64, index_head_dim=128, index_n_heads=4)
    with pytest.raises(ValueError, match=r"--oscar-mla-storage expanded does not serve DSA sparse attention "
                                         r"\('deepseek_v3', index_topk 64.*use --oscar-mla-storage latent"):
        hooked.preflight(SimpleNamespace(model_path=dsa, _oscar_config=config))
    kimi = tmp_path / "kimi"
    KimiLinearConfig(architectures=["KimiLinearForCausalLM"], hidden_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=128,
                     qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, mla_use_nope=True,
                     linear_attn_config={"full_attn_layers": [3], "kda_layers": [1, 2, 4], "num_heads": 4,
                                         "head_dim": 32}).save_pretrained(kimi)
    with pytest.raises(ValueError, match=r"does not serve Kimi-Linear.*use --oscar-mla-storage latent \(the default\)"):
        hooked.preflight(SimpleNamespace(model_path=str(kimi), _oscar_config=config))
    longcat = _deepseek_dir(tmp_path, "lc", architectures=["LongcatFlashForCausalLM"])
    with pytest.raises(ValueError, match=r"serves DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; "
                                         r"LongcatFlashForCausalLM .*nor among the latent storage's: .*auto"):
        hooked.preflight(SimpleNamespace(model_path=longcat, _oscar_config=config))


def test_expanded_files_of_models_served_with_the_latent_only(hooked, tmp_path, monkeypatch, capsys):
    """hadamard / validate --mla-storage expanded refuse a model the expanded storage does not serve (a DSA
    model here), naming the latent file instead; an expanded file built for such a model anyway is refused
    at launch with the latent fix, not with --oscar-mla-storage expanded (which that launch would refuse)."""
    dsa = _deepseek_dir(tmp_path, "dsa", index_topk=64, index_head_dim=128, index_n_heads=4)
    out = str(tmp_path / "x.safetensors")
    for verb in (["hadamard", "--config", dsa, "--mla-storage", "expanded", "--out", out],
                 ["validate", out, "--config", dsa, "--mla-storage", "expanded"]):
        assert cli(verb) == 2
        err = capsys.readouterr().err
        assert "does not serve DSA sparse attention" in err and "(here: --mla-storage latent)" in err, err
    # DeepSeek-V3.2 (DSA too) is served by neither storage: the advice is auto, never the latent storage
    v32 = _deepseek_dir(tmp_path, "v32", index_topk=64, index_head_dim=128, index_n_heads=4,
                        architectures=["DeepseekV32ForCausalLM"])
    assert cli(["hadamard", "--config", v32, "--mla-storage", "expanded", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "DeepseekV32ForCausalLM ('deepseek_v3') is not among them, nor among the latent storage's: serve it with " \
        "--kv-cache-dtype auto" in err and "--mla-storage latent" not in err, err
    RotationSet.data_free(ModelGeometry.from_hf_config(dsa).expanded()).save(out)
    with pytest.raises(ValueError, match=r"holds per-head K/V rotations .*served with the latent only: pass a latent "
                                         r"rotation file"):
        hooked.preflight(SimpleNamespace(model_path=dsa, _oscar_config=OscarConfig(rotation_path=out, group_size=64)))


def test_traced_prefill_graph_is_refused_for_expanded_storage(hooked, tmp_path):
    """SGLang never traces its MHA prefill (tc_piecewise picks MLA): with expanded storage forcing MHA the
    tc_piecewise prefill graph (asked for, or resolved on a GPU) stops the launch naming the fix; breakable
    and disabled pass, and the latent storage is not affected."""
    model = _deepseek_dir(tmp_path)
    graph = lambda backend: SimpleNamespace(prefill=SimpleNamespace(backend=backend))  # noqa: E731
    asked = {("prefill", "backend")}  # --cuda-graph-backend-prefill given (CPU resolves tc_piecewise by default)
    for storage, backend, locked, refused in (("expanded", "tc_piecewise", asked, True),
                                              ("expanded", "tc_piecewise", set(), torch.cuda.is_available()),
                                              ("expanded", "breakable", asked, False),
                                              ("expanded", "disabled", asked, False),
                                              ("latent", "tc_piecewise", asked, False)):
        config = OscarConfig(**{**EXPANDED, "mla_storage": storage})
        args = SimpleNamespace(model_path=model, _oscar_config=config, cuda_graph_config=graph(backend),
                               _cuda_graph_config_locked=locked)
        if refused:
            with pytest.raises(ValueError, match=r"--oscar-mla-storage expanded does not support the tc_piecewise "
                                                 r"prefill CUDA graph: use .*--disable-prefill-cuda-graph"):
                hooked.preflight(args)
        else:
            hooked.preflight(args)


def test_cli_needs_the_storage_for_mla_configs_and_refuses_it_for_mha(tmp_path, capsys):
    model = _deepseek_dir(tmp_path)
    out = str(tmp_path / "r.safetensors")
    assert cli(["hadamard", "--config", model, "--out", out]) == 2
    assert "is an MLA model: pass --mla-storage expanded" in capsys.readouterr().err
    assert cli(["hadamard", "--config", _qwen3_dir(tmp_path), "--mla-storage", "expanded", "--out", out]) == 2
    assert "--mla-storage applies to MLA configs; 'qwen3' is an MHA/GQA model" in capsys.readouterr().err
    assert cli(["hadamard", "--config", model, "--mla-storage", "latent", "--out", out]) == 0
    assert LatentRotationSet.load(out).layer_ids == [0, 1]
    assert cli(["validate", out, "--config", model, "--mla-storage", "latent"]) == 0
    assert cli(["validate", out, "--config", model, "--mla-storage", "expanded"]) == 2  # a latent file


# ------------------------------------------------------------------------------------------ sizing and pool
def _model_config(tmp_path, layers=3):
    """SGLang's own ``ModelConfig`` of a DeepSeek-V3-shaped config (128 heads, latent 512 + 64)."""
    from sglang.srt.configs.model_config import ModelConfig

    cfg = dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=128, hidden_size=64,
               intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=128,
               num_key_value_heads=128, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=N, qk_rope_head_dim=P,
               v_head_dim=V, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1)
    d = tmp_path / "dsv3"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    logging.disable(logging.WARNING)
    try:
        return ModelConfig(str(d))
    finally:
        logging.disable(logging.NOTSET)


def _kvc(mc, config):
    """What SGLang's pool configurator and the pool hook read of a ``KVCacheConfigurator`` (one rank, every layer)."""
    n = mc.num_hidden_layers
    no = lambda: False  # noqa: E731
    return SimpleNamespace(
        model_config=mc, kv_cache_dtype=torch.uint8, model_dtype=torch.bfloat16, use_mla_backend=True,
        is_hybrid_swa=False, is_hybrid_swa_compress=False, mambaish_config=None, is_draft_worker=False,
        layer_info=SimpleNamespace(start_layer=0, end_layer=n, num_effective_layers=n), page_size=1, device="cpu",
        spec_algorithm=SimpleNamespace(is_eagle=no, is_standalone=no, is_dflash_family=no), sliding_window_size=None,
        server_args=SimpleNamespace(kv_cache_dtype="int2", _oscar_config=config, page_size=1, max_running_requests=None,
                                    disable_radix_cache=False, enable_dsa_cache_layer_split=False,
                                    chunked_prefill_size=None, enable_memory_saver=False, enable_pdmux=False))


@pytest.mark.parametrize("tp,rank", [(1, 0), (8, 3)])
def test_cell_size_is_the_pools_real_bytes_per_token(hooked, tmp_path, caplog, tp, rank):
    """Mirrors ``pool_configurator.py:DefaultPoolConfigurator`` (``_compute_cell_size`` with the hook;
    ``max_total_num_tokens = budget // cell``) and ``deepseek_v2.py`` (``kv_b_proj`` column-parallel:
    ``128 / tp`` heads of K 192 / V 128 per rank). Group 64, fp16 pairs: 48 + 12 + 32 + 8 = 100 bytes per
    head and layer: 3 x 128 x 100 = 38,400 per token at TP 1, 4,800 per rank at TP 8 (the INT2 latent:
    3 x 288, every rank; BF16 expanded 3 x 128 x 640). The pool the hook builds allocates exactly that per
    slot, and its log line names the storage, both BF16 sizes and the INT2 latent's."""
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_parallel

    from sglang_oscar.plugin import serving

    mc = _model_config(tmp_path)
    config = OscarConfig(sink_tokens=4, recent_tokens=8, **EXPANDED)
    heads = 128 // tp
    want = 3 * heads * 100
    old = dict(serving._ACTIVE)
    try:
        with get_parallel().override(attn_tp_size=tp, attn_tp_rank=rank):
            kvc = _kvc(mc, config)
            conf = create_memory_pool_configurator(kvc)
            assert conf._cell_size == want
            assert conf.calculate_pool_sizes(2**30, 1).max_total_num_tokens == 2**30 // want
            assert serving._kv_groups(kvc) == [("expanded", 3, heads, DK, V)]
            latent = _kvc(mc, OscarConfig(sink_tokens=4, recent_tokens=8, group_size=64))
            assert create_memory_pool_configurator(latent)._cell_size == 3 * 288  # unchanged, TP-invariant
            with caplog.at_level(logging.INFO, logger="sglang_oscar"):
                pool = serving.around_build_token_to_kv_pool(
                    None, kvc, sizes=SimpleNamespace(max_total_num_tokens=8),
                    req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 16, dtype=torch.int32)))
        assert isinstance(pool, OscarMHATokenToKVPool)
        assert (pool.head_num, pool.head_dim, pool.v_head_dim, pool.layer_num) == (heads, DK, V, 3)
        assert pool.layout.k.group_size == pool.layout.v.group_size == 64
        per_slot = (sum(pool.get_kv_size_bytes()) - pool.hp_bytes()) / (8 + 1)
        assert per_slot == pool.int2_bytes_per_token() == want
        assert serving._ACTIVE["mla_storage"] == "expanded" and serving._ACTIVE["recent"] == 8
        line = next(r.getMessage() for r in caplog.records if "INT2 MLA expanded pool" in r.getMessage())
        assert (f"8 slots x 3 layers x {heads} heads (K 192 / V 128), {want} B/token INT2 (BF16 expanded: "
                f"{3 * heads * 320 * 2}; BF16 latent: {3 * 576 * 2}; INT2 latent, --oscar-mla-storage latent: "
                f"{3 * 288}, {want / (3 * 288):.1f}x less)") in line
        # the memory plan: BF16 window rows of the expanded heads reserved first, the rest INT2 tokens
        from sglang_oscar.pool.sizing import hp_row_bytes, plan_windows

        budget = 2**34
        planner = SimpleNamespace(**vars(kvc), _profile_available_bytes=lambda pre: budget,
                                  resolve_max_num_reqs=lambda tokens: 4096)
        planner.server_args.mem_fraction_static = 0.8
        planner.config_from_budget = lambda b: create_memory_pool_configurator(planner).calculate_pool_sizes(b, 1)
        caplog.clear()
        with get_parallel().override(attn_tp_size=tp, attn_tp_rank=rank), caplog.at_level(logging.INFO,
                                                                                           logger="sglang_oscar"):
            pool_config = serving.around_resolve_memory_pool_config(None, planner, 0)
        plan = plan_windows(config, budget, hp_row_bytes(heads, DK, V, 3, torch.bfloat16), None)
        assert pool_config.max_total_num_tokens == plan.int2_budget // want
        assert pool_config.max_running_requests == plan.max_running_requests
        line = next(r.getMessage() for r in caplog.records if "MLA expanded (" in r.getMessage())
        assert (f"INT2 KV cache, MLA expanded (3 layers x {heads} heads x K 192 / V 128; BF16 latent 3456, INT2 "
                f"latent 864): {want} bytes/token (BF16: {3 * heads * 640}") in line
    finally:
        serving._ACTIVE.update(old)


def test_dispatch_hook_returns_mha_for_expanded_and_mla_for_latent(hooked):
    """Every forward mode -- prefill, extend with a prefix, decode -- of an expanded server takes SGLang's plain
    MHA method (never the chunked / one-shot ones), the latent server's the absorbed MLA one, other servers
    SGLang's own choice; SGLang's dispatch still runs (it sets ``current_attention_backend``)."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    from sglang_oscar.plugin import mla_serving, serving
    sglang_choice = {"prefill": AttnForwardMethod.MHA, "prefix": AttnForwardMethod.MHA_CHUNKED_KV,
                     "decode": AttnForwardMethod.MLA}

    def handler(self, fb):
        self.current_attention_backend = "triton"
        return sglang_choice[fb]

    old = dict(serving._ACTIVE)
    try:
        for active, want in (((None, None), sglang_choice), ((8, "latent"), dict.fromkeys(sglang_choice,
                             AttnForwardMethod.MLA)), ((8, "expanded"), dict.fromkeys(sglang_choice,
                                                                                       AttnForwardMethod.MHA))):
            serving._ACTIVE["recent"], serving._ACTIVE["mla_storage"] = active
            for mode in sglang_choice:
                attn = SimpleNamespace(current_attention_backend=None)
                assert mla_serving.around_mla_dispatch(handler, attn, mode) == want[mode], (active, mode)
                assert attn.current_attention_backend == "triton"
    finally:
        serving._ACTIVE.update(old)


def test_backend_factory_picks_the_expanded_backend_for_an_mla_models_mha_pool(hooked, monkeypatch):
    from sglang.srt.layers.attention import attention_registry

    from sglang_oscar.backend import expanded_backend, latent_backend, triton_backend
    from sglang_oscar.pool.latent_pool import OscarMLATokenToKVPool

    monkeypatch.setattr(expanded_backend, "OscarExpandedMLABackend", lambda runner: ("expanded", runner))
    monkeypatch.setattr(latent_backend, "OscarTritonLatentBackend", lambda runner: ("latent", runner))
    monkeypatch.setattr(triton_backend, "OscarTritonAttnBackend", lambda runner: ("mha", runner))
    factory = attention_registry.ATTENTION_BACKENDS["triton"]
    config = OscarConfig(sink_tokens=2, recent_tokens=4, **EXPANDED)
    mha = OscarMHATokenToKVPool(8, page_size=1, dtype=torch.uint8, head_num=2, head_dim=DK, v_head_dim=V, layer_num=1,
                                device="cpu", enable_memory_saver=False, enable_alt_stream=False, oscar_config=config,
                                hp_dtype=torch.bfloat16, max_reqs=2, sink_rows=4)
    latent = OscarMLATokenToKVPool(8, page_size=1, dtype=torch.uint8, kv_lora_rank=128, qk_rope_head_dim=P,
                                   layer_num=1, device="cpu", enable_memory_saver=False, oscar_config=OscarConfig(
                                       sink_tokens=2, recent_tokens=4), hp_dtype=torch.bfloat16, max_reqs=2,
                                   sink_rows=4)
    int2 = SimpleNamespace(kv_cache_dtype="int2")

    def runner(pool, mla):
        return SimpleNamespace(server_args=int2, token_to_kv_pool=pool, use_mla_backend=mla)

    assert factory(runner(mha, True))[0] == "expanded"
    assert factory(runner(mha, False))[0] == "mha"
    assert factory(runner(latent, True))[0] == "latent"


def test_backend_init_serves_the_ranks_heads_of_attn_mha_only(tmp_path, monkeypatch):
    """``OscarExpandedMLABackend.__init__`` (SGLang's own ``__init__`` stubbed) on a DeepSeek-V3-shaped model at
    TP 8, rank 5: a per-head rotation file of the expanded geometry (128 heads) is sliced to heads 80..95 as
    SGLang's column-parallel ``kv_b_proj`` shards them; only the ``attn_mha`` modules are planned (one geometry:
    16 q / 16 kv heads, 192 / 128; the ``attn_mqa`` twins with the same layer ids are left out); SGLang's
    split-KV scratch is sized by ``v_head_dim`` 1."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    import sglang.srt.runtime_context as rc
    from sglang_oscar.backend.expanded_backend import OscarExpandedMLABackend
    from sglang_oscar.backend.triton_backend import Geometry

    mc = _model_config(tmp_path)
    expanded = ModelGeometry.from_hf_config(mc.hf_config).expanded()
    gen = torch.Generator().manual_seed(7)
    k = {i: random_orthogonal(DK, 128, generator=gen) for i in range(3)}
    v = {i: random_orthogonal(V, 128, generator=gen) for i in range(3)}
    path = str(tmp_path / "per_head.safetensors")
    RotationSet(k, v, {"method": "test"}).save(path)
    config = OscarConfig(rotation_path=path, sink_tokens=4, recent_tokens=8, **EXPANDED)
    pool = OscarMHATokenToKVPool(8, page_size=1, dtype=torch.uint8, head_num=16, head_dim=DK, v_head_dim=V,
                                 layer_num=3, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
                                 oscar_config=config, hp_dtype=torch.bfloat16, max_reqs=2, sink_rows=8)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for i in range(3):
        attn = torch.nn.Module()
        for name, (hk, dk, dv) in (("attn_mqa", (1, 512 + P, 512)), ("attn_mha", (16, DK, V))):
            m = torch.nn.Module()
            for key, value in dict(layer_id=i, tp_q_head_num=16, tp_k_head_num=hk, qk_head_dim=dk, v_head_dim=dv,
                                   scaling=DK ** -0.5, logit_cap=0.0).items():
                setattr(m, key, value)
            attn.add_module(name, m)
        layer = torch.nn.Module()
        layer.self_attn = attn
        model.layers.append(layer)
    runner = SimpleNamespace(token_to_kv_pool=pool, model=model, device="cpu", model_config=mc,
                             req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 16, dtype=torch.int32)))
    monkeypatch.setattr(TritonAttnBackend, "__init__", lambda self, *a, **kw: setattr(self, "v_head_dim", V))
    monkeypatch.setattr(rc, "get_parallel", lambda: SimpleNamespace(attn_tp_rank=5, attn_tp_size=8))
    be = OscarExpandedMLABackend(runner)
    assert be.v_head_dim == 1
    assert set(be._layer_geometry.values()) == {Geometry(16, 16, DK, V, False)}
    assert sorted(be._layer_geometry) == [0, 1, 2]
    for i in range(3):
        rk, rv = be.rotations[i]
        assert torch.equal(rk, k[i][80:96]) and torch.equal(rv, v[i][80:96])
    assert expanded.layers[0].num_kv_heads == 128
