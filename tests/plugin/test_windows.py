"""HPWindows: sink rows keyed by slot (free stack), recent ring keyed by request slot."""

from __future__ import annotations

import torch

from sglang_oscar.pool.windows import HPWindows


def _w(sink_rows=8, sink=4, recent=3, slots=32, reqs=3):
    return HPWindows(slots, reqs, sink, recent, sink_rows, "cpu")


def test_static_ring_index_and_row_count():
    w = _w()
    assert w.num_rows == 8 + 3 * 3
    assert w.hp_index[2, 4:7].tolist() == [8 + 6, 8 + 7, 8 + 8]
    assert (w.hp_index[:, :4] == -1).all()


def test_assign_sink_then_ring_rows_and_padding():
    w = _w()
    # request 1 prefills 6 tokens at slots 5..10 (positions 0..5, length after = 6)
    loc = torch.arange(5, 11)
    rows = w.assign(loc, torch.arange(6), torch.full((6,), 1), torch.full((6,), 6))
    # positions 0..3 take sink rows from the top of the stack (7, 6, 5, 4); 4..5 are in the
    # recent window (>= 6 - 3) -> ring rows 8 + 1*3 + p % 3
    assert rows.tolist() == [7, 6, 5, 4, 8 + 3 + 1, 8 + 3 + 2]
    assert w.free_sink_rows == 4
    assert w.row_of_slot[5:9].tolist() == [7, 6, 5, 4]
    # padding token (slot 0) gets nothing and takes nothing
    rows = w.assign(torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), torch.tensor([1]))
    assert rows.tolist() == [-1] and w.free_sink_rows == 4
    # a middle token outside the ring window gets no HP row
    rows = w.assign(torch.tensor([20]), torch.tensor([9]), torch.tensor([1]), torch.tensor([20]))
    assert rows.tolist() == [-1]


def test_release_returns_rows_and_refresh_follows_slots():
    w = _w()
    w.assign(torch.arange(5, 11), torch.arange(6), torch.full((6,), 1), torch.full((6,), 6))
    r2t = torch.zeros(3, 16, dtype=torch.int32)
    r2t[1, :6] = torch.arange(5, 11)
    r2t[2, :6] = torch.arange(5, 11)  # a radix borrower sharing the slots
    w.refresh(torch.tensor([1, 2]), r2t)
    assert w.hp_index[1, :4].tolist() == [7, 6, 5, 4] == w.hp_index[2, :4].tolist()
    assert w.sink_lens[1:].tolist() == [4, 4]
    w.release(torch.tensor([5, 6, 15]))  # slot 15 has no row
    w.release(torch.tensor([6]))  # freed twice in one step: its row must come back once
    assert w.free_sink_rows == 4  # queued only
    w.process_releases()
    assert w.free_sink_rows == 6
    assert w.row_of_slot[5:7].tolist() == [-1, -1]
    # the rows come back and are handed out again
    rows = w.assign(torch.tensor([30, 31]), torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([2, 2]))
    assert sorted(rows.tolist()) == [6, 7]


def test_exhaustion_shortens_sink_lens_and_uses_the_ring():
    w = _w(sink_rows=2, sink=4, recent=3)
    rows = w.assign(torch.arange(1, 6), torch.arange(5), torch.zeros(5, dtype=torch.long), torch.full((5,), 5))
    # 2 sink rows only: positions 2, 3 have none and stay INT2-only (the ring holds positions
    # >= sink only, so readers never look for them there); position 4 is recent -> ring
    assert rows.tolist() == [1, 0, -1, -1, 2 + 1]
    assert int(w.missed) == 2
    r2t = torch.zeros(1, 8, dtype=torch.int32)
    r2t[0, :5] = torch.arange(1, 6)
    w.refresh(torch.tensor([0]), r2t)
    assert w.sink_lens[0].item() == 2
    w.reset()
    assert w.free_sink_rows == 2 and (w.row_of_slot == -1).all()


def test_low_arena_evicts_radix_leaves_until_rows_return():
    class Tree:
        def __init__(self):
            self.asked = []

        def evictable_size(self):
            return 400

        def evict(self, params):
            self.asked.append(params.num_tokens)

    w = _w(sink_rows=64, sink=4, slots=64, reqs=10)  # low watermark max(32, 8) = 32
    tree = Tree()
    assert w.maybe_reclaim(tree) == 0  # 64 free rows: nothing to do
    w.assign(torch.arange(1, 41), torch.arange(40) % 4, torch.arange(40) // 4, torch.full((40,), 4))
    w.publish()
    assert int(w.host_free) == 24
    assert w.maybe_reclaim(tree) == 100 and tree.asked == [100]
    assert [w.maybe_reclaim(tree) for _ in range(4)] == [0, 0, 0, 0]  # cooldown
    w.release(torch.arange(1, 41))
    w.process_releases()
    w.publish()
    assert w.maybe_reclaim(tree) == 0 and tree.asked == [100]
