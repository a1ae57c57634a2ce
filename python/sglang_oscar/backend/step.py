"""The per-layer rotations of the served step, and the optional value-rotation fold at load.

* :func:`rotate_inputs`: ``q R_k`` (fp32), ``(k - mu_k) R_k`` and ``(v - mu_v) R_v`` (the pool's HP
  dtype) of one layer; for a layer whose value rotation is folded into its weights
  (``--oscar-fold-rotations on``, :mod:`.fold`) V comes out of ``qkv_proj`` rotated and centred
  already, so only q and K are rotated and V is written as it comes (cast to the HP dtype).
* :func:`rotate_output`: ``o R_v^T + mu_v`` back to the model's frame; for a folded layer ``o``
  only cast (``o_proj`` holds ``R_v`` and its bias the mean term). Gemma-4's layers fold only this
  output side (``fold.OUTPUT_FOLDABLE_ATTENTION``): V is rotated at run time, the output only cast.
* :func:`fold_model`: the fold, once per backend, on this rank's rotations and means.

``engine`` is ``--oscar-rotate-engine``: ``"triton"`` (``kernels.rotate``: q, K and V in one
``rotate_qkv`` launch, q and K in one when V is folded, the output in one ``rotate_heads``) or
``"torch"`` (the fp32 einsum, ``rotate_heads_reference``). The output rotation takes the Triton
engine's ``precision`` (``kernels.rotate``): the backend passes ``"tf32x3"`` for the extend steps of
a 16-bit model (an 8K-token chunk's output rotation: 155 us instead of 437 us per Qwen3-8B layer on
the H200; the q / K / V launch was slower at TF32x3, 614 vs 371 us, and stays IEEE:
docs/benchmarks_extend.md), ``"ieee"`` for decode batches and fp32 models (which the oracle checks at
fp32 noise). "Extend" is the batch's forward mode: MIXED and TARGET_VERIFY batches count as extend.
"""

from __future__ import annotations

import logging

import torch

from ..kernels.rotate import rotate_heads, rotate_heads_reference, rotate_qkv

logger = logging.getLogger("sglang_oscar")


def _rotate(x: torch.Tensor, r: torch.Tensor, out_dtype: torch.dtype, transpose: bool = False,
            sub_mean: torch.Tensor | None = None, add_mean: torch.Tensor | None = None,
            engine: str = "triton", precision: str = "ieee") -> torch.Tensor:
    """``(x - sub_mean) r`` (or ``x r^T + add_mean``) of ``x [T, H, D]`` per kv head with ``r [H_kv, D, D]``
    (GQA: head ``h`` uses ``h // (H/H_kv)``; means ``[H_kv, D]`` or ``None``), in fp32, cast to ``out_dtype``;
    ``engine`` (``--oscar-rotate-engine``): ``"torch"`` einsum or the ``"triton"`` kernel (at ``precision``)."""
    if engine == "triton":
        return rotate_heads(x, r, out_dtype, transpose=transpose, sub_mean=sub_mean,
                            add_mean=add_mean, validate=False, precision=precision)
    return rotate_heads_reference(x, r, out_dtype, transpose=transpose, sub_mean=sub_mean, add_mean=add_mean)


def rotate_inputs(q3, k3, v3, rotations, means, hp_dtype, engine: str, folded: bool):
    """``(q_rot fp32, k_rot, v_rot)`` of one layer's ``q [T, H_q, D_k]``, ``k [T, H_kv, D_k]``,
    ``v [T, H_kv, D_v]`` (``k3`` / ``v3`` ``None``: q only, the others returned ``None``);
    ``rotations`` ``(R_k, R_v)``, ``means`` ``(mu_k, mu_v)`` (each ``None`` if not centred). K and V
    in ``hp_dtype``, last dim contiguous (the pool's write). ``folded``: V is already ``(v - mu_v) R_v``
    (the folded ``qkv_proj``) and is only cast."""
    rk, rv = rotations
    mk, mv = means
    if k3 is None:
        return _rotate(q3, rk, torch.float32, engine=engine), None, None
    if folded:
        if engine == "triton":  # q and K in one launch
            q_rot, k_rot, _ = rotate_qkv(q3, k3, None, rk, None, hp_dtype, mean_k=mk, validate=False)
        else:
            q_rot = _rotate(q3, rk, torch.float32, engine=engine)
            k_rot = _rotate(k3, rk, hp_dtype, sub_mean=mk, engine=engine)
        v_rot = v3.to(hp_dtype)
        return q_rot, k_rot, (v_rot if v_rot.stride(-1) == 1 else v_rot.contiguous())
    if engine == "triton":  # q, K and V in one launch (kernels.rotate.rotate_qkv)
        return rotate_qkv(q3, k3, v3, rk, rv, hp_dtype, mean_k=mk, mean_v=mv, validate=False)
    return (_rotate(q3, rk, torch.float32, engine=engine), _rotate(k3, rk, hp_dtype, sub_mean=mk, engine=engine),
            _rotate(v3, rv, hp_dtype, sub_mean=mv, engine=engine))


def rotate_output(o: torch.Tensor, rv: torch.Tensor, mean_v, out_dtype: torch.dtype, engine: str,
                  folded: bool, precision: str = "ieee") -> torch.Tensor:
    """The attention output ``o [T, H_q, D_v]`` (rotated frame) for ``o_proj``: ``o R_v^T + mu_v`` in
    ``out_dtype`` from fp32, or for a folded layer ``o`` as is (``o_proj`` reads the rotated frame; the
    backend's plans write it in the model dtype already, so the cast is a no-op). ``precision``: the
    Triton engine's (module docstring)."""
    if folded:
        return o.to(out_dtype)
    return _rotate(o, rv, out_dtype, transpose=True, add_mean=mean_v, engine=engine, precision=precision)


def fold_model(config, model, rotations, means, par) -> tuple[frozenset[int], frozenset[int]]:
    """Fold the value rotations into ``model`` when ``config.fold_rotations`` (``--oscar-fold-rotations``).

    Args:
        config: :class:`~sglang_oscar.config.OscarConfig`.
        model: the loaded SGLang model (``model_runner.model``) or ``None``.
        rotations, means: this rank's ``{layer id: (R_k, R_v)}`` / ``{layer id: (mu_k, mu_v)}``.
        par: SGLang's parallel context (``runtime_context.get_parallel()``): ``attn_tp_rank``,
            ``attn_tp_size``, ``attn_tp_group.cpu_group`` (the gloo group the mean terms are summed on).

    Returns:
        ``(value_folded, output_folded)``: global ids of the layers whose V comes out of
        ``qkv_proj`` rotated, and of those whose ``o_proj`` reads the rotated frame (a superset:
        the output-only layers too); both empty when off. The report is logged on rank 0.
    """
    if not config.fold_rotations or model is None:
        return frozenset(), frozenset()
    from .fold import cpu_all_reduce, fold_value_rotations

    rank, size = par.attn_tp_rank, par.attn_tp_size
    all_reduce = cpu_all_reduce(par.attn_tp_group.cpu_group) if size > 1 else None
    report = fold_value_rotations(model, rotations, means, rank, size, all_reduce=all_reduce)
    if rank == 0:
        report.log(logger)
    return report.folded_layers, report.output_folded_layers
