"""CPU tests of the device harness (``tests/e2e``): the fp32 shim plugin of check c's
``--dtype float32`` servers, and check c against fake servers that compute the oracle."""

from __future__ import annotations

import os

import pytest
import torch

from types import SimpleNamespace

from . import check_c, checkpoints, config, dummy_shim, fp32_shim, oracle, results, window_shim
from .run import Run, precompute

# ----------------------------------------------------------------------------- fp32 servers of check c


def test_fp32_shim_entry_point(tmp_path):
    from importlib.metadata import distributions

    shim = fp32_shim.write_fp32_shim(fp32_shim.fp32_shim_dir(str(tmp_path)))
    assert shim == str(tmp_path / "fp32_shim")
    eps = [ep for d in distributions(path=[shim]) for ep in d.entry_points if ep.group == "sglang.srt.plugins"]
    win = f"{window_shim.WINDOW_SHIM_MODULE}:{window_shim.hf_window_register.__name__}"
    dummy = f"{dummy_shim.DUMMY_SHIM_MODULE}:{dummy_shim.dummy_register.__name__}"
    assert [(ep.name, ep.value) for ep in eps] == [(fp32_shim.FP32_SHIM_ENTRY, fp32_shim.FP32_SHIM_VALUE),
                                                   (window_shim.WINDOW_SHIM_ENTRY, win),
                                                   (dummy_shim.DUMMY_SHIM_ENTRY, dummy)]
    mod, fn = fp32_shim.FP32_SHIM_VALUE.split(":")
    assert mod == fp32_shim.FP32_SHIM_MODULE and fn == fp32_shim.fp32_shim_register.__name__
    # the modules the entry points name sit next to the dist-info (first on the servers' PYTHONPATH)
    for name, src in ((mod, fp32_shim.__file__), (window_shim.WINDOW_SHIM_MODULE, window_shim.__file__),
                      (dummy_shim.DUMMY_SHIM_MODULE, dummy_shim.__file__)):
        with open(os.path.join(shim, name + ".py")) as copy, open(src) as original:
            assert copy.read() == original.read()


def test_gpt_oss_weights_follow_an_fp32_default_dtype():
    seen = []

    def init(self, config, *a, **k):
        seen.append(config.dtype)

    for default, cfg_dtype, want in ((torch.float32, torch.bfloat16, torch.float32),
                                     (torch.bfloat16, torch.bfloat16, torch.bfloat16)):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            fp32_shim._gpt_oss_weights_in_default_dtype(init, object(), SimpleNamespace(dtype=cfg_dtype))
        finally:
            torch.set_default_dtype(prev)
        assert seen[-1] == want


def test_fp32_servers_keep_ieee_gemms_where_sglang_turns_tf32_on():
    """SGLang 0.5.16's launch overrides turn TF32 matmuls on for MiniMax-M2 (its router GEMM); the
    shim turns them off again for --dtype float32 servers only, whichever way ModelRunner gets its
    server_args, before ModelRunner reads the flag."""
    import inspect

    from sglang.srt.arg_groups.overrides import _minimax_m2_overrides
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    assert _minimax_m2_overrides(SimpleNamespace(), None) == {"enable_tf32_matmul": True}
    # the hook's premise: ModelRunner.__init__ takes server_args and is where SGLang applies the flag
    assert "server_args" in inspect.signature(ModelRunner.__init__).parameters
    assert "enable_tf32_matmul" in inspect.getsource(ModelRunner.__init__)
    assert hasattr(ServerArgs, "override")
    seen = []

    def init(self, *a, server_args=None, **k):
        seen.append((server_args or a[0]).enable_tf32_matmul)

    for dtype, want in (("float32", False), ("bfloat16", True), ("auto", True)):
        fp32_shim._no_tf32_in_fp32(init, object(), server_args=SimpleNamespace(dtype=dtype, enable_tf32_matmul=True))
        fp32_shim._no_tf32_in_fp32(init, object(), SimpleNamespace(dtype=dtype, enable_tf32_matmul=True))
        assert seen[-2:] == [want, want], dtype

    class Strict(SimpleNamespace):  # ServerArgs in strict mode: fields change only through override()
        def __setattr__(self, name, value):
            if "enable_tf32_matmul" in self.__dict__:
                raise AttributeError(name)
            super().__setattr__(name, value)

        def override(self, source, **fields):
            self.__dict__.update(fields, source=source)

    sa = Strict(dtype="float32", enable_tf32_matmul=True)
    fp32_shim._no_tf32_in_fp32(init, object(), server_args=sa)
    assert seen[-1] is False and sa.source == "oscar-e2e-fp32-shim"


