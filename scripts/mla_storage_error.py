#!/usr/bin/env python
"""Attention error of the two INT2 storages of an MLA layer: the packed latent vs expanded MHA.

On the MLA device check's model (``tests/e2e/mla_models.build_model``: a seeded, sharpened
DeepseekV3ForCausalLM with DeepSeek-V3's latent geometry, kv_lora_rank 512, rope 64, nope 128,
v 128, 8 heads), one prompt; per layer, the captured ``c_kv``, ``k_pe``, queries and ``kv_b_proj``
halves (``tests/e2e/mla_oracle.capture_latent_inputs``) go through both oracles with the same windows
(sink 64 + recent 256) and data-free rotations, in window mode "extend" for the prompt's last
``--queries`` positions:

* latent: ``reference.latent.latent_attention`` over the INT2 latent (group 128, the served block
  Hadamard of 128), ``k_pe`` BF16: 272 bytes per token and layer;
* expanded: ``K = [c W_UK^T | k_pe]`` (192) and ``V = c W_UV`` (128) per head
  (``reference.latent.expand_latent``) through the MHA oracle ``reference.oscar_attention`` (group
  64, the largest dividing 192 and 128; per-head Hadamard of 192 / 128): ``heads x 100`` bytes.

Error: ``10 log10(|o - o_exact|^2 / |o_exact|^2)`` against the unquantized attention (dB, lower is
better), on the output after ``W_UV`` (what the model consumes).

    PYTHONPATH=python:tests TRITON_INTERPRET=1 python scripts/mla_storage_error.py [--tokens 1500] [--queries 256]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--queries", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from e2e.checkpoints import random_prompt
    from e2e.mla_models import VOCAB, build_model
    from e2e.mla_oracle import capture_latent_inputs
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.reference import oscar_attention, relative_error_db
    from sglang_oscar.reference.latent import expand_latent, latent_attention
    from sglang_oscar.rotation.hadamard import default_hadamard
    from sglang_oscar.rotation.latent import latent_hadamard

    path = tempfile.mkdtemp(prefix="mla-storage-")
    geo = build_model(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = random_prompt(a.tokens, a.seed, VOCAB)
    h, n = geo["num_attention_heads"], geo["qk_nope_head_dim"]
    r, p, dv = geo["kv_lora_rank"], geo["qk_rope_head_dim"], geo["v_head_dim"]
    latent_cfg = OscarConfig(group_size=128, sink_tokens=64, recent_tokens=256)
    expanded_cfg = OscarConfig(group_size=64, sink_tokens=64, recent_tokens=256)
    rot_latent = latent_hadamard(r, 128).float()
    rk = default_hadamard(n + p).float().expand(h, n + p, n + p).contiguous()
    rv = default_hadamard(dv).float().expand(h, dv, dv).contiguous()
    qpos = torch.arange(a.tokens - a.queries, a.tokens)
    rows = ["| layer | latent INT2 (dB) | expanded INT2 (dB) |", "|---:|---:|---:|"]
    for layer in range(geo["num_hidden_layers"]):
        with torch.no_grad():
            x = capture_latent_inputs(model, ids, layer=layer)
        qn, qp, c, kpe = (x[k][qpos] if k.startswith("q") else x[k] for k in ("q_nope", "q_pe", "c_kv", "k_pe"))
        scale = x.get("scaling", (n + p) ** -0.5)
        common = dict(softmax_scale=scale, q_positions=qpos, hp_dtype=torch.float32)
        exact = latent_attention(qn, qp, c, kpe, x["w_kc"], x["w_vc"], None, latent_cfg, window_mode="none",
                                 cache="bf16", **common)
        lat = latent_attention(qn, qp, c, kpe, x["w_kc"], x["w_vc"], rot_latent, latent_cfg, window_mode="extend",
                               **common)
        k, v = expand_latent(c, kpe, x["w_kc"], x["w_vc"])
        exp = oscar_attention(torch.cat([qn, qp], -1), k, v, rk, rv, expanded_cfg, q_positions=qpos, sm_scale=scale,
                              window_mode="extend", hp_dtype=torch.float32)
        rows.append(f"| {layer} | {relative_error_db(lat, exact):.2f} | {relative_error_db(exp, exact):.2f} |")
        print(rows[-1], flush=True)
    bytes_expanded = h * ((n + p) // 4 + 2 * 2 * (n + p) // 64 + dv // 4 + 2 * 2 * dv // 64)
    print(f"\nbytes per token and layer: latent {r // 4 + 2 * 2 * r // 128 + 2 * p} (k_pe BF16), "
          f"expanded {bytes_expanded} ({h} heads); BF16 latent {2 * (r + p)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
