"""``OscarMHATokenToKVPool``: SGLang's MHA/GQA token pool with INT2 rows and BF16 windows.

Storage per layer (``H`` = local kv heads, ``S = size + page_size`` slots):

* ``k_buffer[l]`` uint8 ``[S, H, D_k/4]``: the quarter-split 2-bit codes of each (slot, head);
  ``k_pair_buffer[l]`` ``[S, H, 2*NG_k]`` in the scale dtype: the ``(scale, zero)`` pairs of its
  groups; ``v_buffer`` / ``v_pair_buffer`` likewise. Both planes are head-major (``[H, S, ...]``
  memory behind the ``[S, H, ...]`` views of :func:`~.rows.kv_head_major_zeros`): a decode program
  reads one kv head, so consecutive slots of that head are adjacent and a run of slots is read in
  whole 32-byte sectors, with 8-byte aligned code words (faster than interleaved code + pair
  rows or slot-major rows; docs/kernels.md#pool-planes).
  Every kernel takes the strides of the views. SGLang's slot-row machinery (``move_kv_cache``, CPU
  offload copies, PD transfer) knows only ``k_buffer`` / ``v_buffer`` and would miss the pair
  planes: those paths are refused with a message (their features are refused by the plugin anyway).
* ``hp_k_buffer[l]`` / ``hp_v_buffer[l]`` ``[R, H, D]`` in the model dtype: the BF16 copies of
  the rotated rows for the sink and recent windows (:class:`~.windows.HPWindows`).

Rows are written only by :meth:`write_rotated` (the OSCAR attention backend rotates, then calls
it). SGLang's generic ``set_kv_buffer`` and the BF16 buffer getters refuse: anything that would
read or write BF16 rows of this pool directly (fused RoPE+KV writes, other attention backends)
fails loudly instead of corrupting the packed rows. The getters return ``meta`` tensors of the
logical shape so shape queries (``get_value_buffer(0).shape[-1]``) keep working.
"""

from __future__ import annotations

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from ..config import OscarConfig
from ..kernels import write_kv
from ..kernels.layout import Int2Layout
from .rows import kv_head_major_zeros
from .sizing import hp_row_bytes
from .windows import HPWindows


def int2_row_bytes(layout: Int2Layout, which: str) -> int:
    """Bytes of one (slot, kv head) row of K (``which="k"``) or V: codes + pairs."""
    t = layout.k if which == "k" else layout.v
    return t.head_dim // 4 + 2 * t.num_groups * layout.scale_dtype.itemsize


