"""MiniMax-M3 (sparse / MSA attention) with ``--kv-cache-dtype int2`` on CPU (issue 27).

Checked: the pool (INT2 main K/V + SGLang's BF16 index pools, their bytes against SGLang's own cell
size formula, refused BF16 main writes, the allocator's frees), the sizing / pool / attention-wrapper
hooks, the launch refusals, the fold report, and the sparse backend: SGLang's own ``__init__`` with the
BF16-only paths off, the indexer call's plumbing (SGLang's indexer kernels stood in by the reference
selection: they are autotuned and do not run under the Triton interpreter) and ``forward_extend`` /
``forward_decode`` with a fixed selection against the oracle (``reference.attention.attend`` with
``reference.sparse.block_topk_key_mask``), fp32.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from _support.forward import Mode
from _support.orthogonal import random_orthogonal
from _support.served import cpu_backend
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


def test_pool_bytes_are_int2_main_plus_sglangs_index_term():
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
    w = pool.windows
    s = torch.arange(10, 14)
    w.assign(s, torch.arange(4), torch.zeros(4, dtype=torch.int64), torch.full((4,), 4))
    top = int(w.top)
    alloc = SimpleNamespace(is_not_in_free_group=True, _kvcache=pool)
    freed = []
    serving.around_allocator_free(lambda self, idx: freed.append(idx), alloc, s[:2])
    w.process_releases()
    assert int(w.top) == top + 2 and (w.row_of_slot[10:12] == -1).all() and (w.row_of_slot[12:14] >= 0).all()
    assert freed[0].tolist() == [10, 11]


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


# ------------------------------------------------------------------------------------------- backend
def _layer(lid):
    return SimpleNamespace(layer_id=lid, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                           scaling=D ** -0.5, logit_cap=0.0, sliding_window_size=-1, logit_capping_method="tanh",
                           is_cross_attention=False)


def _runner(pool, req_to_token, block=B):
    return SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                           model_config=SimpleNamespace(hf_config=_hf(block), context_len=CTX, num_attention_heads=HQ),
                           server_args=SimpleNamespace(speculative_algorithm=None, kv_cache_dtype="int2"))


def _extend_batch(reqs, starts, ends, slots):
    n = [e - s for s, e in zip(starts, ends)]
    return SimpleNamespace(
        forward_mode=Mode("extend"), batch_size=len(reqs), out_cache_loc=torch.cat(slots),
        positions=torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)]), req_pool_indices=torch.tensor(reqs),
        seq_lens=torch.tensor(ends), seq_lens_cpu=torch.tensor(ends), extend_seq_lens=torch.tensor(n),
        extend_prefix_lens=torch.tensor(starts),
        extend_seq_lens_cpu=n, minimax_m3_precached_sparse_layers=None)


def _decode_batch(reqs, positions, slots):
    return SimpleNamespace(forward_mode=Mode("decode"), batch_size=len(reqs), out_cache_loc=torch.cat(slots),
                           positions=torch.tensor(positions), req_pool_indices=torch.tensor(reqs),
                           seq_lens=torch.tensor(positions) + 1, seq_lens_cpu=torch.tensor(positions) + 1,
                           minimax_m3_precached_sparse_layers=None)


def test_sparse_backend_init_runs_sglangs_with_the_bf16_paths_off(monkeypatch):
    """SGLang's own ``MiniMaxSparseAttnBackend.__init__`` on a stand-in runner: its block settings from the
    config, MSA and the dense-sparse decode off (they read BF16 main rows) even where SGLang would turn
    them on; a BF16 pool and a block size the kernel does not take are refused."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention.minimax_sparse_ops import msa

    from sglang_oscar.backend.minimax_backend import OscarMiniMaxSparseBackend

    pool = _pool(torch.bfloat16)
    monkeypatch.setattr(msa, "msa_available", lambda: True)
    monkeypatch.setattr(envs.SGLANG_OPT_USE_MINIMAX_DENSE_SPARSE_DECODE, "get", lambda: True)
    be = OscarMiniMaxSparseBackend(_runner(pool, torch.zeros(MAX_REQS, CTX, dtype=torch.int32)))
    assert (be.block_size_k, be.topk_blocks, be.init_blocks, be.local_blocks) == (B, TOPK, 1, 1)
    assert be.sparse_layer_ids == SPARSE and be.disable_value_layer_ids == set(NO_VALUE) and be.kv_pool is pool
    assert not (be.use_msa or be._use_msa_decode or be._msa_owns_decode or be.use_dense_sparse_decode)
    with pytest.raises(ValueError, match="sparse_block_size 8: the INT2 block-sparse attention takes"):
        OscarMiniMaxSparseBackend(_runner(pool, torch.zeros(MAX_REQS, CTX, dtype=torch.int32), block=8))
    with pytest.raises(RuntimeError, match="not the INT2 MiniMax pool"):
        OscarMiniMaxSparseBackend(SimpleNamespace(token_to_kv_pool=object()))