def test_window_shim_widens_only_sglangs_own_sliding_backend(monkeypatch):
    TritonAttnBackend = type("TritonAttnBackend", (), {})
    Subclass = type("OscarTritonAttnBackend", (TritonAttnBackend,), {})
    for cls, sws, want in ((TritonAttnBackend, 63, 64), (TritonAttnBackend, None, None), (TritonAttnBackend, -1, -1),
                           (Subclass, 63, 63)):
        be = cls()
        be.sliding_window_size = sws
        assert window_shim._decode_reads_w_keys("r", be) == "r" and be.sliding_window_size == want
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.delenv(window_shim.WINDOW_ENV, raising=False)
    before = list(HookRegistry._hooks.get(window_shim.WINDOW_SHIM_TARGET, ()))
    window_shim.hf_window_register()  # without the env var: nothing registered
    assert list(HookRegistry._hooks.get(window_shim.WINDOW_SHIM_TARGET, ())) == before


def test_fp32_shim_hooks_route_only_fp32():
    class Op:
        def forward_native(self, *a, **k):
            return ("native", a, k)

    def orig(*a, **k):
        return ("cuda", a, k)

    op = Op()
    x32, x16 = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16)
    assert fp32_shim._fp32_native(orig, op, x32, "res")[0] == "native"
    assert fp32_shim._fp32_native(orig, op, x16, "res")[0] == "cuda"
    pos = torch.arange(2)
    assert fp32_shim._fp32_native_rope(orig, op, pos, x32, x32)[0] == "native"
    assert fp32_shim._fp32_native_rope(orig, op, pos, x16, x16)[0] == "cuda"
    assert fp32_shim._fp32_native_rope(orig, op, pos, x32, x32, fused_set_kv_buffer_arg=object())[0] == "cuda"
    assert fp32_shim._fp32_native_rope(orig, op, pos, x32, x32, None, object())[0] == "cuda"
    layer = SimpleNamespace(forward_prepare_native=lambda p, h: ("native", p, h))
    fused = lambda self, p, h: ("fused", p, h)  # noqa: E731  (Qwen3.5's fused q/k norm + RoPE: bf16 rounding)
    assert fp32_shim._fp32_unfused_qk_rope_gate(fused, layer, pos, x32) == ("native", pos, x32)
    assert fp32_shim._fp32_unfused_qk_rope_gate(fused, layer, pos, x16)[0] == "fused"
    assert fp32_shim._no_fp32_jit_qknorm(lambda d, t: "probe", 128, torch.float32) is False
    assert fp32_shim._no_fp32_jit_qknorm(lambda d, t: "probe", 128, torch.bfloat16) == "probe"
    import triton.language as tl

    seen = []
    launch = lambda A, *a, **k: seen.append(k["compute_type"])  # noqa: E731
    fp32_shim._fp32_moe_compute(launch, x32, compute_type=tl.float16)
    fp32_shim._fp32_moe_compute(launch, x16, compute_type=tl.bfloat16)
    assert seen == [tl.float32, tl.bfloat16]
    assert fp32_shim.FP32_FAMILY_ARGS["gpt_oss"] == ["--moe-runner-backend", "triton"]
    for target, hook in fp32_shim.FP32_SHIM_HOOKS + (fp32_shim.DUMP_TARGET,):  # every target exists
        import pkgutil

        obj_path, attr = target.rsplit(".", 1)
        assert callable(getattr(pkgutil.resolve_name(obj_path), attr)), target
    obj_path, attr = window_shim.WINDOW_SHIM_TARGET.rsplit(".", 1)
    assert callable(getattr(pkgutil.resolve_name(obj_path), attr))


