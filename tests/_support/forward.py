"""Stand-ins for SGLang's forward-batch pieces in the CPU served-path tests."""

from __future__ import annotations


class Mode:
    """``ForwardMode`` with only what the OSCAR backend asks: decode, extend, idle."""

    def __init__(self, kind: str):
        self.kind = kind

    def is_decode(self) -> bool:
        return self.kind == "decode"

    def is_extend(self) -> bool:
        return self.kind == "extend"

    def is_idle(self) -> bool:
        return False
