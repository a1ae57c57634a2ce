"""Teacher-forced perplexity with a fake-quantized KV cache (``sglang-oscar ppl``).

Two runs of the model over the same sequences: **BF16** (the model's own attention, in the
loaded dtype) and **INT2**, where every attention layer's output is replaced by the reference
oracle with the served settings (rotation, BF16 sink/recent windows, group size, clip ratios,
quantizer, scale dtype; the layers of ``skip_layers`` read K/V in BF16, as from SGLang's BF16 cache):

* ``window_mode="decode"`` (default): every position is scored as if it were decoded -- the
  query at position ``i`` reads keys ``j < sink`` and ``j > i - recent`` in BF16, the rest INT2;
* ``window_mode="extend"``: as served for prefill -- only the sink is BF16 and the prompt's
  own keys are read through INT2.

Reported: mean NLL and perplexity of both runs, ``relative_change = ppl_int2 / ppl_bf16 - 1``,
and the share of key reads that went through INT2. The report is refused when nothing would be
quantized (every key inside the windows, e.g. sequences shorter than ``sink + recent``):
an "INT2" perplexity equal to BF16's would otherwise be reported (spec §8.7).
"""

from __future__ import annotations

import math
import sys
from typing import Any

import torch

from ..config import OscarConfig
from ..rotation import RotationSet
from ..rotation.latent import LatentRotationSet
from . import CalibrationError
from .fit import check_rotation
from .model import config_fingerprint, geometry_of, input_device
from .oracle import (OutputFn, RotationCache, check_window_mode, low_reads, mla_output, oracle_capture,
                     settings, skipped_layers)
from .prompts import PromptSet