def test_select_runs_sglangs_indexer_and_unions_per_kv_head(monkeypatch):
    """``_select``'s plumbing: SGLang's indexer kernels (stood in by the reference selection, computed
    from exactly the arguments SGLang's kernels take: index pool, ``req_to_token``, request slots,
    ``cu_seqlens`` / ``prefix_lens`` / ``seq_lens``) over the index keys the pool holds, then
    ``topk_index_reduce``'s union of each kv head's two index heads: equal to the reference selection
    per kv head, for an extend batch of two requests (one with a prefix) and a decode batch."""
    import sglang.kernels.ops.attention.minimax_sparse.decode.flash_with_topk_idx as dec
    import sglang.kernels.ops.attention.minimax_sparse.prefill.flash_with_topk_idx as pre

    from sglang_oscar.backend.minimax_backend import OscarMiniMaxSparseBackend
    from sglang_oscar.reference.sparse import minimax_block_selection

    gen = torch.Generator().manual_seed(fresh_seed())
    pool = _pool(torch.bfloat16)
    r2t = torch.zeros(MAX_REQS, CTX, dtype=torch.int32)
    be = OscarMiniMaxSparseBackend(_runner(pool, r2t))
    # bf16-exact keys: the pool holds them in bf16, and the expected lists are computed from the same
    # values (fp32 keys would select differently on near-equal block scores, ~7% of seeds)
    keys = {1: torch.randn(60, 1, DI, generator=gen).bfloat16().float(),
            3: torch.randn(30, 1, DI, generator=gen).bfloat16().float()}
    r2t[1, :60], r2t[3, :30] = torch.arange(1, 61), torch.arange(61, 91)
    for req, k in keys.items():
        pool.set_index_k_buffer(_layer(2), r2t[req, : len(k)].long(), k.bfloat16())
    sel = dict(block_size=B, topk=TOPK, init_blocks=1, local_blocks=1, score_type="max")
    calls = []

    def per_head(q, k_cache, req_to_token, slot, positions, seq_len):
        k = k_cache[req_to_token[slot, :seq_len].long()].float()
        return minimax_block_selection(q.float(), k, positions, kv_heads=H_IDX, **sel)

    def prefill(q, k_cache, v_cache, sink, req_to_token, slot_ids, cu_seqlens, seq_lens, prefix_lens, max_seqlen_q,
                max_seqlen_k, block_size_q, block_size_k, topk, init_blocks, local_blocks, score_type,
                disable_index_value, cu_seqblocks_q, max_seqblock_q, all_seqblock_q, **kw):
        calls.append(("prefill", v_cache, disable_index_value, block_size_q, all_seqblock_q, max_seqlen_q))
        lists = [per_head(q[cu_seqlens[b]:cu_seqlens[b + 1]], k_cache, req_to_token, int(slot_ids[b]),
                          torch.arange(int(prefix_lens[b]), int(seq_lens[b])), int(seq_lens[b]))
                 for b in range(len(slot_ids))]
        return None, torch.cat(lists, dim=1)

    def decode(q, sink, k_cache, v_cache, req_to_token, seq_lens, max_seqlen, slot_ids, block_size, topk, init_blocks,
               local_blocks, score_type, disable_index_value, use_dense_main_attn, page_size, **kw):
        calls.append(("decode", v_cache, disable_index_value, use_dense_main_attn, page_size))
        lists = [per_head(q[b:b + 1], k_cache, req_to_token, int(slot_ids[b]), seq_lens[b:b + 1] - 1, int(seq_lens[b]))
                 for b in range(len(slot_ids))]
        return None, torch.cat(lists, dim=1), None

    monkeypatch.setattr(pre, "flash_prefill_with_topk_index", prefill)
    monkeypatch.setattr(dec, "flash_decode_with_topk_idx", decode)
    iq = torch.randn(60 + 30, H_IDX, DI, generator=gen).bfloat16()
    be._max_seqlen_q, be._max_seqlen_k = 20, 60
    fb = _extend_batch([1, 3], [40, 0], [60, 30], [r2t[1, 40:60], r2t[3, :30]])
    idx_o, blocks = be._select(iq[:50], _layer(2), fb, True)
    want = torch.cat([minimax_block_selection(iq[:20].float(), keys[1], torch.arange(40, 60), kv_heads=HKV, **sel),
                      minimax_block_selection(iq[20:50].float(), keys[3], torch.arange(30), kv_heads=HKV, **sel)],
                     dim=1)
    assert idx_o is None and blocks.dtype == torch.int32 and tuple(blocks.shape) == (HKV, 50, 2 * TOPK)
    assert torch.equal(blocks, want) and (blocks[..., 3:] >= 0).any()  # the union widens some lists past topk
    assert calls[-1] == ("prefill", None, True, 1, 50, 20)
    fb = _decode_batch([3, 1], [29, 59], [r2t[3, 29:30], r2t[1, 59:60]])
    _, blocks = be._select(iq[50:52], _layer(2), fb, True)
    want = torch.cat([minimax_block_selection(iq[50:51].float(), keys[3], torch.tensor([29]), kv_heads=HKV, **sel),
                      minimax_block_selection(iq[51:52].float(), keys[1], torch.tensor([59]), kv_heads=HKV, **sel)],
                     dim=1)
    assert torch.equal(blocks, want) and calls[-1] == ("decode", None, True, False, 1)


