"""How much do the eigenvector signs of OSCAR's ``U H P`` matter? (issue 7 diagnostic, CPU)

``eigh`` fixes each eigenvector only up to its sign, and under ``U H`` a flipped eigenvector is a
different rotation (the Hadamard mixes the eigen-directions). On the synthetic layer of
:func:`sglang_oscar.reference.synthetic.synthetic_qkv` (outlier key channels, anisotropic queries;
calibration draw ``seed 0``, evaluation draw ``seed 1``) this fits OSCAR's K rotation from the
calibration queries, keeps OSCAR's V rotation fixed, and prints the attention-output error (dB,
all positions in INT2, group = head_dim) of: the data-free Hadamard for K, OSCAR with the fitter's
canonical signs (:func:`sglang_oscar.rotation.fit.canonical_signs`), and OSCAR with ``--trials``
seeded random sign vectors. ``--center`` subtracts the calibration draw's per-kv-head key and
value means first (``fit --center``). For rows whose eigen-coordinates are independent and
symmetric about zero the sign vector cannot matter (``z S`` has the distribution of ``z``); the
spread measures how far the rows are from that (a static offset, which centering removes, and
offsets that RoPE turns with the position, which it does not).

``--search N`` also picks the signs by calibration: N greedy sweeps over the 128 signs, each flip
kept if it lowers the query-weighted score error of the calibration keys,
``sum_t e_t^T C e_t`` (``e_t`` the key's INT2 error back in the model frame, ``C`` the calibration
query covariance), then scores that sign vector on the evaluation draw.

    PYTHONPATH=$PWD/python python scripts/sign_spread.py [--trials 16 --tokens 1024] [--center] [--search 2]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from sglang_oscar.config import OscarConfig  # noqa: E402
from sglang_oscar.quant.int2 import fake_quantize  # noqa: E402
from sglang_oscar.reference import oscar_attention, plain_attention, relative_error_db  # noqa: E402
from sglang_oscar.reference.synthetic import synthetic_qkv  # noqa: E402
from sglang_oscar.rotation.fit import query_covariance, score_weighted_value_covariance  # noqa: E402
from sglang_oscar.rotation.hadamard import default_hadamard, eig_bitrev_permutation  # noqa: E402
from sglang_oscar.rotation.latent import covariance_eigenbasis  # noqa: E402


def rotation_with_signs(cov: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``U S H P`` (fp32 ``[D, D]``) of a ``[D, D]`` second moment: ``U`` canonical eigenvectors,
    ``S = diag(signs)`` (``+-1``, float64 ``[D]``)."""
    u, lam = covariance_eigenbasis(cov)  # the fitter's eigh: symmetrised, float64, canonical signs
    return ((u * signs) @ default_hadamard(cov.shape[0]) @ eig_bitrev_permutation(lam)).float()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--center", action="store_true", help="subtract the calibration draw's K/V means")
    ap.add_argument("--search", type=int, default=0, help="greedy sweeps of a calibration sign search (0: none)")
    args = ap.parse_args(argv)
    q, k, v = synthetic_qkv(args.tokens, 8, 2, 128, seed=0)
    qe, ke, ve = synthetic_qkv(args.tokens, 8, 2, 128, seed=1)
    cfg = OscarConfig(sink_tokens=0, recent_tokens=0)
    pos = torch.arange(args.tokens)
    want = plain_attention(qe, ke, ve, q_positions=pos)
    qcov = query_covariance(q, 2)
    rv = rotation_with_signs(score_weighted_value_covariance(k, v, qcov).mean(0), torch.ones(128, dtype=torch.float64))

    km, vm = (k.mean(0), v.mean(0)) if args.center else (None, None)

    def err(rk):
        return relative_error_db(oscar_attention(qe, ke, ve, rk, rv, cfg, q_positions=pos, k_mean=km, v_mean=vm), want)

    had = err(default_hadamard(128).float())
    canon = err(rotation_with_signs(qcov.mean(0), torch.ones(128, dtype=torch.float64)))
    g = torch.Generator().manual_seed(3)
    errs = [err(rotation_with_signs(qcov.mean(0), torch.where(torch.rand(128, generator=g) < 0.5, -1.0, 1.0).double()))
            for _ in range(args.trials)]
    if args.search:
        c = qcov.mean(0)
        rows = k.double() - (km.double() if km is not None else 0.0)

        def score_error(signs):
            r = rotation_with_signs(c, signs).double()
            y = torch.einsum("thd,de->the", rows, r).to(torch.bfloat16).float()
            yq = fake_quantize(y, group_size=cfg.group_size, clip_ratio=cfg.k_clip_ratio, quantizer=cfg.quantizer,
                               scale_dtype=cfg.scale_dtype)
            e = torch.einsum("the,de->thd", (yq - y).double(), r)
            return float(torch.einsum("thd,de,the->", e, c.double(), e))

        signs = torch.ones(128, dtype=torch.float64)
        start = best = score_error(signs)
        for _ in range(args.search):
            for i in range(128):
                signs[i] = -signs[i]
                val = score_error(signs)
                if val < best:
                    best = val
                else:
                    signs[i] = -signs[i]
        print(f"sign search ({args.search} sweeps, {int((signs < 0).sum())} signs flipped): calibration score error "
              f"{best / start:.4f} of the canonical signs'; evaluation {err(rotation_with_signs(qcov.mean(0), signs)):.2f} dB")
    print(("centred K/V; " if args.center else "") + f"K = Hadamard: {had:.2f} dB; K = OSCAR, canonical signs: {canon:.2f} dB; {args.trials} random sign vectors: "
          f"min {min(errs):.2f} max {max(errs):.2f} mean {sum(errs) / len(errs):.2f} dB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
