"""Rotations: Hadamard/bit-reversal building blocks, fitting math, geometry, rotation files."""

from .fit import (
    fit_layer,
    gqa_group,
    query_covariance,
    query_second_moment_sums,
    rotation_from_covariance,
    rotations_from_covariances,
    score_weighted_value_covariance,
    value_weighted_sums,
)
from .geometry import GeometryGroup, LayerGeometry, ModelGeometry
from .hadamard import (
    bit_reversal_permutation,
    block_hadamard,
    default_hadamard,
    eig_bitrev_permutation,
    hadamard_matrix,
    is_power_of_two,
)
from .rotation_set import METHODS, RotationError, RotationSet, orthogonality_error

__all__ = [name for name in dir() if not name.startswith("_")]
