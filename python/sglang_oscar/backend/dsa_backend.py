"""``OscarDSALatentBackend``: SGLang's DSA backend with its sparse MLA kernels over the INT2 latent.

GLM-5 (``glm_moe_dsa``; DeepSeek-V3.2's ``DeepseekV32ForCausalLM`` is not among the served
architectures yet) runs every MLA layer as DSA: a lightning indexer scores the
cached tokens with its own FP8 keys and selects each query's top-k (``index_topk``, 2048) positions,
and the attention reads only those. In SGLang 0.5.16 both halves live in the ``"dsa"`` attention
backend (``srt/layers/attention/dsa_backend.py``): it owns the indexer's metadata (page tables,
sequence lengths, schedule metadata the indexer's DeepGEMM kernels read), and the model passes the
absorbed query and latent split (``q_rope`` / ``k_rope``) with each layer's ``topk_indices`` only to
backends of that name (``models/deepseek_common/utils.py``). So an int2 server keeps the name and the
indexer path, and replaces only what reads the latent:

* the indexer returns **positions** (``use_fused_topk = False``: SGLang's unfused top-k transform),
  not pool slot ids, because the INT2 kernels pick each position's tier (BF16 sink row, recent ring,
  INT2 slot) from its position;
* ``forward_decode`` / ``forward_extend`` go to an inner
  :class:`~.latent_backend.OscarTritonLatentBackend` set up with ``dsa_topk = index_topk`` (top-k
  decode plan per batch, sparse extend per chunk token), which also runs the windows' bookkeeping and
  keeps its plans with each CUDA graph;
* the metadata hooks run SGLang's DSA metadata first (the indexer reads it), then the inner
  backend's (windows, plans).

The indexer's key buffer is :class:`~sglang_oscar.pool.dsa_pool.OscarDSALatentPool`'s, SGLang's own
layout. Prefill never takes SGLang's dense MHA path (``use_mha`` stays off: the INT2 pool has no BF16
latent rows to run it over).
"""

from __future__ import annotations

import logging

from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend

from ..pool.dsa_pool import OscarDSALatentPool
from .latent_backend import OscarTritonLatentBackend

logger = logging.getLogger("sglang_oscar")


class OscarDSALatentBackend(DeepseekSparseAttnBackend):
    """SGLang's DSA backend whose sparse attention runs over the INT2 latent (module docstring).

    Raises:
        RuntimeError: the pool is not the INT2 DSA latent pool (a hook did not apply).
    """

    def __init__(self, model_runner, *args, **kwargs):
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, OscarDSALatentPool):
            raise RuntimeError(f"--kv-cache-dtype int2 on a DSA model: the token pool is {type(pool).__name__}, not "
                               "the INT2 DSA latent pool; the sglang-oscar pool hook did not apply (check the log)")
        super().__init__(model_runner, *args, **kwargs)
        self.use_fused_topk = False  # the indexer returns positions (see the module docstring)
        self.latent = OscarTritonLatentBackend(model_runner, dsa_topk=self.dsa_index_topk)
        logger.info("sglang-oscar: DSA attention over the INT2 latent (top-k %d positions per query, indexer keys "
                    "FP8 as SGLang keeps them)", self.dsa_index_topk)

    def set_dsa_prefill_impl(self, forward_batch=None):
        super().set_dsa_prefill_impl(forward_batch)
        self.use_mha = False

    # ------------------------------------------------------------------ metadata: SGLang's, then the latent's
    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self.latent.init_forward_metadata(forward_batch)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        super().init_cuda_graph_state(max_bs, max_num_tokens)
        self.latent.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        super().init_forward_metadata_out_graph(forward_batch, in_capture)
        self.latent.init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        super().init_forward_metadata_in_graph(forward_batch)
        self.latent.init_forward_metadata_in_graph(forward_batch)

    # ------------------------------------------------------------------ attention over the INT2 latent
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                       topk_indices=None, **kwargs):
        return self.latent.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, q_rope=q_rope,
                                          k_rope=k_rope, topk_indices=topk_indices, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                       topk_indices=None, **kwargs):
        return self.latent.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, q_rope=q_rope,
                                          k_rope=k_rope, topk_indices=topk_indices, **kwargs)
