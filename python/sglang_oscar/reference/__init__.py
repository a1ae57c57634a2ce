"""The plain-PyTorch oracle of the OSCAR INT2 cache (the definition of "correct")."""

from .attention import (
    ReferenceCache,
    attend,
    build_cache,
    WINDOW_MODES,
    hp_window_mask,
    oscar_attention,
    plain_attention,
    relative_error_db,
    rotate_rows,
)
from .masks import visible_mask

__all__ = [name for name in dir() if not name.startswith("_")]
