"""``OscarSWAKVPool``: SGLang's hybrid sliding-window pool (``SWAKVPool``) over two INT2 pools.

Hybrid sliding-window models (Gemma-4, GPT-OSS) keep two token pools in SGLang: a *full* pool
indexed by the slots in ``req_to_token`` and a smaller *sliding* pool whose slots come from
``full_to_swa_index_mapping`` and are freed as tokens leave the window
(``SWATokenToKVPoolAllocator.free_swa``). Here each of the two is an
:class:`~.int2_pool.OscarMHATokenToKVPool` with its own geometry (kv heads, head_dim, code and pair
planes, :class:`~sglang_oscar.kernels.layout.Int2Layout`); SGLang's allocator, eviction and radix
cache run unchanged.

``--oscar-skip-layers sliding|full`` keeps one kind's sub-pool SGLang's own BF16
``MHATokenToKVPool`` (its layers then run SGLang's BF16 attention, :meth:`OscarSWAKVPool.is_int2_layer`).

The INT2 sub-pools share one :class:`~.windows.HPWindows`: the BF16 sink rows and recent ring are
keyed by *full* slots and request slots, so one bookkeeping per forward serves every layer, and
each sub-pool holds the BF16 rows of its own layers (``[rows, heads, head_dim]`` of its geometry).
Sink rows go back when a full slot is freed (the full sub-pool ``owns_windows``); a sink token
that left a sliding layer's window keeps its row, and the kernels' window mask hides it.

The INT2 kernels read a request's slots from a ``[request, position]`` table. For the sliding
layers that table holds sliding-pool slots (:meth:`OscarSWAKVPool.update_swa_table`, run by the
backend once per forward, CUDA-graph safe): the new tokens' entries, plus, for an extend, the
``window`` positions before the chunk (a radix hit's prefix that this request slot never wrote).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from ..kernels.layout import Int2Layout
from .int2_pool import OscarMHATokenToKVPool
from .sizing import hp_row_bytes
from .windows import HPWindows


#: the order in which SGLang's ``SWAKVPool.__init__`` builds its sub-pools (checked after it ran)
SUB_POOL_ORDER = ("sliding", "full")


class OscarSWAKVPool(SWAKVPool):
    """SGLang's ``SWAKVPool`` with INT2 sub-pools and shared BF16 windows (module docstring).

    Args:
        size, size_swa: full / sliding pool slots (SGLang's ``full_max_total_num_tokens`` /
            ``swa_max_total_num_tokens``).
        swa_attention_layer_ids, full_attention_layer_ids: global layer ids of each kind.
        oscar_config, hp_dtype, max_reqs, sink_rows: as :class:`~.int2_pool.OscarMHATokenToKVPool`.
        skip: ``"none"``, or the kind (``"sliding"`` / ``"full"``) whose sub-pool stays BF16.
        **kwargs: ``SWAKVPool``'s other arguments (``page_size``, ``dtype``, ``head_num``,
            ``head_dim``, ``v_head_dim``, ``swa_head_num`` / ``swa_head_dim`` / ``swa_v_head_dim``
            for a sliding geometry that differs, ``device``, ...).

    Raises:
        ValueError: as :class:`~.int2_pool.OscarMHATokenToKVPool` (page size, head_dim / group).
    """

    def __init__(self, *, size: int, size_swa: int, oscar_config, hp_dtype: torch.dtype, max_reqs: int,
                 sink_rows: int, skip: str = "none", **kwargs):
        if skip not in ("none", "sliding", "full"):
            raise ValueError(f"skip must be 'none', 'sliding' or 'full', got {skip!r}")
        page_size = kwargs.get("page_size", 1)
        self.windows = HPWindows(size + page_size, max_reqs, oscar_config.sink_tokens, oscar_config.recent_tokens,
                                 sink_rows, kwargs.get("device", "cuda"))
        self.oscar_config = oscar_config
        self.hp_dtype = hp_dtype
        self.skip = skip
        shared = dict(oscar_config=oscar_config, hp_dtype=hp_dtype, max_reqs=max_reqs, sink_rows=sink_rows,
                      windows=self.windows)
        kinds = iter(SUB_POOL_ORDER)

        def sub_pool(**kw):
            if next(kinds) == skip:
                kw["dtype"] = hp_dtype
                return MHATokenToKVPool(**kw)
            return OscarMHATokenToKVPool(**kw, **shared)

        super().__init__(size=size, size_swa=size_swa, token_to_kv_pool_class=sub_pool, enable_alt_stream=False,
                         **kwargs)
        for kind, pool in (("sliding", self.swa_kv_pool), ("full", self.full_kv_pool)):
            if isinstance(pool, OscarMHATokenToKVPool) == (kind == skip):  # SGLang built its sub-pools in another order
                raise RuntimeError(f"OscarSWAKVPool: the {kind} sub-pool is "
                                   f"{'INT2' if kind == skip else 'BF16'}, but --oscar-skip-layers is {skip!r}: this "
                                   "SGLang builds SWAKVPool's sub-pools in an order sglang-oscar does not know")
        # only the full allocator's frees are full slots, the keys of the sink rows (whatever the
        # full sub-pool's dtype: the sliding layers' rows are keyed by them too)
        # SWAKVPool sets start_layer 0 only; the backend selects its layers by [start_layer, end_layer]
        self.end_layer = self.layer_num - 1
        self.swa_kv_pool.owns_windows = False
        self.full_kv_pool.windows = self.windows
        self.full_kv_pool.owns_windows = True
        self.owns_windows = False

    # ------------------------------------------------------------------ per-layer access
    def _sub(self, layer_id: int):
        local, is_swa = self.layers_mapping[layer_id]
        return (self.swa_kv_pool if is_swa else self.full_kv_pool), local

    def is_int2_layer(self, layer_id: int) -> bool:
        """Whether a global layer id is cached in INT2 (``False`` for the kind ``skip`` names)."""
        return isinstance(self._sub(layer_id)[0], OscarMHATokenToKVPool)

    def layout_of(self, layer_id: int) -> Int2Layout:
        """The :class:`~sglang_oscar.kernels.layout.Int2Layout` of a global layer id."""
        return self._sub(layer_id)[0].layout

    def is_swa_layer(self, layer_id: int) -> bool:
        """Whether a global layer id lives in the sliding pool (its slots are sliding-pool slots)."""
        return self.layers_mapping[layer_id][1]

    def int2_buffers(self, layer_id: int):
        """``(k_codes, k_pairs, v_codes, v_pairs, hp_k, hp_v)`` of a global layer id."""
        pool, local = self._sub(layer_id)
        return pool.int2_buffers(local)

    def write_rotated(self, layer_id: int, loc: torch.Tensor, k_rot: torch.Tensor, v_rot: torch.Tensor,
                      hp_rows: torch.Tensor | None) -> None:
        """:meth:`.OscarMHATokenToKVPool.write_rotated` of a global layer id; ``loc`` are the layer's
        own pool's slots (sliding-pool slots for a sliding layer)."""
        pool, local = self._sub(layer_id)
        pool.write_rotated(local, loc, k_rot, v_rot, hp_rows)

    def int2_bytes_per_token(self) -> tuple[int, int]:
        """Bytes of one token over ``(full, sliding)`` layers (K + V, all local kv heads): INT2, or
        BF16 for the kind ``skip`` names."""
        return tuple(p.int2_bytes_per_token() if isinstance(p, OscarMHATokenToKVPool)
                     else hp_row_bytes(p.head_num, p.head_dim, p.v_head_dim, p.layer_num, p.store_dtype)
                     for p in (self.full_kv_pool, self.swa_kv_pool))

    def hp_bytes(self) -> int:
        """Bytes of the BF16 window rows of the INT2 sub-pools."""
        return sum(p.hp_bytes() for p in (self.full_kv_pool, self.swa_kv_pool) if isinstance(p, OscarMHATokenToKVPool))

    # ------------------------------------------------------------------ sliding slot table
    def new_swa_table(self, req_to_token: torch.Tensor) -> torch.Tensor:
        """A zeroed int32 ``[requests, positions + 1]`` table shaped like ``req_to_token`` (the last
        column absorbs masked writes); :meth:`update_swa_table` keeps its live entries."""
        r, c = req_to_token.shape
        return torch.zeros((r, c + 1), dtype=torch.int32, device=req_to_token.device)

    def update_swa_table(self, table: torch.Tensor, req_to_token: torch.Tensor, new_req: torch.Tensor,
                         new_pos: torch.Tensor, new_loc: torch.Tensor, window: int,
                         req_pool_indices: torch.Tensor | None = None,
                         prefix_lens: torch.Tensor | None = None) -> torch.Tensor:
        """Write the sliding-pool slots the kernels read into ``table`` (static shapes, no sync).

        Args:
            table: from :meth:`new_swa_table`.
            req_to_token: SGLang's ``[requests, positions]`` full-slot table.
            new_req, new_pos, new_loc: int ``[N]`` request slot, position and *full* slot of each
                new token of the forward.
            window: the largest sliding window of the model's layers (keys, HF convention).
            req_pool_indices, prefix_lens: int ``[B]`` (extend only): the ``window`` positions
                before each request's chunk are (re)written too.

        Returns:
            int64 ``[N]``: the new tokens' sliding-pool slots (where the sliding layers write them).
        """
        cols = table.shape[1] - 1
        mapping = self.full_to_swa_index_mapping
        new_swa = mapping[new_loc.long()]
        table[new_req.long(), new_pos.long()] = new_swa.to(torch.int32)
        if req_pool_indices is None or prefix_lens is None or window <= 0:
            return new_swa
        offs = torch.arange(window, device=table.device)
        pos = prefix_lens.long()[:, None] - window + offs[None, :]
        req = req_pool_indices.long()[:, None].expand_as(pos)
        ok = pos >= 0
        full = req_to_token[req, pos.clamp(min=0)].long()
        swa = mapping[full].to(torch.int32)
        table[req, torch.where(ok, pos, torch.full_like(pos, cols))] = torch.where(ok, swa, torch.zeros_like(swa))
        return new_swa
