"""The ``--dtype float32`` servers of check c (``--c-fp32``) and their SGLang plugin.

``--c-fp32``: check c's int2 servers again with ``--dtype float32`` (HP windows then hold fp32
rows and the INT2 kernels multiply in fp32), and a ``--dtype float32`` BF16-path twin for the
noise floor. SGLang 0.5.16 cannot serve Qwen3 in fp32 on CUDA as is: ``RMSNorm.forward_cuda``
without a residual (q/k norms, layer 0's input norm) calls ``sgl_kernel.rmsnorm``, which sends
fp32 to flashinfer's ``rmsnorm`` (compiled for fp16/bf16 only: "failed to dispatch data type
Float"). These servers therefore load a second, harness-only SGLang plugin (entry point
``oscar_e2e_fp32``, :func:`fp32_shim_register`, made discoverable by a dist-info folder on their
PYTHONPATH) that routes fp32 inputs of RMSNorm, SiluAndMul and RoPE (M-RoPE too) to their PyTorch
``forward_native``, skips the JIT fused QK-norm (``static_assert`` fp16/bf16) and Qwen3.5's fused
q/k norm + RoPE kernel (bf16 rounding) for fp32, and
builds GPT-OSS's attention and router weights in fp32 (SGLang takes their dtype from the
checkpoint's config) and keeps its Triton MoE products in fp32 (the fp32 GPT-OSS servers take
SGLang's Triton MoE runner, :data:`FP32_FAMILY_ARGS`). With ``$OSCAR_E2E_DUMP_KV`` the int2
servers also save the K/V rows of their first prompts (``_dump_extend_kv``). The same folder carries :mod:`.window_shim`, check b's BF16 baseline plugin.

:func:`write_fp32_shim` copies this file next to the dist-info as the top-level module
``oscar_e2e_fp32_shim`` that the server processes import, so it imports nothing of the harness.
"""

from __future__ import annotations

import os


C_FP32_SERVERS = {"layer": "qwen3-int2-layer-fp32", "head": "qwen3-int2-head-fp32"}
C_FP32_FLOOR = "qwen3-fp32"


def fp32_name(family: str, kind: str | None = None) -> str:
    """Name of a ``--dtype float32`` server of check c: ``<family>-int2-<kind>-fp32`` (``kind``
    ``layer`` / ``head``) or the noise-floor twin ``<family>-fp32`` (qwen3: :data:`C_FP32_SERVERS`,
    :data:`C_FP32_FLOOR`)."""
    return f"{family}-int2-{kind}-fp32" if kind else f"{family}-fp32"
FP32_SHIM_ENTRY = "oscar_e2e_fp32"
FP32_SHIM_MODULE = "oscar_e2e_fp32_shim"
FP32_SHIM_VALUE = f"{FP32_SHIM_MODULE}:fp32_shim_register"


def _fp32_native(original_fn, self, x, *args, **kwargs):
    """AROUND hook of ``RMSNorm.forward_cuda`` / ``SiluAndMul.forward_cuda``: an fp32 input takes
    the op's PyTorch ``forward_native``; anything else the original CUDA path."""
    import torch

    if x.dtype == torch.float32:
        return self.forward_native(x, *args, **kwargs)
    return original_fn(self, x, *args, **kwargs)


def _fp32_native_rope(original_fn, self, positions, query, key, *args, **kwargs):
    """AROUND hook of ``RotaryEmbedding.forward_cuda``: fp32 queries (without a fused KV write)
    take ``forward_native`` instead of the JIT RoPE kernel (not built or tested for fp32 upstream)."""
    import torch

    fused = kwargs.get("fused_set_kv_buffer_arg", args[1] if len(args) > 1 else None)
    if query.dtype == torch.float32 and fused is None:
        return self.forward_native(positions, query, key, *args, **kwargs)
    return original_fn(self, positions, query, key, *args, **kwargs)


def _no_fp32_jit_qknorm(original_fn, head_dim, dtype, *args, **kwargs):
    """AROUND hook of ``sglang.jit_kernel.norm.can_use_fused_inplace_qknorm``: False for fp32 (its
    kernel ``static_assert``s fp16/bf16; upstream would try an nvcc build per process and fall back)."""
    import torch

    if dtype == torch.float32:
        return False
    return original_fn(head_dim, dtype, *args, **kwargs)


