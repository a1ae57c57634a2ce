"""The radix cap under SGLang's mamba radix cache (linear-attention hybrids): the prefill's recurrent
state is tracked at or before ``input_len - recent``, so a repeated prompt, matched up to that cap,
finds it. Runs SGLang's own tracking code (``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``)."""

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


def _req(input_len, prefix_len=0, branching=None):
    return SimpleNamespace(full_untruncated_fill_ids=array("q", range(input_len)),
                           prefix_indices=torch.arange(prefix_len),
                           extend_range=SimpleNamespace(length=input_len - prefix_len),
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


@pytest.mark.parametrize("input_len, prefix_len", [(400, 0), (900, 0), (1500, 0), (700, 0), (1500, 512), (600, 192)])
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


def test_hook_leaves_other_cases_alone(active, monkeypatch):
    # SGLang's own branching point (a prefix shared with a cached request) is kept
    req = _req(1500, branching=1280)
    serving.after_init_next_round_input(None, req, MAMBA_TREE)
    assert req.mamba_branching_seqlen == 1280
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
