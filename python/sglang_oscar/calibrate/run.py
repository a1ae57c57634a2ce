"""The ``calibrate`` driver: forward passes over the prompts, accumulation, checkpoints.

MHA/GQA models take two passes over the same token sequences (pass 2's value weights need the
final query covariance of pass 1); MLA models take one (latent second moment). Nothing but the
fp64 accumulators is kept between batches.

Resuming: every ``checkpoint_every`` sequences (and at the end of each pass) the accumulators
and the position in the prompt stream (pass, next sequence) are written to ``<out>.ckpt``. A
rerun with the same arguments (same model, dtype and token sequences, i.e. the same prompts,
budget, seed and seq_len) continues from there; different arguments are refused unless
``restart`` is set. The checkpoint is removed when ``<out>`` is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch

from .. import __version__
from . import CalibrationError
from .capture import attention_override, latent_hooks
from .model import config_dict, config_fingerprint, geometry_of, input_device, model_id_of
from .prompts import PromptSet
from .stats import CalibrationStats

DEFAULT_CHECKPOINT_EVERY = 32


def _batches(seqs: list[list[int]], start: int, batch_size: int):
    """Consecutive runs of equal-length sequences (no padding), at most ``batch_size`` each."""
    i = start
    while i < len(seqs):
        j = i + 1
        while j < len(seqs) and j - i < batch_size and len(seqs[j]) == len(seqs[i]):
            j += 1
        yield i, j
        i = j


def args_key(model_id: str, geometry_dict: dict, dtype: str, prompts: PromptSet) -> str:
    """sha256 identifying a calibration run: model id, geometry, dtype and the token sequences
    (which fix prompts, budget, seed and seq_len). A checkpoint resumes only with the same key."""
    blob = json.dumps({"model": model_id, "geometry": geometry_dict, "dtype": dtype,
                       "tokens_sha256": prompts.meta["tokens_sha256"]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def calibrate_model(
    model,
    prompts: PromptSet,
    out: str,
    *,
    model_id: str | None = None,
    batch_size: int = 1,
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
    restart: bool = False,
    progress: bool | None = None,
    stop_after: int | None = None,
) -> CalibrationStats:
    """Accumulate the statistics of ``model`` over ``prompts`` and write them to ``out``.

    Args:
        model: a loaded causal LM (eval mode).
        prompts: token sequences (:func:`.prompts.build_prompt_set`).
        out: statistics ``.safetensors`` path.
        batch_size: sequences per forward (equal lengths only; no padding).
        checkpoint_every: sequences between checkpoints.
        restart: ignore (and replace) an existing checkpoint / output.
        progress: tqdm bar (``None``: only on a terminal).
        stop_after: stop after this many sequences of this run (tests of resuming); the
            checkpoint is written and ``None`` returned.

    Returns:
        The completed :class:`CalibrationStats` (also written to ``out``).

    Raises:
        CalibrationError: unsupported model (an MLA kv_lora_rank no INT2 latent cache serves among them), a
            checkpoint from other arguments, layers never captured.
    """
    from tqdm.auto import tqdm

    if batch_size < 1 or checkpoint_every < 1:
        raise CalibrationError("batch_size and checkpoint_every must be positive")
    if not prompts.sequences:
        raise CalibrationError("no calibration sequences")
    geometry = geometry_of(model.config)
    if geometry.attention_kind == "mla":  # before the forward passes
        from .fit import check_served_latent_rank

        check_served_latent_rank(geometry)
    fingerprint = config_fingerprint(model.config, model_id)  # name: the given id, else config._name_or_path
    model_id = model_id or model_id_of(model)
    dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    key = args_key(model_id, geometry.to_dict(), dtype, prompts)
    ckpt = f"{out}.ckpt"

    if restart and os.path.exists(ckpt):
        os.remove(ckpt)
    if not restart and os.path.exists(out):
        try:
            done = CalibrationStats.load(out)
        except (CalibrationError, ValueError):
            done = None
        if done is not None and done.meta.get("args_key") == key and done.complete:
            print(f"calibrate: {out} is already complete for these arguments; nothing to do", file=sys.stderr)
            return done

    start_pass, next_seq = 1, 0
    if os.path.exists(ckpt):
        st = CalibrationStats.load(ckpt)
        if st.meta.get("args_key") != key:
            raise CalibrationError(
                f"checkpoint {ckpt} was written with other arguments (model, dtype, prompts, budget, seed or seq_len "
                "differ): rerun with the original arguments to resume, or pass --restart to start over"
            )
        stale = [lid for lid in st.sums["k_sum"] if lid not in st.sums["k_lin"] or lid not in st.sums["v_lin"]]
        if stale:
            raise CalibrationError(
                f"checkpoint {ckpt} was written by an sglang-oscar without first moments (k_lin / v_lin missing for "
                f"layers {sorted(stale)[:8]}): resuming would give wrong key/value means; pass --restart to start over"
            )
        cp = st.meta.get("checkpoint", {})
        start_pass, next_seq = int(cp.get("pass", 1)), int(cp.get("next_sequence", 0))
        st.meta.pop("checkpoint", None)
        st.meta.pop("path", None)
        print(f"calibrate: resuming from {ckpt} (pass {start_pass}, sequence {next_seq}/{len(prompts.sequences)})", file=sys.stderr)
    else:
        st = CalibrationStats(geometry, {
            "model": {"id": model_id, "model_type": geometry.model_type, "dtype": dtype, "config": config_dict(model.config),
                      "fingerprint": fingerprint},
            "prompts": prompts.meta,
            "args_key": key,
            "created_by": f"sglang-oscar {__version__}",
        })

    device = input_device(model)
    n_seq = len(prompts.sequences)
    total = sum(n_seq - (next_seq if p == start_pass else 0) for p in range(start_pass, st.passes_needed + 1))
    bar = tqdm(total=total, desc="calibrate", unit="seq", disable=(not sys.stderr.isatty()) if progress is None else not progress)
    current_pass = start_pass

    def on_attention(call):
        b, _, t, _ = call.query.shape
        k = call.key.transpose(1, 2).reshape(b * t, call.key.shape[1], call.key.shape[3])
        v = call.value.transpose(1, 2).reshape(b * t, call.value.shape[1], call.value.shape[3])
        if current_pass == 1:
            q = call.query.transpose(1, 2).reshape(b * t, call.query.shape[1], call.query.shape[3])
            st.add_pass1(call.layer_id, q, k, v)
        else:
            st.add_pass2(call.layer_id, k, v)
        return None

    def on_latent(layer_id, _module, c):
        st.add_latent(layer_id, c.reshape(-1, c.shape[-1]))

    def save_ckpt(p: int, nxt: int) -> None:
        st.save(ckpt, extra={"checkpoint": {"pass": p, "next_sequence": nxt}})

    processed = 0
    since_ckpt = 0
    with torch.inference_mode():
        for p in range(start_pass, st.passes_needed + 1):
            current_pass = p
            bar.set_description(f"calibrate pass {p}/{st.passes_needed}")
            first = next_seq if p == start_pass else 0
            ctx = latent_hooks(model, on_latent) if st.is_mla else attention_override(model, on_attention)
            with ctx:
                for i, j in _batches(prompts.sequences, first, batch_size):
                    ids = torch.tensor(prompts.sequences[i:j], dtype=torch.long, device=device)
                    model(input_ids=ids, use_cache=False)
                    if p == 1 and i == 0:
                        seen = {lid for lid, n in st.tokens[1].items() if n}
                        missing = sorted(set(geometry.layer_ids) - seen)
                        if missing:
                            raise CalibrationError(
                                f"unsupported architecture {type(model).__name__}: attention layers {missing[:8]} "
                                f"(of {len(geometry.layers)}) were never captured; every layer must be (spec lesson 25)"
                            )
                    bar.update(j - i)
                    processed += j - i
                    since_ckpt += j - i
                    if since_ckpt >= checkpoint_every and j < n_seq:
                        save_ckpt(p, j)
                        since_ckpt = 0
                    if stop_after is not None and processed >= stop_after:
                        if j < n_seq:
                            save_ckpt(p, j)
                        else:
                            st.passes_done = p
                            save_ckpt(p + 1, 0)
                        bar.close()
                        return None
            st.passes_done = p
            if p < st.passes_needed:
                save_ckpt(p + 1, 0)
                since_ckpt = 0
    bar.close()
    st.check_complete()
    st.save(out)
    if os.path.exists(ckpt):
        os.remove(ckpt)
    st.meta["path"] = out
    return st


def summary(st: CalibrationStats) -> dict[str, Any]:
    """One-line JSON summary of finished statistics (model, layers, tokens per layer, passes,
    prompts provenance), printed by ``sglang-oscar calibrate``."""
    toks = st.tokens_per_layer(1)
    return {
        "model": st.meta.get("model", {}).get("id"),
        "model_type": st.geometry.model_type,
        "attention": st.geometry.attention_kind,
        "layers": len(st.geometry.layers),
        "tokens_per_layer_min": min(toks.values()) if toks else 0,
        "tokens_per_layer_max": max(toks.values()) if toks else 0,
        "passes_done": st.passes_done,
        "prompts": {k: st.meta.get("prompts", {}).get(k) for k in ("source", "sha256", "tokens", "num_sequences")},
    }