ROPE_ENV = "OSCAR_E2E_CPU_ROPE"


def _cpu_inv_freq(original_fn, self, *args, **kwargs):
    """AROUND hook of ``RotaryEmbedding._compute_inv_freq`` (and the Gemma-4 and YaRN overrides), with
    ``$OSCAR_E2E_CPU_ROPE`` set: compute RoPE's inverse frequencies on the CPU, as transformers
    does for the oracle, then move them to the device SGLang would have used. SGLang computes them
    on the GPU (``base.py``'s own note: "a slight numerical difference between the HF
    implementation and ours"), whose ``pow`` differs from the CPU's in the last bit; on Gemma-4 a
    one-ulp table change starts an INT2 code cascade as large as check c's tolerance
    (docs/serving_hybrid.md)."""
    import torch

    if not os.environ.get(ROPE_ENV):
        return original_fn(self, *args, **kwargs)
    with torch.device("cpu"):
        inv_freq = original_fn(self, *args, **kwargs)
    return inv_freq.to(torch.get_default_device())


def _gpt_oss_weights_in_default_dtype(original_fn, self, config, *args, **kwargs):
    """AROUND hook of ``GptOssForCausalLM.__init__``: SGLang builds GPT-OSS's attention and router
    weights in ``config.dtype`` (the checkpoint's bf16, ``gpt_oss.py:249,522``) whatever ``--dtype``
    says, so a ``--dtype float32`` server multiplies fp32 activations by bf16 weights and fails
    ("mat1 and mat2 must have the same dtype"). Under an fp32 default dtype (SGLang's loader sets
    ``--dtype`` as the default while it builds the model) the config follows it."""
    import torch

    if torch.get_default_dtype() == torch.float32 and getattr(config, "dtype", None) in (torch.bfloat16, torch.float16):
        config.dtype = torch.float32
    return original_fn(self, config, *args, **kwargs)


def _no_tf32_in_fp32(original_fn, self, *args, **kwargs):
    """AROUND hook of ``ModelRunner.__init__``: SGLang turns TF32 matmuls on for some models
    whatever ``--dtype`` says (MiniMax-M2's launch override sets ``enable_tf32_matmul``, for its
    router GEMM), which rounds every fp32 GEMM's inputs to 10 mantissa bits; a ``--dtype float32``
    server keeps IEEE fp32 GEMMs, as the fp32 oracle computes."""
    sa = kwargs.get("server_args") or next((a for a in args if hasattr(a, "enable_tf32_matmul")), None)
    if sa is not None and str(getattr(sa, "dtype", "")) == "float32" and sa.enable_tf32_matmul:
        if hasattr(sa, "override"):  # ServerArgs' one post-resolution mutation point (strict mode refuses setattr)
            sa.override("oscar-e2e-fp32-shim", enable_tf32_matmul=False)
        else:
            sa.enable_tf32_matmul = False
    return original_fn(self, *args, **kwargs)


def _fp32_moe_compute(original_fn, A, *args, **kwargs):
    """AROUND hook of the Triton fused-MoE kernel launcher: SGLang picks ``compute_type`` bf16 for
    bf16 activations and fp16 for anything else, which would round fp32 experts' products to fp16;
    fp32 activations keep fp32 (with ``TRITON_F32_DEFAULT=ieee`` its ``tl.dot`` is IEEE fp32)."""
    import torch
    import triton.language as tl

    if A.dtype == torch.float32 and "compute_type" in kwargs:
        kwargs["compute_type"] = tl.float32
    return original_fn(A, *args, **kwargs)