def test_fp32_gated_deltanet_prefill_runs_sglangs_function_in_ieee(monkeypatch, tmp_path):
    """The fp32 servers' gated-DeltaNet hook: fp32 inputs skip the original's fp32 assert and run
    SGLang's own ``ChunkGatedDeltaRuleFunction`` with the original's arguments and default scale, its
    block-merge dots switched to IEEE; bf16 inputs call the original untouched. The servers' environment
    makes SGLang keep the conv-window state in fp32 (its prefill conv kernel does not compile with a
    bf16 state and fp32 activations)."""
    import triton.language as tl
    from sglang.kernels.ops.attention.fla import chunk, chunk_fwd
    from sglang.srt.configs.mamba_utils import mamba2_state_dtype

    calls = []

    class Fn:
        @staticmethod
        def apply(*a):
            calls.append(a)
            return "o", "h"

    monkeypatch.setattr(chunk, "ChunkGatedDeltaRuleFunction", Fn)
    monkeypatch.setattr(chunk_fwd, "_MERGE_DOT_PRECISION", tl.constexpr("tf32"))
    q, k, v = (torch.zeros(1, 5, 2, 64) for _ in range(3))
    g, beta = torch.zeros(1, 5, 2), torch.zeros(1, 5, 2)
    state, idx, cu = torch.zeros(3, 2, 64, 64), torch.tensor([2]), torch.tensor([0, 5])

    def original(*a, **kw):
        return ("original", a, kw)

    with pytest.raises(AssertionError, match="float32"):  # what the hook works around
        chunk.chunk_gated_delta_rule(q, k, v, g, beta)
    got = fp32_shim._fp32_chunk_gated_delta_rule(original, q, k, v, g, beta, initial_state=state,
                                                 initial_state_indices=idx, cu_seqlens=cu,
                                                 use_qk_l2norm_in_kernel=True)
    assert got == ("o", None, "h") and chunk_fwd._MERGE_DOT_PRECISION.value == "ieee"
    assert len(calls) == 1 and calls[0][:5] == (q, k, v, g, beta) and calls[0][5] == 64 ** -0.5
    assert calls[0][6:] == (state, idx, cu, True)
    b16 = [t.to(torch.bfloat16) for t in (q, k, v)]
    got = fp32_shim._fp32_chunk_gated_delta_rule(original, *b16, g, beta, scale=0.5, cu_seqlens=cu)
    assert got[0] == "original" and got[2]["scale"] == 0.5 and got[2]["cu_seqlens"] is cu and len(calls) == 1
    env = fp32_shim.fp32_server_env(str(tmp_path))
    assert env["SGLANG_MAMBA_CONV_DTYPE"] == "float32" and env["TRITON_F32_DEFAULT"] == "ieee"
    monkeypatch.setenv("SGLANG_MAMBA_CONV_DTYPE", env["SGLANG_MAMBA_CONV_DTYPE"])
    assert mamba2_state_dtype().conv == torch.float32
    monkeypatch.delenv("SGLANG_MAMBA_CONV_DTYPE")
    assert mamba2_state_dtype().conv == torch.bfloat16  # SGLang's default, whatever --dtype says


def test_cpu_inv_freq_matches_transformers(monkeypatch):
    """$OSCAR_E2E_CPU_ROPE: SGLang's inverse frequencies (default and Gemma-4's proportional RoPE)
    are computed on the CPU whatever the default device, land on that device, and equal the
    oracle's (transformers') bit for bit; without the variable the original runs where it would."""
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding
    from sglang.srt.layers.rotary_embedding.rope_variant import Gemma4RotaryEmbedding

    cfg = Gemma4TextConfig(head_dim=128, global_head_dim=256, num_attention_heads=8, num_key_value_heads=2)
    full = cfg.rope_parameters["full_attention"]
    hf_full, _ = ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu", layer_type="full_attention", head_dim_key="global_head_dim")
    sliding_theta = cfg.rope_parameters["sliding_attention"]["rope_theta"]
    hf_sliding, _ = Gemma4TextRotaryEmbedding.compute_default_rope_parameters(cfg, "cpu", layer_type="sliding_attention")
    angles = int(full["partial_rotary_factor"] * 256) // 2
    g4 = SimpleNamespace(rope_angles=angles, nope_angles=128 - angles, head_size=256)
    plain = SimpleNamespace(rotary_dim=128)
    seen = []

    def on(fn):
        return lambda self, *a: (seen.append(torch.get_default_device().type), fn(self, *a))[1]

    monkeypatch.setattr(fp32_shim, "os", SimpleNamespace(environ={fp32_shim.ROPE_ENV: "1"}))
    with torch.device("meta"):
        moved = fp32_shim._cpu_inv_freq(on(Gemma4RotaryEmbedding._compute_inv_freq), g4, full["rope_theta"])
    assert moved.device.type == "meta" and seen == ["cpu"]
    assert torch.equal(fp32_shim._cpu_inv_freq(Gemma4RotaryEmbedding._compute_inv_freq, g4, full["rope_theta"]), hf_full)
    import sglang.srt.layers.rotary_embedding.base as rope_base

    monkeypatch.setattr(rope_base, "get_server_args", lambda: SimpleNamespace(rl_on_policy_target=None))
    assert torch.equal(fp32_shim._cpu_inv_freq(RotaryEmbedding._compute_inv_freq, plain, sliding_theta), hf_sliding)
    monkeypatch.setattr(fp32_shim, "os", SimpleNamespace(environ={}))
    with torch.device("meta"):
        fp32_shim._cpu_inv_freq(on(Gemma4RotaryEmbedding._compute_inv_freq), g4, full["rope_theta"])
    assert seen == ["cpu", "meta"]


