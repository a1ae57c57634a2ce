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
from .latent import (
    LatentCache,
    build_latent_cache,
    expand_latent,
    latent_attention,
    split_kv_b_proj,
    topk_key_mask,
)
from .masks import visible_mask
from .sparse import (
    block_topk_key_mask,
    minimax_block_scores,
    minimax_block_selection,
    union_block_lists,
)

__all__ = [name for name in dir() if not name.startswith("_")]
