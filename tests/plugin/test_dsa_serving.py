"""DSA models (GLM-5 ``glm_moe_dsa``) with ``--kv-cache-dtype int2``: the launch checks, the pool with
SGLang's indexer key buffer, its sizing, the paged allocator's frees and the backend entry, on CPU.

SGLang's ``ServerArgs`` reads the device capability for DSA configs: one test stands an H200's in
and builds it; the others call the launch hooks as ``ServerArgs.__post_init__`` does. The attention
over the INT2 latent with a DSA selection is tested in ``test_latent_backend.py`` (backend) and
``tests/kernels/test_latent.py`` (kernels).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang_oscar.config import OscarConfig


def _glm5_config():
    """A tiny GLM-5 (``moe_layer_freq`` / ``topk_method`` / ``scoring_func`` are read by SGLang, not
    declared by transformers' config)."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(
        architectures=["GlmMoeDsaForCausalLM"], vocab_size=256, hidden_size=128, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, topk_method="noaux_tc",
        scoring_func="sigmoid", kv_lora_rank=512, q_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, index_topk=2048, index_head_dim=128, index_n_heads=32,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=4096)


def _dense_dict() -> dict:
    """The same config without an indexer (``index_topk`` unset): SGLang's dense MLA rules apply."""
    return {**_glm5_config().to_dict(), "index_topk": None}


def _glm5_dir(tmp_path):
    d = tmp_path / "glm5"
    _glm5_config().save_pretrained(d)
    return str(d)


def _dsa_pool(size=256, page_size=64, layers=2, device="cpu", max_reqs=2, **kw):
    from sglang_oscar.pool.dsa_pool import OscarDSALatentPool

    return OscarDSALatentPool(size, page_size=page_size, dtype=torch.uint8, kv_lora_rank=512, qk_rope_head_dim=64,
                              layer_num=layers, device=device, enable_memory_saver=False,
                              oscar_config=OscarConfig(sink_tokens=4, recent_tokens=8), hp_dtype=torch.bfloat16,
                              max_reqs=max_reqs, sink_rows=16, **{"index_head_dim": 128, **kw})


def test_glm5_launch_takes_sglangs_dsa_page_size_and_backend(hooked, tmp_path):
    """A GLM-5 config passes the preflight (data-free latent rotation of its MLA layers); an int2 launch
    defaults to the "dsa" backend; SGLang's DSA page size 64 and the dsa backend pass the refusals, a
    page size 1 or the triton backend (which would run without the indexer) are refused naming the fix;
    a dense DeepSeek-V3 keeps the triton rules."""
    from sglang_oscar.plugin.refusals import is_dsa_model, refusal_messages

    model = _glm5_dir(tmp_path)
    assert hooked.preflight(SimpleNamespace(model_path=model, _oscar_config=OscarConfig())) is None
    assert is_dsa_model(SimpleNamespace(model_path=model))
    args = SimpleNamespace(model_path=model, kv_cache_dtype="int2", attention_backend=None)
    hooked._before_post_init(args)
    assert args.attention_backend == "dsa"
    assert refusal_messages(SimpleNamespace(model_path=model, page_size=64, attention_backend="dsa")) == []
    msgs = refusal_messages(SimpleNamespace(model_path=model, page_size=1, attention_backend="triton"))
    assert len(msgs) == 2
    assert "--page-size 1" in msgs[0] and "DSA page size 64; drop --page-size" in msgs[0]
    assert "--attention-backend 'triton'" in msgs[1] and "indexer runs only under the dsa backend" in msgs[1]
    # a Hub id: no local config.json, the config SGLang loaded in its __post_init__ decides
    hub = SimpleNamespace(model_path="zai-org/GLM-5", model_config=SimpleNamespace(hf_config=_glm5_config()),
                          page_size=64, attention_backend="triton")
    assert is_dsa_model(hub) and "pass --attention-backend dsa" in refusal_messages(hub)[0]
    assert not is_dsa_model(SimpleNamespace(model_path="zai-org/GLM-5"))  # before SGLang loaded it
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps(_dense_dict()))
    assert not is_dsa_model(SimpleNamespace(model_path=str(dense)))
    msgs = refusal_messages(SimpleNamespace(model_path=str(dense), page_size=64, attention_backend="dsa"))
    assert "token-granular; use --page-size 1" in msgs[0] and "use --attention-backend triton" in msgs[1]


