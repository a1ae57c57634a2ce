"""Eigenvector signs of OSCAR's ``U S H P`` (``eigh`` fixes each eigenvector only up to its sign).

Findings kept as tests (they were the one-off scripts ``sign_spread.py`` and ``eigh_sign_check.py``):

* the sign vector ``S`` changes the rotation and its INT2 attention error: on the synthetic layer
  (:func:`sglang_oscar.reference.synthetic.synthetic_qkv`, calibration draw seed 0, evaluation draw
  seed 1, all positions INT2, group = head_dim) every sign vector gives another error, and OSCAR's
  K rotation beats the data-free Hadamard with any of them;
* a greedy calibration search over the signs never raises its own objective (the query-weighted
  score error of the calibration keys, ``sum_t e_t^T C e_t``);
* with the fitter's canonical signs (:func:`sglang_oscar.rotation.fit.canonical_signs`) the CPU
  (LAPACK) and GPU (cuSOLVER) fits of the same covariance give the same rotation (GPU).
"""

from __future__ import annotations

import pytest
import torch

from sglang_oscar.config import OscarConfig
from sglang_oscar.quant.int2 import fake_quantize
from sglang_oscar.reference import oscar_attention, plain_attention, relative_error_db
from sglang_oscar.reference.synthetic import synthetic_qkv
from sglang_oscar.rotation.fit import query_covariance, rotation_from_covariance, score_weighted_value_covariance
from sglang_oscar.rotation.hadamard import default_hadamard, eig_bitrev_permutation
from sglang_oscar.rotation.latent import covariance_eigenbasis

HEAD_DIM = 128


def rotation_with_signs(cov: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """``U S H P`` (fp32 ``[D, D]``) of a ``[D, D]`` second moment: ``U`` canonical eigenvectors,
    ``S = diag(signs)`` (``+-1``, float64 ``[D]``)."""
    u, lam = covariance_eigenbasis(cov)  # the fitter's eigh: symmetrised, float64, canonical signs
    return ((u * signs) @ default_hadamard(cov.shape[0]) @ eig_bitrev_permutation(lam)).float()


class SyntheticLayer:
    """One synthetic GQA layer (8 query heads, 2 kv heads, head_dim 128): OSCAR's V rotation fixed,
    :meth:`error_db` scores a K rotation (attention-output error in dB on the evaluation draw,
    every position INT2)."""

    def __init__(self, tokens: int, center: bool):
        self.q, self.k, v = synthetic_qkv(tokens, 8, 2, HEAD_DIM, seed=0)
        self.qe, self.ke, self.ve = synthetic_qkv(tokens, 8, 2, HEAD_DIM, seed=1)
        self.cfg = OscarConfig(sink_tokens=0, recent_tokens=0)
        self.pos = torch.arange(tokens)
        self.want = plain_attention(self.qe, self.ke, self.ve, q_positions=self.pos)
        self.qcov = query_covariance(self.q, 2).mean(0)
        self.rv = rotation_with_signs(score_weighted_value_covariance(self.k, v, query_covariance(self.q, 2)).mean(0),
                                      torch.ones(HEAD_DIM, dtype=torch.float64))
        self.km, self.vm = (self.k.mean(0), v.mean(0)) if center else (None, None)

    def error_db(self, rk: torch.Tensor) -> float:
        out = oscar_attention(self.qe, self.ke, self.ve, rk, self.rv, self.cfg, q_positions=self.pos,
                              k_mean=self.km, v_mean=self.vm)
        return relative_error_db(out, self.want)

    def score_error(self, signs: torch.Tensor) -> float:
        """Calibration objective of a K sign vector: ``sum_t e_t^T C e_t`` over the calibration keys."""
        r = rotation_with_signs(self.qcov, signs).double()
        rows = self.k.double() - (self.km.double() if self.km is not None else 0.0)
        y = torch.einsum("thd,de->the", rows, r).to(torch.bfloat16).float()
        yq = fake_quantize(y, group_size=self.cfg.group_size, clip_ratio=self.cfg.k_clip_ratio,
                           quantizer=self.cfg.quantizer, scale_dtype=self.cfg.scale_dtype)
        e = torch.einsum("the,de->thd", (yq - y).double(), r)
        return float(torch.einsum("thd,de,the->", e, self.qcov.double(), e))


def random_signs(n: int, trials: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double() for _ in range(trials)]


@pytest.mark.parametrize("center", [False, True])
def test_signs_change_the_rotation_and_its_int2_error(center):
    layer = SyntheticLayer(256, center)
    had = layer.error_db(default_hadamard(HEAD_DIM).float())
    canon = layer.error_db(rotation_with_signs(layer.qcov, torch.ones(HEAD_DIM, dtype=torch.float64)))
    errs = [layer.error_db(rotation_with_signs(layer.qcov, s)) for s in random_signs(HEAD_DIM, 3)]
    assert all(x < -1.0 for x in (had, canon, sum(errs) / len(errs))), (had, canon, errs)
    assert min(errs) < max(errs), errs  # three sign vectors, three different errors
    assert max(errs) - min(errs) > 0.1, errs
    assert canon < had and max(errs) < had, (had, canon, errs)  # OSCAR's K beats Hadamard with any signs
    # U S H P is orthogonal for any S and differs from U H P when S is not all ones
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 32, generator=g, dtype=torch.float64)
    cov = x.T @ x / 300
    ones = torch.ones(32, dtype=torch.float64)
    flip = ones.clone()
    flip[3] = -1.0
    a, b = rotation_with_signs(cov, ones), rotation_with_signs(cov, flip)
    torch.testing.assert_close(a @ a.T, torch.eye(32), atol=1e-5, rtol=0)
    assert float((a - b).abs().max()) > 0.05


def test_sign_search_never_raises_its_calibration_objective():
    """Greedy flips are kept only when they lower the calibration score error: the ratio is <= 1."""
    layer = SyntheticLayer(128, center=False)
    signs = torch.ones(HEAD_DIM, dtype=torch.float64)
    start = best = layer.score_error(signs)
    for i in range(HEAD_DIM):  # one sweep
        signs[i] = -signs[i]
        val = layer.score_error(signs)
        if val < best:
            best = val
        else:
            signs[i] = -signs[i]
    flipped, ratio = int((signs < 0).sum()), best / start
    assert ratio <= 1.0 and (flipped == 0) == (ratio == 1.0), (flipped, ratio)
    assert ratio == layer.score_error(signs) / start  # the kept signs are the ones scored
    assert layer.error_db(rotation_with_signs(layer.qcov, signs)) < -1.0


@pytest.mark.gpu
def test_canonical_signs_make_cpu_and_gpu_fits_agree():
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(4):
        x = torch.randn(4000, HEAD_DIM, generator=g, dtype=torch.float64)
        x = x * torch.logspace(0, 1.5, HEAD_DIM, dtype=torch.float64)  # anisotropic, 1.5 decades
        s = x.T @ x / x.shape[0]
        rc, _ = rotation_from_covariance(s)
        rg, _ = rotation_from_covariance(s.cuda())
        worst = max(worst, float((rc - rg.cpu()).abs().max()))
    assert worst < 1e-9, worst
