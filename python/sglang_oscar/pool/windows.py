"""Bookkeeping of the BF16 (HP) windows of the served INT2 cache: sink rows and recent ring.

Every token is stored in INT2 at the slot SGLang's allocator gave it; the HP windows hold
*extra* BF16 copies of the rotated rows (docs/design.md):

* **recent ring** -- one ring of ``recent`` rows per request slot (``req_pool_idx``): position
  ``p`` of request ``r`` lives in row ``ring_base + r * recent + p % recent``. Static
  addresses, nothing to allocate or free.
* **sink rows** -- keyed by *slot*, so a radix (prefix-cache) hit shares the donor's sink rows
  exactly as it shares its INT2 rows. Rows come from a device-side free stack
  (``free_rows[:top]``) when a token with position ``< sink`` is written, and go back when
  SGLang frees the slot (:meth:`HPWindows.release` queues the slots; :meth:`process_releases`
  applies them on the forward stream before the next forward's allocations).

All device work is plain torch ops with static shapes per batch and no host synchronisation,
so the decode bookkeeping can be recorded in a CUDA graph.

If the sink arena runs out, a sink token gets no row. Readers then use
``sink_lens[req]`` = the number of leading sink positions of the request that have rows: the
request's later sink positions are read through INT2 (never from the ring, which holds only
positions ``>= sink``). The choice follows the *slots*, so a fresh run and a radix hit reading
the same slots still see the same cache; :attr:`missed` counts such tokens and the backend logs
a warning when it grows.
"""

from __future__ import annotations

import torch


