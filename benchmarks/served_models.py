"""The real-shape models of the served benchmarks (``bench_served``, ``bench_prefix``,
``bench_full_pool``): their ``config.json`` files in ``benchmarks/configs/``, what the plans estimate
from them (:class:`Shape`) and the model folder a dummy-weight server loads (:func:`write_model_dir`).

Qwen3-8B, Qwen3-32B and Qwen3-30B-A3B are the published Hugging Face ``config.json`` values (but
``max_position_embeddings`` 135168, see ``bench_served``). ``qwen3.5-35b-a3b`` is the language model
of transformers 5.12's ``Qwen3_5MoeTextConfig`` defaults (40 layers, every 4th full attention with 16
q / 2 kv heads x 256, the others Gated-DeltaNet with 16 key / 32 value heads x 128; 256 experts top-8
of 512 plus a shared expert of 512; vocabulary 248,320), the geometry of the Qwen3.5-35B-A3B recipe,
in Qwen3.5's multimodal wrapper as the device checks' ``qwen3_5`` family writes it
(``tests/e2e/families.py``): ``full_attention_interval`` for SGLang, interleaved M-RoPE sections
11/11/10, a one-block vision tower and vision token ids just past the vocabulary (text-only
requests never reach either). SGLang loads a processor for every multimodal model, so its folder
also gets the offline one of ``tests/e2e/checkpoints.write_processor``. ``gpt-oss-20b`` is
transformers' ``GptOssConfig`` (whose defaults are gpt-oss-120b's) with gpt-oss-20b's 24 layers and 32
experts (top-4 of 2,880): 64 q / 8 kv heads x 64, layers alternating a 128-key sliding window and full
attention, learned attention sinks, YaRN RoPE (factor 33 here: 135,168 positions), ``swiglu_limit`` 7
(SGLang reads it), BF16 weights in place of the published MXFP4 experts.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
MODELS = ("qwen3-8b", "qwen3-32b", "qwen3-30b-a3b")  # the default set of bench_served
HYBRID_MODELS = ("qwen3.5-35b-a3b", "gpt-oss-20b")  # run when --models names them
ALL_MODELS = MODELS + HYBRID_MODELS
# Launch flags a model's recipe serves it with, on every server / on the int2 ones (recipes/GPT-OSS-20B:
# a BF16 sliding pool sized for 0.02 sliding tokens per full one, since a 128-key window never uses
# SGLang's default 0.8; its sliding layers kept BF16)
SERVER_ARGS = {"gpt-oss-20b": ("--swa-full-tokens-ratio", "0.02")}
INT2_ARGS = {"gpt-oss-20b": ("--oscar-skip-layers", "sliding")}


def load_config(name: str) -> dict:
    return json.loads((CONFIG_DIR / f"{name}.json").read_text())


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the estimates need from a ``config.json`` (a multimodal one: its ``text_config``);
    parameter counts exclude norms and the vision tower. ``layers`` counts the layers that keep K/V
    and grow with the context (full attention: not a linear-attention layer, not a sliding-window one);
    ``all_layers`` every decoder layer."""

    name: str
    config: dict
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: float  # all weights
    matmul_params: float  # weights one token multiplies by (active experts, lm_head; no embedding)
    expert_params: float  # all routed-expert weights (0 for dense)
    experts: int = 0
    topk: int = 0
    all_layers: int = 0

    @classmethod
    def load(cls, name: str) -> "Shape":
        """Parameter counts: attention ``2 h Hq d + 2 h Hkv d`` (with Qwen3.5's output gate another
        ``h Hq d``), Gated-DeltaNet ``h (2 Nk dk + 2 Nv dv + 2 Nv) + Nv dv h`` (q/k/v/z, b/a and out
        projections, as ``transformers``' ``Qwen3NextGatedDeltaNet``), SwiGLU MLPs ``3 h i`` per
        expert (routed, shared) plus the router ``h E``."""
        root = load_config(name)
        c = root.get("text_config", root)
        h, d, n_layers = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
        hq, hkv, vocab = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
        kinds = c.get("layer_types") or ["full_attention"] * n_layers
        n_full, n_linear = kinds.count("full_attention"), kinds.count("linear_attention")
        gated = "linear_num_value_heads" in c  # the Qwen3-Next / Qwen3.5 attention has an output gate
        attn = 2 * h * hq * d + 2 * h * hkv * d + (h * hq * d if gated else 0)
        linear = 0
        if gated:
            nk, nv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                              c["linear_value_head_dim"])
            linear = h * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * h
        mixers = (n_layers - n_linear) * attn + n_linear * linear  # sliding layers: attention too
        if "num_experts" in c or "num_local_experts" in c:
            e, k = c.get("num_experts") or c["num_local_experts"], c["num_experts_per_tok"]
            per_expert = 3 * h * (c.get("moe_intermediate_size") or c["intermediate_size"])  # GPT-OSS: per expert
            shared = 3 * h * c.get("shared_expert_intermediate_size", 0)
            mlp_all, mlp_active = e * per_expert + shared + h * e, k * per_expert + shared + h * e
            experts_total = n_layers * e * per_expert
        else:
            e = k = 0
            mlp_all = mlp_active = 3 * h * c["intermediate_size"]
            experts_total = 0
        head = vocab * h * (1 if c.get("tie_word_embeddings") else 2)
        return cls(name, c, n_full, hq, hkv, d, mixers + n_layers * mlp_all + head,
                   mixers + n_layers * mlp_active + vocab * h, experts_total, e, k, n_layers)

    def kv_bytes(self, bits: float) -> float:
        """Pool bytes per token (every K/V layer, K and V) at ``bits`` per stored element."""
        return self.layers * self.kv_heads * self.head_dim * 2 * bits / 8


def write_model_dir(name: str, path: str | Path) -> Path:
    """The folder a ``--load-format dummy`` server of model ``name`` loads: its ``config.json`` and,
    for a multimodal config, the offline processor (``tests/e2e/checkpoints.write_processor``, imported
    from the repository root, where the benchmarks run). Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shutil.copy(CONFIG_DIR / f"{name}.json", path / "config.json")
    if "vision_config" in load_config(name):
        from transformers import AutoConfig

        from tests.e2e.checkpoints import write_processor

        write_processor(str(path), AutoConfig.from_pretrained(str(path)))
    return path