class OscarMHATokenToKVPool(MHATokenToKVPool):
    """INT2 token-to-KV pool (module docstring). Constructor: ``MHATokenToKVPool``'s arguments
    plus the keyword-only OSCAR settings below (``dtype`` must be ``torch.uint8``).

    Args:
        oscar_config: :class:`~sglang_oscar.config.OscarConfig`.
        hp_dtype: dtype of the BF16 windows (the model dtype).
        max_reqs: request slots (``ReqToTokenPool.size``), for the recent ring.
        sink_rows: rows of the sink arena (see :func:`~.sizing.plan_windows`).
        windows: an :class:`~.windows.HPWindows` to share (the sub-pools of
            :class:`~.swa_pool.OscarSWAKVPool` share one, keyed by full-pool slots); ``None`` builds
            this pool's own from ``max_reqs`` / ``sink_rows``.

    Attributes:
        owns_windows: SGLang's allocator over this pool frees the slots the windows are keyed by,
            so its ``free`` returns their sink rows (false for the sliding sub-pool of a hybrid
            model, whose slots are a second index space).

    Raises:
        ValueError: page size other than 1, or a head_dim/group combination the kernels do not
            support (message names the flag to change).
    """

    def __init__(self, *args, oscar_config: OscarConfig, hp_dtype: torch.dtype, max_reqs: int,
                 sink_rows: int, windows: HPWindows | None = None, **kwargs):
        page_size = kwargs.get("page_size", args[1] if len(args) > 1 else 1)
        if page_size != 1:
            raise ValueError(f"--kv-cache-dtype int2 needs --page-size 1 (got {page_size})")
        # SWAKVPool passes the sliding group's geometry as swa_* keywords (MHATokenToKVPool's rule)
        head_dim = kwargs.get("swa_head_dim") or kwargs.get("head_dim")
        v_head_dim = kwargs.get("swa_v_head_dim") or kwargs.get("v_head_dim") or head_dim
        self.oscar_config = oscar_config
        self.hp_dtype = hp_dtype
        self.layout = Int2Layout.from_config(oscar_config, head_dim, v_head_dim)
        self.row_bytes_k = int2_row_bytes(self.layout, "k")
        self.row_bytes_v = int2_row_bytes(self.layout, "v")
        size = kwargs.get("size", args[0] if args else None)
        self.windows = windows if windows is not None else HPWindows(
            size + page_size, max_reqs, oscar_config.sink_tokens, oscar_config.recent_tokens, sink_rows,
            kwargs.get("device", "cuda"))
        self.owns_windows = True
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ storage
    def _create_buffers(self):
        rows = self.size + self.page_size
        h = self.head_num
        hp_rows = self.windows.num_rows
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            lk, lv = self.layout.k, self.layout.v
            self.k_buffer = [kv_head_major_zeros(rows, h, lk.head_dim // 4, torch.uint8, self.device)
                             for _ in range(self.layer_num)]
            self.v_buffer = [kv_head_major_zeros(rows, h, lv.head_dim // 4, torch.uint8, self.device)
                             for _ in range(self.layer_num)]
            sdt = self.layout.scale_dtype
            self.k_pair_buffer = [kv_head_major_zeros(rows, h, 2 * lk.num_groups, sdt, self.device)
                                  for _ in range(self.layer_num)]
            self.v_pair_buffer = [kv_head_major_zeros(rows, h, 2 * lv.num_groups, sdt, self.device)
                                  for _ in range(self.layer_num)]
            self.hp_k_buffer = [torch.zeros((hp_rows, h, self.head_dim), dtype=self.hp_dtype, device=self.device)
                                for _ in range(self.layer_num)]
            self.hp_v_buffer = [torch.zeros((hp_rows, h, self.v_head_dim), dtype=self.hp_dtype, device=self.device)
                                for _ in range(self.layer_num)]
        self.k_scale_buffer = self.v_scale_buffer = self.dq_k_buffer = self.dq_v_buffer = None
        self._views = list(zip(self.k_buffer, self.k_pair_buffer, self.v_buffer, self.v_pair_buffer))
        self._kv_buffer_descs = self._build_kv_buffer_descs()
        self._init_data_ptrs_and_strides()

    def get_kv_size_bytes(self):
        k = sum(t.numel() * t.element_size() for t in self.k_buffer + self.k_pair_buffer + self.hp_k_buffer)
        v = sum(t.numel() * t.element_size() for t in self.v_buffer + self.v_pair_buffer + self.hp_v_buffer)
        return k, v

    def int2_bytes_per_token(self) -> int:
        """INT2 bytes of one token over all local layers and kv heads (K + V)."""
        return self.layer_num * self.head_num * (self.row_bytes_k + self.row_bytes_v)

    def hp_bytes(self) -> int:
        """Bytes of the BF16 window arenas (sink rows + recent rings, all layers)."""
        return self.windows.num_rows * hp_row_bytes(self.head_num, self.head_dim, self.v_head_dim, self.layer_num,
                                                    self.hp_dtype)

    # ------------------------------------------------------------------ packed access
    def layout_of(self, layer_id: int) -> Int2Layout:
        """The :class:`~sglang_oscar.kernels.layout.Int2Layout` of a global layer id (one per pool)."""
        return self.layout

    def is_int2_layer(self, layer_id: int) -> bool:
        """Every layer of a single pool is INT2."""
        return True

    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether a layer's slots are sliding-pool slots (never, in a single pool)."""
        return False

    def int2_buffers(self, layer_id: int):
        """``(k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v)`` views of a global layer id."""
        i = layer_id - self.start_layer
        return (*self._views[i], self.hp_k_buffer[i], self.hp_v_buffer[i])

    def write_rotated(self, layer_id: int, loc: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor,
                      hp_rows: torch.Tensor | None) -> None:
        """Quantize rotated rows into the slots ``loc`` and copy them to HP rows ``hp_rows``.

        Args:
            layer_id: global layer id.
            loc: int ``[N]`` slots (slot 0 = padding: written, never read).
            k_rot, v_rot: ``[N, H, D_k]`` / ``[N, H, D_v]`` rotated rows in the HP dtype.
            hp_rows: int32 ``[N]`` HP rows (``-1`` = none), from :meth:`HPWindows.assign`.
        """
        kc, kp, vc, vp, hk, hv = self.int2_buffers(layer_id)
        write_kv(k_rot, v_rot, loc, kc, kp, vc, vp, self.layout,
                 hp_rows=hp_rows, hp_k=hk if hp_rows is not None else None,
                 hp_v=hv if hp_rows is not None else None, validate=False)

    # ------------------------------------------------------------------ refusals of BF16 access
    def _meta(self, d: int) -> torch.Tensor:
        return torch.empty((self.size + self.page_size, self.head_num, d), dtype=self.hp_dtype, device="meta")

    def _get_key_buffer(self, layer_id: int):
        return self._meta(self.head_dim)

    def _get_value_buffer(self, layer_id: int):
        return self._meta(self.v_head_dim)

    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, *args, **kwargs):
        raise RuntimeError(
            "the INT2 KV pool (--kv-cache-dtype int2) is written only by the OSCAR triton attention "
            "backend; something tried to write BF16 rows directly (a fused RoPE+KV write or another "
            "attention backend). Use --attention-backend triton, or serve with --kv-cache-dtype auto"
        )

    def move_kv_cache(self, tgt_loc, src_loc):
        raise RuntimeError(
            "the INT2 KV pool (--kv-cache-dtype int2) cannot move KV slots (move_kv_cache): its (scale, zero) "
            "pairs live in planes SGLang's mover does not know, and its sink/recent BF16 windows are keyed by "
            "request, not by slot. This path serves speculative decoding and the multi-ended allocator; serve "
            "those with --kv-cache-dtype auto"
        )

    def get_cpu_copy(self, indices, mamba_indices=None):
        raise RuntimeError(
            "the INT2 KV pool (--kv-cache-dtype int2) has no CPU copy of its slots (get_cpu_copy: used when a "
            "PD-disaggregated decode server retracts requests); serve that setup with --kv-cache-dtype auto"
        )

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise RuntimeError("the INT2 KV pool (--kv-cache-dtype int2) has no CPU copy of its slots (load_cpu_copy)")

    def set_kv_buffer_prefix_valid(self, *args, **kwargs):
        raise RuntimeError("--kv-cache-dtype int2 does not support speculative decoding (DFlash prefix writes)")

    def get_contiguous_buf_infos(self):
        raise RuntimeError("--kv-cache-dtype int2 does not support PD disaggregation")