def test_glm5_int2_server_args_resolve_through_sglangs_dsa_defaults(hooked, tmp_path, monkeypatch):
    """SGLang's own ``ServerArgs`` for a GLM-5 directory with ``--kv-cache-dtype int2`` (the device
    capability of an H200 stood in: SGLang's DSA defaults read it): its DSA branch sets page size 64,
    the plugin's hooks keep int2 through the DSA dtype pass and pick the dsa backend, and SGLang's own
    DSA kernel picks pass; an explicit ``--attention-backend triton`` or DSA kernel choice is refused
    naming the fix."""
    from sglang.srt.server_args import ServerArgs

    from _support.server_args import int2_server_args

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    model = _glm5_dir(tmp_path)
    args = int2_server_args(model, monkeypatch)
    assert (args.kv_cache_dtype, args.attention_backend, args.page_size) == ("int2", "dsa", 64)
    assert args.dsa_decode_backend is not None and args.dsa_prefill_backend is not None  # SGLang's picks
    with pytest.raises(ValueError, match="indexer runs only under the dsa backend; pass --attention-backend dsa"):
        ServerArgs(model_path=model, kv_cache_dtype="int2", skip_tokenizer_init=True, device="cuda",
                   attention_backend="triton")
    for field, flag in (("dsa_decode_backend", "--dsa-decode-backend"), ("dsa_prefill_backend", "--dsa-prefill-backend")):
        with pytest.raises(ValueError, match=f"does not support {flag} 'flashmla_sparse': .*drop the flag"):
            ServerArgs(model_path=model, kv_cache_dtype="int2", skip_tokenizer_init=True, device="cuda",
                       **{field: "flashmla_sparse"})
    bf16 = ServerArgs(model_path=model, skip_tokenizer_init=True, device="cuda", dsa_decode_backend="flashmla_sparse")
    assert bf16.dsa_decode_backend == "flashmla_sparse"  # SGLang's own DSA path keeps the choice


def test_dsa_defaults_pass_keeps_int2(hooked):
    """SGLang's DSA defaults pass asserts a BF16 / FP8 KV dtype: the hook keeps int2 and passes others on."""
    from sglang.srt.arg_groups import overrides

    from sglang_oscar.plugin import serving

    calls = []
    assert serving.around_dsa_kv_cache_dtype_default(calls.append, SimpleNamespace(kv_cache_dtype="int2")) == {}
    assert calls == []
    view = SimpleNamespace(kv_cache_dtype="auto")
    serving.around_dsa_kv_cache_dtype_default(calls.append, view)
    assert calls == [view]
    # the module attribute ServerArgs imports at its legacy slot is the hooked one
    assert overrides._dsa_kv_cache_dtype_default(SimpleNamespace(kv_cache_dtype="int2")) == {}