def test_dump_hook_saves_the_first_whole_prompt_extend(tmp_path, monkeypatch):
    """$OSCAR_E2E_DUMP_KV: the rows of each layer of the first prefix-free extend of a length are
    saved once (a later extend of that length, a cached prefix or a batch of two is left alone)."""
    monkeypatch.setenv(fp32_shim.DUMP_ENV, str(tmp_path))
    monkeypatch.setattr(fp32_shim, "_DUMPED", {})
    monkeypatch.setattr("sys.argv", ["launch_server", "--port", "31000"])
    calls = []
    orig = lambda self, q, k, v, layer, fb, *a, **kw: calls.append(layer.layer_id) or q * 2  # noqa: E731

    def fb(n, prefix=0, bs=1):
        return SimpleNamespace(batch_size=bs, extend_prefix_lens_cpu=[prefix] * bs, extend_seq_lens_cpu=[n] * bs,
                               input_ids=torch.arange(n * bs))

    rows = {lid: [torch.randn(5, 8), torch.randn(5, 4), torch.randn(5, 4)] for lid in (0, 1)}
    def layer(lid):
        return SimpleNamespace(layer_id=lid, scaling=0.5, sliding_window_size=63 if lid == 0 else None,
                               tp_q_head_num=2, tp_k_head_num=1, qk_head_dim=4, v_head_dim=4)

    for lid in (0, 1):
        out = fp32_shim._dump_extend_kv(orig, None, *rows[lid], layer(lid), fb(5))
        assert torch.equal(out, rows[lid][0] * 2)
    for later in (fb(5), fb(5, prefix=2), fb(5, bs=2)):  # none of these may overwrite the first rows
        fp32_shim._dump_extend_kv(orig, None, *(r + 1 for r in rows[0]), layer(0), later)
    d = torch.load(tmp_path / "kv_31000_5.pt")
    assert calls == [0, 1, 0, 0, 0] and torch.equal(d["input_ids"], torch.arange(5))
    for lid in (0, 1):
        got = d["layers"][lid]
        assert [torch.equal(got[n], r) for n, r in zip("qkv", rows[lid])] == [True] * 3
        assert torch.equal(got["o"], rows[lid][0] * 2) and got["sliding_window"] == (63 if lid == 0 else None)


