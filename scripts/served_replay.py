"""Check c on CPU: the served INT2 path replayed on the oracle's own rows of a tiny checkpoint.

The oracle (``tests.e2e.oracle``) runs a prompt and its greedy continuation through the
checkpoint loaded in fp32 (HP tier and (scale, zero) pairs fp32, c's windows) and records every
layer's q / K / V rows and its attention output. The same rows then go through the served
pieces -- ``OscarSWAKVPool`` (one INT2 pool per layer kind) in SGLang's hybrid sliding-window
memory with its ``SWATokenToKVPoolAllocator`` and sliding eviction where SGLang builds one
(``is_hybrid_swa_model``), else one ``OscarMHATokenToKVPool``; ``forward_extend`` for the prompt
and ``forward_decode`` per generated token with the layer's attention-sink logits; kernels under
the Triton interpreter -- and each layer's output is compared
with the oracle's. Identical inputs, so what is left is the INT2 path's own arithmetic: rel. L2
~1e-6 per layer, unless a row or window is read differently (then ~1e-3 and more).

  PYTHONPATH=python:.:tests TRITON_INTERPRET=1 python scripts/served_replay.py \\
      --model tiny-gemma4 --rotation rot-gemma4/rot_layer.safetensors --prompt-len 256 --decode 16
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import torch

from _support.forward import Mode
from _support.served import cpu_backend
from sglang.srt.configs.model_config import is_hybrid_swa_model
from sglang_oscar.backend.rotations import rank_rotations
from sglang_oscar.calibrate.capture import attention_override
from sglang_oscar.config import OscarConfig
from sglang_oscar.pool.int2_pool import OscarMHATokenToKVPool
from sglang_oscar.pool.swa_pool import OscarSWAKVPool
from sglang_oscar.rotation import RotationSet
from tests.e2e.checkpoints import load_hf, random_prompt
from tests.e2e.config import C_RECENT, C_SINK
from tests.e2e.oracle import greedy_paths, oracle_handler


def record(model, seq: list[int], rs: RotationSet, cfg: OscarConfig, prompt_len: int) -> dict:
    """Per layer id: the call's q / K / V rows ``[T, H, D]`` (fp32), its scaling and window, and
    the oracle's output ``[T, H_q, D_v]`` (prompt positions extend windows, later ones decode)."""
    inner = oracle_handler(rs, cfg, prompt_len, torch.float32)
    rec = {}

    def handler(call):
        out = inner(call)
        q, k, v = call.rows(0)
        sinks = call.sinks if call.sinks is not None else getattr(call.module, "sinks", None)
        rec[call.layer_id] = dict(q=q.float(), k=k.float(), v=v.float(), o=out[0].float(), scaling=call.scaling,
                                  window=call.sliding_window, sinks=None if sinks is None else sinks.float())
        return out

    with torch.no_grad(), attention_override(model, handler):
        model(input_ids=torch.tensor([seq]), use_cache=False)
    return rec


def layer_ns(lid: int, r: dict):
    """RadixAttention's fields the backend reads (SGLang's ``sliding_window_size`` is ``W - 1``)."""
    return SimpleNamespace(layer_id=lid, tp_q_head_num=r["q"].shape[1], tp_k_head_num=r["k"].shape[1],
                           qk_head_dim=r["k"].shape[2], v_head_dim=r["v"].shape[2], scaling=r["scaling"],
                           logit_cap=0.0, sliding_window_size=r["window"] - 1 if r["window"] else -1,
                           logit_capping_method="tanh", is_cross_attention=False)


