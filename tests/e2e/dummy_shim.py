"""Scaled dummy weights for the device checks of models transformers cannot build (Kimi-Linear).

SGLang's ``--load-format dummy`` fills every float parameter with U(-1e-3, 1e-3) from one seed
(``initialize_dummy_weights``, ``model_loader/weight_utils.py:1493``), norm weights included: the
logits come out near 1e-5 and attention has no visible effect on them, so nothing a check compares
depends on the KV cache. Servers started with ``OSCAR_E2E_DUMMY_INIT=1`` load this harness-only
plugin (entry point ``oscar_e2e_dummy``, installed beside :mod:`.fp32_shim`'s by
:func:`.fp32_shim.write_fp32_shim`), whose AROUND hook replaces that initializer with
:func:`scaled_dummy_weights`: every norm scales by 1, other 1-D parameters as SGLang draws them,
every other parameter N(0, 1 / fan_in) (``fan_in`` its last dim), so activations keep their scale
through the layers, attention scores and logits have a standard deviation near 1, and a different
seed per parameter name gives every server of a comparison the same weights. FP8 weights keep
SGLang's draw (their scales do not): use it with BF16 models.

A Gemma-style norm scales by ``1 + weight`` (SGLang's ``GemmaRMSNorm`` and ``Gemma3RMSNorm``,
``layers/layernorm.py:694,872``; MiniMax-M3's ``multi_head`` q / k ``MultiHeadRMSNorm`` with
``apply_layernorm_1p``, ``models/minimax_m3.py:164``), so its weight is 0, not 1: a weight of 1
doubles every norm of MiniMax-M3 (``use_gemma_norm``: ``GemmaRMSNorm`` everywhere in the check
model's ``per_head`` layout), which quadruples its attention scores (q and k norms) and doubles
its logits.

:func:`.fp32_shim.write_fp32_shim` copies this file next to the plugin folder's dist-info as the
top-level module ``oscar_e2e_dummy_shim``; it imports nothing of the harness.
"""

from __future__ import annotations

import os
import zlib

DUMMY_ENV = "OSCAR_E2E_DUMMY_INIT"
DUMMY_SHIM_ENTRY = "oscar_e2e_dummy"
DUMMY_SHIM_MODULE = "oscar_e2e_dummy_shim"
DUMMY_SHIM_TARGET = "sglang.srt.model_loader.weight_utils.initialize_dummy_weights"
#: norm classes that scale by ``1 + weight`` (module docstring), matched by name: the shim imports no SGLang
GEMMA_NORMS = ("GemmaRMSNorm", "Gemma3RMSNorm")


def scaled_dummy_weights(model, seed: int = 1234) -> None:
    """Fill ``model``'s floating-point parameters and buffers in place (module docstring); formats
    narrower than 16 bits (FP8 weights) keep SGLang's draw; Gemma-style norms (:data:`GEMMA_NORMS`,
    or ``apply_layernorm_1p``) get weight 0, their scale ``1 + weight`` then 1 as every other norm's."""
    import torch

    for name, param in model.state_dict().items():
        if not torch.is_floating_point(param) or torch.finfo(param.dtype).bits < 16:
            continue
        gen = torch.Generator(device=param.device)
        gen.manual_seed(seed + zlib.crc32(name.encode()))
        if name.endswith("norm.weight"):  # any rank: MiniMax-M3's multi_head q / k norm weight is [heads, head_dim]
            param.fill_(1.0)
        elif param.dim() <= 1:
            param.uniform_(-1e-3, 1e-3, generator=gen)
        else:
            # Kimi's KDA A_log [1, 1, H, 1] (fan_in 1) gets N(0, 1): decay rates e^N(0,1), near trained ones
            draw = torch.randn(param.shape, generator=gen, device=param.device, dtype=torch.float32)
            param.copy_(draw * param.shape[-1] ** -0.5)
    for module in model.modules():
        if type(module).__name__ in GEMMA_NORMS or getattr(module, "apply_layernorm_1p", False) is True:
            module.weight.data.zero_()
            # GemmaRMSNorm keeps 1 + weight precomputed for fused paths; its weight loader, which
            # dummy loading never calls, would refresh it
            if isinstance(getattr(module, "gemma_weight", None), torch.Tensor):
                module.gemma_weight.fill_(1.0)


def _around_dummy_init(original_fn, model, *args, **kwargs):
    """AROUND hook of ``initialize_dummy_weights``: SGLang's draw first (it also covers FP8
    weights), then :func:`scaled_dummy_weights` over the rest. SGLang 0.5.16's Kimi-Linear derives
    its MLA layers' ``w_kc`` / ``w_vc`` from ``kv_b_proj`` only at the end of ``load_weights``,
    which dummy loading never calls: it runs here with no weights."""
    original_fn(model, *args, **kwargs)
    scaled_dummy_weights(model)
    if type(model).__name__ == "KimiLinearForCausalLM":
        model.load_weights([])


def dummy_register() -> None:
    """``sglang.srt.plugins`` entry point: the hook above, only where :data:`DUMMY_ENV` is set."""
    if os.environ.get(DUMMY_ENV) != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not any(h is _around_dummy_init for _, h, _ in HookRegistry._hooks.get(DUMMY_SHIM_TARGET, ())):
        HookRegistry.register(DUMMY_SHIM_TARGET, _around_dummy_init, HookType.AROUND)