def _fp32_chunk_gated_delta_rule(original_fn, q, k, v, g, beta, scale=None, initial_state=None,
                                 initial_state_indices=None, cu_seqlens=None, head_first=False,
                                 use_qk_l2norm_in_kernel=False):
    """AROUND hook of SGLang's gated-DeltaNet prefill (``fla.chunk.chunk_gated_delta_rule``, called by
    ``TritonGDNKernel.extend`` of Qwen3-Next / Qwen3.5): the function asserts bf16/fp16 inputs, while
    the Triton kernels of the ``ChunkGatedDeltaRuleFunction`` it runs compile for fp32 on sm_90. fp32
    inputs run that Function directly (as the original does after its checks; SGLang's callers pass
    one varlen batch with one state index per sequence) with the block-merge dots of its kkt/solve
    kernel switched from TF32 to IEEE (``chunk_fwd._MERGE_DOT_PRECISION``, set before the kernel's
    first compile in this process: an fp32 server's first prefill); other dtypes call the original."""
    import torch

    if q.dtype != torch.float32 or head_first:
        return original_fn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           initial_state_indices=initial_state_indices, cu_seqlens=cu_seqlens,
                           head_first=head_first, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    import triton.language as tl
    from sglang.kernels.ops.attention.fla import chunk, chunk_fwd

    if chunk_fwd._MERGE_DOT_PRECISION.value != "ieee":
        chunk_fwd._MERGE_DOT_PRECISION = tl.constexpr("ieee")
    if not (k.dtype == v.dtype == torch.float32 and beta.dim() == 3):
        raise ValueError(f"fp32 gated-DeltaNet prefill: q/k/v {q.dtype}/{k.dtype}/{v.dtype}, beta {tuple(beta.shape)}")
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    o, h = chunk.ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, initial_state, initial_state_indices,
                                                   cu_seqlens, use_qk_l2norm_in_kernel)
    return o, None, h


def _fp32_unfused_qk_rope_gate(original_fn, self, positions, hidden_states, *args, **kwargs):
    """AROUND hook of ``Qwen3_5AttentionDecoderLayer.forward_prepare_cuda_fused`` (SGLang's CUDA path
    of Qwen3.5's attention layers): its Triton kernel rounds the normalized q and k to bf16 for any
    input that is not fp16 (``fused_qk_rmsnorm_rope_gate.py``: ``out_dtype``), which would make the
    cached K of a ``--dtype float32`` server bf16 values. fp32 inputs take the layer's
    ``forward_prepare_native`` (q/k RMSNorm, then RoPE: both routed to PyTorch here); others the kernel."""
    import torch

    if hidden_states.dtype == torch.float32:
        return self.forward_prepare_native(positions, hidden_states)
    return original_fn(self, positions, hidden_states, *args, **kwargs)


# Extra flags of a family's --dtype float32 servers: GPT-OSS's default MoE runner (triton_kernels)
# asserts bf16 activations, SGLang's Triton runner takes fp32 with _fp32_moe_compute.
FP32_FAMILY_ARGS = {"gpt_oss": ["--moe-runner-backend", "triton"]}


def fp32_args(family: str) -> list[str]:
    """The flags that make a server of ``family`` an fp32 one (``--dtype float32`` and
    :data:`FP32_FAMILY_ARGS`); their environment is :func:`fp32_server_env`."""
    return ["--dtype", "float32", *FP32_FAMILY_ARGS.get(family, [])]

DUMP_ENV = "OSCAR_E2E_DUMP_KV"
_DUMPED: dict = {}


def _dump_extend_kv(original_fn, self, q, k, v, layer, forward_batch, *args, **kwargs):
    """AROUND hook of ``OscarTritonAttnBackend.forward_extend`` (only with ``$OSCAR_E2E_DUMP_KV``
    set to a folder): an int2 server's first whole-prompt extend of each prompt length saves, per
    layer, the q / K / V rows its backend receives (post-norm, post-RoPE, before any rotation),
    the attention output it returns, the layer's scaling / sliding window / sinks and whether the
    fold moved its value or output rotation into the weights (then V arrives rotated and the output
    leaves rotated), as fp32 to ``<folder>/kv_<port>_<len>.pt`` with the token ids
    (``scripts/served_kv_diff.py`` replays them through the oracle)."""
    import sys

    import torch

    out = original_fn(self, q, k, v, layer, forward_batch, *args, **kwargs)
    folder = os.environ.get(DUMP_ENV)
    fb = forward_batch
    # SGLang's batches carry host copies of the lengths; tensors where they do not (CPU tests)
    prefix = getattr(fb, "extend_prefix_lens_cpu", None) or fb.extend_prefix_lens
    if folder and k is not None and fb.batch_size == 1 and int(prefix[0]) == 0:
        n = int((getattr(fb, "extend_seq_lens_cpu", None) or fb.extend_seq_lens)[0])
        port = sys.argv[sys.argv.index("--port") + 1] if "--port" in sys.argv else str(os.getpid())
        ids = getattr(fb, "input_ids", None)
        rec = _DUMPED.setdefault(n, {"layers": {}, "input_ids": None if ids is None else ids.detach().cpu()})
        if layer.layer_id not in rec["layers"]:  # a repeated layer id is a later extend of this length
            sinks = kwargs.get("sinks", args[1] if len(args) > 1 else None)
            lid = layer.layer_id
            rec["layers"][lid] = {
                "q": q.detach().float().cpu(), "k": k.detach().float().cpu(), "v": v.detach().float().cpu(),
                "o": out.detach().float().cpu(), "scaling": float(layer.scaling),
                "sliding_window": getattr(layer, "sliding_window_size", None), "tp_q_head_num": layer.tp_q_head_num,
                "tp_k_head_num": layer.tp_k_head_num, "qk_head_dim": layer.qk_head_dim, "v_head_dim": layer.v_head_dim,
                "sinks": None if sinks is None else sinks.detach().float().cpu(),
                "value_folded": lid in getattr(self, "folded", ()),
                "output_folded": lid in getattr(self, "output_folded", ())}
            os.makedirs(folder, exist_ok=True)
            torch.save({"input_ids": rec["input_ids"], "layers": rec["layers"], "argv": list(sys.argv)},
                       os.path.join(folder, f"kv_{port}_{n}.pt"))
    return out


