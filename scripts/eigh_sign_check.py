"""Do CPU and GPU fits give the same rotation? (device helper; issue 7, tenth session)

``torch.linalg.eigh`` returns every eigenvector up to its sign, and LAPACK (CPU) and cuSOLVER
(GPU) may choose differently. Under OSCAR's ``U H P`` a flipped eigenvector is a different
rotation, so statistics fitted on the GPU (``sglang-oscar quality``) and the same statistics
fitted on the CPU (``scripts/rotation_ablation.py``) could disagree. For ``--trials`` seeded
random ``--dim`` x ``--dim`` covariances (anisotropic, 1.5 decades) this prints how many
eigenvectors came back with opposite signs from the two solvers, and the largest entry of
``R_cpu - R_gpu`` from :func:`sglang_oscar.rotation.fit.rotation_from_covariance` (which fixes
the signs with ``canonical_signs``).

    PYTHONPATH=$PWD/python python scripts/eigh_sign_check.py [--trials 20 --dim 128]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from sglang_oscar.rotation.fit import rotation_from_covariance  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--dim", type=int, default=128)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA device (it compares the CPU and GPU eigensolvers)", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    flips, worst = [], 0.0
    for _ in range(args.trials):
        x = torch.randn(4000, args.dim, generator=g, dtype=torch.float64)
        x = x * torch.logspace(0, 1.5, args.dim, dtype=torch.float64)
        s = x.T @ x / x.shape[0]
        _, uc = torch.linalg.eigh(s)
        _, ug = torch.linalg.eigh(s.cuda())
        flips.append(int(((uc * ug.cpu()).sum(0) < 0).sum()))
        rc, _ = rotation_from_covariance(s)
        rg, _ = rotation_from_covariance(s.cuda())
        worst = max(worst, float((rc - rg.cpu()).abs().max()))
    print("raw eigh: eigenvectors with opposite sign CPU vs GPU per trial:", flips)
    print("rotation_from_covariance (canonical signs): max |R_cpu - R_gpu| per trial:", worst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
