"""Reference log-probabilities computed in the harness's own process.

The tiny model in ``transformers`` with every attention layer replaced by the PyTorch oracle
(:func:`sglang_oscar.reference.oscar_attention`) with the windows SGLang serves, teacher-forced
or greedy, and the prompt screening of the greedy comparisons.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from .checkpoints import random_prompt
from .config import VOCAB


def oracle_handler(rotation, config, prompt_len: int, hp_dtype=None):
    """An :func:`sglang_oscar.calibrate.capture.attention_override` handler that replaces every
    attention layer by the reference oracle (:func:`sglang_oscar.reference.oscar_attention`) with
    the windows SGLang serves: query positions ``< prompt_len`` use the *extend* windows (only the
    sink read in BF16; everything else, the prompt's own keys included, through INT2), later
    positions (generated tokens) the *decode* windows (sink and the last ``recent`` positions in
    BF16). K/V rows are rotated, rounded to the HP dtype ``hp_dtype`` (default BF16, what a BF16
    server stores; ``torch.float32`` for a ``--dtype float32`` server, whose HP windows hold the
    model dtype) and quantized once per call. A layer with attention-sink logits (GPT-OSS: the
    call's ``sinks``, transformers' ``s_aux=module.sinks``) passes them to the oracle, which adds
    them to each head's softmax denominator as SGLang's ``sinks`` argument does."""
    import torch

    from sglang_oscar.calibrate.oracle import RotationCache
    from sglang_oscar.reference.attention import build_cache, oscar_attention

    cache = RotationCache(rotation)
    hp = hp_dtype or torch.bfloat16

    def handler(call):
        outs = []
        for b in range(call.query.shape[0]):
            q, k, v = call.rows(b)
            rk = cache.get(call.layer_id, "k", q.device)
            rv = cache.get(call.layer_id, "v", q.device)
            km, vm = cache.mean(call.layer_id, "k", q.device), cache.mean(call.layer_id, "v", q.device)
            sinks = call.sinks if call.sinks is not None else getattr(call.module, "sinks", None)
            kv = build_cache(k, v, rk, rv, config, hp, k_mean=km, v_mean=vm)
            t = q.shape[0]
            pos = torch.arange(t, device=q.device)
            split = min(prompt_len, t)
            parts = []
            for lo, hi, mode in ((0, split, "extend"), (split, t, "decode")):
                if hi > lo:
                    parts.append(oscar_attention(q[lo:hi], k, v, rk, rv, config, q_positions=pos[lo:hi],
                                                 sm_scale=call.scaling, sliding_window=call.sliding_window,
                                                 logit_cap=call.softcap, window_mode=mode, cache=kv,
                                                 k_mean=km, v_mean=vm, sinks=sinks))
            outs.append(torch.cat(parts, dim=0))
        return torch.stack(outs).to(call.query.dtype)

    return handler


@contextlib.contextmanager
def maybe_oracle(model, rotation, config, prompt_len: int, hp_dtype=None):
    from sglang_oscar.calibrate.capture import attention_override

    if rotation is None:
        yield
        return
    with attention_override(model, oracle_handler(rotation, config, prompt_len, hp_dtype)):
        yield


def teacher_forced_logprobs(model, sequences: Sequence[Sequence[int]], *, rotation=None, config=None,
                            prompt_lens: Sequence[int] | None = None, hp_dtype=None) -> list[list[float]]:
    """Per-position log-probabilities ``log p(s[i] | s[:i])``, ``i = 1..T-1``, of each sequence.

    ``rotation=None``: the model as loaded (its own attention, e.g. BF16). Otherwise the oracle
    (:func:`oracle_handler`, ``config`` an :class:`~sglang_oscar.config.OscarConfig`, HP tier in
    ``hp_dtype``, default BF16) with the prompt of sequence ``n`` being its first ``prompt_lens[n]``
    tokens (default: all of it, a pure prefill). Sequences run one at a time (no padding).
    """
    import torch

    device = next(model.parameters()).device
    out: list[list[float]] = []
    for n, seq in enumerate(sequences):
        p_len = len(seq) if prompt_lens is None else int(prompt_lens[n])
        ids = torch.tensor([list(seq)], device=device)
        with torch.no_grad(), maybe_oracle(model, rotation, config, p_len, hp_dtype):
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
        lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None]).squeeze(1)
        out.append([float(x) for x in lp.cpu()])
    return out


def greedy_paths(model, prompts: Sequence[Sequence[int]], n_new: int, *, rotation=None, config=None
                 ) -> list[dict[str, Any]]:
    """Greedy continuation of every prompt (full recompute per step, so the oracle's windows apply
    exactly as served: prompt positions extend, generated positions decode) with the log-prob and
    the top-1/top-2 margin of each step. ``rotation=None``: the model's own attention. Prompts of
    equal length run as one batch."""
    import torch

    device = next(model.parameters()).device
    res: dict[int, dict[str, Any]] = {}
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    for length, idx in groups.items():
        seqs = torch.tensor([list(prompts[i]) for i in idx], device=device)
        toks, lps, margins = [], [], []
        with torch.no_grad(), maybe_oracle(model, rotation, config, length):
            for _ in range(n_new):
                logits = model(input_ids=seqs, use_cache=False).logits[:, -1]
                top = torch.topk(torch.log_softmax(logits.float(), dim=-1), 2)
                toks.append(top.indices[:, 0])
                lps.append(top.values[:, 0])
                margins.append(top.values[:, 0] - top.values[:, 1])
                seqs = torch.cat([seqs, top.indices[:, :1]], dim=1)
        for j, i in enumerate(idx):
            m = [float(x[j]) for x in margins]
            res[i] = {"prompt": list(prompts[i]), "tokens": [int(x[j]) for x in toks],
                      "logprobs": [float(x[j]) for x in lps], "margins": m,
                      "min_margin": min(m) if m else float("inf")}
    return [res[i] for i in range(len(prompts))]


def screen_prompts(model, lengths: Sequence[int], n_new: int, *, candidates: int, seed: int, rotation=None,
                   config=None, vocab: int = VOCAB) -> list[dict[str, Any]]:
    """For each length, the seeded random prompt (of ``candidates``, seeds ``seed * 100003 + i * 1009
    + c``) whose greedy path has the largest minimum top-1/top-2 margin (:func:`greedy_paths`, the
    candidates of one length in one batch); each entry also records its seed."""
    chosen = []
    for li, length in enumerate(lengths):
        seeds = [seed * 100003 + li * 1009 + c for c in range(candidates)]
        paths = greedy_paths(model, [random_prompt(length, s, vocab) for s in seeds], n_new, rotation=rotation,
                             config=config)
        best = max(range(candidates), key=lambda c: paths[c]["min_margin"])
        chosen.append({**paths[best], "seed": seeds[best], "candidate_min_margins": [p["min_margin"] for p in paths]})
    return chosen