def build(layers, rotations, cfg: OscarConfig, ctx: int, hybrid: bool):
    """Pool, allocator and backend objects as the plugin builds them (``__init__`` needs a GPU
    model runner, so the attributes it sets are set here, as tests/plugin does): SGLang's hybrid
    sliding-window pool when ``hybrid`` (its ``is_hybrid_swa_model``: Gemma-4, GPT-OSS), else one
    pool (Gemma-3, Qwen3)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    full = [lay for lay in layers if lay.sliding_window_size < 0]
    slid = [lay for lay in layers if lay.sliding_window_size >= 0]
    kw = dict(dtype=torch.uint8, device="cpu", oscar_config=cfg, hp_dtype=torch.float32, max_reqs=2,
              sink_rows=cfg.sink_tokens * 8)
    if hybrid and slid and full:
        pool = OscarSWAKVPool(size=ctx + 8, size_swa=ctx + 8, page_size=1, head_num=full[0].tp_k_head_num,
                              head_dim=full[0].qk_head_dim, v_head_dim=full[0].v_head_dim,
                              swa_head_num=slid[0].tp_k_head_num, swa_head_dim=slid[0].qk_head_dim,
                              swa_v_head_dim=slid[0].v_head_dim, swa_attention_layer_ids=[x.layer_id for x in slid],
                              full_attention_layer_ids=[x.layer_id for x in full], **kw)
        alloc = SWATokenToKVPoolAllocator(ctx + 8, ctx + 8, 1, torch.uint8, "cpu", pool, need_sort=False)
    else:
        lay = layers[0]
        pool = OscarMHATokenToKVPool(ctx + 8, page_size=1, head_num=lay.tp_k_head_num, head_dim=lay.qk_head_dim,
                                     v_head_dim=lay.v_head_dim, layer_num=max(x.layer_id for x in layers) + 1,
                                     enable_memory_saver=False, enable_alt_stream=False, **kw)
        alloc = None
    be = cpu_backend(pool, cfg, layers, rotations, max_reqs=2, ctx=ctx)
    return be, alloc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rotation", required=True)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--prompt-seed", type=int, default=44, help="check c: seed * 31 + 44 + index of the length")
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--layers", help="comma-separated layer ids to replay (default: all)")
    p.add_argument("--out")
    a = p.parse_args()
    torch.set_num_threads(2)
    rs = RotationSet.load(a.rotation)
    cfg = OscarConfig(sink_tokens=C_SINK, recent_tokens=C_RECENT, scale_dtype="float32")
    model = load_hf(a.model, "cpu", dtype=torch.float32)
    prompt = random_prompt(a.prompt_len, a.prompt_seed, model.config.vocab_size)
    with torch.no_grad():
        gen = greedy_paths(model, [prompt], a.decode, rotation=rs, config=cfg)[0]["tokens"] if a.decode else []
    seq, n = list(prompt) + list(gen), a.prompt_len
    rec = record(model, seq, rs, cfg, n)
    keep = sorted(rec) if not a.layers else [int(x) for x in a.layers.split(",")]
    layers = [layer_ns(lid, rec[lid]) for lid in keep]
    # the served per-rank expansion (one rank): per-layer matrices broadcast to the kv heads
    geo = SimpleNamespace(layers=[SimpleNamespace(layer_id=x.layer_id, num_kv_heads=x.tp_k_head_num) for x in layers])
    rot = rank_rotations(rs, geo, 0, 1, "cpu", keep)
    text = model.config.to_dict()
    hybrid = bool(is_hybrid_swa_model(text.get("architectures") or [], SimpleNamespace(**text)))
    be, alloc = build(layers, rot, cfg, len(seq) + 8, hybrid)
    r2t = be._int2_req_to_token
    window = max((lay.sliding_window_size + 1 for lay in layers), default=0)
    outs = {lay.layer_id: [] for lay in layers}
    steps = [(0, n, "extend")] + [(t, t + 1, "decode") for t in range(n, len(seq))]
    for start, end, mode in steps:
        slots = alloc.alloc(end - start) if alloc is not None else torch.arange(start + 1, end + 1)
        r2t[1, start:end] = slots.to(torch.int32)
        fb = SimpleNamespace(forward_mode=Mode(mode), batch_size=1, out_cache_loc=slots,
                             positions=torch.arange(start, end), req_pool_indices=torch.tensor([1]),
                             seq_lens=torch.tensor([end]), extend_seq_lens=torch.tensor([end - start]),
                             extend_prefix_lens=torch.tensor([start]))
        be._windows_out_of_graph()
        be._windows_in_forward(fb)
        if mode == "extend":
            be.forward_metadata = SimpleNamespace(qo_indptr=torch.tensor([0, end - start]), max_extend_len=end - start)
            be.plan_extend(fb, end - start)
        else:
            be.plan_decode(fb)
        for lay in layers:
            r = rec[lay.layer_id]
            fwd = be.forward_extend if mode == "extend" else be.forward_decode
            o = fwd(*(r[x][start:end].reshape(end - start, -1) for x in "qkv"), lay, fb, sinks=r["sinks"])
            outs[lay.layer_id].append(o.float().reshape(end - start, lay.tp_q_head_num, lay.v_head_dim))
        if alloc is not None and window and end - window > 0:  # SGLang's sliding eviction
            alloc.free_swa(r2t[1, : end - window].long())
    report = []
    for lay in layers:
        got, ref = torch.cat(outs[lay.layer_id]), rec[lay.layer_id]["o"]
        err = (got - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))
        row = {"layer": lay.layer_id, "window": lay.sliding_window_size + 1 if lay.sliding_window_size >= 0 else None,
               "prefill_rel_l2": float((got[:n] - ref[:n]).norm() / ref[:n].norm()),
               "decode_rel_l2": float((got[n:] - ref[n:]).norm() / ref[n:].norm()) if len(seq) > n else None,
               "worst_position": int(err.argmax()), "worst_rel": float(err.max()),
               "positions_over_1e-4": [(int(i), float(err[i])) for i in torch.nonzero(err > 1e-4).flatten()[:16]]}
        report.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        json.dump(report, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
