import pytest
import torch

from sglang_oscar.quant import pack_quarter, unpack_quarter

HEAD_DIMS = [64, 128, 192, 256, 512]


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_pack_unpack_bijection(d):
    gen = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 4, (37, 3, d), generator=gen, dtype=torch.uint8)
    packed = pack_quarter(codes)
    assert packed.shape == (37, 3, d // 4) and packed.dtype == torch.uint8
    assert torch.equal(unpack_quarter(packed), codes)
    # and the other direction: every byte value round-trips, in every byte position
    nb = d // 4
    values = torch.arange(256, dtype=torch.uint8)
    all_bytes = torch.stack([values.roll(shift) for shift in range(nb)], dim=1)  # [256, D/4]
    assert torch.equal(pack_quarter(unpack_quarter(all_bytes)), all_bytes)


def test_quarter_split_layout_known_bytes():
    # D = 8: byte j holds elements j, j+2, j+4, j+6 in bits 0-1, 2-3, 4-5, 6-7.
    codes = torch.tensor([[1, 2, 3, 0, 2, 1, 0, 3]], dtype=torch.uint8)
    packed = pack_quarter(codes)
    assert packed.tolist() == [[1 | (3 << 2) | (2 << 4) | (0 << 6), 2 | (0 << 2) | (1 << 4) | (3 << 6)]]


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_quarter(torch.zeros(2, 6, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        pack_quarter(torch.full((1, 8), 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="integer"):
        pack_quarter(torch.zeros(1, 8))
    with pytest.raises(ValueError, match="uint8"):
        unpack_quarter(torch.zeros(1, 2, dtype=torch.int32))