def test_dsa_pool_keeps_sglangs_index_buffer_beside_the_int2_latent():
    """OscarDSALatentPool: SGLang's page-major index buffer and accessors, unchanged; bytes per token =
    the INT2 latent's + the index key's 132 (BF16 DSA: 1,152 + 132); SGLang's checks: page size 64 on
    CUDA, index_head_dim 128; the plain latent pool refuses DSA naming this class."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    from sglang_oscar.pool.dsa_pool import OscarDSALatentPool, dsa_index_bytes
    from sglang_oscar.pool.latent_pool import OscarMLATokenToKVPool

    pool = _dsa_pool()
    pages = (256 + 64 + 1) // 64
    assert [tuple(b.shape) for b in pool.index_k_with_scale_buffer] == [(pages, 64 * (128 + 4))] * 2
    assert pool.index_k_with_scale_buffer[0].dtype == torch.uint8
    assert pool.get_index_k_with_scale_buffer(1) is pool.index_k_with_scale_buffer[1]
    for name in ("get_index_k_scale_buffer", "set_index_k_scale_buffer", "get_index_k_continuous"):
        assert getattr(OscarDSALatentPool, name) is getattr(DSATokenToKVPool, name)
    assert pool.use_dsa and not pool.dsa_kv_cache_store_fp8 and pool.kv_cache_dim == 576
    assert dsa_index_bytes(128, 2) == 2 * 132
    assert pool.int2_bytes_per_token() == 2 * (272 + 132)
    index = sum(b.numel() for b in pool.index_k_with_scale_buffer)
    assert pool.get_kv_size_bytes() == _dsa_pool(layers=2).get_kv_size_bytes() == (
        OscarMLATokenToKVPool.get_kv_size_bytes(pool) + index)
    assert pool.windows.num_slots == 256 + 64  # slots of a paged pool: size + page_size
    assert (1152 + 132) / (272 + 132) > 3.1  # INT2 DSA latent vs SGLang's BF16 DSA pool, per layer
    with pytest.raises(ValueError, match="DSA page size 64 \\(got --page-size 1\\); drop --page-size"):
        _dsa_pool(page_size=1, device="cuda")  # checked before anything is allocated
    with pytest.raises(ValueError, match="index_head_dim 64: SGLang's indexer kernels take 128"):
        _dsa_pool(index_head_dim=64)
    with pytest.raises(ValueError, match="is OscarDSALatentPool"):
        OscarMLATokenToKVPool(64, 1, torch.uint8, 512, 64, layer_num=1, device="cpu", enable_memory_saver=False,
                              use_dsa=True, oscar_config=OscarConfig(), hp_dtype=torch.bfloat16, max_reqs=2,
                              sink_rows=8)


def test_dsa_cell_size_counts_the_index_keys(hooked):
    """The sizing hook's bytes per token of a DSA model = the pool's per slot (latent + index key), as
    SGLang's own DSA cell size adds its indexer keys; a dense MLA model has none."""
    from sglang_oscar.plugin import serving

    config = OscarConfig(sink_tokens=4, recent_tokens=8)

    def kvc(hf):
        return SimpleNamespace(use_mla_backend=True, server_args=SimpleNamespace(kv_cache_dtype="int2",
                                                                                _oscar_config=config),
                               model_config=SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, hf_config=hf),
                               model_dtype=torch.bfloat16)

    assert serving.around_compute_cell_size(None, None, kvc(_glm5_config()), 2) == _dsa_pool().int2_bytes_per_token()
    assert serving.around_compute_cell_size(None, None, kvc(_dense_dict()), 2) == 2 * 272


def test_paged_free_returns_the_sink_rows_of_whole_pages(hooked):
    """SGLang's paged allocator (page 64 for DSA) frees the whole page of every index it is given: the
    free hook releases every slot of those pages, so a request's sink rows come back even when the
    freed indices name only part of its first page."""
    from sglang_oscar.plugin import serving
    from sglang_oscar.pool.windows import HPWindows

    w = HPWindows(256 + 64, 2, 4, 8, 8, "cpu")
    slots = torch.arange(64, 68)  # page 1 holds request 0's positions 0..3: four sink rows
    w.assign(slots, torch.arange(4), torch.zeros(4, dtype=torch.int64), torch.full((4,), 4))
    assert int(w.top) == 4
    kvcache = SimpleNamespace(owns_windows=True, windows=w)
    alloc = SimpleNamespace(page_size=64, is_not_in_free_group=True, get_kvcache=lambda: kvcache)
    freed = []
    serving.around_allocator_free(lambda self, idx: freed.append(idx), alloc, torch.tensor([66]))
    w.process_releases()
    assert int(w.top) == 8 and (w.row_of_slot[64:68] == -1).all()  # all four rows back
    assert freed[0].tolist() == [66]  # SGLang's free itself gets what it was given