DUMP_TARGET = ("sglang_oscar.backend.triton_backend.OscarTritonAttnBackend.forward_extend", _dump_extend_kv)

BATCH_INVARIANT_ENV = "OSCAR_E2E_BATCH_INVARIANT"


def _batch_invariant_gemms(original_fn, self, *args, **kwargs):
    """AROUND hook of ``ModelRunner.maybe_enable_batch_invariant_mode``: with
    ``$OSCAR_E2E_BATCH_INVARIANT`` the server runs SGLang's batch-invariant GEMMs
    (``srt/batch_invariant_ops``, what ``--enable-deterministic-inference`` turns on, a flag SGLang
    refuses with the ``dsa`` attention backend): a 64-row chunk then rounds as the whole prompt does,
    so chunked prefill and a radix hit see the rows a one-chunk prefill writes."""
    out = original_fn(self, *args, **kwargs)
    from sglang.srt.batch_invariant_ops import enable_batch_invariant_mode

    enable_batch_invariant_mode()
    return out


BATCH_INVARIANT_TARGET = ("sglang.srt.model_executor.model_runner.ModelRunner.maybe_enable_batch_invariant_mode",
                          _batch_invariant_gemms)

FP32_SHIM_HOOKS = (
    ("sglang.srt.layers.layernorm.RMSNorm.forward_cuda", _fp32_native),
    ("sglang.srt.layers.activation.SiluAndMul.forward_cuda", _fp32_native),
    # the Gemma families (--families gemma3,gemma4): their norms and GELU-tanh MLP
    ("sglang.srt.layers.layernorm.GemmaRMSNorm.forward_cuda", _fp32_native),
    ("sglang.srt.layers.layernorm.Gemma3RMSNorm.forward_cuda", _fp32_native),
    ("sglang.srt.layers.layernorm.Gemma4RMSNorm.forward_cuda", _fp32_native),
    ("sglang.srt.layers.activation.GeluAndMul.forward_cuda", _fp32_native),
    ("sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.forward_cuda", _fp32_native_rope),
    ("sglang.jit_kernel.norm.can_use_fused_inplace_qknorm", _no_fp32_jit_qknorm),
    ("sglang.srt.layers.rotary_embedding.base.RotaryEmbedding._compute_inv_freq", _cpu_inv_freq),
    ("sglang.srt.layers.rotary_embedding.rope_variant.Gemma4RotaryEmbedding._compute_inv_freq", _cpu_inv_freq),
    ("sglang.srt.layers.rotary_embedding.yarn.YaRNScalingRotaryEmbedding._compute_inv_freq", _cpu_inv_freq),  # GPT-OSS
    ("sglang.srt.models.gpt_oss.GptOssForCausalLM.__init__", _gpt_oss_weights_in_default_dtype),
    ("sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe.invoke_fused_moe_kernel", _fp32_moe_compute),
    ("sglang.srt.model_executor.model_runner.ModelRunner.__init__", _no_tf32_in_fp32),  # MiniMax-M2
    ("sglang.kernels.ops.attention.fla.chunk.chunk_gated_delta_rule", _fp32_chunk_gated_delta_rule),  # Qwen3-Next
    # Qwen3.5: its attention layers' fused q/k norm + RoPE kernel, and its M-RoPE (a subclass with its own forward_cuda)
    ("sglang.srt.models.qwen3_5.Qwen3_5AttentionDecoderLayer.forward_prepare_cuda_fused", _fp32_unfused_qk_rope_gate),
    ("sglang.srt.layers.rotary_embedding.mrope.MRotaryEmbedding.forward_cuda", _fp32_native_rope),
)


