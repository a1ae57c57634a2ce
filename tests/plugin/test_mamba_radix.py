"""The radix cap under SGLang's mamba radix cache (linear-attention hybrids): the prefill's recurrent
state is tracked at or before ``input_len - recent``, so a repeated prompt, matched up to that cap,
finds it. Runs SGLang's own tracking code (``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``)
and its own radix tree (``UnifiedRadixCache`` with a mamba component on a CPU state pool)."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.managers import schedule_batch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt import runtime_context

from sglang_oscar.plugin import serving

CHUNK = 64  # SGLang's FLA chunk size, server_args.mamba_cache_chunk_size at page size 1


def _server_args(strategy="extra_buffer"):
    return SimpleNamespace(mamba_cache_chunk_size=CHUNK, mamba_radix_cache_strategy=strategy,
                           enable_mamba_extra_buffer=lambda: strategy.startswith("extra_buffer"),
                           enable_mamba_extra_buffer_lazy=lambda: False)


def _req(input_len, prefix_len=0, branching=None, extend_len=None):
    return SimpleNamespace(full_untruncated_fill_ids=array("q", range(input_len)),
                           prefix_indices=torch.arange(prefix_len),
                           extend_range=SimpleNamespace(length=input_len - prefix_len if extend_len is None else extend_len),
                           mamba_branching_seqlen=branching, mamba_ping_pong_track_buffer=torch.tensor([5, 6]),
                           mamba_next_track_idx=0, mamba_last_track_seqlen=None)


@pytest.fixture
def active(monkeypatch):
    args = _server_args()
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)
    monkeypatch.setattr(schedule_batch, "get_server_args", lambda: args)
    monkeypatch.setitem(serving._ACTIVE, "recent", 32)
    return args


def _tracked(req):
    """The sequence length whose state SGLang's prefill tracks for ``req`` (its real code)."""
    batch = SimpleNamespace(req_to_token_pool=SimpleNamespace(get_mamba_ping_pong_other_idx=lambda i: 1 - i))
    entry = ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend(batch, req)
    assert bool(entry.track_mask)
    return req.mamba_last_track_seqlen


MAMBA_TREE = SimpleNamespace(supports_mamba=lambda: True)


@pytest.mark.parametrize("input_len, prefix_len", [(200, 0), (400, 0), (900, 0), (1500, 0), (700, 0), (1500, 512),
                                                    (600, 192)])
def test_tracked_state_lies_within_the_radix_cap(active, input_len, prefix_len):
    cap = input_len - 32
    # without the hook SGLang tracks the last aligned position of the prompt, past the cap but for 700
    plain = _tracked(_req(input_len, prefix_len))
    assert plain == prefix_len + (input_len - prefix_len) // CHUNK * CHUNK
    assert (plain > cap) == (input_len != 700)
    req = _req(input_len, prefix_len)
    serving.after_init_next_round_input(None, req, MAMBA_TREE)
    want = prefix_len + (cap - prefix_len) // CHUNK * CHUNK
    assert req.mamba_branching_seqlen == want
    got = _tracked(req)
    assert got == want and got <= cap and cap - got < CHUNK


def test_chunked_prefill_tracks_the_point_in_its_chunk(active):
    """The first chunk (512 of 1,500 tokens) ends before the point and tracks its own end, as without the
    hook; the last chunk (prefix 1,024) tracks the point, which the request keeps between chunks."""
    req = _req(1500, extend_len=512)
    serving.after_init_next_round_input(None, req, MAMBA_TREE)
    assert req.mamba_branching_seqlen == 1408 and _tracked(req) == 512
    req.prefix_indices, req.extend_range = torch.arange(1024), SimpleNamespace(length=476)
    serving.after_init_next_round_input(None, req, None)  # a chunked request's next round: no tree
    assert _tracked(req) == 1408


def test_sglang_branching_point_kept_past_the_prefix_replaced_at_it(active):
    # past the matched prefix (a prefix shared with a cached request): SGLang's point, at or before the cap
    req = _req(1500, prefix_len=256, branching=1280)
    serving.after_init_next_round_input(None, req, MAMBA_TREE)
    assert req.mamba_branching_seqlen == 1280
    # at the prefix (the matched path ran a few tokens past the last state): SGLang would ignore it
    req = _req(450, prefix_len=128, branching=128)
    serving.after_init_next_round_input(None, req, MAMBA_TREE)
    assert req.mamba_branching_seqlen == 128 + (450 - 32 - 128) // CHUNK * CHUNK == 384
    assert _tracked(req) == 384


