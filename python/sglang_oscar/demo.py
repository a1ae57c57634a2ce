"""The CPU demo of the whole scheme on synthetic attention data (``sglang-oscar demo``).

Fits OSCAR rotations on one draw of synthetic Q/K/V (:mod:`.reference.synthetic`), then on a
held-out draw measures the attention-output error (dB, :func:`.reference.relative_error_db`)
of naive INT2, Hadamard and OSCAR caches against unquantized attention, with the uniform and
Lloyd-Max quantizers, and their bits per element at that context length; Hadamard and OSCAR
also without the BF16 windows, at equal bits. The same comparison on a trained language model is
``sglang-oscar quality`` (docs/quality.md).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .config import OscarConfig
from .quant.baselines import naive_symmetric_int2
from .quant.bits import bits_per_element
from .reference import oscar_attention, plain_attention, relative_error_db
from .reference.attention import attend
from .reference.synthetic import synthetic_qkv
from .rotation import default_hadamard, fit_layer


@dataclasses.dataclass
class DemoRow:
    """One row of the demo table: a rotation scheme, its quantizer, attention-output error in dB vs
    unquantized attention (lower is better) and stored bits per K/V element."""

    scheme: str
    quantizer: str
    error_db: float
    bits_per_element: float


def run_demo(
    seq_len: int = 4096,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 128,
    group_size: int | None = None,
    num_queries: int = 256,
    seed: int = 0,
) -> list[DemoRow]:
    """Compute the demo table (see module docstring). Returns one :class:`DemoRow` per scheme.

    Raises:
        ValueError: ``seq_len < 1`` or settings the format rejects.
    """
    if seq_len < 1:
        raise ValueError(f"context must be at least 1 token, got {seq_len}")
    num_queries = min(num_queries, seq_len)
    torch.manual_seed(seed)
    q_cal, k_cal, v_cal = synthetic_qkv(seq_len, num_q_heads, num_kv_heads, head_dim, seed=seed + 1)
    q, k, v = synthetic_qkv(seq_len, num_q_heads, num_kv_heads, head_dim, seed=seed + 2)
    r_k, r_v = fit_layer(q_cal, k_cal, v_cal)
    q = q[-num_queries:]
    exact = plain_attention(q, k, v)
    rows = []
    # Naive INT2: per-token symmetric, no rotation, no BF16 windows; one fp16 scale per row.
    qpos = torch.arange(seq_len - num_queries, seq_len)
    naive = attend(q, qpos, k, v, naive_symmetric_int2(k), naive_symmetric_int2(v), sink=0, recent=0,
                   sm_scale=head_dim**-0.5)
    rows.append(DemoRow("naive INT2 (no rotation, no windows)", "symmetric", relative_error_db(naive, exact), 2.0 + 16.0 / head_dim))
    hadamard = default_hadamard(head_dim).float()
    eye = torch.eye(head_dim)
    schemes = (("no rotation", (eye, eye)), ("Hadamard", (hadamard, hadamard)), ("OSCAR", (r_k.float(), r_v.float())))
    for name, (rk, rv) in schemes:
        for quantizer in ("uniform", "lloyd-max"):
            cfg = OscarConfig(group_size=group_size, quantizer=quantizer)
            out = oscar_attention(q, k, v, rk, rv, cfg)
            bpe = bits_per_element(head_dim, group_size, cfg.scale_dtype, seq_len, cfg.sink_tokens, cfg.recent_tokens)
            rows.append(DemoRow(f"{name} + sink/recent", quantizer, relative_error_db(out, exact), bpe))
    # Hadamard and OSCAR without their BF16 windows (equal bits): what the windows buy, and the
    # rotations compared on the INT2 tier alone.
    cfg = OscarConfig(group_size=group_size, sink_tokens=0, recent_tokens=0)
    bpe = bits_per_element(head_dim, group_size, cfg.scale_dtype, seq_len, 0, 0)
    for name, (rk, rv) in schemes[1:]:
        out = oscar_attention(q, k, v, rk, rv, cfg)
        rows.append(DemoRow(f"{name}, no windows", "uniform", relative_error_db(out, exact), bpe))
    return rows


def format_table(rows: list[DemoRow], seconds: float, seq_len: int) -> str:
    """The demo table as text: one line per row, then the run time in seconds."""
    lines = [
        f"attention-output error vs unquantized attention (held-out synthetic data, context {seq_len}; lower dB is better)",
        f"{'scheme':<40} {'quantizer':<10} {'error (dB)':>10} {'bits/elem':>10}",
        "-" * 73,
    ]
    for r in rows:
        lines.append(f"{r.scheme:<40} {r.quantizer:<10} {r.error_db:>10.2f} {r.bits_per_element:>10.3f}")
    lines.append(f"({seconds:.1f} s)")
    return "\n".join(lines)


def main(seq_len: int = 4096, group_size: int | None = None, seed: int = 0) -> str:
    """Run :func:`run_demo` and return its table (``sglang-oscar demo``)."""
    t0 = time.time()
    rows = run_demo(seq_len=seq_len, group_size=group_size, seed=seed)
    return format_table(rows, time.time() - t0, seq_len)
