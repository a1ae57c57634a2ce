"""Per-rank behaviour of the INT2 cache under tensor parallelism, on CPU (issue 29's unit part).

For the families issue 29 names -- Gemma-4-style hybrid sliding window (sliding layers 8 kv heads x
256, full layers ONE kv head x 512), DeepSeek-V3 MLA latent, Qwen3-Next / Qwen3.5 linear-attention
hybrids (2 kv heads x 256 on every 4th layer), MiniMax-M2 GQA (48 q / 8 kv heads x 128) -- and each
TP size their heads allow: (1) which rotation matrices rank ``r`` of TP ``t`` receives, and (2) the
INT2 bytes per token of that rank's pool, hence SGLang's ``max_total_num_tokens`` per rank.

The expectations come from SGLang 0.5.16 itself wherever it runs on CPU -- its ``ModelConfig`` built
from a saved config (kv heads per rank, layer kinds, Gemma-4's renamed keys), its
``QKVParallelLinear.weight_loader`` (which global kv head a rank loads), its pool configurators
(cell size, ``max_total_num_tokens`` from a byte budget) -- and from INT2 row bytes computed by
hand (group 128, fp16 pairs: ``D/4 + 2 * 2 * D/128`` per K or V row).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from types import SimpleNamespace

import pytest
import torch

from _support.orthogonal import random_orthogonal
from sglang_oscar.backend.rotations import (
    model_geometry,
    rank_means,
    rank_rotations,
    served_latent_rotations,
    served_rotation_set,
)
from sglang_oscar.config import OscarConfig
from sglang_oscar.rotation import RotationSet

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

GROUP = 128
CONFIG = OscarConfig(group_size=GROUP, sink_tokens=4, recent_tokens=8)
# INT2 bytes of one token of one kv head, K + V (codes D/4 + one fp16 (scale, zero) pair per 128)
HEAD_BYTES = {128: 2 * (32 + 4), 256: 2 * (64 + 8), 512: 2 * (128 + 16)}
LATENT_BYTES = 128 + 16 + 64 * 2  # DeepSeek-V3 layer: R=512 codes + 4 fp16 pairs + BF16 k_pe (64)
BUDGET = 40 * 2**30  # one rank's INT2 KV budget (bytes) for the max_total_num_tokens checks


# ------------------------------------------------------------------------------------------ configs
def gemma4(layers: int) -> dict:
    """Gemma-4-style multimodal wrapper (HF names: base keys = sliding, ``global_*`` = full); every
    6th layer full attention."""
    types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
    text = dict(model_type="gemma4_text", vocab_size=128, hidden_size=64, intermediate_size=64,
                num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8, head_dim=256,
                global_head_dim=512, num_global_key_value_heads=1, sliding_window=64, layer_types=types,
                attention_k_eq_v=True)
    return dict(model_type="gemma4", architectures=["Gemma4ForConditionalGeneration"], text_config=text)


def minimax_m2(layers: int) -> dict:
    return dict(model_type="minimax_m2", architectures=["MiniMaxM2ForCausalLM"], vocab_size=128, hidden_size=64,
                intermediate_size=64, num_hidden_layers=layers, num_attention_heads=48, num_key_value_heads=8,
                head_dim=128, num_local_experts=4, num_experts_per_tok=2, rotary_dim=64, use_qk_norm=True,
                qk_norm_type="per_layer")


_GDN = dict(vocab_size=128, hidden_size=64, num_key_value_heads=2, head_dim=256, full_attention_interval=4,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32)


def qwen3_next(layers: int) -> dict:
    return dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], intermediate_size=64,
                num_hidden_layers=layers, num_attention_heads=16, decoder_sparse_step=1, **_GDN)


def qwen3_5(layers: int) -> dict:
    """Qwen3.5-MoE's multimodal wrapper (SGLang reads the text config's ``full_attention_interval``)."""
    text = dict(model_type="qwen3_5_moe_text", num_hidden_layers=layers, num_attention_heads=32, **_GDN)
    return dict(model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"], text_config=text,
                vision_config={})


def deepseek_v3(layers: int) -> dict:
    return dict(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=128, hidden_size=64,
                intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=128,
                num_key_value_heads=128, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=128,
                qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2,
                first_k_dense_replace=1, n_shared_experts=1)


def model_config(tmp_path, cfg: dict):
    """SGLang's own ``ModelConfig`` of ``cfg`` (what the scheduler serves: Gemma-4's keys renamed)."""
    from sglang.srt.configs.model_config import ModelConfig

    d = tmp_path / f"{cfg['model_type']}_{id(cfg)}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    logging.disable(logging.WARNING)  # "no generation_config.json"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ModelConfig(str(d))
    finally:
        logging.disable(logging.NOTSET)


def sglang_kv_heads(total_q: int, total_kv: int, tp_rank: int, tp_size: int) -> list[int]:
    """The global kv heads SGLang's ``QKVParallelLinear`` of rank ``tp_rank`` loads: a checkpoint ``k_proj``
    whose rows of head ``h`` hold ``h`` goes through the layer's own ``weight_loader``; read back."""
    from sglang.srt.layers.linear import QKVParallelLinear

    d = 4
    m = QKVParallelLinear(8, d, total_q, total_kv, bias=False, params_dtype=torch.float32, tp_rank=tp_rank,
                          tp_size=tp_size)
    k = torch.arange(total_kv, dtype=torch.float32).repeat_interleave(d)[:, None].expand(total_kv * d, 8)
    m.weight_loader(m.weight, k.contiguous(), "k")
    q = m.num_heads * d
    return m.weight.data[q:q + m.num_kv_heads * d, 0].view(m.num_kv_heads, d)[:, 0].long().tolist()