class HPWindows:
    """Sink-row arena (keyed by slot) and recent ring (keyed by request slot).

    Args:
        num_slots: INT2 slots of the pool (``size + page_size``); slot 0 is SGLang's padding
            sink and never gets a row.
        max_reqs: request slots (``ReqToTokenPool.size``); the ring has ``max_reqs * recent`` rows.
        sink, recent: window sizes in tokens.
        sink_rows: rows of the sink arena.
        device: torch device.

    Attributes:
        num_rows: HP rows per layer (``sink_rows + max_reqs * recent``).
        hp_index: int32 ``[max_reqs, sink + recent]``: entry ``p < sink`` = sink row of position
            ``p`` (refreshed per forward for the batch's requests), entry ``sink + j`` = ring row
            ``ring_base + r * recent + j`` (static).
        sink_lens: int32 ``[max_reqs]`` (refreshed per forward): leading sink positions with rows.
        missed: int64 scalar tensor: sink tokens that found the arena empty (cumulative).
    """

    def __init__(self, num_slots: int, max_reqs: int, sink: int, recent: int, sink_rows: int, device):
        if num_slots < 1 or max_reqs < 1 or sink < 0 or recent < 0 or sink_rows < 0:
            raise ValueError(f"invalid window geometry: slots={num_slots} reqs={max_reqs} sink={sink} "
                             f"recent={recent} sink_rows={sink_rows}")
        self.num_slots = num_slots
        self.max_reqs = max_reqs
        self.sink = sink
        self.recent = recent
        self.sink_rows = sink_rows
        self.ring_base = sink_rows
        self.num_rows = sink_rows + max_reqs * recent
        self.device = torch.device(device)
        i32 = dict(dtype=torch.int32, device=self.device)
        # one extra entry at the end of each table absorbs masked-out scatter writes
        self.row_of_slot = torch.full((num_slots + 1,), -1, **i32)
        self.free_rows = torch.arange(sink_rows + 1, **i32)
        self.top = torch.tensor(sink_rows, dtype=torch.int64, device=self.device)
        self.missed = torch.zeros((), dtype=torch.int64, device=self.device)
        self.hp_index = torch.full((max_reqs, max(sink + recent, 1)), -1, **i32)
        if recent:
            ring = (self.ring_base + torch.arange(max_reqs, **i32)[:, None] * recent
                    + torch.arange(recent, **i32)[None, :])
            self.hp_index[:, sink:sink + recent] = ring
        self.sink_lens = torch.zeros((max_reqs,), **i32)
        self._pending: list[torch.Tensor] = []
        # host views of the free-row and missed counts, refreshed without a sync by publish()
        pin = self.device.type == "cuda"
        self.host_free = torch.full((), sink_rows, dtype=torch.int64, pin_memory=pin)
        self.host_missed = torch.zeros((), dtype=torch.int64, pin_memory=pin)
        self.low_watermark = max(8 * sink, sink_rows // 8)
        self._cooldown = 0

    # ------------------------------------------------------------------ slots freed by SGLang
    def release(self, slots: torch.Tensor) -> None:
        """Queue freed slots (called from the token allocator's ``free``; no device work)."""
        if self.sink and slots.numel():
            self._pending.append(slots)

    def process_releases(self) -> None:
        """Return the sink rows of queued freed slots to the free stack (device ops, no sync).

        Must run on the stream of the forward passes, before :meth:`assign` of the next forward.
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        slots = torch.cat([s.reshape(-1).to(device=self.device, dtype=torch.int64) for s in pending])
        # static shapes only (no host sync): out-of-range slots go to the dummy entry, and a slot
        # freed twice in one step returns its row once (sorted, later copies masked)
        slots, _ = torch.sort(torch.where((slots > 0) & (slots < self.num_slots), slots, self.num_slots))
        first = torch.ones_like(slots, dtype=torch.bool)
        first[1:] = slots[1:] != slots[:-1]
        rows = self.row_of_slot[slots]
        has = (rows >= 0) & first & (slots < self.num_slots)
        rank = torch.cumsum(has.to(torch.int64), 0) - 1
        dst = torch.where(has, self.top + rank, self.sink_rows)  # sink_rows = the dummy entry
        self.free_rows[dst] = torch.where(has, rows, 0)
        self.top += has.sum()
        self.top.clamp_(max=self.sink_rows)
        self.row_of_slot[slots] = -1

    def reset(self) -> None:
        """Forget every sink row (SGLang flushed the cache: ``allocator.clear()``)."""
        self._pending = []
        self.row_of_slot.fill_(-1)
        self.free_rows.copy_(torch.arange(self.sink_rows + 1, dtype=torch.int32, device=self.device))
        self.top.fill_(self.sink_rows)
        self.host_free.fill_(self.sink_rows)

    def publish(self) -> None:
        """Copy the free-row and missed counts to :attr:`host_free` / :attr:`host_missed`
        (non-blocking; they land by the next step)."""
        self.host_free.copy_(self.top, non_blocking=True)
        self.host_missed.copy_(self.missed, non_blocking=True)

    def maybe_reclaim(self, tree_cache) -> int:
        """Evict radix-cache leaves when the sink arena runs low (tier-aware eviction).

        Sink rows are held by slots, and the radix cache keeps finished prefixes (and their sink
        rows) until it needs token space, which an INT2 pool rarely does. When the last published
        free-row count is under :attr:`low_watermark`, evict a quarter of the evictable tokens
        (least recently used first); their slots come back through the allocator's ``free`` and
        return their rows at the next forward. At most once every 4 scheduler steps, so rows
        have time to come back before the next decision.

        Returns:
            tokens asked to evict (0 if nothing was done).
        """
        if not self.sink or not self.sink_rows:
            return 0
        if self._cooldown > 0:
            self._cooldown -= 1
            return 0
        if int(self.host_free) >= self.low_watermark:
            return 0
        evictable = int(tree_cache.evictable_size()) if hasattr(tree_cache, "evictable_size") else 0
        if evictable <= 0:
            return 0
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        n = max(1, evictable // 4)
        tree_cache.evict(EvictParams(num_tokens=n))
        self._cooldown = 4
        return n

    @property
    def free_sink_rows(self) -> int:
        """Free rows in the sink arena (host sync; for logs and tests)."""
        return int(self.top)

    # ------------------------------------------------------------------ per forward
    def assign(self, loc: torch.Tensor, positions: torch.Tensor, token_req: torch.Tensor,
               token_seq_end: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """HP rows for the tokens written by one forward, taking sink rows as needed.

        Args:
            loc: int ``[N]`` INT2 slots of the new tokens (slot 0 = padding: no HP row).
            positions: int ``[N]`` positions of the tokens in their requests.
            token_req: int ``[N]`` request slot of each token.
            token_seq_end: int ``[N]`` the request's length after this forward.
            out: optional int32 ``[>= N]`` buffer (CUDA graphs); the result is ``out[:N]``.

        Returns:
            int32 ``[N]``: sink row (position ``< sink`` and a row was available), else ring row
            (``sink <= position`` and ``position >= seq_end - recent``), else ``-1`` (INT2 only).
        """
        loc = loc.to(torch.int64)
        positions = positions.to(torch.int64)
        token_req = token_req.to(torch.int64)
        live = loc > 0
        rows = torch.full_like(positions, -1)
        if self.sink:
            is_sink = live & (positions < self.sink)
            existing = self.row_of_slot[loc]
            need = is_sink & (existing < 0)
            rank = torch.cumsum(need.to(torch.int64), 0) - 1
            ok = need & (rank < self.top)
            src = torch.clamp(self.top - 1 - rank, min=0)
            new_rows = self.free_rows[src]
            self.row_of_slot[torch.where(ok, loc, self.num_slots)] = torch.where(ok, new_rows, -1)
            self.top -= ok.sum()
            self.missed += (need & ~ok).sum()
            sink_row = self.row_of_slot[loc].to(torch.int64)
            rows = torch.where(is_sink & (sink_row >= 0), sink_row, rows)
        if self.recent:
            # ring rows only for positions >= sink: readers never take a sink position from the
            # ring (one without a sink row is read through INT2), so no unwritten ring row is read
            in_ring = live & (positions >= self.sink) & (positions >= token_seq_end.to(torch.int64) - self.recent)
            ring_row = self.ring_base + token_req * self.recent + positions % self.recent
            rows = torch.where(in_ring, ring_row, rows)
        rows = rows.to(torch.int32)
        if out is None:
            return rows
        out[: rows.shape[0]].copy_(rows)
        return out[: rows.shape[0]]

    def refresh(self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor) -> None:
        """Point ``hp_index[req, :sink]`` at the sink rows of the requests' slots and recompute
        ``sink_lens[req]`` (after :meth:`assign`, before attention reads). Static shapes."""
        if not self.sink:
            return
        req = req_pool_indices.to(torch.int64)
        width = min(self.sink, req_to_token.shape[1])
        slots = req_to_token[req, :width].to(torch.int64).clamp_(0, self.num_slots - 1)
        rows = self.row_of_slot[slots]
        if width < self.sink:
            rows = torch.cat([rows, rows.new_full((rows.shape[0], self.sink - width), -1)], 1)
        self.hp_index[req, : self.sink] = rows
        lead = torch.cumprod((rows >= 0).to(torch.int32), 1).sum(1)
        self.sink_lens[req] = lead.to(torch.int32)