@pytest.mark.parametrize("folded", [False, True], ids=["runtime", "folded"])
def test_dump_of_the_served_backend_replays_to_its_output(tmp_path, monkeypatch, folded):
    """The K/V dump of a real (CPU) served backend, Gemma-4-like hybrid pool (sliding 2 kv heads x
    64, window 16; full 1 x 128), fp32 HP tier and pairs: ``scripts/served_kv_diff.py``'s replay of
    each dumped layer equals the output the backend returned (rel. L2 < 1e-5). With the fold on,
    V arrives rotated and the output leaves rotated: the replay takes both back from the flags."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from _support.orthogonal import random_orthogonal
    from plugin.test_served_pools import HQ, Served, _layer
    from scripts.served_kv_diff import per_head, replay

    from sglang_oscar.config import OscarConfig

    monkeypatch.setenv(fp32_shim.DUMP_ENV, str(tmp_path))
    monkeypatch.setattr(fp32_shim, "_DUMPED", {})
    monkeypatch.setattr("sys.argv", ["launch_server", "--port", "31000"])
    gen = torch.Generator().manual_seed(5)
    layers = [_layer(0, 1, 128, 0), _layer(1, 2, 64, 16)]
    rot = {lay.layer_id: (random_orthogonal(lay.qk_head_dim, lay.tp_k_head_num, generator=gen),
                          random_orthogonal(lay.v_head_dim, lay.tp_k_head_num, generator=gen)) for lay in layers}
    config = OscarConfig(group_size=32, sink_tokens=4, recent_tokens=8, scale_dtype="float32")
    sv = Served(config, layers, rot, hybrid=True, hp_dtype=torch.float32)
    if folded:
        sv.be.folded = sv.be.output_folded = frozenset({0, 1})
    t = 40
    seqs = {lay.layer_id: (torch.randn(t, HQ, lay.qk_head_dim, generator=gen),
                           torch.randn(t, lay.tp_k_head_num, lay.qk_head_dim, generator=gen),
                           torch.randn(t, lay.tp_k_head_num, lay.v_head_dim, generator=gen)) for lay in layers}
    if folded:  # a folded v_proj emits V in the rotated frame
        seqs = {i: (q, k, torch.einsum("thd,hde->the", v, per_head(rot[i][1], v.shape[1])))
                for i, (q, k, v) in seqs.items()}
    backend_cls = type(sv.be)
    original = backend_cls.forward_extend
    monkeypatch.setattr(backend_cls, "forward_extend",
                        lambda self, *a, **k: fp32_shim._dump_extend_kv(original, self, *a, **k))
    outs = sv.extend(1, seqs, 0, t)
    d = torch.load(tmp_path / f"kv_31000_{t}.pt")
    for lay in layers:
        got = d["layers"][lay.layer_id]
        assert got["value_folded"] is folded and got["output_folded"] is folded
        ref = replay(got, *rot[lay.layer_id], None, None, config).reshape(t, HQ, -1)
        assert torch.equal(got["o"].reshape(t, HQ, -1), outs[lay.layer_id])
        err = float((ref - outs[lay.layer_id]).norm() / ref.norm())
        assert err < 1e-5, (lay.layer_id, err)


def test_batch_invariant_hook_turns_sglangs_mode_on_only_when_asked(monkeypatch):
    """$OSCAR_E2E_BATCH_INVARIANT: the shim hooks SGLang's ``maybe_enable_batch_invariant_mode`` (a
    method that exists) to run it, then turn SGLang's batch-invariant GEMMs on; without the variable
    the hook is not registered."""
    import collections
    import pkgutil

    import sglang.srt.batch_invariant_ops as bio
    from sglang.srt.plugins.hook_registry import HookRegistry

    target, hook = fp32_shim.BATCH_INVARIANT_TARGET
    obj_path, attr = target.rsplit(".", 1)
    assert callable(getattr(pkgutil.resolve_name(obj_path), attr))
    calls = []
    monkeypatch.setattr(bio, "enable_batch_invariant_mode", lambda: calls.append("enable"))
    assert hook(lambda self: calls.append("original") or 7, object()) == 7 and calls == ["original", "enable"]
    monkeypatch.setattr(HookRegistry, "_hooks", collections.defaultdict(list))  # a registry of this test's own
    monkeypatch.delenv(fp32_shim.BATCH_INVARIANT_ENV, raising=False)
    fp32_shim.fp32_shim_register()
    assert target not in HookRegistry._hooks
    monkeypatch.setenv(fp32_shim.BATCH_INVARIANT_ENV, "1")
    fp32_shim.fp32_shim_register()
    assert [h for _, h, _ in HookRegistry._hooks[target]] == [hook]


def test_fp32_shim_loads_as_sglang_plugin(tmp_path):
    """A fresh interpreter with the shims' folder first on PYTHONPATH: SGLang's own plugin loader
    finds both entry points and applies their hooks -- an fp32 RMSNorm.forward_cuda then runs
    forward_native (on CPU; the upstream CUDA path would call flashinfer's fp16/bf16-only rmsnorm),
    Qwen3.5's fused q/k norm + RoPE and SGLang's M-RoPE are hooked too, and with
    OSCAR_E2E_HF_WINDOW=1 (check b's baseline) the window hook lands on SGLang's Triton backend.
    One interpreter for both: importing SGLang takes most of the time."""
    import subprocess
    import sys

    work = str(tmp_path)
    fp32_shim.write_fp32_shim(fp32_shim.fp32_shim_dir(work))
    env = {**os.environ, **fp32_shim.fp32_server_env(work), **fp32_shim.hf_window_server_env(work),
           "SGLANG_PLUGINS": f"{fp32_shim.FP32_SHIM_ENTRY},{window_shim.WINDOW_SHIM_ENTRY}"}
    code = "\n".join([
        "import torch",
        "from sglang.srt.plugins import load_plugins",
        "load_plugins()",
        "from sglang.srt.layers.layernorm import RMSNorm",
        "from sglang.jit_kernel.norm import can_use_fused_inplace_qknorm",
        "from sglang.srt.layers.attention.triton_backend import TritonAttnBackend",
        "assert hasattr(RMSNorm.forward_cuda, '__wrapped__'), 'RMSNorm.forward_cuda not hooked'",
        "assert hasattr(TritonAttnBackend.__init__, '__wrapped__'), 'TritonAttnBackend.__init__ not hooked'",
        "from sglang.srt.models.qwen3_5 import Qwen3_5AttentionDecoderLayer",
        "from sglang.srt.layers.rotary_embedding.mrope import MRotaryEmbedding",
        "assert hasattr(Qwen3_5AttentionDecoderLayer.forward_prepare_cuda_fused, '__wrapped__'), 'Qwen3.5 not hooked'",
        "assert hasattr(MRotaryEmbedding.forward_cuda, '__wrapped__'), 'MRotaryEmbedding.forward_cuda not hooked'",
        "n = RMSNorm(8, eps=1e-6)",
        "n.weight.data.uniform_(0.5, 1.5)",
        "x, r = torch.randn(3, 8), torch.randn(3, 8)",
        "assert torch.equal(n.forward_cuda(x), n.forward_native(x))",
        "a, b = n.forward_cuda(x, r)",
        "c, d = n.forward_native(x, r)",
        "assert torch.equal(a, c) and torch.equal(b, d)",
        "assert can_use_fused_inplace_qknorm(128, torch.float32) is False",
        "print('SHIM_OK')",
    ])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path), check=False)
    assert out.returncode == 0 and "SHIM_OK" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


# ----------------------------------------------------------------------------- check c (fake servers)


class _FakeServer:
    """Answers /generate like an int2 (``rotation``) or plain server would if it computed exactly
    the oracle / HF model in this process: arbitrary new tokens, their teacher-forced log-probs."""

    def __init__(self, name, model, rotation=None, config=None, hp_dtype=None):
        from types import SimpleNamespace

        self.model, self.rotation, self.config, self.hp = model, rotation, config, hp_dtype
        self.spec = SimpleNamespace(name=name)
        self.t_ready, self.error, self.log_path = 1.0, None, "-"

    def alive(self):
        return True

    def log_text(self):
        return ""

    def generate(self, payload, timeout=None):
        ids = list(payload["input_ids"])
        new = checkpoints.random_prompt(payload["sampling_params"]["max_new_tokens"], len(ids), vocab=256)
        lp = oracle.teacher_forced_logprobs(self.model, [ids + new], rotation=self.rotation, config=self.config,
                                          prompt_lens=[len(ids)], hp_dtype=self.hp)[0]
        meta = {"output_token_logprobs": [[lp[len(ids) - 1 + j], t, None] for j, t in enumerate(new)],
                "completion_tokens": len(new), "finish_reason": {"type": "length"}}
        if payload.get("logprob_start_len") == 0:
            meta["input_token_logprobs"] = [[None, ids[0], None]] + [[lp[i], ids[i + 1], None] for i in range(len(ids) - 1)]
        return {"output_ids": new, "meta_info": meta}


def _identity_c_run(family: str, path: str, out, argv: list) -> Run:
    """A Run of check c (``argv`` after ``--only c``) on ``family``'s checkpoint at ``path`` with identity
    rotation files, its references from precompute()."""
    from sglang_oscar.calibrate.model import geometry_of
    from sglang_oscar.rotation import RotationSet

    run = Run(config.parse_args(["--only", "c", "--out", str(out / "out"), *argv]))
    run.models[family] = path
    run.hf[family] = checkpoints.load_hf(path, "cpu")
    ident = RotationSet.data_free(geometry_of(run.hf[family].config), "identity")
    for kind in ("layer", "head"):
        run.rot[f"{family}:{kind}"] = str(out / f"rot_{kind}.safetensors")
        ident.save(run.rot[f"{family}:{kind}"])
    precompute(run)
    return run


@pytest.fixture(scope="module")
def c_run(tiny_qwen3, tmp_path_factory):
    """A Run of check c with --c-fp32 on the tiny checkpoint: references from precompute()."""
    path, _ = tiny_qwen3
    return _identity_c_run("qwen3", path, tmp_path_factory.mktemp("c_run"),
                           ["--c-fp32", "--c-prompt-lens", "40,64", "--c-decode-tokens", "4"])


def _c_servers(run, fp32_hp=torch.float32, fp32_cfg=None):
    cfg, cfg32 = run.data["c_config"], fp32_cfg or run.data["c_config_fp32"]
    srv = {"qwen3-bf16": _FakeServer("qwen3-bf16", run.hf["qwen3"]),
           fp32_shim.C_FP32_FLOOR: _FakeServer(fp32_shim.C_FP32_FLOOR, run.hf["qwen3-fp32"])}
    for kind in ("layer", "head"):
        rs = run.data[f"c_rot_{kind}"]
        srv[f"qwen3-int2-{kind}"] = _FakeServer(f"qwen3-int2-{kind}", run.hf["qwen3"], rs, cfg)
        name = fp32_shim.C_FP32_SERVERS[kind]
        srv[name] = _FakeServer(name, run.hf["qwen3-fp32"], rs, cfg32, fp32_hp)
    return srv


def test_check_c_fp32_criterion(c_run):
    import torch as _t

    run = c_run
    assert run.hf["qwen3-fp32"].dtype == _t.float32 and run.hf["qwen3"].dtype == _t.bfloat16
    assert {"c_hf_fp32", "c_oracle_fp32_layer", "c_oracle_fp32_head", "c_oracle_layer", "c_hf_bf16"} <= set(run.data)
    run.servers = _c_servers(run)
    res = check_c.check_c(run)
    assert res.status == config.PASS, res.measured
    d = res.detail
    assert d["settings"]["criterion"] == "fp32" and d["bf16_pass"] is True
    for kind in ("layer", "head"):
        assert d["fp32"][kind]["prefill_mean"] == 0 and d["fp32"][kind]["decode_mean"] == 0
        assert d["fp32"][kind]["server"] == fp32_shim.C_FP32_SERVERS[kind] and d[kind]["server"] == f"qwen3-int2-{kind}"
        assert d["fp32"][kind]["quantization_effect_mean"] > 1e-3 and d[kind]["prefill_mean"] == 0
        assert all(r["decode_vs_oracle"]["n"] == 4 for r in d["fp32"][kind]["rows"])
    assert d["fp32"]["noise_floor_mean"] == 0 and d["bf16_noise_floor_mean"] == 0
    assert "--dtype float32 servers" in res.measured and "BF16 servers (reported" in res.measured
    # reported: the fp32 oracle against the same oracle on the model in fp64, per prompt
    assert run.hf["qwen3-fp64"].dtype == _t.float64
    spread = [x for k in ("layer", "head") for p in ("prefill", "decode") for x in d["fp32"][k]["oracle_fp64_spread"][p]]
    assert len(spread) == 8 and all(0 <= x < 0.5 for x in spread) and max(spread) > 0
    assert "layer: served 0,0 / 0,0, oracle fp64" in res.measured
    saved = run.hf["qwen3-fp64"], run.data["c_oracle_fp64_layer"], run.data["c_oracle_fp64_head"]
    try:  # the fp32 model in the fp64 slot: the spread is exactly zero
        run.hf["qwen3-fp64"] = run.hf["qwen3-fp32"]
        for kind in ("layer", "head"):
            run.data[f"c_oracle_fp64_{kind}"] = run.data[f"c_oracle_fp32_{kind}"]
        same = check_c.check_c(run).detail["fp32"]
        assert all(x == 0 for k in ("layer", "head") for p in ("prefill", "decode") for x in same[k]["oracle_fp64_spread"][p])
    finally:
        run.hf["qwen3-fp64"], run.data["c_oracle_fp64_layer"], run.data["c_oracle_fp64_head"] = saved
    # an fp32 server whose windows held BF16 rows would not match the fp32 references
    run.servers = _c_servers(run, fp32_hp=None)
    off = check_c.check_c(run)
    assert off.detail["fp32"]["layer"]["prefill_mean"] > 0 and off.detail["layer"]["prefill_mean"] == 0
    # nor one that stored fp16 (scale, zero) pairs: the fp32 criterion's references use fp32 pairs
    assert run.data["c_config_fp32"].scale_dtype == "float32"
    run.servers = _c_servers(run, fp32_cfg=run.data["c_config"])
    fp16_pairs = check_c.check_c(run)
    assert fp16_pairs.detail["fp32"]["layer"]["prefill_mean"] > 0 and fp16_pairs.detail["layer"]["prefill_mean"] == 0
    # a missing fp32 server: c fails, the BF16 comparison is still reported
    run.servers = {k: v for k, v in _c_servers(run).items() if k != fp32_shim.C_FP32_SERVERS["head"]}
    miss = check_c.check_c(run)
    assert miss.status == config.FAIL and "fp32 comparison could not be evaluated" in miss.measured
    assert miss.detail["bf16_pass"] is True and "error" in miss.detail["fp32"]


def test_check_c_without_fp32_keeps_the_bf16_criterion(c_run):
    import argparse

    run = c_run
    saved = run.args
    run.args = argparse.Namespace(**{**vars(saved), "c_fp32": False})
    try:
        run.servers = {k: v for k, v in _c_servers(run).items() if not k.endswith("fp32")}
        res = check_c.check_c(run)
        assert res.status == config.PASS and "fp32" not in res.detail and res.detail["settings"]["criterion"] == "bf16"
        assert res.measured.startswith("mean |served - oracle| logprob: layer: prefill 0, decode 0")
        del run.servers["qwen3-int2-head"]
        with pytest.raises(results.CheckError):  # as before: run_check reports "could not be evaluated"
            check_c.check_c(run)
    finally:
        run.args = saved


def test_check_c_on_a_sliding_window_family(tmp_path):
    """--families gemma4 --c-fp32: precompute fills gemma4's own references (a prompt 4x the window
    leads c's prompts) and check c compares the ``gemma4-*`` servers with them."""
    from .tiny import TINY_SWA

    path = str(tmp_path / "g4")
    checkpoints.build_checkpoint("gemma4", path, seed=3, **TINY_SWA)
    run = _identity_c_run("gemma4", path, tmp_path, ["--c-fp32", "--families", "gemma4", "--c-prompt-lens", "40",
                                                     "--c-decode-tokens", "2"])
    d = run.fdata("gemma4")
    assert [len(p) for p in d["c_prompts"]] == [4 * config.SWA_WINDOW, 40] and "c_prompts" not in run.data
    cfg = run.data["c_config"]
    srv = {"gemma4-bf16": _FakeServer("gemma4-bf16", run.hf["gemma4"]),
           fp32_shim.fp32_name("gemma4"): _FakeServer("gemma4-fp32", run.hf["gemma4-fp32"])}
    for kind in ("layer", "head"):
        srv[f"gemma4-int2-{kind}"] = _FakeServer(f"gemma4-int2-{kind}", run.hf["gemma4"], d[f"c_rot_{kind}"], cfg)
        srv[fp32_shim.fp32_name("gemma4", kind)] = _FakeServer("f", run.hf["gemma4-fp32"], d[f"c_rot_{kind}"],
                                                               run.data["c_config_fp32"], torch.float32)
    run.servers = srv
    res = check_c.check_c(run)
    assert res.status == config.PASS, res.measured
    assert res.detail["settings"]["prompt_lens"] == [256, 40] and res.detail["fp32"]["layer"]["prefill_mean"] == 0
    assert res.detail["fp32"]["layer"]["quantization_effect_mean"] > 1e-3


@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_next", "qwen3_5"])
def test_check_c_on_sink_and_hybrid_families(tiny_family, tmp_path, monkeypatch, name):
    """--families gpt_oss / qwen3_next / qwen3_5: precompute fills the family's own references (gpt_oss, a
    sliding-window family, leads with a prompt 4x the window: the tiny model's window 16 here) with
    the oracle on its attention layers (GPT-OSS: with the layers' sinks), and check c compares the
    family's servers with them."""
    path, _ = tiny_family(name)
    monkeypatch.setattr(config, "SWA_WINDOW", 16)  # TINY_SWA's window: a 64-token lead prompt
    run = _identity_c_run(name, path, tmp_path, ["--families", name, "--c-prompt-lens", "40", "--c-decode-tokens", "2"])
    d = run.fdata(name)
    assert [len(p) for p in d["c_prompts"]] == ([4 * config.SWA_WINDOW] if name == "gpt_oss" else []) + [40]
    cfg = run.data["c_config"]
    srv = {f"{name}-bf16": _FakeServer(f"{name}-bf16", run.hf[name])}
    for kind in ("layer", "head"):
        srv[f"{name}-int2-{kind}"] = _FakeServer(f"{name}-int2-{kind}", run.hf[name], d[f"c_rot_{kind}"], cfg)
    run.servers = srv
    res = check_c.check_c(run)
    assert res.status == config.PASS, res.measured
    # the oracle quantizes: its references are not the BF16 model's
    assert max(abs(a - b) for a, b in zip(d["c_oracle_layer"][-1], d["c_hf_bf16"][-1])) > 1e-2


def test_fp64_oracle_of_a_moe_family_runs_and_a_failure_is_not_fatal(tiny_family, tmp_path, monkeypatch):
    """--c-fp32 on GPT-OSS: the fp64 oracle runs its MoE experts eagerly (transformers' grouped GEMM
    has no fp64 kernel) and c gets the fp64 spread; a model that still fails in fp64 records why and
    c reports no spread instead of stopping the run, the fp32 references still there."""
    from . import run as run_mod

    path, _ = tiny_family("gpt_oss")
    monkeypatch.setattr(config, "SWA_WINDOW", 16)
    argv = ["--c-fp32", "--families", "gpt_oss", "--c-prompt-lens", "40", "--c-decode-tokens", "2"]
    (tmp_path / "ok").mkdir(), (tmp_path / "fail").mkdir()
    run = _identity_c_run("gpt_oss", path, tmp_path / "ok", argv)
    d = run.fdata("gpt_oss")
    assert "c_fp64_error" not in d and run.hf["gpt_oss-fp64"].dtype == torch.float64
    for kind in ("layer", "head"):  # the same oracle in fp64 and fp32: equal to well under c's tolerance
        for a, b in zip(d[f"c_oracle_fp64_{kind}"], d[f"c_oracle_fp32_{kind}"]):
            assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-2

    real = run_mod.load_hf

    def no_fp64(path, device, dtype=None, **kw):
        if dtype == torch.float64:
            raise RuntimeError("Expected mat_a to be Float32, BFloat16 or Float16 matrix, got Double")
        return real(path, device, dtype=dtype, **kw)

    monkeypatch.setattr(run_mod, "load_hf", no_fp64)
    run = _identity_c_run("gpt_oss", path, tmp_path / "fail", argv)
    d = run.fdata("gpt_oss")
    assert "Double" in d["c_fp64_error"] and "gpt_oss-fp64" not in run.hf
    assert "c_oracle_fp64_layer" not in d and len(d["c_oracle_fp32_layer"]) == len(d["c_prompts"])
