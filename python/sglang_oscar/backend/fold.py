"""Fold the value rotation (and the value centering mean) into the attention's projection weights.

V has no RoPE, so the served step's value rotation and its output counter-rotation are linear maps
next to linear layers and can be moved into them once, at weight load (issue 28, item 2). Per
attention layer, with ``R_h`` the value rotation and ``mu_h`` the value mean of kv head ``h`` and
``h(g) = g // (H_q / H_kv)`` the kv head that query head ``g`` reads (GQA):

* **value projection** (rows of kv head ``h``, ``W_h [D_v, hidden]``, bias ``b_h``): the cache wants
  ``v' = (v - mu_h) R_h = x (R_h^T W_h)^T + (b_h - mu_h) R_h``, so ``W_h <- R_h^T W_h`` and
  ``b_h <- (b_h - mu_h) R_h`` (a bias is created when the layer has none and the file is centred);
* **output projection** (input columns of query head ``g``, ``W_g [hidden, D_v]``): attention now
  returns the rotated-frame ``o' = (o - mu) R`` and the model needs ``o = o' R^T + mu``, so
  ``W_g <- W_g R_h(g)`` and ``bias <- bias + sum_g W_g mu_h(g)`` (over *all* query heads of the
  layer, also created when missing).

Everything is computed in fp32 from the loaded weights and rounded once to the weight dtype.
The key rotation stays at run time (RoPE sits between ``k_proj`` and the cache), and so does
``q R_k``.

SGLang layout (0.5.16, ``sglang/srt/layers/linear.py``): ``qkv_proj`` is a ``QKVParallelLinear``
whose weight on a tensor-parallel rank is ``[q rows | k rows | v rows]`` of that rank's heads
(``num_heads`` query heads, ``num_kv_heads`` kv heads, replicated when ``tp_size > H_kv``),
``o_proj`` a ``RowParallelLinear`` holding the input columns of the rank's query heads, with a
*full* ``[hidden]`` bias that only rank 0 adds (``RowParallelLinear.forward``: ``bias_ = None if
self.tp_rank > 0``), before the all-reduce (or before the decoder layer's reduction when
``reduce_results=False``, Qwen3). So the output-side mean term, whose columns are spread over the
ranks, is the all-reduce of each rank's partial ``sum_{g on rank} W_g mu_h(g)``: the fold takes the
tensor-parallel group's ``all_reduce`` (:func:`cpu_all_reduce` of its gloo ``cpu_group``) and calls
it once on every rank, with one row per centred layer on every rank and a count of the ranks that
folded it (a layer folded on some ranks only raises), and every rank stores the same full bias.

Rounding: with a calibrated mean (the mean of the layer's values) the bf16 folded layer is as
close to the fp32 truth as the bf16 run-time path (tests). A mean far from the values would make
o_proj add two large cancelling bf16 terms (``W' o'`` and the bias) where the run-time path
cancels ``o' R^T + mu`` in fp32 first. The rotations and means passed
in are the rank's own (``backend.rotations.rank_rotations`` / ``rank_means``: the backend's
``self.rotations`` / ``self.means``), never sliced here.

What is not folded keeps the run-time rotation, with the reason in the :class:`FoldReport`:
quantized weights (any linear method other than ``UnquantizedLinearMethod``, weights that are not
plain bf16/fp16/fp32 tensors, CPU AMX-packed weights), modules that are not exactly
``QKVParallelLinear`` / ``RowParallelLinear`` (LoRA wrappers, other fused layouts), attention
classes whose V path has not been checked to be linear from the projection to the cache and from
the attention output to ``o_proj`` (:data:`FOLDABLE_ATTENTION`; e.g. a ``v_norm`` or an output
gate breaks the fold; classes in :data:`OUTPUT_FOLDABLE_ATTENTION`, whose output alone reaches
``o_proj`` unchanged, fold only the output side and keep V's run-time rotation), a centred file
where a bias is needed but the layer returns its bias to the caller (``skip_bias_add``), and a
centred file under tensor parallelism without ``all_reduce``.
A layer folded already (a second backend over the same model, a second call) is reported folded
again without being touched when the rotation and mean are the same, and is an error otherwise.
Weights reloaded after the fold (SGLang's ``update_weights_from_*``) would be unfolded again while the
report still says folded: the plugin refuses those updates for a folded model
(:func:`folded_layer_ids`, ``plugin/serving.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Mapping

import torch

logger = logging.getLogger("sglang_oscar")

# SGLang 0.5.16 attention modules whose forward is ``qkv_proj -> split -> (q, k norm/RoPE) ->
# attn(q, k, v) -> o_proj`` with V untouched between the split and the attention and the
# attention output fed straight to o_proj (checked in sglang/srt/models/{llama,qwen2,qwen3,
# qwen3_moe,gemma3_causal,gpt_oss}.py).
FOLDABLE_ATTENTION = frozenset({"LlamaAttention", "Qwen2Attention", "Qwen3Attention", "Qwen3MoeAttention",
                                "Gemma3Attention", "GptOssAttention"})
# Attention modules whose output feeds o_proj as is but whose V is not linear from qkv_proj to the cache
# (sglang/srt/models/gemma4_causal.py: an RMS v_norm after the projection, and on the full layers V taken
# from k_proj's rows): only the output side folds (o_proj absorbs R_v and the mean term), V keeps its
# run-time rotation.
OUTPUT_FOLDABLE_ATTENTION = frozenset({"Gemma4Attention"})
PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FOLDED_MARK = "_oscar_value_rotation_folded"


@dataclasses.dataclass
class FoldReport:
    """What :func:`fold_value_rotations` did.

    Attributes:
        folded: global layer ids whose value rotation (and mean) now live in the weights: the
            backend writes their projected V rows as they come and skips the output counter-rotation.
        output_only: layers of :data:`OUTPUT_FOLDABLE_ATTENTION` classes whose ``o_proj`` holds
            ``R_v`` and the mean term: the backend rotates V at run time and skips the output
            counter-rotation.
        kept: ``{layer id: reason}`` of layers that keep the run-time rotation.
        created_bias: module names that were given a bias (bias-less layers of a centred file).
    """

    folded: list[int] = dataclasses.field(default_factory=list)
    kept: dict[int, str] = dataclasses.field(default_factory=dict)
    created_bias: list[str] = dataclasses.field(default_factory=list)
    output_only: list[int] = dataclasses.field(default_factory=list)

    @property
    def folded_layers(self) -> frozenset[int]:
        """Layers whose V comes out of ``qkv_proj`` rotated."""
        return frozenset(self.folded)

    @property
    def output_folded_layers(self) -> frozenset[int]:
        """Layers whose ``o_proj`` reads the rotated frame (``folded`` and ``output_only``)."""
        return frozenset(self.folded) | frozenset(self.output_only)

    def messages(self) -> list[str]:
        """One log line per kept layer, then a summary."""
        lines = [f"layer {lid}: {why}: value rotation stays at run time" for lid, why in sorted(self.kept.items())]
        summary = f"sglang-oscar: value rotation folded into the weights of {len(self.folded)} layers"
        if self.output_only:
            summary += f", into o_proj only (V rotated at run time) in {len(self.output_only)}"
        if self.kept:
            summary += f", kept at run time in {len(self.kept)}"
        if self.created_bias:
            summary += f"; created a bias on {len(self.created_bias)} projections for the value mean"
        return lines + [summary]

    def log(self, log: logging.Logger | None = None) -> None:
        log = log or logger
        for line in self.messages():
            (log.warning if line.startswith("layer ") else log.info)(line)


# ---------------------------------------------------------------------------------- the math
def _per_head(r: torch.Tensor, heads: int) -> torch.Tensor:
    r = r.float()
    if r.dim() == 2:
        return r.unsqueeze(0).expand(heads, *r.shape)
    if r.dim() != 3 or r.shape[0] != heads:
        raise ValueError(f"rotation of shape {tuple(r.shape)} does not match {heads} kv heads")
    return r


def fold_v_projection(w_v: torch.Tensor, b_v: torch.Tensor | None, rotation: torch.Tensor,
                      mean: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The value-projection rows and bias that output ``(v - mean) R`` per kv head, in fp32.

    Args:
        w_v: ``[H_kv * D_v, hidden]`` value rows (kv head major), any float dtype.
        b_v: ``[H_kv * D_v]`` or ``None``.
        rotation: ``[D_v, D_v]`` or ``[H_kv, D_v, D_v]``.
        mean: ``[H_kv, D_v]`` or ``None``.

    Returns:
        ``(W', b')``: fp32 ``R_h^T W_h`` per head and ``(b - mean) R`` (``None`` when there is
        neither bias nor mean).
    """
    d = rotation.shape[-1]
    if w_v.dim() != 2 or w_v.shape[0] % d:
        raise ValueError(f"value rows {tuple(w_v.shape)} are not [H_kv * {d}, hidden]")
    h = w_v.shape[0] // d
    r = _per_head(rotation.to(w_v.device), h)
    w = torch.einsum("hde,hdi->hei", r, w_v.float().reshape(h, d, -1)).reshape(h * d, -1)
    if b_v is None and mean is None:
        return w, None
    b = torch.zeros(h, d, dtype=torch.float32, device=w_v.device) if b_v is None else b_v.float().reshape(h, d)
    if mean is not None:
        if tuple(mean.shape) != (h, d):
            raise ValueError(f"value mean {tuple(mean.shape)} does not match [{h}, {d}]")
        b = b - mean.float().to(b.device)
    return w, torch.einsum("hd,hde->he", b, r).reshape(h * d)