class M3Served:
    """The INT2 M3 pool, the OSCAR Triton backend (dense layers, windows) and the OSCAR sparse backend under
    SGLang's ``MiniMaxHybridAttnBackend``, fp32, with ``_select`` replaced by a fixed selection. The rotated
    rows the backend hands ``write_rotated`` are recorded per (layer, slot): the oracle quantizes exactly
    those (a rotation rounded one ulp apart may flip a code at a level boundary)."""

    def __init__(self, gen):
        from sglang.srt.layers.attention.minimax_sparse_backend import MiniMaxHybridAttnBackend

        from sglang_oscar.backend.minimax_backend import OscarMiniMaxSparseBackend

        self.pool = _pool(torch.float32)
        self.rot = {i: (random_orthogonal(D, HKV, generator=gen), random_orthogonal(D, HKV, generator=gen))
                    for i in range(3)}
        self.dense = cpu_backend(self.pool, CONFIG, [_layer(i) for i in range(3)], self.rot, max_reqs=MAX_REQS, ctx=CTX)
        self.r2t = self.dense._int2_req_to_token
        sparse = OscarMiniMaxSparseBackend(_runner(self.pool, self.r2t))
        self.hybrid = MiniMaxHybridAttnBackend(self.dense, sparse, sparse.sparse_layer_ids)
        self.gen, self.next_slot, self.calls = gen, 1, []
        self.window_updates = 0
        windows_in_forward = self.dense._windows_in_forward

        def count(fb):
            self.window_updates += 1
            windows_in_forward(fb)

        self.dense._windows_in_forward = count
        sparse._select = self._select
        self.written = {lid: (torch.zeros(161, HKV, D), torch.zeros(161, HKV, D)) for lid in SPARSE}
        write = self.pool.write_rotated

        def record(layer_id, loc, k_rot, v_rot, hp_rows):
            self.written[layer_id][0][loc], self.written[layer_id][1][loc] = k_rot.float(), v_rot.float()
            write(layer_id, loc, k_rot, v_rot, hp_rows)

        self.pool.write_rotated = record

    def alloc(self, req, start, end):
        s = torch.arange(self.next_slot, self.next_slot + end - start)
        self.next_slot += end - start
        self.r2t[req, start:end] = s.to(torch.int32)
        return s

    def blocks_for(self, positions):
        """A random causal selection per kv head and row: the row's own block plus up to 3 earlier ones,
        at random places of a ``-1``-padded list of the union's width (2 x topk)."""
        width = 2 * TOPK
        out = torch.full((HKV, len(positions), width), -1, dtype=torch.int32)
        for h in range(HKV):
            for i, p in enumerate(positions.tolist()):
                own = p // B
                others = torch.randperm(own, generator=self.gen)[: int(torch.randint(0, 4, (1,), generator=self.gen))]
                ids = torch.cat([torch.tensor([own]), others])
                out[h, i, torch.randperm(width, generator=self.gen)[: len(ids)]] = ids.to(torch.int32)
        return out

    def _select(self, idx_q, layer, fb, disable_value):
        # SGLang's indexer reads the index keys of the chunk itself: they must be written already
        ik = self.pool.get_index_k_buffer(layer.layer_id)[fb.out_cache_loc]
        self.calls.append((layer.layer_id, idx_q, disable_value, torch.equal(ik, self.idx_k_written)))
        return self.idx_o_next, self.blocks_next

    def run(self, fb, data, rows, mode, layers=SPARSE):
        """Sparse layers on one batch; ``rows``: ``(request, position)`` per query row; ``data[lid][req]``:
        ``(q, k, v, idx_q, idx_k, idx_v)`` of each request's positions. Returns ``{lid: (o, blocks)}``."""
        # the hybrid's metadata calls reach both backends: SGLang's sparse one sets the indexer's max lengths
        # and leaves the windows alone, the dense one updates them, once per forward (the OSCAR part of its
        # out-of-graph call, then its in-graph call; TritonAttnBackend's own metadata needs a GPU runner)
        self.hybrid.sparse.init_forward_metadata_out_graph(fb)
        self.dense._windows_out_of_graph()
        before = self.window_updates
        self.hybrid.init_forward_metadata_in_graph(fb)
        assert self.window_updates == before + 1
        assert self.hybrid.sparse._max_seqlen_k == int(fb.seq_lens_cpu.max())
        assert self.hybrid.sparse._max_seqlen_q == (max(fb.extend_seq_lens_cpu) if mode == "extend" else 1)
        out = {}
        for lid in layers:
            pick = [tuple(t[p] for t in data[lid][r]) for r, p in rows]
            q, k, v, iq, ik, iv = (torch.stack([x[j] for x in pick]) for j in range(6))
            self.blocks_next = self.blocks_for(torch.tensor([p for _, p in rows]))
            self.idx_o_next = None if lid in NO_VALUE else torch.randn(len(rows), H_IDX, DI, generator=self.gen)
            self.idx_k_written = ik
            fwd = self.hybrid.forward_extend if mode == "extend" else self.hybrid.forward_decode
            idx_o, o = fwd(q, k, v, _layer(lid), fb, idx_q=iq, idx_k=ik, idx_v=None if lid in NO_VALUE else iv)
            seen_q = self.calls[-1][1]  # the model's idx_q (a view of its real rows)
            assert self.calls[-1][0] == lid and self.calls[-1][2] == (lid in NO_VALUE)
            assert seen_q.data_ptr() == iq.data_ptr() and seen_q.shape == iq.shape
            assert self.calls[-1][3], "index keys not written before the indexer ran"
            if lid in NO_VALUE:
                assert idx_o is None
            else:  # idx_o as the indexer returned it, [N, H_idx * Di]; the index value rows in SGLang's buffer
                assert torch.equal(idx_o, self.idx_o_next.reshape(len(rows), -1))
                assert torch.equal(self.pool.get_index_kv_buffer(lid)[1][fb.out_cache_loc], iv)
            assert o.shape == (len(rows), HQ * D) and o.dtype == torch.float32
            out[lid] = (o.reshape(len(rows), HQ, D), self.blocks_next)
        return out

    def oracle(self, lid, q, req, positions, blocks, mode, dense=False):
        """``attend`` over the reference cache of the rows written for ``req`` (positions ``0 .. max + 1``)
        with the selection's per-kv-head mask (all keys with ``dense``), back in the model frame."""
        from sglang_oscar.reference.attention import attend, build_cache, rotate_rows
        from sglang_oscar.reference.sparse import block_topk_key_mask

        end = int(positions.max()) + 1
        slots = self.r2t[req, :end].long()
        eye = torch.eye(D)
        cache = build_cache(self.written[lid][0][slots], self.written[lid][1][slots], eye, eye, CONFIG, torch.float32)
        rk, rv = self.rot[lid]
        o = attend(rotate_rows(q, rk, num_kv_heads=HKV), positions, cache.k_hp, cache.v_hp, cache.k_deq, cache.v_deq,
                   sink=SINK, recent=RECENT, sm_scale=D ** -0.5, window_mode=mode,
                   key_mask=None if dense else block_topk_key_mask(blocks, positions, end, B))
        return rotate_rows(o, rv, transpose=True, num_kv_heads=HKV), cache


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_sparse_layers_extend_and_decode_match_the_oracle():
    """Two requests through the hybrid backend: one extend batch (req 1 positions 0..19, req 2 0..11), a
    second chunk of req 1 over its prefix (20..35), a decode batch of both. Each sparse layer's output
    equals the oracle over the INT2 cache with the selection's per-kv-head mask (window mode "extend"
    for the chunks, "decode" for the step; fp32, rel L2 < 1e-4) and differs from dense attention; the
    rows written are the rotated K/V and the INT2 codes of every slot the reference quantizer's;
    ``idx_o`` passes through (``None`` for the layer without index value)."""
    from sglang_oscar.reference.attention import rotate_rows

    gen = torch.Generator().manual_seed(fresh_seed())
    sv = M3Served(gen)
    lens = {1: 37, 2: 13}
    data = {lid: {r: (torch.randn(n, HQ, D, generator=gen), torch.randn(n, HKV, D, generator=gen) * 2,
                      torch.randn(n, HKV, D, generator=gen), torch.randn(n, H_IDX, DI, generator=gen),
                      torch.randn(n, 1, DI, generator=gen), torch.randn(n, 1, DI, generator=gen))
                  for r, n in lens.items()} for lid in SPARSE}
    sparse_gap = []

    def check(out, rows, mode):
        for lid, (o, blocks) in out.items():
            for r in lens:
                i = [j for j, (rr, _) in enumerate(rows) if rr == r]
                if i:
                    pos = torch.tensor([rows[j][1] for j in i])
                    q = data[lid][r][0][pos]
                    want, _ = sv.oracle(lid, q, r, pos, blocks[:, i], mode)
                    assert _rel(o[i], want) < 1e-4, (lid, r, mode, _rel(o[i], want))
                    sparse_gap.append(_rel(o[i], sv.oracle(lid, q, r, pos, blocks[:, i], mode, dense=True)[0]))

    rows = [(1, p) for p in range(20)] + [(2, p) for p in range(12)]
    slots = [sv.alloc(1, 0, 20), sv.alloc(2, 0, 12)]
    check(sv.run(_extend_batch([1, 2], [0, 0], [20, 12], slots), data, rows, "extend", layers=[1]), rows, "extend")
    rows = [(1, p) for p in range(20, 36)]
    check(sv.run(_extend_batch([1], [20], [36], [sv.alloc(1, 20, 36)]), data, rows, "extend"), rows, "extend")
    rows = [(2, 12), (1, 36)]
    fb = _decode_batch([2, 1], [12, 36], [sv.alloc(2, 12, 13), sv.alloc(1, 36, 37)])
    check(sv.run(fb, data, rows, "decode"), rows, "decode")
    assert max(sparse_gap) > 0.05  # the selection matters: dense attention is far from the output
    lid = 1  # every position of layer 1: the rotated rows, quantized by the reference quantizer
    kc, _, vc, _, _, _ = sv.pool.int2_buffers(lid)
    for r, n in lens.items():
        slots = sv.r2t[r, :n].long()
        k_rot = rotate_rows(data[lid][r][1], sv.rot[lid][0], num_kv_heads=HKV)
        assert torch.allclose(sv.written[lid][0][slots], k_rot, atol=1e-5, rtol=1e-5)
        _, cache = sv.oracle(lid, data[lid][r][0][:1], r, torch.tensor([n - 1]), None, "decode", dense=True)
        assert torch.equal(kc[slots], cache.k_quant.codes) and torch.equal(vc[slots], cache.v_quant.codes)


