"""``OscarMLATokenToKVPool``: SGLang's MLA latent pool with INT2 latents and BF16 windows.

An MLA layer caches one latent ``c_kv`` (``R`` = kv_lora_rank, 512 for DeepSeek-V3 / GLM-5 /
Kimi) and one rope key ``k_pe`` (``P`` = qk_rope_head_dim, 64) per token, shared by every head;
SGLang's ``MLATokenToKVPool`` keeps them as one BF16 row of ``R + P`` elements (1,152 bytes per
token and layer). Here, per layer (``S = size + page_size`` slots):

* ``codes[l]`` uint8 ``[S, 1, R/4]``: quarter-split 2-bit codes of the rotated latent ``c Rot``;
  ``pairs[l]`` ``[S, 1, 2R/G]`` in the scale dtype: the (scale, zero) pair of each group -- the
  MHA pool's K plane with one "kv head" of width ``R``, written by the same ``write_kv`` (K only,
  the oracle's bytes: ``tests/kernels/test_latent.py``);
* ``k_pe[l]`` ``[S, P]`` in the model dtype: never rotated or quantized (issue 26: an FP8
  checkpoint's rows still join in BF16 or wider);
* ``hp_latent[l]`` ``[rows, 1, R]`` and ``hp_pe[l]`` ``[rows + 1, P]``: the BF16 sink and recent
  windows (:class:`~.windows.HPWindows`, rows addressed as in the MHA pool; the extra ``k_pe``
  row takes the writes of tokens that have no HP row).

With G = 128 and fp16 pairs that is 128 + 16 + 128 = 272 bytes per token and layer, 4.2x fewer
than BF16. Readers: :func:`sglang_oscar.kernels.latent_plan.latent_decode_attention` (decode) and
:func:`~sglang_oscar.kernels.latent.gather_latent` (the ``[c_kv | k_pe]`` rows of an extend).
SGLang's BF16 accessors (``set_kv_buffer``, ``set_mla_kv_buffer``, ``get_mla_kv_buffer``,
slot moves, CPU copies, PD transfer) refuse, as in :mod:`.int2_pool`; the buffer getters return
``meta`` tensors of the logical shape.
"""

from __future__ import annotations

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

from ..config import OscarConfig
from ..kernels import write_kv
from .sizing import hp_row_bytes, latent_cell_size, latent_layout
from .windows import HPWindows