def per_head_file(tmp_path, geometry, seed: int, centered: bool = False) -> str:
    """A per-kv-head rotation file for ``geometry`` (random orthogonal per layer and head; with
    ``centered`` per-head key / value means), saved where ``--oscar-rotation`` would point."""
    gen = torch.Generator().manual_seed(seed)
    k, v, km, vm = {}, {}, {}, {}
    for layer in geometry.layers:
        h = layer.num_kv_heads
        k[layer.layer_id] = random_orthogonal(layer.head_dim_k, h, generator=gen)
        v[layer.layer_id] = random_orthogonal(layer.head_dim_v, h, generator=gen)
        if centered:
            km[layer.layer_id] = torch.randn(h, layer.head_dim_k, generator=gen)
            vm[layer.layer_id] = torch.randn(h, layer.head_dim_v, generator=gen)
    path = str(tmp_path / f"rot_{seed}.safetensors")
    RotationSet(k, v, {"method": "test"}, k_mean=km, v_mean=vm).save(path)
    return path


def kvc_of(mc, *, dtype: str = "int2", ratio: float = 0.5, config: OscarConfig = CONFIG):
    """What SGLang's pool configurators and the pool hook read of a ``KVCacheConfigurator``, for one
    rank holding every layer (no pipeline parallelism), page size 1, no speculative decoding."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import AttentionArch

    n = mc.num_hidden_layers
    no = lambda: False  # noqa: E731
    return SimpleNamespace(
        model_config=mc, kv_cache_dtype=torch.uint8 if dtype == "int2" else torch.bfloat16,
        model_dtype=torch.bfloat16, use_mla_backend=mc.attention_arch == AttentionArch.MLA,
        is_hybrid_swa=mc.is_hybrid_swa, is_hybrid_swa_compress=mc.is_hybrid_swa_compress,
        mambaish_config=mambaish_config(mc),
        layer_info=SimpleNamespace(start_layer=0, end_layer=n, num_effective_layers=n),
        spec_algorithm=SimpleNamespace(is_eagle=no, is_standalone=no, is_dflash_family=no), is_draft_worker=False,
        sliding_window_size=63, page_size=1, device="cpu",
        server_args=SimpleNamespace(kv_cache_dtype=dtype, _oscar_config=config, swa_full_tokens_ratio=ratio,
                                    page_size=1, max_running_requests=None, disable_radix_cache=False,
                                    enable_dsa_cache_layer_split=False,
                                    chunked_prefill_size=None, enable_memory_saver=False, enable_pdmux=False))


def sized(mc, tp: int, rank: int = 0, **kw):
    """SGLang's configurator for this rank (hooks applied) and its pool sizes for :data:`BUDGET`."""
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_tp_size=tp, attn_tp_rank=rank):
        conf = create_memory_pool_configurator(kvc_of(mc, **kw))
    return conf, conf.calculate_pool_sizes(BUDGET, 1)