def test_padded_extend_rows_come_back_as_zeros():
    """An extend batch padded past its tokens (the breakable prefill graph's bucket): as SGLang's
    ``forward_extend`` (``minimax_sparse_backend.py:313-366``), the indexer and the main attention see
    the real tokens only (one block list per real token) and the padded rows of ``o`` and ``idx_o``
    come back as zeros; the real rows equal those of the same batch unpadded."""
    gen = torch.Generator().manual_seed(fresh_seed())
    sv = M3Served(gen)
    n, pad, lid = 12, 4, 1  # layer 1 keeps an index value
    slots = sv.alloc(1, 0, n)
    fb = _extend_batch([1], [0], [n], [slots])
    q, k, v = torch.randn(n, HQ, D, generator=gen), torch.randn(n, HKV, D, generator=gen), \
        torch.randn(n, HKV, D, generator=gen)
    iq, ik, iv = (torch.randn(n, h, DI, generator=gen) for h in (H_IDX, 1, 1))
    sv.dense._windows_out_of_graph()
    sv.hybrid.init_forward_metadata_in_graph(fb)
    blocks, idx_o_real, seen = sv.blocks_for(torch.arange(n)), torch.randn(n, H_IDX, DI, generator=gen), []

    def select(idx_q, layer, batch, disable_value):
        seen.append(idx_q.shape[0])
        return idx_o_real, blocks

    sv.hybrid.sparse._select = select
    idx_o, o = sv.hybrid.forward_extend(q, k, v, _layer(lid), fb, idx_q=iq, idx_k=ik, idx_v=iv)
    padded = SimpleNamespace(**vars(fb))
    padded.positions = torch.cat([fb.positions, torch.zeros(pad, dtype=fb.positions.dtype)])
    padded.out_cache_loc = torch.cat([slots, torch.zeros(pad, dtype=slots.dtype)])

    def grow(t):
        return torch.cat([t, torch.randn(pad, *t.shape[1:], generator=gen)])

    # the rows are in the cache already (the unpadded pass wrote them): this pass only reads
    idx_o2, o2 = sv.hybrid.forward_extend(grow(q), grow(k), grow(v), _layer(lid), padded, save_kv_cache=False,
                                          idx_q=grow(iq), idx_k=grow(ik), idx_v=grow(iv))
    assert seen == [n, n]
    assert o2.shape == (n + pad, HQ * D) and idx_o2.shape == (n + pad, H_IDX * DI)
    assert torch.allclose(o2[:n], o, rtol=1e-6, atol=1e-6) and not o2[n:].any()
    assert torch.equal(idx_o2[:n], idx_o) and not idx_o2[n:].any()