def fold_o_projection(w_o: torch.Tensor, rotation: torch.Tensor, mean: torch.Tensor | None,
                      num_q_heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output-projection columns that read the rotated-frame attention output, in fp32.

    Args:
        w_o: ``[hidden, H_q * D_v]`` (the columns of these query heads, head major).
        rotation: ``[D_v, D_v]`` or ``[H_kv, D_v, D_v]``; query head ``g`` uses kv head
            ``g // (H_q / H_kv)``.
        mean: ``[H_kv, D_v]`` value mean or ``None``.
        num_q_heads: ``H_q``.

    Returns:
        ``(W', term)``: fp32 ``W_g R_h(g)`` per query head and the bias term ``sum_g W_g mean_h(g)``
        ``[hidden]`` of these columns (``None`` without a mean).
    """
    d = rotation.shape[-1]
    if w_o.dim() != 2 or w_o.shape[1] != num_q_heads * d:
        raise ValueError(f"output columns {tuple(w_o.shape)} are not [hidden, {num_q_heads} * {d}]")
    hkv = rotation.shape[0] if rotation.dim() == 3 else 1
    if num_q_heads % hkv:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {hkv} kv heads")
    group = num_q_heads // hkv
    r = _per_head(rotation.to(w_o.device), hkv).repeat_interleave(group, dim=0)
    w3 = w_o.float().reshape(w_o.shape[0], num_q_heads, d)
    w = torch.einsum("ohd,hde->ohe", w3, r).reshape(w_o.shape[0], -1)
    if mean is None:
        return w, None
    m = mean.float().to(w_o.device)
    if m.dim() != 2 or m.shape[-1] != d or num_q_heads % m.shape[0]:
        raise ValueError(f"value mean {tuple(m.shape)} does not fit {num_q_heads} query heads of {d}")
    m = m.repeat_interleave(num_q_heads // m.shape[0], dim=0)
    return w, torch.einsum("ohd,hd->o", w3, m)


def cpu_all_reduce(cpu_group) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``all_reduce`` for :func:`fold_value_rotations` over a process group's CPU (gloo) side,
    e.g. ``cpu_all_reduce(get_parallel().attn_tp_group.cpu_group)``: the tensor goes through the
    host once at load, so no device collective (custom all-reduce, NCCL) is involved and fp32
    is summed as fp32; every rank receives the same sum."""

    def reduce(t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        c = t.detach().to("cpu", torch.float32, copy=True).contiguous()  # never reduce into the input
        dist.all_reduce(c, group=cpu_group)
        return c.to(t.device)

    return reduce


# ---------------------------------------------------------------------------------- SGLang model
def _weight_problem(mod, what: str) -> str | None:
    """Why ``mod``'s weight cannot be folded exactly, or ``None``."""
    method = type(getattr(mod, "quant_method", None)).__name__
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor):
        return f"{what} has no weight tensor ({method})"
    dtype = str(w.dtype).replace("torch.", "")
    if method != "UnquantizedLinearMethod":
        return f"{what} weights are {dtype} ({method})"
    if (w.dtype not in PLAIN_DTYPES or type(w) not in (torch.Tensor, torch.nn.Parameter)
            or type(w.data) is not torch.Tensor or w.dim() != 2):  # tensor subclasses: torchao, packed layouts
        return f"{what} weights are {dtype} {type(w).__name__} of {w.dim()} dims, not a plain bf16/fp16/fp32 matrix"
    if getattr(mod, "use_intel_amx_backend", False):
        return f"{what} weights are packed for the CPU AMX kernel"
    return None


def _attention_modules(model) -> Iterable[tuple[str, object]]:
    for name, mod in model.named_modules():
        attn = getattr(mod, "attn", None)
        if hasattr(mod, "qkv_proj") and hasattr(mod, "o_proj") and hasattr(attn, "layer_id"):
            yield name, mod


def folded_layer_ids(model) -> frozenset[int]:
    """The global layer ids whose value rotation :func:`fold_value_rotations` folded into ``model``'s
    weights (the plugin refuses in-place weight updates of such a model: they would load unfolded
    weights under a backend that reads them as folded)."""
    if model is None:
        return frozenset()
    return frozenset(int(mod.attn.layer_id) for _, mod in _attention_modules(model)
                     if getattr(mod, FOLDED_MARK, None) is not None)


def _v_rotation(entry) -> torch.Tensor:
    return entry[1] if isinstance(entry, (tuple, list)) else entry


def fold_value_rotations(model, rotations: Mapping[int, object], means: Mapping[int, object] | None = None,
                         tp_rank: int = 0, tp_size: int = 1, *,
                         all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                         attention_classes: Iterable[str] = FOLDABLE_ATTENTION,
                         output_classes: Iterable[str] = OUTPUT_FOLDABLE_ATTENTION) -> FoldReport:
    """Fold each layer's value rotation and value mean into a loaded SGLang model's weights.

    Call once after the weights are loaded (and processed), before CUDA-graph capture, on every
    tensor-parallel rank. Only layers whose id is in ``rotations`` are considered.

    Args:
        model: the SGLang model (``model_runner.model``); attention modules are found as modules
            with ``qkv_proj``, ``o_proj`` and ``attn.layer_id``.
        rotations: ``{global layer id: (R_k, R_v)}`` (the backend's ``self.rotations``, from
            ``rank_rotations``) or ``{layer id: R_v}``; ``R_v`` fp32 ``[H_kv_local, D_v, D_v]`` (or
            ``[D_v, D_v]``) of this rank's kv heads.
        means: ``{layer id: (mean_k, mean_v)}`` (the backend's ``self.means``, ``rank_means``) or
            ``{layer id: mean_v}``; ``mean_v`` ``[H_kv_local, D_v]`` or ``None``. ``None`` = no mean.
        tp_rank, tp_size: this rank of the attention tensor-parallel group; must match the modules'.
        all_reduce: sum of a tensor over that group, returned (:func:`cpu_all_reduce` of the
            group's ``cpu_group``), needed with ``tp_size > 1`` and a value mean; called once by every
            rank, with an fp32 ``[layers with a mean, hidden + 1]`` tensor (the last column counts the
            ranks that folded the layer: all or none must).
        attention_classes: attention module class names whose V path is linear (checked).
        output_classes: class names whose output alone feeds ``o_proj`` unchanged (checked): their
            ``o_proj`` is folded, V keeps its run-time rotation (``report.output_only``).

    Returns:
        :class:`FoldReport`; log it (``report.log()``).
    """
    report = FoldReport()
    allowed, output_allowed = frozenset(attention_classes), frozenset(output_classes) - frozenset(attention_classes)
    # o_proj mean terms, one slot per layer with a value mean in module order (the same list on every rank, so
    # the one all-reduce lines up even if a rank kept a layer): (layer id, o_proj or None if kept, fp32 term)
    slots: list[tuple[int, object, torch.Tensor | None, int]] = []
    for name, mod in _attention_modules(model):
        lid = int(mod.attn.layer_id)
        if lid not in rotations:
            continue
        r = _v_rotation(rotations[lid])
        mean = None if means is None or means.get(lid) is None else _v_rotation(means[lid])
        out_size = int(getattr(mod.o_proj, "output_size", 0) or 0)  # full (unsharded) hidden: rank-invariant
        output_only = type(mod).__name__ in output_allowed
        done = getattr(mod, FOLDED_MARK, None)
        if done is not None:  # a second backend of the same model (or a second call): same fold or an error
            if not _same_fold(done, r, mean, output_only):
                raise ValueError(f"layer {lid}: the value rotation is folded into the weights already, with another "
                                 "rotation or mean; a loaded model can be folded once (reload the weights to refold)")
            (report.output_only if output_only else report.folded).append(lid)
            if mean is not None:
                slots.append((lid, None, None, out_size))
            continue
        why = (_why_not_output(mod, r, mean, tp_rank, tp_size, all_reduce) if output_only
               else _why_not(mod, r, mean, tp_rank, tp_size, all_reduce, allowed))
        if why is not None:
            report.kept[lid] = why
            if mean is not None:
                slots.append((lid, None, None, out_size))
            continue
        o_proj = mod.o_proj
        with torch.no_grad():
            if not output_only:  # V's rows of qkv_proj: (v - mean) R comes out of the projection
                qkv = mod.qkv_proj
                hq, hkv, d = qkv.num_heads, qkv.num_kv_heads, qkv.head_size
                v0 = (hq + hkv) * d
                v_rows = slice(v0, v0 + hkv * getattr(qkv, "v_head_size", d))
                w_v, b_v = fold_v_projection(qkv.weight[v_rows], None if qkv.bias is None else qkv.bias[v_rows], r,
                                             mean)
                qkv.weight[v_rows].copy_(w_v.to(qkv.weight.dtype))
                if b_v is not None:
                    if qkv.bias is None:
                        qkv.bias = torch.nn.Parameter(torch.zeros(qkv.weight.shape[0], dtype=qkv.weight.dtype,
                                                                  device=qkv.weight.device), requires_grad=False)
                        report.created_bias.append(f"{name}.qkv_proj")
                    qkv.bias[v_rows].copy_(b_v.to(qkv.bias.dtype))
            w_o, term = fold_o_projection(o_proj.weight, r, mean, o_proj.weight.shape[1] // r.shape[-1])
            o_proj.weight.copy_(w_o.to(o_proj.weight.dtype))
        if term is not None:
            slots.append((lid, o_proj, term, out_size))
            if o_proj.bias is None:
                report.created_bias.append(f"{name}.o_proj")
        setattr(mod, FOLDED_MARK, _mark(r, mean, output_only))
        (report.output_only if output_only else report.folded).append(lid)
    _add_mean_terms(slots, tp_size, all_reduce)
    report.folded.sort()
    report.output_only.sort()
    return report


def _mark(r, mean, output_only: bool) -> tuple:
    return (r.detach().float().cpu().clone(), None if mean is None else mean.detach().float().cpu().clone(),
            output_only)


def _add_mean_terms(slots, tp_size: int, all_reduce) -> None:
    """Add each folded layer's full ``sum_g W_g mu_h(g)`` to its o_proj bias (created if missing).

    With ``tp_size > 1`` the rank's partial terms, each followed by a 1 where this rank folded the
    layer, go through one ``all_reduce`` of a flat fp32 vector; a layer that some ranks folded and
    others kept is an error (its ranks would hold mixed frames)."""
    if tp_size > 1:
        if all_reduce is None or not slots:
            return  # no mean, or every centred layer was kept (_why_not) on every rank
        # one row per slot on every rank, of a rank-invariant width (the o_proj output size)
        width = max(max(n for *_, n in slots), max((t.shape[0] for _, _, t, _ in slots if t is not None), default=0))
        device = next((t.device for _, _, t, _ in slots if t is not None), torch.device("cpu"))
        flat = torch.zeros(len(slots), width + 1, dtype=torch.float32, device=device)
        for i, (_, o_proj, term, _) in enumerate(slots):
            if o_proj is not None:
                flat[i, :term.shape[0]] = term
                flat[i, width] = 1.0
        flat = all_reduce(flat)
        for i, (lid, *_) in enumerate(slots):
            ranks = int(round(float(flat[i, width])))
            if ranks not in (0, tp_size):
                raise RuntimeError(f"layer {lid}: the value rotation was folded on {ranks} of {tp_size} tensor-parallel "
                                   "ranks; the ranks must agree (check the fold report of each rank)")
        terms = [None if t is None else flat[i, :t.shape[0]] for i, (_, _, t, _) in enumerate(slots)]
    else:
        terms = [t for _, _, t, _ in slots]
    with torch.no_grad():
        for (lid, o_proj, _, _), term in zip(slots, terms):
            if o_proj is None:
                continue
            w = o_proj.weight
            if o_proj.bias is None:
                o_proj.bias = torch.nn.Parameter(torch.zeros(w.shape[0], dtype=w.dtype, device=w.device),
                                                 requires_grad=False)
            o_proj.bias.copy_((o_proj.bias.float() + term.to(o_proj.bias.device)).to(o_proj.bias.dtype))


def _same_fold(done, r, mean, output_only: bool) -> bool:
    r0, m0, o0 = done
    r = r.detach().float().cpu()
    if o0 != output_only or r.shape != r0.shape or not torch.equal(r, r0) or (mean is None) != (m0 is None):
        return False
    return mean is None or torch.equal(mean.detach().float().cpu(), m0)


def _linear_problem(m, what: str, kind: str, tp_rank: int, tp_size: int) -> str | None:
    """Why the projection ``m`` (named ``what``, expected of SGLang class ``kind``) cannot be folded, or ``None``."""
    if type(m).__name__ != kind:
        return f"{what} is a {type(m).__name__}, not a plain {kind} (fused, wrapped or LoRA layout)"
    problem = _weight_problem(m, what)
    if problem:
        return problem
    if (getattr(m, "tp_rank", tp_rank), getattr(m, "tp_size", tp_size)) != (tp_rank, tp_size):
        return f"{what} is sharded as rank {m.tp_rank} of {m.tp_size}, the fold was asked for rank {tp_rank} of {tp_size}"
    return None


def _mean_problem(mods, mean, tp_size, all_reduce) -> str | None:
    for m, what in mods:
        if m.bias is None and getattr(m, "skip_bias_add", False):
            return (f"the value mean needs a bias on {what}, which has none and returns its bias to the caller "
                    "(skip_bias_add)")
    if tp_size > 1 and all_reduce is None:
        return ("the value mean's output term sums o_proj columns of every tensor-parallel rank and no "
                "all_reduce was given")
    return None


def _why_not_output(mod, r, mean, tp_rank, tp_size, all_reduce) -> str | None:
    """The reason an output-only layer keeps its run-time output rotation, or ``None``."""
    o_proj = mod.o_proj
    problem = _linear_problem(o_proj, "o_proj", "RowParallelLinear", tp_rank, tp_size)
    if problem:
        return problem
    dv = r.shape[-1]
    hkv = r.shape[0] if r.dim() == 3 else 1
    cols = o_proj.weight.shape[1]
    if r.dim() not in (2, 3) or r.shape[-2] != dv or cols % dv or (cols // dv) % hkv:
        return f"value rotation {tuple(r.shape)} does not fit o_proj's {cols} input columns"
    if mean is not None:
        if mean.dim() != 2 or mean.shape[-1] != dv or (cols // dv) % mean.shape[0]:
            return f"value mean {tuple(mean.shape)} does not fit o_proj's {cols} input columns"
        return _mean_problem(((o_proj, "o_proj"),), mean, tp_size, all_reduce)
    return None


def _why_not(mod, r, mean, tp_rank, tp_size, all_reduce, allowed) -> str | None:
    """The reason a layer keeps its run-time value rotation, or ``None`` if it folds exactly."""
    cls = type(mod).__name__
    if cls not in allowed:
        return f"attention module {cls} is not one whose V path is known to be linear ({', '.join(sorted(allowed))})"
    qkv, o_proj = mod.qkv_proj, mod.o_proj
    for m, what, kind in ((qkv, "qkv_proj", "QKVParallelLinear"), (o_proj, "o_proj", "RowParallelLinear")):
        problem = _linear_problem(m, what, kind, tp_rank, tp_size)
        if problem:
            return problem
    hq, hkv, d = qkv.num_heads, qkv.num_kv_heads, qkv.head_size
    dv = getattr(qkv, "v_head_size", d)
    rows = (hq + hkv) * d + hkv * dv
    if tuple(qkv.weight.shape) != (rows, qkv.weight.shape[1]) or list(getattr(qkv, "output_sizes", [])) != \
            [hq * d * tp_size, hkv * d * tp_size, hkv * dv * tp_size]:
        return (f"qkv_proj weight {tuple(qkv.weight.shape)} is not [q | k | v] rows of {hq} + {hkv} + {hkv} heads "
                f"of {d}/{dv}")
    if o_proj.weight.shape[1] != hq * dv:
        return f"o_proj weight {tuple(o_proj.weight.shape)} does not hold the columns of {hq} heads of {dv}"
    if not (r.dim() == 2 and r.shape == (dv, dv)) and not (r.dim() == 3 and tuple(r.shape) == (hkv, dv, dv)):
        return f"value rotation {tuple(r.shape)} does not fit {hkv} kv heads of {dv}"
    if mean is not None:
        if tuple(mean.shape) != (hkv, dv):
            return f"value mean {tuple(mean.shape)} does not fit {hkv} kv heads of {dv}"
        return _mean_problem(((qkv, "qkv_proj"), (o_proj, "o_proj")), mean, tp_size, all_reduce)
    return None