def test_backend_factory_builds_the_dsa_backend_for_int2(hooked, monkeypatch):
    """ATTENTION_BACKENDS["dsa"]: the OSCAR DSA backend for an int2 runner, SGLang's otherwise."""
    from sglang.srt.layers.attention import attention_registry

    from sglang_oscar.backend import dsa_backend

    monkeypatch.setattr(dsa_backend, "OscarDSALatentBackend", lambda runner: ("oscar-dsa", runner))
    factory = attention_registry.ATTENTION_BACKENDS["dsa"]
    assert getattr(factory, "_oscar", False)
    assert factory(SimpleNamespace(server_args=SimpleNamespace(kv_cache_dtype="int2")))[0] == "oscar-dsa"
    monkeypatch.setattr(attention_registry, "ATTENTION_BACKENDS",
                        {"triton": lambda runner: ("sglang", runner), "dsa": lambda runner: ("sglang-dsa", runner)})
    from sglang_oscar.plugin import serving

    serving.install_backend_factory()
    wrapped = attention_registry.ATTENTION_BACKENDS["dsa"]
    assert wrapped(SimpleNamespace(server_args=SimpleNamespace(kv_cache_dtype="auto")))[0] == "sglang-dsa"


def test_dsa_backend_runs_sglangs_metadata_then_the_latent_backends(monkeypatch):
    """OscarDSALatentBackend: every metadata hook runs SGLang's DSA metadata (the indexer reads it), then
    the inner latent backend's; attention goes to the inner backend with the DSA arguments as given;
    SGLang's dense MHA prefill stays off; a pool that is not the INT2 DSA pool is refused first."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

    from sglang_oscar.backend.dsa_backend import OscarDSALatentBackend

    calls = []
    hooks = ("init_forward_metadata", "init_cuda_graph_state", "init_forward_metadata_out_graph",
             "init_forward_metadata_in_graph", "set_dsa_prefill_impl")
    for name in hooks:
        monkeypatch.setattr(DeepseekSparseAttnBackend, name,
                            lambda self, *a, _n=name: calls.append(("sglang", _n, a)))

    class Inner:  # the latent backend, recording
        def __getattr__(self, name):
            return lambda *a, **k: calls.append(("latent", name, a, k)) or f"{name} out"

    be = object.__new__(OscarDSALatentBackend)
    be.latent, be.use_mha = Inner(), True
    fb = object()
    be.init_forward_metadata(fb)
    be.init_cuda_graph_state(8, 64)
    be.init_forward_metadata_out_graph(fb, True)
    be.init_forward_metadata_in_graph(fb)
    assert [c[:2] for c in calls] == [(who, n) for n in hooks[:4] for who in ("sglang", "latent")]
    assert calls[5][2:] == ((fb, True), {})  # in_capture reaches the latent backend (its graph plans)
    be.set_dsa_prefill_impl(fb)
    assert be.use_mha is False
    calls.clear()
    assert be.forward_decode("q", "k", "v", "layer", fb, q_rope="qr", k_rope="kr", topk_indices="t") == "forward_decode out"
    assert be.forward_extend("q", "k", "v", "layer", fb, False, q_rope="qr", k_rope="kr", topk_indices="t",
                             cos_sin_cache=None) == "forward_extend out"
    dsa = {"q_rope": "qr", "k_rope": "kr", "topk_indices": "t"}
    assert calls == [("latent", "forward_decode", ("q", "k", "v", "layer", fb, True), dsa),
                     ("latent", "forward_extend", ("q", "k", "v", "layer", fb, False), {**dsa, "cos_sin_cache": None})]
    with pytest.raises(RuntimeError, match="not the INT2 DSA latent pool"):
        OscarDSALatentBackend(SimpleNamespace(token_to_kv_pool=object()))


def test_pool_hook_builds_the_dsa_pool_for_glm5(hooked):
    """``around_build_token_to_kv_pool`` for a GLM-5 config: the INT2 DSA latent pool at SGLang's page
    size, one index buffer page per 64 slots, and the sizing hook's bytes per token equal to its own."""
    from sglang_oscar.plugin import serving
    from sglang_oscar.pool.dsa_pool import OscarDSALatentPool

    config = OscarConfig(sink_tokens=4, recent_tokens=8)
    server_args = SimpleNamespace(kv_cache_dtype="int2", page_size=64, enable_memory_saver=False, _oscar_config=config)
    kvc = SimpleNamespace(
        server_args=server_args, use_mla_backend=True, is_hybrid_swa=False, is_draft_worker=False, device="cpu",
        model_dtype=torch.bfloat16, mambaish_config=None,
        model_config=SimpleNamespace(hf_config=_glm5_config(), kv_lora_rank=512, qk_rope_head_dim=64),
        layer_info=SimpleNamespace(num_effective_layers=2, start_layer=0, end_layer=2))
    req_pool = SimpleNamespace(req_to_token=torch.zeros(2, 256, dtype=torch.int32))
    pool = serving.around_build_token_to_kv_pool(None, kvc, sizes=SimpleNamespace(max_total_num_tokens=256),
                                                 req_to_token_pool=req_pool)
    assert isinstance(pool, OscarDSALatentPool) and pool.page_size == 64 and pool.index_head_dim == 128
    assert pool.latent_buffers(1)["codes"].shape == (256 + 64, 128)
    assert pool.int2_bytes_per_token() == serving.around_compute_cell_size(None, None, kvc, 2) == 2 * (272 + 132)