# ------------------------------------------------------------------------------ (1) rotations per rank
@pytest.mark.parametrize("family,total_q,tps", [
    (minimax_m2, 48, (1, 2, 4, 8)),
    (qwen3_next, 16, (1, 2, 4)),
    (qwen3_5, 32, (1, 2, 4)),
])
def test_gqa_and_linear_hybrid_ranks_get_the_heads_sglang_loads(tmp_path, family, total_q, tps):
    """Mirrors ``sglang/srt/layers/linear.py:QKVParallelLinear.__init__`` (``num_kv_heads =
    max(1, H_kv / tp)``, replicas ``tp / H_kv`` when ``H_kv < tp``) and ``weight_loader``
    (``shard_id = tp_rank // num_kv_head_replicas``), which MiniMax-M2 (``models/minimax_m2.py``) and the
    full-attention layers of Qwen3-Next / Qwen3.5 (``models/qwen3_next.py:Qwen3HybridAttentionDecoderLayer``)
    build with ``attn_tp_rank`` / ``attn_tp_size``; and ``configs/model_config.py:get_num_kv_heads``,
    the pool's head count. A per-head file (with per-head means) loaded through the launch check: rank
    ``r`` gets exactly the rotations and means of the global heads SGLang's loader gives it (Qwen3-Next
    at TP 4: heads 0, 0, 1, 1), one per local pool head; the linear hybrids' file holds only the
    full-attention layers 3 and 7 (the Gated-DeltaNet layers have no KV cache)."""
    mc = model_config(tmp_path, family(8))
    geometry = model_geometry(mc.hf_config)
    ids = [layer.layer_id for layer in geometry.layers]
    assert ids == (list(range(8)) if family is minimax_m2 else [3, 7])
    path = per_head_file(tmp_path, geometry, seed=1, centered=True)
    rs = served_rotation_set(OscarConfig(group_size=GROUP, rotation_path=path), geometry, log=False,
                             hf_config=mc.hf_config)
    assert rs.per_head and sorted(rs.layer_ids) == ids
    h_kv = mc.get_total_num_kv_heads()
    for tp in tps:
        for rank in range(tp):
            heads = sglang_kv_heads(total_q, h_kv, rank, tp)
            assert len(heads) == mc.get_num_kv_heads(tp)
            rots = rank_rotations(rs, geometry, rank, tp, "cpu", ids)
            means = rank_means(rs, geometry, rank, tp, "cpu", ids)
            for lid in ids:
                rk, rv = rots[lid]
                assert rk.shape[0] == rv.shape[0] == len(heads)
                assert torch.equal(rk, rs.k[lid][heads]) and torch.equal(rv, rs.v[lid][heads])
                assert torch.equal(means[lid][0], rs.k_mean[lid][heads])
                assert torch.equal(means[lid][1], rs.v_mean[lid][heads])
    if family is qwen3_next:
        assert [sglang_kv_heads(total_q, 2, r, 4) for r in range(4)] == [[0], [0], [1], [1]]


