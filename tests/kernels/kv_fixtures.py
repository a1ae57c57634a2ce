"""Shared fixtures of the kernel tests: random seeds, poisoned buffers, paged two-tier pools.

A pool is built from ``reference.build_cache`` (the oracle's bytes), scattered to random
non-contiguous slots / HP rows, with every unused slot and row poisoned (NaN pairs / 0xAB codes /
NaN HP rows) so that a kernel reading the wrong place produces NaN or a large error.
"""

from __future__ import annotations

import dataclasses
import os
import random

import torch
from sglang_oscar.config import OscarConfig
from _support.orthogonal import random_orthogonal
from sglang_oscar.kernels import Int2Layout, rotate_rows_hp
from sglang_oscar.reference.attention import build_cache, oscar_attention

POISON_BYTE = 0xAB


def fresh_seed() -> int:
    """A new random seed each run (``OSCAR_TEST_SEED`` pins it); printed so failures can be replayed."""
    env = os.environ.get("OSCAR_TEST_SEED")
    seed = int(env) if env else random.SystemRandom().randrange(1 << 31)
    print(f"[seed] OSCAR_TEST_SEED={seed}")
    torch.manual_seed(seed)
    return seed


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (float) or 0xAB bytes (uint8/int)."""
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.view(torch.uint8).fill_(POISON_BYTE)
    return t


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a = a.double()
    b = b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def random_rows(t: int, h: int, d: int, device="cpu") -> torch.Tensor:
    """KV-like rows: per-channel scales, a few outlier channels, a small offset."""
    scale = torch.rand(h, d) * 1.5 + 0.25
    scale[:, torch.randint(0, d, (max(1, d // 32),))] *= 6.0
    scale, off = scale.to(device), (0.3 * torch.randn(h, d)).to(device)
    return torch.randn(t, h, d, device=device) * scale + off


@dataclasses.dataclass
class Pool:
    layout: Int2Layout
    config: OscarConfig
    k_codes: torch.Tensor
    k_pairs: torch.Tensor
    v_codes: torch.Tensor
    v_pairs: torch.Tensor
    hp_k: torch.Tensor
    hp_v: torch.Tensor
    hp_index: torch.Tensor
    req_to_token: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    ks: list
    vs: list
    caches: list
    rot_k: torch.Tensor
    rot_v: torch.Tensor

    def buffers(self):
        return (self.k_codes, self.k_pairs, self.v_codes, self.v_pairs, self.hp_k, self.hp_v, self.hp_index,
                self.req_to_token)


def make_config(*, group_size=None, quantizer="uniform", scale_dtype="float16", sink=4, recent=8,
                k_clip=0.96, v_clip=0.92) -> OscarConfig:
    return OscarConfig(group_size=group_size, k_clip_ratio=k_clip, v_clip_ratio=v_clip, sink_tokens=sink,
                       recent_tokens=recent, quantizer=quantizer, scale_dtype=scale_dtype)


def build_pool(lens, hkv, dk, dv, config: OscarConfig, *, hp_dtype=torch.bfloat16, per_head_rotation=False,
               window_mode="decode", extra_slots=13, max_reqs=None, max_ctx=None, index_dtype=torch.int32,
               write_with_kernel=False, device="cpu", rows=None) -> Pool:
    """Pool holding ``len(lens)`` requests of lengths ``lens`` (HP rows as a decode step sees them).

    ``rows(t, h, d, device)`` makes the K/V rows (default :func:`random_rows`)."""
    rows_fn = rows or random_rows
    layout = Int2Layout.from_config(config, dk, dv)
    sink, recent = config.sink_tokens, config.recent_tokens
    rot_k = random_orthogonal(dk, hkv if per_head_rotation else None, device=device)
    rot_v = random_orthogonal(dv, hkv if per_head_rotation else None, device=device)
    nreq = len(lens)
    max_reqs = max_reqs or nreq + 3
    max_ctx = max_ctx or max(lens) + 5
    total = sum(lens)
    num_slots = total + extra_slots
    bufs = layout.allocate(num_slots, hkv, device)
    for t in bufs.values():
        poison_(t)
    slot_perm = torch.randperm(num_slots).to(device)
    hp_need = sum(min(sink, L) + (min(recent, max(L - sink, 0)) if window_mode == "decode" else 0) for L in lens)
    num_hp = hp_need + 7
    hp_k = poison_(torch.empty(num_hp, hkv, dk, dtype=hp_dtype, device=device))
    hp_v = poison_(torch.empty(num_hp, hkv, dv, dtype=hp_dtype, device=device))
    hp_perm = torch.randperm(num_hp).to(device)
    hp_index = torch.full((max_reqs, max(sink + recent, 1)), -1, dtype=index_dtype, device=device)
    req_to_token = torch.full((max_reqs, max_ctx), -1, dtype=index_dtype, device=device)
    rpi = torch.randperm(max_reqs)[:nreq]
    ks, vs, caches = [], [], []
    si = hi = 0
    for r, L in enumerate(lens):
        k = rows_fn(L, hkv, dk, device)
        v = rows_fn(L, hkv, dv, device)
        cache = build_cache(k, v, rot_k, rot_v, config, hp_dtype)
        ks.append(k)
        vs.append(v)
        caches.append(cache)
        req = int(rpi[r])
        slots = slot_perm[si:si + L]
        si += L
        req_to_token[req, :L] = slots.to(index_dtype)
        if write_with_kernel:
            from sglang_oscar.kernels import write_kv
            write_kv(cache.k_hp, cache.v_hp, slots, bufs["k_codes"], bufs["k_pairs"], bufs["v_codes"],
                     bufs["v_pairs"], layout)
        else:
            bufs["k_codes"][slots] = cache.k_quant.codes
            bufs["k_pairs"][slots] = cache.k_quant.pairs
            bufs["v_codes"][slots] = cache.v_quant.codes
            bufs["v_pairs"][slots] = cache.v_quant.pairs
        pos = torch.arange(L, device=device)
        is_sink = pos < sink
        is_rec = (~is_sink) & (pos >= L - recent) if window_mode == "decode" else torch.zeros_like(is_sink)
        hp_pos = pos[is_sink | is_rec]
        entries = torch.where(hp_pos < sink, hp_pos, sink + hp_pos % max(recent, 1))
        rows = hp_perm[hi:hi + hp_pos.numel()]
        hi += hp_pos.numel()
        hp_index[req, entries] = rows.to(index_dtype)
        hp_k[rows] = cache.k_hp[hp_pos]
        hp_v[rows] = cache.v_hp[hp_pos]
    return Pool(layout, config, bufs["k_codes"], bufs["k_pairs"], bufs["v_codes"], bufs["v_pairs"], hp_k, hp_v,
                hp_index, req_to_token, rpi.to(torch.int64).to(device), torch.tensor(lens, dtype=torch.int64, device=device),
                ks, vs, caches, rot_k, rot_v)


def reference_decode(pool: Pool, q: torch.Tensor, *, sliding_window=None, logit_cap=None, counter_rotate=False,
                     hp_dtype=torch.bfloat16, sinks=None) -> torch.Tensor:
    """Oracle output ``[B, H_q, D_v]`` for unrotated queries ``q`` (query b at position L_b - 1)."""
    outs = []
    for b, L in enumerate(pool.seq_lens.tolist()):
        o = oscar_attention(q[b:b + 1], pool.ks[b], pool.vs[b], pool.rot_k, pool.rot_v, pool.config,
                            q_positions=torch.tensor([L - 1], device=q.device), sliding_window=sliding_window, logit_cap=logit_cap,
                            window_mode="decode", counter_rotate=counter_rotate, hp_dtype=hp_dtype,
                            cache=pool.caches[b], sinks=sinks)
        outs.append(o[0])
    return torch.stack(outs)


def rotate_q(pool: Pool, q: torch.Tensor) -> torch.Tensor:
    """fp32 rotated queries (``q R_k`` with the GQA head mapping)."""
    return rotate_rows_hp(q, pool.rot_k, torch.float32)


def run_decode(pool: Pool, q_rot: torch.Tensor, *, sink=None, recent=None, poison=True, **kw) -> torch.Tensor:
    """``decode_attention`` on ``pool`` with a NaN-poisoned output and workspace; checks full coverage."""
    from sglang_oscar.kernels import DecodeWorkspace, decode_attention, decode_num_hp_splits

    sink = pool.config.sink_tokens if sink is None else sink
    recent = pool.config.recent_tokens if recent is None else recent
    b, hq, _ = q_rot.shape
    dv = pool.layout.v.head_dim
    nkv = kw.pop("num_kv_splits", 3) or 48
    nhp = kw.pop("num_hp_splits", decode_num_hp_splits(sink, recent))
    out = kw.pop("out", None)
    if poison and out is None and kw.get("rotation_v") is None:
        out = poison_(torch.empty(b, hq, dv, dtype=kw.pop("out_dtype", torch.float32), device=q_rot.device))
    ws = DecodeWorkspace(q_rot.device).views(b, hq, dv, nkv + nhp)
    if poison:
        poison_(ws[0])
        poison_(ws[1])
    o = decode_attention(q_rot, pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v,
                         pool.hp_index, pool.req_to_token, pool.req_pool_indices, pool.seq_lens, pool.layout,
                         sink=sink, recent=recent, num_kv_splits=nkv, num_hp_splits=nhp, workspace=ws, out=out,
                         debug=kw.pop("debug", True), **kw)
    assert not bool(torch.isnan(o.float()).any()), "decode output not fully written (NaN left)"
    return o


def triton_config(pool: Pool, *, extend: bool = False, pairs: int | None = None, **changes):
    """:func:`~sglang_oscar.kernels.default_triton_config` of ``pool``'s layout on this platform with
    ``changes`` (field values) applied: a variant of what the kernels run by default."""
    from sglang_oscar.kernels import default_triton_config

    return dataclasses.replace(default_triton_config(pool.layout, extend=extend, pairs=pairs), **changes)


def reference_extend(pool: Pool, q: torch.Tensor, prefixes, exts, *, sliding_window=None, logit_cap=None,
                     counter_rotate=False, hp_dtype=torch.bfloat16, sinks=None) -> torch.Tensor:
    outs = []
    start = 0
    for b, (p, e) in enumerate(zip(prefixes, exts)):
        outs.append(oscar_attention(q[start:start + e], pool.ks[b][:p + e], pool.vs[b][:p + e], pool.rot_k,
                                    pool.rot_v, pool.config, q_positions=torch.arange(p, p + e, device=q.device),
                                    sliding_window=sliding_window, logit_cap=logit_cap, window_mode="extend",
                                    counter_rotate=counter_rotate, hp_dtype=hp_dtype, cache=pool.caches[b],
                                    sinks=sinks))
        start += e
    return torch.cat(outs)


def run_extend(pool: Pool, q_rot: torch.Tensor, prefixes, exts, *, poison=True, **kw):
    """``extend_attention`` with poisoned output; request ``b`` = pool request ``b``."""
    from sglang_oscar.kernels import extend_attention

    n, hq, _ = q_rot.shape
    dev = q_rot.device
    qo = torch.zeros(len(exts) + 1, dtype=torch.int64, device=dev)
    qo[1:] = torch.tensor(exts, device=dev).cumsum(0)
    out = kw.pop("out", None)
    if poison and out is None and kw.get("rotation_v") is None:
        out = poison_(torch.empty(n, hq, pool.layout.v.head_dim, dtype=kw.pop("out_dtype", torch.float32), device=dev))
    res = extend_attention(q_rot, pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v,
                           pool.hp_index, pool.req_to_token, pool.req_pool_indices, qo,
                           torch.tensor(prefixes, device=dev), torch.tensor(exts, device=dev), pool.layout, sink=pool.config.sink_tokens, out=out,
                           debug=kw.pop("debug", True), **kw)
    o = res[0] if isinstance(res, tuple) else res
    assert not bool(torch.isnan(o.float()).any()), "extend output not fully written (NaN left)"
    return res


def assert_rows_match(codes: torch.Tensor, pairs: torch.Tensor, ref, what: str = "") -> None:
    """Kernel bytes vs ``quant.quantize_rows`` output ``ref``.

    Uniform: codes and pairs bit-identical. Lloyd-Max: the group mean / variance are sums in fp64
    whose order differs from torch's, so a stored pair may differ by 1 ulp of its dtype in rare
    cases (never observed in these tests); such rows may then differ in codes, every other row must
    be bit-identical.
    """
    g, e = pairs.float(), ref.pairs.float()
    same_pair = (g == e) | (torch.isnan(g) & torch.isnan(e))
    if ref.quantizer == "uniform":
        assert bool(same_pair.all()), f"{what}: {int((~same_pair).sum())} pair values differ"
        assert torch.equal(codes, ref.codes), f"{what}: {int((codes != ref.codes).sum())} code bytes differ"
        return
    eps = torch.finfo(ref.pairs.dtype).eps
    ulp = eps * torch.maximum(g.abs(), e.abs()).clamp_min(torch.finfo(ref.pairs.dtype).tiny)
    assert bool(((g - e).abs() <= ulp).all() | same_pair.all()), f"{what}: pairs differ by more than 1 ulp"
    row_ok = same_pair.reshape(-1, pairs.shape[-1]).all(dim=-1)
    c, rc = codes.reshape(-1, codes.shape[-1]), ref.codes.reshape(-1, codes.shape[-1])
    assert torch.equal(c[row_ok], rc[row_ok]), f"{what}: code bytes differ on rows with identical pairs"


def build_latent_pool(lens, r, p, config, rotation, hp_dtype=torch.bfloat16, device="cpu"):
    """Random MLA latents ``c_kv [L, r]`` / ``k_pe [L, p]`` of each request quantized by the oracle
    (``reference.latent.build_latent_cache`` with ``rotation``) in a paged latent pool: codes,
    pairs and ``k_pe`` at random slots, the sink / recent rows at random HP rows, the rest poisoned.
    Returns ``(seqs, tensors)``: ``seqs[i] = (c_kv, k_pe)``, ``tensors`` the keyword arguments of
    ``kernels.latent_plan.latent_decode_attention`` on ``device``."""
    from sglang_oscar.reference.latent import build_latent_cache

    g = config.group_size
    total = sum(lens)
    slots_n, rows_n = 2 * total + 7, 2 * len(lens) * (config.sink_tokens + config.recent_tokens) + 5
    codes = poison_(torch.empty(slots_n, r // 4, dtype=torch.uint8))
    pairs = poison_(torch.empty(slots_n, 2 * r // g, dtype=torch.float16))
    k_pe = poison_(torch.empty(slots_n, p, dtype=hp_dtype))
    hp_latent = poison_(torch.empty(rows_n, r, dtype=hp_dtype))
    hp_pe = poison_(torch.empty(rows_n, p, dtype=hp_dtype))
    sink, recent = config.sink_tokens, config.recent_tokens
    hp_index = torch.full((len(lens) + 2, sink + recent), -1, dtype=torch.int32)
    r2t = torch.zeros(len(lens) + 2, max(lens) + 3, dtype=torch.int32)
    slot_perm = torch.randperm(slots_n - 1)[:total] + 1
    row_perm = iter(torch.randperm(rows_n).tolist())
    seqs, at = [], 0
    for i, n in enumerate(lens):
        req = i + 1  # request slot 0 stays unused
        c_kv, kpe = torch.randn(n, r) * (torch.rand(r) * 1.5 + 0.25), torch.randn(n, p)
        seqs.append((c_kv, kpe))
        lc = build_latent_cache(c_kv, kpe, rotation, config, hp_dtype=hp_dtype)
        s = slot_perm[at:at + n]
        at += n
        r2t[req, :n] = s.to(torch.int32)
        codes[s] = lc.quant.codes[:, 0]
        pairs[s] = lc.quant.pairs[:, 0].to(torch.float16)
        k_pe[s] = lc.kpe
        for pos in range(n):
            if pos < sink or pos >= n - recent:
                entry = pos if pos < sink else sink + pos % recent
                row = next(row_perm)
                hp_index[req, entry] = row
                hp_latent[row], hp_pe[row] = lc.ckv_hp[pos], lc.kpe[pos]
    tensors = dict(codes=codes, pairs=pairs, k_pe=k_pe, hp_latent=hp_latent, hp_pe=hp_pe, hp_index=hp_index,
                   req_to_token=r2t, req_pool_indices=torch.arange(1, len(lens) + 1, dtype=torch.int32),
                   seq_lens=torch.tensor(lens, dtype=torch.int32))
    return seqs, {k: v.to(device) for k, v in tensors.items()}


class _Cfg:
    def __init__(self, cfg, rotation):
        self.cfg, self.rotation = cfg, rotation
        self.group_size, self.sink_tokens, self.recent_tokens = cfg.group_size, cfg.sink_tokens, cfg.recent_tokens