def _nll(model, ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token NLL of one sequence ``ids [1, T]`` and the number of scored tokens ``T - 1``."""
    logits = model(input_ids=ids, use_cache=False).logits.float()
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:].to(logits.device), reduction="sum")
    return float(nll), ids.shape[1] - 1


def perplexity(
    model,
    prompts: PromptSet,
    rotation: RotationSet | LatentRotationSet | None,
    config: OscarConfig,
    *,
    window_mode: str = "decode",
    progress: bool | None = None,
    allow_other_model: bool = False,
    output_fn: OutputFn | None = None,
    output_name: str | None = None,
) -> dict[str, Any]:
    """BF16 vs INT2 teacher-forced perplexity (module docstring).

    Args:
        rotation: the served rotation set (``None``: data-free Hadamard).
        allow_other_model: accept a fitted rotation whose recorded model fingerprint differs from
            ``model``'s (same geometry; :func:`.fit.check_rotation`).
        output_fn: replaces the oracle in the INT2 run (:data:`.oracle.OutputFn`, MHA/GQA models
            only): a cache that is not the OSCAR format (naive INT2, KIVI). ``rotation`` must then be
            ``None``; ``config``'s windows still decide the "nothing quantized" check and the
            reported INT2 read share.
        output_name: the ``rotation.method`` reported with ``output_fn`` (default: its ``__name__``).

    Raises:
        CalibrationError: nothing quantized, a rotation for another model, bad window_mode,
        sparse attention that drops keys (:func:`.oracle.check_dense`), or ``output_fn`` with a
        rotation or on an MLA model.
    """
    from tqdm.auto import tqdm

    check_window_mode(window_mode)
    geometry = geometry_of(model.config)
    mla = geometry.attention_kind == "mla"
    if output_fn is not None:
        if rotation is not None or mla:
            raise CalibrationError("output_fn replaces the oracle of MHA/GQA models: pass rotation=None, not on MLA models")
    elif rotation is None:
        rotation = (LatentRotationSet.served_data_free(geometry) if mla
                    else RotationSet.data_free(geometry, "hadamard"))
    if rotation is not None:
        check_rotation(rotation, geometry, config_fingerprint(model.config), allow_other_model=allow_other_model)
    seqs = [s for s in prompts.sequences if len(s) >= 2]
    if not seqs:
        raise CalibrationError("perplexity needs sequences of at least 2 tokens")
    skip = skipped_layers(config, geometry, model)
    low = sum(low_reads(len(s), config, window_mode, lg.sliding_window) for s in seqs for lg in geometry.layers
              if lg.layer_id not in skip)
    total = sum(low_reads(len(s), OscarConfig(sink_tokens=0, recent_tokens=0), "extend", lg.sliding_window)
                for s in seqs for lg in geometry.layers)
    if low == 0:
        longest = max(len(s) for s in seqs)
        raise CalibrationError(
            f"nothing would be quantized: all keys of the {len(seqs)} sequences (longest {longest} tokens) fall inside the "
            f"BF16 windows (sink {config.sink_tokens} + recent {config.recent_tokens}, window_mode {window_mode}); "
            "an INT2 perplexity would equal BF16's. Use longer sequences (--seq-len) or smaller windows."
        )
    cache = RotationCache(rotation) if rotation is not None else None
    floor = RotationCache(RotationSet.data_free(geometry, "identity")) if skip else None
    latents: dict[int, torch.Tensor] = {}

    def on_attention(call):
        outs = []
        for b in range(call.query.shape[0]):
            dev = call.query.device
            if call.layer_id in skip:  # SGLang's BF16 cache: K/V rounded to BF16, nothing quantized
                o = floor.mha(call, b, config, window_mode, quantize=False)
            elif output_fn is not None:
                o = output_fn(call, b)
            elif mla:
                o = mla_output(call, b, latents[call.layer_id][b], cache.get(call.layer_id, "latent", dev), config, window_mode)
            else:
                o = cache.mha(call, b, config, window_mode)
            outs.append(o)
        return torch.stack(outs).to(call.query.dtype)

    def on_latent(lid, _m, c):
        latents[lid] = c

    device = input_device(model)
    per_seq = []
    bar = tqdm(total=2 * len(seqs), desc="ppl", unit="seq", disable=(not sys.stderr.isatty()) if progress is None else not progress)
    with torch.inference_mode():
        for s in seqs:
            nll, n = _nll(model, torch.tensor([s], device=device))
            per_seq.append({"tokens": n, "nll_bf16": nll})
            bar.update(1)
    with oracle_capture(model, mla, on_attention, on_latent):
        for rec, s in zip(per_seq, seqs):
            rec["nll_int2"] = _nll(model, torch.tensor([s], device=device))[0]
            bar.update(1)
    bar.close()
    n_tok = sum(r["tokens"] for r in per_seq)
    nll_bf16 = sum(r["nll_bf16"] for r in per_seq) / n_tok
    nll_int2 = sum(r["nll_int2"] for r in per_seq) / n_tok
    ppl_bf16, ppl_int2 = math.exp(nll_bf16), math.exp(nll_int2)
    for r in per_seq:
        r["ppl_bf16"] = math.exp(r["nll_bf16"] / r["tokens"])
        r["ppl_int2"] = math.exp(r["nll_int2"] / r["tokens"])
    return {
        "model_type": geometry.model_type,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "rotation": ({"source": rotation.source, "method": rotation.metadata.get("method"),
                      "centered": {"k": bool(getattr(rotation, "k_mean", None)), "v": bool(getattr(rotation, "v_mean", None))}}
                     if rotation is not None else
                     {"source": "output_fn", "method": output_name or getattr(output_fn, "__name__", "output_fn")}),
        "window_mode": window_mode,
        "settings": settings(config),
        "tokens_scored": n_tok,
        "sequences": len(seqs),
        "bf16": {"nll": nll_bf16, "ppl": ppl_bf16},
        "int2": {"nll": nll_int2, "ppl": ppl_int2},
        "relative_change": ppl_int2 / ppl_bf16 - 1.0,
        "quantized_read_fraction": low / max(total, 1),
        "skipped_layers": sorted(skip),
        "per_sequence": per_seq,
        "prompts": prompts.meta,
    }


def format_report(rep: dict[str, Any]) -> str:
    """The report in five lines: tokens and INT2 read share, BF16 and INT2 perplexity, relative change."""
    return (
        f"teacher-forced perplexity over {rep['tokens_scored']} tokens ({rep['sequences']} sequences, "
        f"window_mode {rep['window_mode']}, {100 * rep['quantized_read_fraction']:.1f}% of key reads in INT2)\n"
        f"  BF16 ({rep['dtype']}): {rep['bf16']['ppl']:.4f}\n"
        f"  INT2 ({rep['rotation']['method']}{' + K/V means' if any(rep['rotation'].get('centered', {}).values()) else ''}): "
        f"{rep['int2']['ppl']:.4f}\n"
        f"  relative change: {100 * rep['relative_change']:+.2f}%"
    )
