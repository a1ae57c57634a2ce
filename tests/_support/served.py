"""The served backend object without a GPU model runner, for the CPU served-path tests and scripts."""

from __future__ import annotations

import torch


def cpu_backend(pool, config, layers, rotations, *, max_reqs: int, ctx: int, means=None, folded=frozenset(),
                output_folded=None, cls=None):
    """An ``OscarTritonAttnBackend`` over ``pool`` with the attributes its ``__init__`` sets (that
    ``__init__`` needs SGLang's GPU model runner): ``rotations`` ``{layer id: (R_k, R_v)}`` of
    ``layers`` (RadixAttention-like objects), centering ``means`` ``{layer id: (mean_k, mean_v)}``
    (default none), the layers whose value rotation (``folded``) and output rotation
    (``output_folded``, default ``folded``) ``fold_model`` moved into the weights, a
    ``[max_reqs, ctx]`` request-to-slot table (and its sliding-pool twin for an ``OscarSWAKVPool``); ``cls``:
    a subclass of ``OscarTritonAttnBackend`` to build instead (e.g. ``OscarExpandedMLABackend``)."""
    from sglang_oscar.backend.triton_backend import OscarTritonAttnBackend, decode_config
    from sglang_oscar.pool.swa_pool import OscarSWAKVPool

    be = object.__new__(cls or OscarTritonAttnBackend)
    be.pool, be.windows, be.config = pool, pool.windows, config
    be.rotations = rotations
    be.means = means if means is not None else {lay.layer_id: (None, None) for lay in layers}
    be.folded = frozenset(folded)
    be.output_folded = be.folded if output_folded is None else frozenset(output_folded)
    be._hp_rows = None
    be._missed_seen = 0
    be._int2_req_to_token = torch.zeros(max_reqs, ctx, dtype=torch.int32)
    be._swa_table = pool.new_swa_table(be._int2_req_to_token) if isinstance(pool, OscarSWAKVPool) else None
    be._swa_loc = None
    be._decode_config = decode_config(config)
    be.max_context_len = ctx
    be.set_geometry(layers)
    return be