def fp32_shim_register() -> None:
    """SGLang plugin of the ``--dtype float32`` servers of check c (entry point ``oscar_e2e_fp32``):
    AROUND hooks :data:`FP32_SHIM_HOOKS`, and :data:`DUMP_TARGET` / :data:`BATCH_INVARIANT_TARGET` when
    their environment variables are set. Idempotent; without those, changes nothing for fp16/bf16 tensors."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = FP32_SHIM_HOOKS
    if os.environ.get(DUMP_ENV):
        hooks += (DUMP_TARGET,)
    if os.environ.get(BATCH_INVARIANT_ENV):
        hooks += (BATCH_INVARIANT_TARGET,)
    for target, hook in hooks:
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType.AROUND)


def fp32_shim_dir(work: str) -> str:
    return os.path.join(work, "fp32_shim")


def write_fp32_shim(path: str) -> str:
    """A minimal ``oscar_e2e_fp32-0.dist-info`` (METADATA + entry_points.txt) under ``path``, this
    file as ``path/oscar_e2e_fp32_shim.py`` and :mod:`.window_shim` as
    ``path/oscar_e2e_window_shim.py`` and :mod:`.dummy_shim` as ``path/oscar_e2e_dummy_shim.py``,
    which make :func:`fp32_shim_register`, ``hf_window_register`` and ``dummy_register``
    ``sglang.srt.plugins`` entry points of a process with ``path`` on its PYTHONPATH; returns ``path``."""
    from sglang_oscar.serving_launcher import write_plugin_folder

    from . import dummy_shim, window_shim

    return write_plugin_folder(
        path, FP32_SHIM_ENTRY,
        {FP32_SHIM_MODULE: __file__, window_shim.WINDOW_SHIM_MODULE: window_shim.__file__,
         dummy_shim.DUMMY_SHIM_MODULE: dummy_shim.__file__},
        {FP32_SHIM_ENTRY: FP32_SHIM_VALUE,
         window_shim.WINDOW_SHIM_ENTRY: f"{window_shim.WINDOW_SHIM_MODULE}:hf_window_register",
         dummy_shim.DUMMY_SHIM_ENTRY: f"{dummy_shim.DUMMY_SHIM_MODULE}:dummy_register"})


def fp32_server_env(work: str) -> dict[str, str]:
    """Environment of the fp32 servers: the shim's folder (:func:`write_fp32_shim`) first on
    PYTHONPATH, ``TRITON_F32_DEFAULT=ieee`` so that no Triton ``tl.dot`` on fp32 operands
    silently runs in TF32 (the INT2 kernels already ask for IEEE), ``$OSCAR_E2E_CPU_ROPE``
    (:func:`_cpu_inv_freq`: RoPE tables as the oracle's) and ``SGLANG_MAMBA_CONV_DTYPE=float32``:
    SGLang keeps the gated-DeltaNet conv-window state in bf16 whatever ``--dtype`` says, and with
    fp32 activations its prefill conv kernel (``_causal_conv1d_fwd_kernel``) then fails to compile
    (a bf16 state load and an fp32 zero tile in the two branches of one ``if``)."""
    return {"PYTHONPATH": _shim_path(work), "TRITON_F32_DEFAULT": "ieee", ROPE_ENV: "1",
            "SGLANG_MAMBA_CONV_DTYPE": "float32"}


def hf_window_server_env(work: str) -> dict[str, str]:
    """Environment of check b's BF16 baseline of a sliding-window family: the shim's folder first
    on PYTHONPATH and ``OSCAR_E2E_HF_WINDOW=1`` (:mod:`.window_shim`)."""
    from .window_shim import WINDOW_ENV

    return {"PYTHONPATH": _shim_path(work), WINDOW_ENV: "1"}


def _shim_path(work: str) -> str:
    from sglang_oscar.serving_launcher import pythonpath_with

    return pythonpath_with(fp32_shim_dir(work), os.environ.get("PYTHONPATH", ""))
