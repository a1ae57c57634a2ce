"""MiniMax-M3 (sparse / MSA attention) with ``--kv-cache-dtype int2`` on CPU (issue 27).

Checked: the pool (INT2 main K/V + SGLang's BF16 index pools, their bytes against SGLang's own cell
size formula, refused BF16 main writes, the allocator's frees), the sizing / pool / attention-wrapper
hooks, the launch refusals and the fold report. The sparse backend's tests are in
test_minimax_sparse_backend.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_oscar.config import OscarConfig
from sglang_oscar.pool.minimax_pool import OscarMiniMaxSparseKVPool, minimax_index_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))  # the kernel tests' fixtures
from kv_fixtures import fresh_seed  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HQ, HKV, D = 4, 2, 64
H_IDX, DI = 4, 32  # two index heads per kv head: SGLang unions their block lists
B, TOPK = 16, 3
SINK, RECENT = 4, 8
CTX, MAX_REQS = 96, 4
DENSE, SPARSE, NO_VALUE = [0], [1, 2], [2]  # layer 2 keeps no index value (sparse_disable_index_value)
CONFIG = OscarConfig(group_size=32, sink_tokens=SINK, recent_tokens=RECENT)


def _sparse_cfg(block=B):
    return dict(sparse_attention_freq=[0, 1, 1], sparse_disable_index_value=[0, 0, 1], sparse_num_index_heads=H_IDX,
                sparse_index_dim=DI, sparse_block_size=block, sparse_topk_blocks=TOPK, sparse_init_block=1,
                sparse_local_block=1)


def _hf(block=B, arch="MiniMaxM3SparseForCausalLM"):
    return SimpleNamespace(architectures=[arch], sparse_attention_config=_sparse_cfg(block))


def _pool(hp_dtype=torch.float32, start=0, end=3, size=160):
    return OscarMiniMaxSparseKVPool(size, 1, torch.uint8, HKV, D, DI, DENSE, SPARSE, "cpu",
                                    disable_value_sparse_layer_ids=NO_VALUE, index_dtype=hp_dtype, start_layer=start,
                                    end_layer=end, oscar_config=CONFIG, hp_dtype=hp_dtype, max_reqs=MAX_REQS,
                                    sink_rows=SINK * 4 * MAX_REQS, enable_alt_stream=False)


def _kvc(hf=None, dtype=torch.bfloat16, start=0, end=3):
    return SimpleNamespace(
        server_args=SimpleNamespace(kv_cache_dtype="int2", _oscar_config=CONFIG, page_size=1, enable_memory_saver=False,
                                    enable_pdmux=False, enable_dsa_cache_layer_split=False),
        model_config=SimpleNamespace(hf_config=hf or _hf(), get_num_kv_heads=lambda tp: HKV, head_dim=D, v_head_dim=D),
        layer_info=SimpleNamespace(start_layer=start, end_layer=end, num_effective_layers=end - start),
        use_mla_backend=False, is_hybrid_swa=False, is_draft_worker=False, mambaish_config=None, device="cpu",
        model_dtype=dtype, kv_cache_dtype=dtype)


# ------------------------------------------------------------------------------------------- pool
def test_pool_keeps_int2_main_rows_and_sglangs_index_pools():
    """INT2 planes for every layer, SGLang's BF16 index pools for the sparse ones (K+V / K only), index
    rows round-trip through SGLang's own set/get methods, BF16 main writes are refused naming the fix."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKOnlyPool, MHATokenToKVPool

    fresh_seed()
    pool = _pool(torch.bfloat16)
    assert (pool.layer_num, pool.start_layer, pool.head_num, pool.head_dim) == (3, 0, HKV, D)
    kc, kp, vc, vp, hk, hv = pool.int2_buffers(2)
    assert kc.dtype == torch.uint8 and tuple(kc.shape) == (161, HKV, D // 4) and tuple(vc.shape) == (161, HKV, D // 4)
    assert tuple(kp.shape) == (161, HKV, 2 * (D // 32)) and hk.dtype == torch.bfloat16
    assert [pool.is_int2_layer(i) for i in range(4)] == [True, True, True, False]
    assert [pool.is_sparse_layer(i) for i in range(3)] == [False, True, True] and not pool.is_swa_layer(1)
    assert type(pool.index_kv_pool) is MHATokenToKVPool and type(pool.index_k_pool) is MHATokenToKOnlyPool
    assert pool.index_kv_pool.layer_num == 1 and pool.index_k_pool.layer_num == 1
    ik, iv = pool.get_index_kv_buffer(1)
    assert tuple(ik.shape) == (161, 1, DI) and ik.dtype == torch.bfloat16
    loc = torch.tensor([3, 7, 9])
    k, v = torch.randn(3, 1, DI).bfloat16(), torch.randn(3, 1, DI).bfloat16()
    pool.set_index_kv_buffer(SimpleNamespace(layer_id=1), loc, k, v)
    pool.set_index_k_buffer(SimpleNamespace(layer_id=2), loc, v)
    assert torch.equal(ik[loc], k) and torch.equal(iv[loc], v) and torch.equal(pool.get_index_k_buffer(2)[loc], v)
    assert not ik[[0, 1, 2, 4]].any()  # no other slot touched
    with pytest.raises(ValueError, match="does not have an index V"):
        pool.get_index_kv_buffer(2)  # SGLang's own rule, unchanged
    with pytest.raises(RuntimeError, match="main K/V pool is INT2"):
        pool.set_kv_buffer(SimpleNamespace(layer_id=0), loc, k, v)
    with pytest.raises(RuntimeError, match="fused main K/V \\+ index store writes BF16 main rows"):
        pool.set_fused_kv_index_buffer(SimpleNamespace(layer_id=1), loc, k, v, k, v)
    with pytest.raises(ValueError, match="needs --page-size 1"):
        OscarMiniMaxSparseKVPool(64, 128, torch.uint8, HKV, D, DI, DENSE, SPARSE, "cpu", start_layer=0, end_layer=3,
                                 oscar_config=CONFIG, hp_dtype=torch.bfloat16, max_reqs=2, sink_rows=8)
    # a pipeline stage holding layers 1..2 only: its own slice of the split
    stage = _pool(torch.bfloat16, start=1, end=3)
    assert stage.layer_num == 2 and stage.sparse_layer_id_mapping == {1: 0, 2: 1} and not stage.is_int2_layer(0)


def test_pool_sets_every_attribute_sglangs_pool_sets():
    """``OscarMiniMaxSparseKVPool.__init__`` stands in for SGLang's (which allocates a BF16 main pool):
    every attribute SGLang's own ``MiniMaxSparseKVPool`` sets is set, and its layer maps and index pools'
    geometry are SGLang's, so code reading the pool (HiCache, PD transfer, the backends) finds them."""
    from sglang.srt.mem_cache.memory_pool import MiniMaxSparseKVPool

    sg = MiniMaxSparseKVPool(160, 1, torch.bfloat16, HKV, D, DI, DENSE, SPARSE, "cpu",
                             disable_value_sparse_layer_ids=NO_VALUE, index_dtype=torch.bfloat16, start_layer=0,
                             end_layer=3)
    ours = _pool(torch.bfloat16)
    assert set(vars(sg)) <= set(vars(ours)), set(vars(sg)) - set(vars(ours))
    for name in ("sparse_layer_id_mapping", "index_kv_layer_id_mapping", "index_k_layer_id_mapping", "layer_num",
                 "start_layer", "end_layer", "head_num", "head_dim", "size", "page_size"):
        assert getattr(ours, name) == getattr(sg, name), name
    assert ours.use_minimax_fused_kv_index_store is False  # ours writes main K/V and index keys apart
    for name in ("index_kv_pool", "index_k_pool"):
        a, b = getattr(sg, name), getattr(ours, name)
        assert type(a) is type(b) and (a is None or (a.layer_num, a.head_dim, a.dtype) == (b.layer_num, b.head_dim,
                                                                                           b.dtype)), name


def test_pool_bytes_are_int2_main_plus_sglangs_index_term(hooked):
    """Bytes per token = INT2 main K/V (3 layers x 2 heads x (16 code + 4 pair bytes) x 2) + the index
    pools' (2 x 1 K+V layer + 1 K-only layer) x 32 x 2 bytes; the index term equals SGLang's own M3 cell
    size minus its BF16 main part; ``get_kv_size_bytes`` counts the allocated planes, windows and index
    buffers; the allocator's free returns the sink rows of the freed slots."""
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.runtime_context import get_parallel

    from sglang_oscar.plugin import serving
    from sglang_oscar.pool.sizing import int2_cell_size

    pool = _pool(torch.bfloat16)
    main = 3 * HKV * 2 * (D // 4 + 2 * (D // 32) * 2)  # fp16 (scale, zero) pairs per 32-group
    index = (2 * 1 + 1) * DI * 2
    assert main == 3 * 2 * 2 * 24 and index == 192
    assert minimax_index_bytes(1, 1, DI, torch.bfloat16) == pool.index_bytes_per_token() == index
    assert pool.int2_bytes_per_token() == main + index == int2_cell_size(CONFIG, HKV, D, D, 3) + index
    kvc = _kvc()
    # SGLang's own cell size through a BF16 server's kvc: when another test left the plugin's hooks
    # applied, the int2 kvc would get the hooked (INT2) size
    bf16_kvc = SimpleNamespace(**{**vars(kvc), "server_args": SimpleNamespace(**{**vars(kvc.server_args),
                                                                                  "kv_cache_dtype": "auto"})})
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
        sglang = DefaultPoolConfigurator._compute_cell_size(DefaultPoolConfigurator.__new__(DefaultPoolConfigurator),
                                                            bf16_kvc, 3)
        ours = serving.around_compute_cell_size(lambda *a: -1, None, kvc, 3)
    assert sglang == 3 * 2 * HKV * D * 2 + index  # SGLang: BF16 main + the same index term
    assert ours == pool.int2_bytes_per_token()
    slots = 161
    k_bytes, v_bytes = pool.get_kv_size_bytes()
    rows = pool.windows.num_rows
    assert k_bytes == 3 * slots * HKV * 24 + 3 * rows * HKV * D * 2 + 2 * slots * DI * 2  # + index K of both layers
    assert v_bytes == 3 * slots * HKV * 24 + 3 * rows * HKV * D * 2 + slots * DI * 2  # + index V of layer 1
    # SGLang's allocator over this pool frees slots: their sink rows come back
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    alloc = TokenToKVPoolAllocator(slots - 1, torch.uint8, "cpu", pool, False)  # free / clear through the hooks
    w = pool.windows
    s = torch.arange(10, 14)
    w.assign(s, torch.arange(4), torch.zeros(4, dtype=torch.int64), torch.full((4,), 4))
    top = int(w.top)
    alloc.free(s[:2])
    w.process_releases()
    assert int(w.top) == top + 2 and (w.row_of_slot[10:12] == -1).all() and (w.row_of_slot[12:14] >= 0).all()
    alloc.clear()  # the hooked clear resets the windows
    assert int(w.top) == w.sink_rows and (w.row_of_slot == -1).all()


def test_pool_hook_and_startup_log(hooked, caplog):
    """``around_build_token_to_kv_pool`` builds the INT2 M3 pool for an M3 config (SGLang's split of its
    layers); the startup log states INT2 vs BF16 bytes per token with and without the index pools."""
    import logging

    from sglang.srt.runtime_context import get_parallel

    from sglang_oscar.plugin import minimax_serving, serving

    kvc = _kvc()
    req_pool = SimpleNamespace(req_to_token=torch.zeros(MAX_REQS, CTX, dtype=torch.int32))
    with get_parallel().override(attn_tp_size=1, attn_tp_rank=0):
        pool = serving.around_build_token_to_kv_pool(None, kvc, sizes=SimpleNamespace(max_total_num_tokens=128),
                                                     req_to_token_pool=req_pool)
    assert isinstance(pool, OscarMiniMaxSparseKVPool) and pool.size == 128
    assert pool.index_kv_layer_id_mapping == {1: 0} and pool.index_k_layer_id_mapping == {2: 0}
    assert pool.index_dtype == torch.bfloat16 and pool.hp_dtype == torch.bfloat16
    assert minimax_serving.minimax_layers(kvc) == ([0], [1, 2], [1], [2], DI)
    with caplog.at_level(logging.INFO, logger="sglang_oscar"):
        minimax_serving.log_minimax_sizes(kvc, CONFIG, HKV, D, D, 1000)
    msg = caplog.records[-1].getMessage()
    main, bf16 = 3 * HKV * 48, 3 * HKV * 2 * D * 2
    assert f"{main} bytes/token INT2 (BF16: {bf16}" in msg and "index pools (BF16, 1 key+value + 1 key-only" in msg
    assert f"total {main + 192} bytes/token (BF16: {bf16 + 192}" in msg and "tokens: 1000" in msg


# ------------------------------------------------------------------------------------------- hooks
def test_attention_wrapper_builds_the_oscar_sparse_backend_only_for_int2_m3(hooked, monkeypatch):
    """The hooked ``attn_backend_wrapper``: SGLang's hybrid over the OSCAR Triton backend and the OSCAR
    sparse backend for an int2 M3 runner; SGLang's wrapper for others (auto M3, int2 Qwen3); a
    non-OSCAR dense backend is refused; ``missing_hooks`` checks the target."""
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.layers.attention.minimax_sparse_backend import MiniMaxHybridAttnBackend
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_oscar.backend import minimax_backend
    from sglang_oscar.backend.triton_backend import OscarTritonAttnBackend
    from sglang_oscar.plugin.minimax_serving import MINIMAX_HOOK_TARGETS

    target = MINIMAX_HOOK_TARGETS[0]
    assert target in hooked.HOOK_TARGETS and target in HookRegistry._patched
    built = []

    class Sparse:
        def __init__(self, runner):
            built.append(runner)
            self.sparse_layer_ids = [1, 2]

    monkeypatch.setattr(minimax_backend, "OscarMiniMaxSparseBackend", Sparse)
    dense = object.__new__(OscarTritonAttnBackend)
    runner = SimpleNamespace(server_args=SimpleNamespace(kv_cache_dtype="int2"),
                             model_config=SimpleNamespace(hf_config=_hf()))
    got = attention_registry.attn_backend_wrapper(runner, dense)
    assert isinstance(got, MiniMaxHybridAttnBackend) and got.dense is dense and isinstance(got.sparse, Sparse)
    assert got.sparse_layer_ids == [1, 2] and got.sparse.dense_backend is dense and built == [runner]
    with pytest.raises(RuntimeError, match="not the OSCAR Triton backend; use --attention-backend triton"):
        attention_registry.attn_backend_wrapper(runner, object())
    # not int2, or not M3: SGLang's wrapper (for Qwen3: the full backend as is; M3 auto: SGLang's sparse backend)
    qwen = SimpleNamespace(server_args=SimpleNamespace(kv_cache_dtype="int2"), use_mla_backend=False,
                           model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["Qwen3ForCausalLM"])))
    monkeypatch.setattr(attention_registry, "hybrid_gdn_config", lambda mc: None)
    monkeypatch.setattr(attention_registry, "mambaish_config", lambda mc: None)
    assert attention_registry.attn_backend_wrapper(qwen, dense) is dense
    import sglang.srt.layers.attention.minimax_sparse_backend as sglang_m3

    monkeypatch.setattr(sglang_m3, "MiniMaxSparseAttnBackend", lambda r: SimpleNamespace(sparse_layer_ids=["sglang"]))
    auto = SimpleNamespace(server_args=SimpleNamespace(kv_cache_dtype="auto"), use_mla_backend=False,
                           model_config=SimpleNamespace(hf_config=_hf()))
    assert attention_registry.attn_backend_wrapper(auto, "full").sparse_layer_ids == ["sglang"]
    assert len(built) == 1


def test_m3_refusals_name_the_fix(tmp_path, monkeypatch):
    """An M3 launch is no longer refused outright; what the INT2 path cannot honour is: the dense
    sparse decode env, ROCm, a block size the kernel does not take. Other models are untouched."""
    from sglang_oscar.plugin.refusals import minimax_m3_messages, refusal_messages

    cfg = {"model_type": "minimax_m3_vl", "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
           "text_config": {"model_type": "minimax_m2", "num_hidden_layers": 3, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 64, "sparse_attention_config": _sparse_cfg()}}
    d = tmp_path / "m3"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    monkeypatch.delenv("SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE", raising=False)
    assert refusal_messages(SimpleNamespace(model_path=str(d), tp_size=1)) == []
    assert minimax_m3_messages(cfg, environ={}, hip=False) == []
    (env,) = minimax_m3_messages(cfg, environ={"SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE": "1"}, hip=False)
    assert "unset SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE" in env
    (rocm,) = minimax_m3_messages(cfg, environ={}, hip=True)
    assert "on ROCm" in rocm and "--kv-cache-dtype auto" in rocm
    odd = json.loads(json.dumps(cfg))
    odd["text_config"]["sparse_attention_config"]["sparse_block_size"] = 256
    (block,) = minimax_m3_messages(odd, environ={}, hip=False)
    assert "sparse_block_size 256" in block and "16, 32, 64 or 128" in block
    monkeypatch.setenv("SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE", "true")
    assert "unset" in refusal_messages(SimpleNamespace(model_path=str(d), tp_size=1))[0]
    assert minimax_m3_messages({"architectures": ["MiniMaxM2ForCausalLM"]}, environ={"x": "1"}, hip=True) == []
    # the prefill CUDA graph SGLang resolved: breakable (its CUDA default) refused for M3, full for every model
    monkeypatch.delenv("SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE")
    graph = lambda backend: SimpleNamespace(prefill=SimpleNamespace(backend=backend))
    m2 = tmp_path / "m2"
    m2.mkdir()
    (m2 / "config.json").write_text(json.dumps({"architectures": ["MiniMaxM2ForCausalLM"], "num_attention_heads": 8,
                                                "num_key_value_heads": 2}))
    for backend, m3_refused, m2_refused in (("breakable", "--disable-prefill-cuda-graph", None), ("disabled", None, None),
                                            ("tc_piecewise", None, None), ("full", "full-graph", "full-graph")):
        for path, expect in ((d, m3_refused), (m2, m2_refused)):
            msgs = refusal_messages(SimpleNamespace(model_path=str(path), tp_size=1, cuda_graph_config=graph(backend)))
            assert (msgs == []) == (expect is None) and all(expect in m for m in msgs), (backend, path, msgs)


def test_m3_refusals_from_a_hub_id(monkeypatch):
    """A Hub id has no local ``config.json``: the refusals read the config SGLang loaded in
    ``ServerArgs.__post_init__`` (``server_args.model_config.hf_config``) -- the recipe's launch path."""
    from transformers import PretrainedConfig

    from sglang_oscar.plugin.refusals import refusal_messages

    monkeypatch.delenv("SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE", raising=False)
    hf = PretrainedConfig(architectures=["MiniMaxM3SparseForConditionalGeneration"],
                          text_config={"model_type": "minimax_m2", "num_hidden_layers": 3, "num_attention_heads": 4,
                                       "num_key_value_heads": 2, "head_dim": 64,
                                       "sparse_attention_config": _sparse_cfg()})
    graph = SimpleNamespace(prefill=SimpleNamespace(backend="breakable"))
    args = SimpleNamespace(model_path="MiniMaxAI/MiniMax-M3", tp_size=1, cuda_graph_config=graph)
    assert refusal_messages(args) == []  # before __post_init__ built the config: nothing known yet
    args.model_config = SimpleNamespace(hf_config=hf)
    (msg,) = refusal_messages(args)
    assert "breakable prefill CUDA graph" in msg and "--disable-prefill-cuda-graph" in msg
    monkeypatch.setenv("SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE", "1")
    assert any("unset SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE" in m for m in refusal_messages(args))


def test_fold_keeps_m3_layers_at_run_time():
    """``--oscar-fold-rotations on``: M3's attention (its sparse layers' qkv_proj emptied into a fused
    projection after loading) is not a class whose V path the fold knows: every layer is reported
    kept, and nothing is folded."""
    from sglang_oscar.backend.fold import fold_value_rotations

    M3 = type("MiniMaxM3Attention", (torch.nn.Module,), {})
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for i in range(2):
        m = M3()
        m.qkv_proj = torch.nn.Linear(8, 0 if i else 24)  # the sparse layer's emptied projection
        m.o_proj = torch.nn.Linear(8, 8)
        m.attn = SimpleNamespace(layer_id=i)
        model.layers.append(m)
    report = fold_value_rotations(model, {0: torch.eye(8), 1: torch.eye(8)})
    assert report.folded == [] and sorted(report.kept) == [0, 1]
    why = "MiniMaxM3Attention is not one whose V path is known to be linear"
    assert all(why in reason for reason in report.kept.values())
