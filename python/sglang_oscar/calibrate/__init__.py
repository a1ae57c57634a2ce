"""Calibration of OSCAR rotations from a Hugging Face ``transformers`` model.

Pipeline (docs/calibration.md): ``calibrate`` (capture post-RoPE Q/K/V of every attention
layer through an attention-function override and accumulate fp64 sufficient statistics) ->
``fit`` (statistics -> validated rotation file) -> ``error`` (attention-output error in dB of
INT2 with naive / Hadamard / fitted rotations on held-out prompts) -> ``ppl`` (teacher-forced
perplexity with a fake-quantized KV cache through the reference oracle).

Modules: :mod:`.capture` (attention override, latent hooks), :mod:`.stats` (accumulators and
the statistics file), :mod:`.prompts` (calibration data), :mod:`.model` (loading, geometry),
:mod:`.run` (the calibrate driver: passes, checkpoints, progress), :mod:`.fit`, :mod:`.error`,
:mod:`.ppl`, :mod:`.recipes` (recipe -> commands/settings), :mod:`.cli` (verbs).
"""


# ``sglang-oscar fit`` methods (documented in :mod:`.fit`); here so the CLI lists them without torch.
FIT_METHODS = ("oscar", "oscar-perhead", "perhead-kv", "hadamard", "identity")


class CalibrationError(ValueError):
    """A user-facing calibration error (bad input, mismatched files, unsupported model)."""


class ShortDataWarning(UserWarning):
    """The calibration data holds fewer tokens than the requested budget."""


class NotHeldOutWarning(UserWarning):
    """``error``/``ppl`` prompts overlap the calibration data of a rotation they evaluate."""