def test_gemma4_ranks_split_the_sliding_heads_and_replicate_the_one_full_head(tmp_path):
    """Mirrors ``sglang/srt/utils/hf_transformers/config.py`` (Gemma-4: base keys become the full
    layers', ``swa_num_key_value_heads`` / ``swa_head_dim`` the sliding ones'),
    ``models/gemma4_causal.py:Gemma4Attention.__init__`` (sliding layers shard
    ``swa_num_key_value_heads``, full layers ``num_key_value_heads``, through ``QKVParallelLinear``:
    ``linear.py`` ``shard_id = tp_rank // num_kv_head_replicas``) and
    ``configs/model_config.py:get_num_kv_heads`` / ``get_swa_num_kv_heads``. At TP 2 rank ``r`` gets
    sliding heads ``4r..4r+3`` (256 x 256 each) and the full layers' single 512 x 512 head whole --
    the same matrices on both ranks; at TP 8 one sliding head each. The geometry read from the served
    (renamed) config equals the one read from the HF checkpoint's config."""
    hf = gemma4(6)
    mc = model_config(tmp_path, hf)
    geometry = model_geometry(mc.hf_config)
    assert geometry.layers == model_geometry(hf).layers
    full = [layer.layer_id for layer in geometry.layers if layer.sliding_window is None]
    sliding = [layer.layer_id for layer in geometry.layers if layer.sliding_window is not None]
    assert (full, sliding) == ([5], [0, 1, 2, 3, 4])
    assert mc.full_attention_layer_ids == full and mc.swa_attention_layer_ids == sliding
    assert {(layer.num_kv_heads, layer.head_dim_k) for layer in geometry.layers} == {(8, 256), (1, 512)}
    rs = served_rotation_set(OscarConfig(group_size=GROUP, rotation_path=per_head_file(tmp_path, geometry, seed=2)),
                             geometry, log=False, hf_config=mc.hf_config)
    ids = full + sliding
    for tp in (2, 4, 8):
        assert mc.get_num_kv_heads(tp) == 1 and mc.get_swa_num_kv_heads(tp) == 8 // tp
        for rank in range(tp):
            rots = rank_rotations(rs, geometry, rank, tp, "cpu", ids)
            swa_heads, full_heads = sglang_kv_heads(32, 8, rank, tp), sglang_kv_heads(32, 1, rank, tp)
            assert swa_heads == list(range(rank * 8 // tp, (rank + 1) * 8 // tp)) and full_heads == [0]
            for lid in sliding:
                assert rots[lid][0].shape == (8 // tp, 256, 256)
                assert torch.equal(rots[lid][0], rs.k[lid][swa_heads])
                assert torch.equal(rots[lid][1], rs.v[lid][swa_heads])
            rk, rv = rots[5]
            assert rk.shape == rv.shape == (1, 512, 512)
            assert torch.equal(rk, rs.k[5]) and torch.equal(rv, rs.v[5])


def test_mla_ranks_keep_the_whole_latent_and_its_rotation(tmp_path, monkeypatch):
    """Mirrors ``sglang/srt/models/deepseek_v2.py:DeepseekV2AttentionMLA.__init__`` (``num_local_heads =
    num_heads / attn_tp_size``; the latent ``kv_a_proj_with_mqa`` is a ``ReplicatedLinear``: every rank
    computes the whole ``kv_lora_rank`` latent) and ``mem_cache`` ``MLATokenToKVPool`` (one latent row per
    token, no head axis). ``OscarTritonLatentBackend.__init__`` (SGLang's own ``__init__`` stubbed) on a
    DeepSeek-V3-shaped model (128 q heads, latent 512 + 64) at TP 1 / 2 / 8: rank ``r`` applies the file's
    full 512 x 512 matrix of every layer (the same on every rank) to its 128 / tp query heads."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    import sglang.srt.runtime_context as rc
    from sglang_oscar.backend.latent_backend import OscarTritonLatentBackend
    from sglang_oscar.pool.latent_pool import OscarMLATokenToKVPool
    from sglang_oscar.rotation.latent import LatentRotationSet

    mc = model_config(tmp_path, deepseek_v3(3))
    geometry = model_geometry(mc.hf_config)
    assert geometry.attention_kind == "mla" and geometry.kv_lora_rank == 512
    gen = torch.Generator().manual_seed(3)
    path = str(tmp_path / "latent.safetensors")
    LatentRotationSet({i: random_orthogonal(512, generator=gen) for i in range(3)}, {"method": "test"}).save(path)
    rs = served_latent_rotations(OscarConfig(rotation_path=path), geometry, log=False,
                                 architectures=mc.hf_config.architectures)
    pool = OscarMLATokenToKVPool(16, page_size=1, dtype=torch.uint8, kv_lora_rank=512, qk_rope_head_dim=64,
                                 layer_num=3, device="cpu", enable_memory_saver=False, oscar_config=OscarConfig(
                                     rotation_path=path, sink_tokens=4, recent_tokens=8),
                                 hp_dtype=torch.bfloat16, max_reqs=2, sink_rows=16)
    assert pool.codes[0].shape == (17, 1, 128)  # one latent "head" per token, whatever the TP size
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for i in range(3):
        layer = torch.nn.Module()
        for name, value in dict(layer_id=i, tp_q_head_num=0, tp_k_head_num=1, qk_head_dim=576, v_head_dim=512,
                                scaling=1.0, logit_cap=0.0).items():
            setattr(layer, name, value)
        model.layers.append(layer)
    runner = SimpleNamespace(token_to_kv_pool=pool, model=model, device="cpu", model_config=mc,
                             req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 32, dtype=torch.int32)))
    monkeypatch.setattr(TritonAttnBackend, "__init__", lambda self, *a, **k: None)
    for tp in (1, 2, 8):
        for rank in {0, tp - 1}:
            monkeypatch.setattr(rc, "get_parallel",
                                lambda r=rank, t=tp: SimpleNamespace(attn_tp_rank=r, attn_tp_size=t))
            be = OscarTritonLatentBackend(runner)
            assert be._heads == 128 // tp
            assert sorted(be.rotations) == [0, 1, 2]
            assert all(torch.equal(be.rotations[i], rs.matrix(i)) and be.rotations[i].shape == (512, 512)
                       for i in range(3))


# ------------------------------------------------------------------------ (2) bytes per token per rank
def test_gqa_rank_cell_size_and_max_total_num_tokens(hooked, tmp_path):
    """Mirrors ``sglang/srt/model_executor/pool_configurator.py:DefaultPoolConfigurator`` (``_compute_cell_size``:
    ``get_num_kv_heads(attn_tp_size) x (head_dim + v_head_dim) x layers x bytes``; ``calculate_pool_sizes``:
    ``max_total_num_tokens = budget // cell``), with the INT2 hook. MiniMax-M2 (62 layers, 8 kv heads x 128):
    per rank 62 x 8/tp x 72 bytes -- 35,712 / 17,856 / 8,928 / 4,464 at TP 1 / 2 / 4 / 8 (SGLang's BF16:
    253,952 / tp) -- so a rank's ``max_total_num_tokens`` for the same per-GPU budget is tp times the
    single-GPU figure; the TP 2 pool the hook builds holds 4 heads per layer and exactly that many
    bytes per slot."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_oscar.plugin import serving
    from sglang_oscar.pool.int2_pool import OscarMHATokenToKVPool

    mc = model_config(tmp_path, minimax_m2(62))
    tokens = {}
    for tp in (1, 2, 4, 8):
        cell = 62 * (8 // tp) * HEAD_BYTES[128]
        conf, sizes = sized(mc, tp)
        assert conf._cell_size == cell
        assert sizes.max_total_num_tokens == BUDGET // cell
        assert sized(mc, tp, dtype="auto")[0]._cell_size == 62 * (8 // tp) * 256 * 2
        tokens[tp] = sizes.max_total_num_tokens
    assert (tokens[1], tokens[2]) == (BUDGET // 35712, BUDGET // 17856)
    assert all(tokens[tp] == BUDGET * tp // 35712 for tp in (1, 2, 4, 8))
    with get_parallel().override(attn_tp_size=2, attn_tp_rank=1):
        pool = serving.around_build_token_to_kv_pool(
            None, kvc_of(mc), sizes=SimpleNamespace(max_total_num_tokens=16),
            req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 32, dtype=torch.int32)))
    assert isinstance(pool, OscarMHATokenToKVPool) and pool.head_num == 4 and pool.layer_num == 62
    assert pool.k_buffer[0].shape == (17, 4, 32) and pool.int2_bytes_per_token() == 17856


def test_gemma4_rank_cell_size_counts_both_pools(hooked, tmp_path):
    """Mirrors ``pool_configurator.py:HybridSWAPoolConfigurator.__init__`` (``_full_per_token`` from
    ``get_num_kv_heads``, ``_swa_per_token`` from ``get_swa_num_kv_heads``; cell = full x full layers +
    ``swa_full_tokens_ratio`` x sliding x sliding layers; ``_solve_pool_sizes``: swa tokens = ratio x full
    tokens) and ``mem_cache/kv_cache_configurator.py`` (``swa_head_num = max(1, swa_num_key_value_heads //
    attn_tp_size)`` for ``is_hybrid_swa_compress`` models, Gemma-4 among them). Gemma-4-style, 60 layers
    (50 sliding x 8 heads x 256, 10 full x 1 head x 512), ratio 0.5: the full layers' 288 B per token do
    not shrink with TP (the one head is replicated), the sliding ones' 8 x 144 B halve: 31,680 / 17,280 /
    10,080 / 6,480 B per token at TP 1 / 2 / 4 / 8. The TP 2 pool the hook builds: full sub-pool 1 head x
    512, sliding 4 heads x 256, the configurator's per-token bytes."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_oscar.plugin import serving
    from sglang_oscar.pool.swa_pool import OscarSWAKVPool

    mc = model_config(tmp_path, gemma4(60))
    assert (len(mc.full_attention_layer_ids), len(mc.swa_attention_layer_ids)) == (10, 50)
    assert mc.is_hybrid_swa and mc.is_hybrid_swa_compress
    want = {1: 31680, 2: 17280, 4: 10080, 8: 6480}
    for tp, cell in want.items():
        conf, sizes = sized(mc, tp)
        assert (conf._full_per_token, conf._swa_per_token) == (HEAD_BYTES[512], (8 // tp) * HEAD_BYTES[256])
        assert conf._cell_size == 10 * HEAD_BYTES[512] + 0.5 * 50 * (8 // tp) * HEAD_BYTES[256] == cell
        full_tokens = BUDGET // cell
        assert (sizes.full_max_total_num_tokens, sizes.swa_max_total_num_tokens) == (full_tokens, full_tokens // 2)
        bf16 = sized(mc, tp, dtype="auto")[0]
        assert (bf16._full_per_token, bf16._swa_per_token) == (1 * 1024 * 2, (8 // tp) * 512 * 2)
        # --oscar-skip-layers: the kind kept BF16 costs what the BF16 server's configurator counts for it
        for skip in ("sliding", "full"):
            kept = sized(mc, tp, config=dataclasses.replace(CONFIG, skip_layers=skip))[0]
            assert (kept._full_per_token, kept._swa_per_token) == (
                (HEAD_BYTES[512], bf16._swa_per_token) if skip == "sliding" else (bf16._full_per_token,
                                                                                  (8 // tp) * HEAD_BYTES[256]))
    # each rank's groups for the window plan: the same per-rank heads
    with get_parallel().override(attn_tp_size=2, attn_tp_rank=0):
        assert serving._kv_groups(kvc_of(mc)) == [("full", 10, 1, 512, 512), ("sliding", 50, 4, 256, 256)]
        pool = serving.around_build_token_to_kv_pool(
            None, kvc_of(mc), sizes=SimpleNamespace(full_max_total_num_tokens=8, swa_max_total_num_tokens=8),
            req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 32, dtype=torch.int32)))
    assert isinstance(pool, OscarSWAKVPool)
    assert (pool.full_kv_pool.head_num, pool.full_kv_pool.head_dim) == (1, 512)
    assert (pool.swa_kv_pool.head_num, pool.swa_kv_pool.head_dim) == (4, 256)
    assert pool.int2_bytes_per_token() == (10 * HEAD_BYTES[512], 50 * 4 * HEAD_BYTES[256])


@pytest.mark.parametrize("family,layers,full", [(qwen3_next, 48, 12), (qwen3_5, 60, 15)])
def test_linear_hybrid_rank_cell_size_counts_its_attention_layers(hooked, tmp_path, family, layers, full):
    """Mirrors ``pool_configurator.py:DefaultPoolConfigurator.__init__`` (a ``mambaish_config`` model:
    ``num_layers`` = its ``full_attention_layer_ids`` in the rank's range; ``configs/hybrid_arch.py:
    hybrid_gdn_config`` for Qwen3-Next / Qwen3.5) and ``get_num_kv_heads`` (``max(1, 2 // tp)``): only
    the full-attention layers (every 4th) hold INT2 rows, 1 kv head x 256 per rank from TP 2 on (TP 4:
    replicated, no further drop): Qwen3-Next-style 48 layers 12 x 2 x 144 = 3,456 B per token at TP 1,
    1,728 at TP 2 and TP 4; Qwen3.5-style 60 layers: 4,320 / 2,160 / 2,160. The TP 2 pool the hook
    builds: SGLang's hybrid pool around one INT2 pool of those layers (1 head each), by global id."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_oscar.plugin import serving
    from sglang_oscar.pool.linear_pool import OscarHybridLinearKVPool

    mc = model_config(tmp_path, family(layers))
    kvc = kvc_of(mc)
    ids = list(range(3, layers, 4))
    assert kvc.mambaish_config.full_attention_layer_ids == ids and len(ids) == full
    for tp in (1, 2, 4):
        cell = full * max(1, 2 // tp) * HEAD_BYTES[256]
        conf, sizes = sized(mc, tp)
        assert conf._cell_size == cell and sizes.max_total_num_tokens == BUDGET // cell
    # TP 2 and TP 4 ranks: twice the single-GPU tokens for the same per-GPU budget (the head halves once)
    tp1_cell = sized(mc, 1)[0]._cell_size
    assert sized(mc, 2)[1].max_total_num_tokens == sized(mc, 4)[1].max_total_num_tokens == BUDGET * 2 // tp1_cell
    with get_parallel().override(attn_tp_size=2, attn_tp_rank=1):
        assert serving._kv_groups(kvc) == [("all", full, 1, 256, 256)]
        pool = serving.around_build_token_to_kv_pool(
            None, kvc, sizes=SimpleNamespace(max_total_num_tokens=8),
            req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 32, dtype=torch.int32), mamba_pool=object()))
    assert isinstance(pool, OscarHybridLinearKVPool)
    assert pool.full_attention_layer_id_mapping == {i: j for j, i in enumerate(ids)}
    assert pool.full_kv_pool.head_num == 1 and pool.int2_bytes_per_token() == full * HEAD_BYTES[256]


def test_mla_rank_cell_size_is_not_divided_by_tp(hooked, tmp_path):
    """Mirrors ``pool_configurator.py:DefaultPoolConfigurator._compute_cell_size``'s MLA branch (``(kv_lora_rank +
    qk_rope_head_dim) x layers x bytes``, no ``attn_tp_size`` factor: every rank caches the whole latent).
    DeepSeek-V3 (61 layers, latent 512 + k_pe 64): 61 x 272 = 16,592 INT2 bytes per token on every rank at TP 1 /
    2 / 8 (SGLang's BF16: 61 x 1,152 = 70,272), so each rank's ``max_total_num_tokens`` equals the single-GPU
    figure for the same per-GPU budget; the TP 2 pool the hook builds is one latent row per token."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_oscar.plugin import serving
    from sglang_oscar.pool.latent_pool import OscarMLATokenToKVPool

    mc = model_config(tmp_path, deepseek_v3(61))
    for tp in (1, 2, 8):
        conf, sizes = sized(mc, tp)
        assert conf._cell_size == 61 * LATENT_BYTES == 16592
        assert sizes.max_total_num_tokens == BUDGET // 16592
        assert sized(mc, tp, dtype="auto")[0]._cell_size == 61 * 1152 == 70272
    with get_parallel().override(attn_tp_size=2, attn_tp_rank=1):
        assert serving._kv_groups(kvc_of(mc)) == [("latent", 61, 1, 512, 64)]
        pool = serving.around_build_token_to_kv_pool(
            None, kvc_of(mc), sizes=SimpleNamespace(max_total_num_tokens=8),
            req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 32, dtype=torch.int32)))
    assert isinstance(pool, OscarMLATokenToKVPool) and pool.layer_num == 61
    assert pool.codes[0].shape == (9, 1, 128) and pool.int2_bytes_per_token() == 16592
