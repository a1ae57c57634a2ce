"""Which keys a query sees (causal + sliding window) and which of them it reads in HP.

Both masks are bool ``[Tq, T]`` over absolute positions: row ``q`` is the query at position
``q_positions[q]``, column ``j`` the key at position ``j``.

Sliding-window convention (``W`` = the HF config's ``sliding_window``): key ``j`` is visible to
the query at position ``pos`` iff ``0 <= pos - j < W`` -- ``W`` keys, the query's own included.
This is the window the models were trained with (transformers ``masking_utils``:
``kv_idx > q_idx - sliding_window``) and the one SGLang 0.5.16's BF16 path applies in prefill:

* the models hand SGLang ``sliding_window_size = W - 1`` (``sglang/srt/models/gemma4_causal.py:69-70``,
  ``gemma3_causal.py:55-56``, ``gpt_oss.py:119-120``; the backend reads it through
  ``model_runner/load_model_utils.py:114-115``);
* the Triton extend kernel keeps a key iff ``q_pos <= k_pos + sliding_window_size``, i.e.
  ``pos - j <= W - 1`` (``sglang/kernels/ops/attention/extend_attention.py:387-392`` for the
  prefix, ``:546-549`` for the extend part, ``:1002-1016`` for the unified kernel), over a prefix
  window of ``min(prefix_len, W - 1)`` keys (``srt/layers/attention/triton_backend.py:861-874``);
* FlashInfer decode reads ``min(seq_len, sliding_window_size + 1) = W`` keys
  (``srt/layers/attention/flashinfer_backend.py:1566-1573``).

**SGLang 0.5.16's Triton decode reads one key fewer**: its window buffer holds
``min(seq_len, sliding_window_size) = W - 1`` keys, the query's own included
(``update_sliding_window_buffer``, ``triton_backend.py:2014-2017``, filled for decode at
``:728-740`` eager and ``:428-440`` under CUDA graphs; ``seq_lens`` counts the token being
decoded, ``managers/schedule_batch.py:2823``), i.e. ``pos - j < W - 1``. That differs from its
own extend kernel and from the trained model; upstream OSCAR windowed its INT2 decode with
"window + 1" for the same reason (``recipes/Gemma-4-12B-it/README.md``). The oracle uses
``pos - j < W``; to reproduce SGLang's Triton BF16 decode exactly, pass ``sliding_window = W - 1``
for decode queries. SGLang's SWA eviction keeps at least ``sliding_window_size + 1 = W`` keys of a
decoding request (``mem_cache/common.py:72-78``, called from ``schedule_batch.py:3049`` with the decoded
token's position), so a ``W``-key window reads live slots only.

HP tiers of a sliding layer follow the same visibility: a key is attended only if visible, in
whichever tier it lives; the BF16 sink tokens of a request stop being attended once they leave
the window (``hp_window_mask`` says where a key is read from, ``visible_mask`` whether it is).
"""

from __future__ import annotations

import torch

WINDOW_MODES = ("decode", "extend", "none")


def visible_mask(q_positions: torch.Tensor, seq_len: int, sliding_window: int | None = None) -> torch.Tensor:
    """Keys a query attends: bool ``[Tq, T]``, ``j <= pos`` and (with a window) ``pos - j < W``.

    Args:
        q_positions: int ``[Tq]`` absolute query positions.
        seq_len: ``T``, keys at positions ``0 .. T-1``.
        sliding_window: ``W`` keys including the query's own (module docstring), or ``None`` for
            full attention.

    Raises:
        ValueError: ``sliding_window < 1``.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 (keys attended, the query's own included), got {sliding_window}")
    j = torch.arange(seq_len, device=q_positions.device).unsqueeze(0)
    i = q_positions.unsqueeze(1)
    visible = j <= i
    if sliding_window is not None:
        visible &= (i - j) < sliding_window
    return visible


def hp_window_mask(q_positions: torch.Tensor, seq_len: int, sink: int, recent: int, window_mode: str = "decode") -> torch.Tensor:
    """Which keys a query reads from the HP tier: bool ``[Tq, T]`` (see ``attention`` module docstring, step 3).

    ``"decode"``: key ``j`` is HP for the query at position ``i`` iff ``j < sink`` or
    ``j > i - recent``. ``"extend"``: iff ``j < sink``. ``"none"``: always. Independent of the
    sliding window: whether the key is attended at all is :func:`visible_mask`.

    Raises:
        ValueError: unknown ``window_mode``.
    """
    if window_mode not in WINDOW_MODES:
        raise ValueError(f"window_mode must be one of {WINDOW_MODES}, got {window_mode!r}")
    j = torch.arange(seq_len, device=q_positions.device).unsqueeze(0)
    i = q_positions.unsqueeze(1)
    if window_mode == "none":
        return torch.ones(i.shape[0], seq_len, dtype=torch.bool, device=q_positions.device)
    hp = (j < sink).expand(i.shape[0], seq_len)
    return hp | (j > i - recent) if window_mode == "decode" else hp


def selection_mask(sel: torch.Tensor, q_positions: torch.Tensor, what: str):
    """A :func:`.attention.attend` ``key_mask`` over a precomputed selection, looked up by position
    (so a caller that splits the queries into chunks gets the same rows).

    Args:
        sel: bool ``[..., Tq, T]``: row ``i`` holds the keys the query at ``q_positions[i]`` may see.
        q_positions: int ``[Tq]``, distinct.
        what: the selection's name for the error message (e.g. ``"topk_indices"``).

    Returns:
        ``(pos [Tq'], t) -> bool [..., Tq', t]`` with ``t <= T``.

    Raises:
        ValueError: repeated positions (when built); ``t > T`` (when called).
    """
    row_of = {int(p): i for i, p in enumerate(q_positions.tolist())}
    if len(row_of) != q_positions.numel():
        raise ValueError(f"q_positions must be distinct when {what} are given")

    def mask(pos: torch.Tensor, t: int) -> torch.Tensor:
        if t > sel.shape[-1]:
            raise ValueError(f"{what} mask built for seq_len {sel.shape[-1]}, asked for {t} keys")
        return sel[..., [row_of[int(p)] for p in pos.tolist()], :t]

    return mask