def _mamba_tree(monkeypatch):
    """SGLang's UnifiedRadixCache with its FULL and MAMBA components (what an ``extra_buffer`` server of a
    linear-attention hybrid builds) over a small CPU HybridReqToTokenPool."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.mem_cache.unified_cache_components import mamba_component
    from sglang.srt.mem_cache.unified_cache_components.tree_component import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    monkeypatch.setattr(mamba_component, "get_server_args", runtime_context.get_server_args)
    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2, head_dim=8,
                                    state_size=8, conv_kernel=2)
    params = Mamba2CacheParams(shape=shape, layers=[0], dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32))
    pool = HybridReqToTokenPool(size=4, mamba_size=8, mamba_spec_state_size=4, max_context_len=2048, device="cpu",
                                enable_memory_saver=False, cache_params=params, mamba_layer_ids=[0],
                                enable_mamba_extra_buffer=True, speculative_num_draft_tokens=None,
                                enable_overlap_schedule=False)
    alloc = TokenToKVPoolAllocator(4096, torch.bfloat16, "cpu", SimpleNamespace(), False)
    tree = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=pool, token_to_kv_pool_allocator=alloc,
                                             page_size=1, enable_mamba_extra_buffer=True,
                                             tree_components=(ComponentType.FULL, ComponentType.MAMBA)))
    return tree, pool


@pytest.mark.parametrize("input_len", [200, 400, 700, 900, 1500])
def test_repeated_prompt_hits_sglangs_mamba_radix_tree(active, monkeypatch, input_len):
    """A prompt's prefill state goes into SGLang's own tree at the length it tracked (its
    ``cache_unfinished_req`` truncates the insert there); the same prompt again, matched up to the int2
    cap, hits that state with the hook; without it only where SGLang's point happened to lie before
    the cap (700: 640 <= 668)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree, pool = _mamba_tree(monkeypatch)
    prompt = array("q", range(1000, 1000 + input_len))
    cap = serving.around_compute_max_prefix_len(lambda self, n: n - 1, None, input_len)
    assert cap == input_len - 32
    for hooked in (False, True):
        tree.reset()
        req = _req(input_len)
        if hooked:
            serving.after_init_next_round_input(None, req, tree)
        tracked = _tracked(req)
        tree.insert(InsertParams(key=RadixKey(prompt[:tracked], None), value=torch.arange(tracked),
                                 mamba_value=pool.mamba_allocator.alloc(1)))
        hit = len(tree.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=prompt, extra_key=None, limit=cap))).device_indices)
        if hooked:
            assert hit == tracked == (cap // CHUNK) * CHUNK > 0
        else:
            assert hit == (tracked if tracked <= cap else 0) and (hit > 0) == (input_len == 700)


def test_hook_leaves_other_cases_alone(active, monkeypatch):
    # not a mamba radix cache, no tree (a chunked request's next round), not serving int2
    for tree in (SimpleNamespace(supports_mamba=lambda: False), None, SimpleNamespace()):
        req = _req(1500)
        serving.after_init_next_round_input(None, req, tree)
        assert req.mamba_branching_seqlen is None
    monkeypatch.setitem(serving._ACTIVE, "recent", None)
    req = _req(1500)
    serving.after_init_next_round_input(None, req, MAMBA_TREE)
    assert req.mamba_branching_seqlen is None
    # the no_buffer strategy tracks no prefill state
    monkeypatch.setitem(serving._ACTIVE, "recent", 32)
    args = _server_args("no_buffer")
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: args)
    req = _req(1500)
    serving.after_init_next_round_input(None, req, MAMBA_TREE)
    assert req.mamba_branching_seqlen is None
    # a prompt shorter than recent + one chunk past its prefix: nothing to track before the cap
    monkeypatch.setattr(runtime_context, "get_server_args", lambda: active)
    req = _req(90)
    serving.after_init_next_round_input(None, req, MAMBA_TREE)
    assert req.mamba_branching_seqlen is None


def test_hook_is_registered():
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_oscar.plugin import register

    register()
    target = "sglang.srt.managers.schedule_batch.Req.init_next_round_input"
    assert any(h is serving.after_init_next_round_input for _, h, _ in HookRegistry._hooks.get(target, ()))