def test_dsa_backend_builds_over_the_dsa_pool(monkeypatch):
    """``OscarDSALatentBackend.__init__`` with SGLang's own DSA ``__init__`` (an H200's capability stood
    in; the inner backend's Triton ``__init__`` stubbed) on a GLM-5 runner: positions from the indexer
    (unfused top-k), an inner latent backend with the model's top-k width and a ``[requests, 2048]``
    selection buffer, rotations of both MLA layers."""
    import sglang.srt.runtime_context as rc
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from sglang_oscar.backend.dsa_backend import OscarDSALatentBackend

    monkeypatch.setattr(TritonAttnBackend, "__init__", lambda self, *a, **k: None)
    import sglang.srt.layers.attention.dsa_backend as sglang_dsa

    one_rank = lambda: SimpleNamespace(attn_tp_rank=0, attn_tp_size=1)  # noqa: E731
    monkeypatch.setattr(rc, "get_parallel", one_rank)
    monkeypatch.setattr(sglang_dsa, "get_parallel", one_rank)  # bound when SGLang's module was imported
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: (9, 0))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for i in range(2):  # the absorbed MLA attention of each layer, as RadixAttention describes it
        m = torch.nn.Module()
        for k, v in dict(layer_id=i, tp_q_head_num=4, tp_k_head_num=1, qk_head_dim=576, v_head_dim=512,
                         scaling=0.1, logit_cap=0.0).items():
            setattr(m, k, v)
        model.layers.append(m)
    server_args = SimpleNamespace(enable_deterministic_inference=False, dsa_prefill_backend="flashmla_sparse",
                                  dsa_decode_backend="fa3", dsa_topk_backend="torch", speculative_eagle_topk=None,
                                  speculative_num_draft_tokens=None, kv_cache_dtype="int2", disaggregation_mode="null")
    runner = SimpleNamespace(
        device="cpu", page_size=64, server_args=server_args, token_to_kv_pool=_dsa_pool(max_reqs=4), model=model,
        model_config=SimpleNamespace(hf_config=_glm5_config(), context_len=4096, num_attention_heads=4,
                                     qk_nope_head_dim=64, kv_lora_rank=512, qk_rope_head_dim=64),
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, 4096, dtype=torch.int32), size=4),
        hisparse_coordinator=None, kv_cache_dtype=torch.uint8)
    be = OscarDSALatentBackend(runner)
    assert be.use_fused_topk is False and be.dsa_index_topk == 2048 and be.use_mha is False
    assert be.latent._dsa_topk == 2048 and tuple(be.latent._topk.shape) == (4, 2048)
    assert sorted(be.latent.rotations) == [0, 1] and be.latent._heads == 4