class OscarMLATokenToKVPool(MLATokenToKVPool):
    """INT2 latent pool (module docstring). Constructor: ``MLATokenToKVPool``'s arguments plus the
    keyword-only OSCAR settings (``dtype`` must be ``torch.uint8``; DSA layers are not served).

    Args:
        oscar_config: group size along the rank (:func:`~sglang_oscar.config.latent_group_size`: 128 unless
            given), K clip ratio, quantizer, scale dtype, windows.
        hp_dtype: dtype of ``k_pe`` and the windows (the model dtype; BF16 for FP8 checkpoints).
        max_reqs: request slots (``ReqToTokenPool.size``), for the recent ring.
        sink_rows: rows of the sink arena (:func:`~.sizing.plan_windows`).

    Raises:
        ValueError: page size other than 1, ``use_dsa`` (both the DSA subclass's,
            :class:`~.dsa_pool.OscarDSALatentPool`), or a group size that does not divide ``R``.
    """

    #: whether the pool keeps a DSA indexer's key buffer (and takes SGLang's DSA page size)
    serves_dsa = False

    def __init__(self, *args, oscar_config: OscarConfig, hp_dtype: torch.dtype, max_reqs: int,
                 sink_rows: int, **kwargs):
        names = ("size", "page_size", "dtype", "kv_lora_rank", "qk_rope_head_dim")
        given = {**dict(zip(names, args)), **kwargs}
        if given.get("page_size", 1) != 1 and not self.serves_dsa:
            raise ValueError(f"--kv-cache-dtype int2 needs --page-size 1 (got {given['page_size']})")
        if given.get("use_dsa") and not self.serves_dsa:
            raise ValueError("the INT2 latent pool of a DSA (sparse-attention) model is OscarDSALatentPool")
        r = given["kv_lora_rank"]
        self.oscar_config = oscar_config
        self.hp_dtype = hp_dtype
        self.layout = latent_layout(oscar_config, r)
        self.windows = HPWindows(given["size"] + given.get("page_size", 1), max_reqs, oscar_config.sink_tokens,
                                 oscar_config.recent_tokens, sink_rows, kwargs.get("device", "cuda"))
        self.owns_windows = True
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ storage
    def _create_buffers(self):
        slots, rows = self.size + self.page_size, self.windows.num_rows
        r, p, lk = self.kv_lora_rank, self.qk_rope_head_dim, self.layout.k
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            self.codes = [torch.zeros(slots, 1, r // 4, dtype=torch.uint8, device=self.device)
                          for _ in range(self.layer_num)]
            self.pairs = [torch.zeros(slots, 1, 2 * lk.num_groups, dtype=self.layout.scale_dtype, device=self.device)
                          for _ in range(self.layer_num)]
            self.k_pe = [torch.zeros(slots, p, dtype=self.hp_dtype, device=self.device) for _ in range(self.layer_num)]
            self.hp_latent = [torch.zeros(rows, 1, r, dtype=self.hp_dtype, device=self.device)
                              for _ in range(self.layer_num)]
            # one row past the arena takes the writes of tokens without an HP row (static shapes, no sync)
            self.hp_pe = [torch.zeros(rows + 1, p, dtype=self.hp_dtype, device=self.device)
                          for _ in range(self.layer_num)]
        self.kv_buffer = self.codes  # MLATokenToKVPool.__init__ takes data_ptrs of kv_buffer

    def _clear_buffers(self):
        del self.codes, self.pairs, self.k_pe, self.hp_latent, self.hp_pe, self.kv_buffer

    def get_kv_size_bytes(self):
        planes = self.codes + self.pairs + self.k_pe + self.hp_latent + self.hp_pe
        return sum(t.numel() * t.element_size() for t in planes)

    def int2_bytes_per_token(self) -> int:
        """Bytes of one token over all local layers: codes + pairs + ``k_pe``."""
        return latent_cell_size(self.oscar_config, self.kv_lora_rank, self.qk_rope_head_dim, self.layer_num,
                                self.hp_dtype)

    def hp_bytes(self) -> int:
        """Bytes of the BF16 window arenas (latent + ``k_pe`` rows, all layers)."""
        return self.windows.num_rows * hp_row_bytes(1, self.kv_lora_rank, self.qk_rope_head_dim, self.layer_num,
                                                    self.hp_dtype)

    # ------------------------------------------------------------------ packed access
    def latent_buffers(self, layer_id: int) -> dict:
        """The planes of a global layer id as :func:`~sglang_oscar.kernels.latent_plan.latent_decode_attention`
        takes them: ``codes [S, R/4]``, ``pairs [S, 2R/G]``, ``k_pe [S, P]``, ``hp_latent [rows, R]``,
        ``hp_pe [rows, P]``."""
        i = layer_id - self.start_layer
        return dict(codes=self.codes[i][:, 0], pairs=self.pairs[i][:, 0], k_pe=self.k_pe[i],
                    hp_latent=self.hp_latent[i][:, 0], hp_pe=self.hp_pe[i][:-1])

    def write_latent(self, layer_id: int, loc: torch.Tensor, c_rot: torch.Tensor, k_pe: torch.Tensor,
                     hp_rows: torch.Tensor | None) -> None:
        """Quantize rotated latents into slots ``loc``, store ``k_pe``, copy both to HP rows.

        Args:
            layer_id: global layer id.
            loc: int ``[N]`` slots (slot 0 = padding: written, never read).
            c_rot: ``[N, R]`` rotated latents ``c Rot`` in the HP dtype (quantized from these values).
            k_pe: ``[N, P]`` post-RoPE rope keys.
            hp_rows: int32 ``[N]`` HP rows (``-1`` = none), from :meth:`HPWindows.assign`.
        """
        i = layer_id - self.start_layer
        write_kv(c_rot[:, None], None, loc, self.codes[i], self.pairs[i], None, None, self.layout,
                 hp_rows=hp_rows, hp_k=self.hp_latent[i] if hp_rows is not None else None, validate=False)
        loc = loc.long()
        self.k_pe[i][torch.where(loc >= 0, loc, 0)] = k_pe.to(self.hp_dtype)  # loc < 0: the padding slot 0
        if hp_rows is not None:
            self.hp_pe[i][torch.where(hp_rows >= 0, hp_rows.long(), self.windows.num_rows)] = k_pe.to(self.hp_dtype)

    # ------------------------------------------------------------------ refusals of BF16 access
    def _meta(self) -> torch.Tensor:
        return torch.empty((self.size + self.page_size, 1, self.kv_cache_dim), dtype=self.hp_dtype, device="meta")

    def get_key_buffer(self, layer_id: int):
        return self._meta()

    def get_value_buffer(self, layer_id: int):
        return self._meta()[..., : self.kv_lora_rank]

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs):
        raise RuntimeError(
            "the INT2 MLA latent pool (--kv-cache-dtype int2) is written only by the OSCAR triton attention "
            "backend; something tried to write BF16 latent rows directly (another attention backend or a fused "
            "write). Use --attention-backend triton, or serve with --kv-cache-dtype auto")

    def set_mla_kv_buffer(self, *args, **kwargs):
        self.set_kv_buffer(None, None, None, None)

    def get_mla_kv_buffer(self, *args, **kwargs):
        raise RuntimeError("the INT2 MLA latent pool has no BF16 latent rows to read (get_mla_kv_buffer); its "
                           "readers are the OSCAR latent kernels")

    def move_kv_cache(self, tgt_loc, src_loc):
        raise RuntimeError("the INT2 MLA latent pool cannot move slots (move_kv_cache: speculative decoding); serve "
                           "that with --kv-cache-dtype auto")

    def get_cpu_copy(self, indices, mamba_indices=None):
        raise RuntimeError("the INT2 MLA latent pool has no CPU copy of its slots (PD-disaggregated retraction); "
                           "serve that setup with --kv-cache-dtype auto")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        raise RuntimeError("the INT2 MLA latent pool has no CPU copy of its slots (load_cpu_copy)")

    def get_contiguous_buf_infos(self):
        raise RuntimeError("--kv-cache-dtype int2 does not support PD disaggregation")
