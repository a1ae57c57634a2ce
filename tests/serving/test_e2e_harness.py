"""CPU tests of the device harness scripts/gpu_e2e.py: everything but the servers themselves."""

from __future__ import annotations

import http.server
import json
import math
import os
import shlex
import threading
import time

import pytest
import torch
from e2e_tiny import TINY

# ----------------------------------------------------------------------------- arguments


def test_parse_args_defaults_and_selection(e2e, tmp_path):
    a = e2e.parse_args(["--out", str(tmp_path)])
    assert a.checks == list("abcdefgi")  # h only with --tp2
    assert a.work == str(tmp_path) + "_work"  # checkpoints stay out of the results folder
    assert a.c_prompt_lens == [1024, 1800]
    assert e2e.parse_args(["--tp2"]).checks == list("abcdefghi")
    assert e2e.parse_args(["--only", "c,a"]).checks == ["a", "c"]
    assert e2e.parse_args(["--only", "gfd"]).checks == ["d", "f", "g"]
    assert e2e.parse_args(["--only", "h", "--tp2"]).checks == ["h"]
    assert e2e.parse_args(["--only", "c", "--c-prompt-lens", "64,128"]).c_prompt_lens == [64, 128]
    assert a.c_fp32 is False and e2e.parse_args(["--only", "c", "--c-fp32"]).c_fp32 is True
    assert a.b_lens == list(e2e.B_LENS) and a.d_lens == list(e2e.D_LENS) and a.h_lens == list(e2e.H_LENS)
    for bad in (["--only", "h"], ["--only", "a,z"], ["--only", ""], ["--load-min-len", "900", "--load-max-len", "100"],
                ["--b-lens", "40,1020"], ["--d-lens", "x"], ["--c-prompt-lens", "1"]):
        with pytest.raises(SystemExit):
            e2e.parse_args(bad)


def test_server_specs_and_commands(e2e, tmp_path):
    args = e2e.parse_args(["--tp2", "--out", str(tmp_path)])
    rot = {f"{m}:{k}": f"/r/{m}_{k}.safetensors" for m in ("qwen3", "moe", "llama")
           for k in ("layer", "head", "identity", "mismatch")}
    specs = e2e.server_specs(args, rot)
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    ports = [s.port for s in specs]
    assert len(set(ports)) == len(ports) and min(ports) == args.base_port
    by = {s.name: s for s in specs}
    # every check is served; phase 2 holds exactly the servers that must run alone
    assert set("".join(s.checks for s in specs)) == set("abcdefghi")
    assert {s.name for s in specs if s.phase == 2} == {"qwen3-int2-head-tp2", "long-bf16", "long-int2"}
    allowed = by["qwen3-plugin-off"].env["SGLANG_PLUGINS"].split(",")
    assert allowed and "oscar" not in allowed and set(allowed) >= set(e2e.plugin_entry_point()["others"])
    assert by["qwen3-bf16"].checks == "abc"  # shared by a, b and c
    for s in specs:
        cmd = e2e.launch_command(s, "/m", "python")
        assert cmd.count("--attention-backend") == 1
        assert cmd[cmd.index("--port") + 1] == str(s.port)
        assert "--max-running-requests" in cmd  # bounds the INT2 ring/sink arenas
        if s.phase == 1:
            assert cmd[cmd.index("--max-total-tokens") + 1] == str(s.pool_tokens)
        if "int2" in s.args:
            assert cmd[cmd.index("--kv-cache-dtype") + 1] == "int2"
    # the sizing pair: same fraction, no pool cap, group 128 for int2
    lb, li = e2e.launch_command(by["long-bf16"], "/m"), e2e.launch_command(by["long-int2"], "/m")
    assert "--max-total-tokens" not in lb + li
    assert lb[lb.index("--mem-fraction-static") + 1] == li[li.index("--mem-fraction-static") + 1] == "0.5"
    assert li[li.index("--kv-cache-quant-group-size") + 1] == "128" and "--kv-cache-dtype" not in lb
    fi = e2e.launch_command(by["bad-flag-flashinfer"], "/m")
    assert fi[fi.index("--attention-backend") + 1] == "flashinfer"
    # BF16 logits of the tiny models tie: every server computes float32 logits unless asked not to
    assert all("--enable-fp32-lm-head" in s.args for s in specs)
    plain = e2e.server_specs(e2e.parse_args(["--only", "a", "--no-fp32-lm-head", "--server-args", "--log-level debug"]), rot)
    assert all("--enable-fp32-lm-head" not in s.args and s.args[-2:] == ["--log-level", "debug"] for s in plain)
    dp = e2e.launch_command(by["bad-flag-dp-attention"], "/m")
    assert dp[dp.index("--dp-size") + 1] == "2"  # dp 1 would silently turn dp-attention off upstream
    full = by["qwen3-int2-full"].args
    assert full[full.index("--oscar-sink-tokens") + 1] == str(e2e.B_SINK)
    assert full[full.index("--oscar-rotation") + 1] == rot["qwen3:identity"]
    assert max(args.b_lens) + args.greedy_tokens <= e2e.B_SINK  # check b really quantizes nothing
    tp2 = e2e.launch_command(by["qwen3-int2-head-tp2"], "/m")
    assert tp2[tp2.index("--tp-size") + 1] == "2" and "--oscar-rotation" in tp2
    assert set(e2e.server_specs(e2e.parse_args(["--only", "i"]), rot)[0].checks) == {"i"}
    # --int2-args reach the int2 servers only (e.g. the einsum rotate engine)
    eng = e2e.server_specs(e2e.parse_args(["--int2-args", "--oscar-rotate-engine torch"]), rot)
    with_int2 = [sp for sp in eng if "int2" in sp.args]
    assert with_int2 and all(sp.args[sp.args.index("--oscar-rotate-engine") + 1] == "torch" for sp in with_int2)
    assert all("--oscar-rotate-engine" not in sp.args for sp in eng if "int2" not in sp.args)
    # --dtype float32 servers only with --c-fp32, used by c alone
    assert not any("--dtype" in s.args or s.name in e2e.C_FP32_SERVERS.values() for s in specs)


def test_c_fp32_server_specs(e2e, tmp_path):
    rot = {f"{m}:{k}": f"/r/{m}_{k}.safetensors" for m in ("qwen3", "moe", "llama")
           for k in ("layer", "head", "identity", "mismatch")}
    plain = {s.name: s for s in e2e.server_specs(e2e.parse_args(["--tp2", "--out", str(tmp_path)]), rot)}
    args = e2e.parse_args(["--tp2", "--c-fp32", "--out", str(tmp_path)])
    specs = e2e.server_specs(args, rot)
    by = {s.name: s for s in specs}
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) and len({s.port for s in specs}) == len(specs)
    fp32 = [*e2e.C_FP32_SERVERS.values(), e2e.C_FP32_FLOOR]
    assert set(fp32) <= set(by) and set(by) - set(fp32) == set(plain)
    # the servers shared with d and h are untouched (same flags, checks and environment)
    for name in plain:
        assert (by[name].args, by[name].checks, by[name].env, by[name].phase) == (
            plain[name].args, plain[name].checks, plain[name].env, plain[name].phase)
    assert by["qwen3-int2-layer"].checks == "cd" and by["qwen3-int2-head"].checks == "ch"
    shim = e2e.fp32_shim_dir(args.work)
    for name in fp32:
        s = by[name]
        cmd = e2e.launch_command(s, "/m", "py")
        assert s.checks == "c" and s.phase == 1 and cmd[cmd.index("--dtype") + 1] == "float32"
        path = s.env["PYTHONPATH"].split(os.pathsep)
        assert path[:2] == [shim, e2e.HERE] and s.env["TRITON_F32_DEFAULT"] == "ieee"
        assert "--enable-fp32-lm-head" in s.args
    for kind, name in e2e.C_FP32_SERVERS.items():
        a = by[name].args
        assert a[a.index("--kv-cache-dtype") + 1] == "int2" and a[a.index("--oscar-rotation") + 1] == rot[f"qwen3:{kind}"]
        assert a[a.index("--oscar-sink-tokens") + 1] == str(e2e.C_SINK)
        assert a[a.index("--oscar-recent-tokens") + 1] == str(e2e.C_RECENT)
        # the same flags as the BF16 server of the same rotation, plus --dtype float32
        base = by[f"qwen3-int2-{kind}"].args
        assert [x for x in a if x not in ("--dtype", "float32")] == base
    assert "--kv-cache-dtype" not in by[e2e.C_FP32_FLOOR].args
    # c not selected: no fp32 servers even with --c-fp32
    assert not set(fp32) & {s.name for s in e2e.server_specs(e2e.parse_args(["--only", "d", "--c-fp32"]), rot)}


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoint_builder_is_seeded_and_loadable(e2e, tiny_qwen3, tmp_path):
    from safetensors.torch import load_file

    path, info = tiny_qwen3
    assert not info["reused"] and info["config"]["head_dim"] == 32
    assert info["sharpen"]["logit_std"] == pytest.approx(0.5, rel=0.05)
    assert info["sharpen"]["score_std"] == pytest.approx(1.5, rel=0.35)  # one gain for all layers
    again = e2e.build_checkpoint("qwen3", path, seed=3, **TINY)
    assert again["reused"]
    other = str(tmp_path / "same_seed")
    e2e.build_checkpoint("qwen3", other, seed=3, **TINY)
    a, b = load_file(os.path.join(path, "model.safetensors")), load_file(os.path.join(other, "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    diff = str(tmp_path / "seed4")
    e2e.build_checkpoint("qwen3", diff, seed=4, **TINY)
    c = load_file(os.path.join(diff, "model.safetensors"))
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    model = e2e.load_hf(path, "cpu")
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.num_key_value_heads == 2
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["dtype"] == "bfloat16" and cfg["head_dim"] == 32 and cfg["vocab_size"] == 256


@pytest.mark.parametrize("name,cls", [("moe", "Qwen3MoeForCausalLM"), ("llama", "LlamaForCausalLM")])
def test_other_families_build_and_load(e2e, tmp_path, name, cls):
    info = e2e.build_checkpoint(name, str(tmp_path), seed=0, **TINY)
    model = e2e.load_hf(str(tmp_path), "cpu")
    assert type(model).__name__ == cls
    assert info["sharpen"]["logit_std"] == pytest.approx(0.5, rel=0.05)
    lp = e2e.teacher_forced_logprobs(model, [e2e.random_prompt(24, 1, vocab=256)])[0]
    assert len(lp) == 23 and all(x <= 0 for x in lp)


def test_long_model_config(e2e):
    args = e2e.parse_args([])
    cfg = e2e.model_config("long", args)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 128, 32, 128)
    assert cfg.max_position_embeddings >= args.long_context + args.decode_tokens
    q = e2e.model_config("qwen3")
    assert (q.num_attention_heads, q.num_key_value_heads, q.head_dim, q.vocab_size) == (8, 2, 128, 2048)
    with pytest.raises(ValueError, match="unknown model"):
        e2e.model_config("gpt2")


# ----------------------------------------------------------------------------- oracle


@pytest.fixture(scope="module")
def oracle_setup(e2e, tiny_qwen3):
    from sglang_oscar.calibrate.model import geometry_of
    from sglang_oscar.rotation import RotationSet

    path, _ = tiny_qwen3
    model = e2e.load_hf(path, "cpu")  # bf16, as served
    ident = RotationSet.data_free(geometry_of(model.config), "identity")
    seq = e2e.random_prompt(96, 7, vocab=256)
    return model, ident, seq


def test_oracle_equals_bf16_model_when_windows_cover_everything(e2e, oracle_setup):
    from sglang_oscar.config import OscarConfig

    model, ident, seq = oracle_setup
    bf16 = e2e.teacher_forced_logprobs(model, [seq])[0]
    full = e2e.teacher_forced_logprobs(model, [seq], rotation=ident, config=OscarConfig(sink_tokens=len(seq)))[0]
    quant = e2e.teacher_forced_logprobs(model, [seq], rotation=ident,
                                        config=OscarConfig(sink_tokens=4, recent_tokens=8))[0]
    assert len(bf16) == len(full) == len(quant) == len(seq) - 1
    same = e2e.abs_diff_stats(bf16, full)
    q = e2e.abs_diff_stats(bf16, quant)
    # nothing quantized: only fp32-vs-bf16 attention arithmetic differs
    assert same["mean"] < 5e-3 and same["max"] < 5e-2
    # quantizing windows: INT2 moves the log-probs far more than that arithmetic noise
    assert q["mean"] > 10 * same["mean"] and q["mean"] > 1e-2
    # the first positions read only the BF16 sink (extend windows), so they match the full-window run
    assert e2e.abs_diff_stats(full[:3], quant[:3])["max"] < 1e-6


def test_oracle_prompt_split_uses_decode_windows_after_the_prompt(e2e, oracle_setup):
    from sglang_oscar.config import OscarConfig

    model, ident, seq = oracle_setup
    cfg = OscarConfig(sink_tokens=4, recent_tokens=16)
    ext = e2e.teacher_forced_logprobs(model, [seq], rotation=ident, config=cfg)[0]
    split = e2e.teacher_forced_logprobs(model, [seq], rotation=ident, config=cfg, prompt_lens=[60])[0]
    # causal: positions before the split are computed identically; later ones read the recent window in BF16
    assert ext[:59] == split[:59]
    assert e2e.abs_diff_stats(ext[59:], split[59:])["mean"] > 1e-3
    # recent window covering everything: decode windows read everything in BF16 like a full sink
    wide = e2e.teacher_forced_logprobs(model, [seq], rotation=ident, config=OscarConfig(sink_tokens=4, recent_tokens=512),
                                       prompt_lens=[4])[0]
    full = e2e.teacher_forced_logprobs(model, [seq], rotation=ident, config=OscarConfig(sink_tokens=512))[0]
    assert e2e.abs_diff_stats(wide, full)["max"] < 1e-6


def test_greedy_paths_agree_with_teacher_forcing(e2e, oracle_setup):
    from sglang_oscar.config import OscarConfig

    model, ident, seq = oracle_setup
    prompt = seq[:40]
    cfg = OscarConfig(sink_tokens=4, recent_tokens=8)
    for rotation, config in ((None, None), (ident, cfg)):
        (path,) = e2e.greedy_paths(model, [prompt], 5, rotation=rotation, config=config)
        assert len(path["tokens"]) == 5 and path["min_margin"] == min(path["margins"]) >= 0
        tf = e2e.teacher_forced_logprobs(model, [prompt + path["tokens"]], rotation=rotation, config=config,
                                         prompt_lens=[len(prompt)])[0]
        assert e2e.abs_diff_stats(path["logprobs"], tf[len(prompt) - 1:])["max"] < 2e-2
    picked = e2e.screen_prompts(model, [12, 20], 3, candidates=3, seed=5, vocab=256)
    assert [len(p["prompt"]) for p in picked] == [12, 20]
    for li, p in enumerate(picked):  # the chosen candidate has the largest minimum margin of its length
        seeds = [5 * 100003 + li * 1009 + c for c in range(3)]
        assert p["seed"] in seeds and p["prompt"] == e2e.random_prompt(len(p["prompt"]), p["seed"], 256)
        alone = [e2e.greedy_paths(model, [e2e.random_prompt(len(p["prompt"]), s_, 256)], 3)[0] for s_ in seeds]
        assert p["min_margin"] == max(p["candidate_min_margins"])
        assert p["min_margin"] >= max(c["min_margin"] for c in alone) - 0.05  # batched vs one-by-one arithmetic


def test_oracle_hp_dtype_fp32(e2e, tiny_qwen3, oracle_setup):
    """The fp32 references of check c (--c-fp32): the model loaded in fp32 and the oracle's HP tier
    in fp32 agree with the plain fp32 model to fp32 precision when nothing is quantized."""
    from sglang_oscar.config import OscarConfig

    path, _ = tiny_qwen3
    _, ident, seq = oracle_setup
    m32 = e2e.load_hf(path, "cpu", torch.float32)
    m64 = e2e.load_hf(path, "cpu", torch.float64)
    full = OscarConfig(sink_tokens=len(seq))
    plain = e2e.teacher_forced_logprobs(m32, [seq])[0]
    hp32 = e2e.teacher_forced_logprobs(m32, [seq], rotation=ident, config=full, hp_dtype=torch.float32)[0]
    hp16 = e2e.teacher_forced_logprobs(m32, [seq], rotation=ident, config=full)[0]  # default: BF16 HP tier
    assert e2e.abs_diff_stats(plain, hp32)["max"] < 1e-4  # fp32 end to end
    assert e2e.abs_diff_stats(plain, hp16)["mean"] > 10 * e2e.abs_diff_stats(plain, hp32)["mean"]  # BF16 rounding
    # an fp64-loaded model: the oracle still runs in fp32 (rotation, quantization, attention)
    hp64 = e2e.teacher_forced_logprobs(m64, [seq], rotation=ident, config=full, hp_dtype=torch.float32)[0]
    assert e2e.abs_diff_stats(hp32, hp64)["max"] < 1e-4
    # quantizing windows: the HP dtype reaches the quantizer (rows quantized from their fp32 values)
    cfg = OscarConfig(sink_tokens=4, recent_tokens=8)
    q32 = e2e.teacher_forced_logprobs(m32, [seq], rotation=ident, config=cfg, hp_dtype=torch.float32, prompt_lens=[60])[0]
    q16 = e2e.teacher_forced_logprobs(m32, [seq], rotation=ident, config=cfg, prompt_lens=[60])[0]
    assert len(q32) == len(seq) - 1 and e2e.abs_diff_stats(q32, plain)["mean"] > 1e-2
    assert q32 != q16 and e2e.abs_diff_stats(q32[:3], plain[:3])["max"] < 1e-4  # first positions read only the sink


def test_rotation_files(e2e, tiny_qwen3, tmp_path):
    from sglang_oscar.calibrate.model import geometry_of
    from sglang_oscar.rotation import RotationSet
    from sglang_oscar.rotation.rotation_set import RotationError

    path, _ = tiny_qwen3
    model = e2e.load_hf(path, "cpu", torch.float32)
    files = e2e.make_rotation_files(model, path, str(tmp_path), seqs=2, seq_len=64, min_tokens=64)
    geo = geometry_of(model.config)
    layer, head = RotationSet.load(files["layer"]), RotationSet.load(files["head"])
    layer.validate(geo)
    head.validate(geo)
    assert not layer.per_head and head.per_head and head.matrices(0, "k").shape == (2, 32, 32)
    assert layer.metadata["method"] == "oscar" and head.metadata["method"] == "oscar-perhead"
    assert torch.equal(RotationSet.load(files["identity"]).matrices(1, "v"), torch.eye(32))
    with pytest.raises(RotationError):
        RotationSet.load(files["mismatch"]).validate(geo)


# ----------------------------------------------------------------------------- fp32 servers of check c


def test_fp32_shim_entry_point(e2e, tmp_path):
    from importlib.metadata import distributions

    shim = e2e.write_fp32_shim(e2e.fp32_shim_dir(str(tmp_path)))
    assert shim == str(tmp_path / "fp32_shim")
    eps = [ep for d in distributions(path=[shim]) for ep in d.entry_points if ep.group == "sglang.srt.plugins"]
    assert [(ep.name, ep.value) for ep in eps] == [(e2e.FP32_SHIM_ENTRY, e2e.FP32_SHIM_VALUE)]
    mod, fn = e2e.FP32_SHIM_VALUE.split(":")
    assert mod == "gpu_e2e" and getattr(e2e, fn) is e2e.fp32_shim_register
    assert os.path.isfile(os.path.join(e2e.HERE, mod + ".py"))  # importable from scripts/ (first on PYTHONPATH)


def test_fp32_shim_hooks_route_only_fp32(e2e):
    class Op:
        def forward_native(self, *a, **k):
            return ("native", a, k)

    def orig(*a, **k):
        return ("cuda", a, k)

    op = Op()
    x32, x16 = torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16)
    assert e2e._fp32_native(orig, op, x32, "res")[0] == "native"
    assert e2e._fp32_native(orig, op, x16, "res")[0] == "cuda"
    pos = torch.arange(2)
    assert e2e._fp32_native_rope(orig, op, pos, x32, x32)[0] == "native"
    assert e2e._fp32_native_rope(orig, op, pos, x16, x16)[0] == "cuda"
    assert e2e._fp32_native_rope(orig, op, pos, x32, x32, fused_set_kv_buffer_arg=object())[0] == "cuda"
    assert e2e._fp32_native_rope(orig, op, pos, x32, x32, None, object())[0] == "cuda"
    assert e2e._no_fp32_jit_qknorm(lambda d, t: "probe", 128, torch.float32) is False
    assert e2e._no_fp32_jit_qknorm(lambda d, t: "probe", 128, torch.bfloat16) == "probe"
    for target, hook in e2e.FP32_SHIM_HOOKS:  # every target exists in the installed SGLang
        import pkgutil

        obj_path, attr = target.rsplit(".", 1)
        assert callable(getattr(pkgutil.resolve_name(obj_path), attr)), target


def test_fp32_shim_loads_as_sglang_plugin(e2e, tmp_path):
    """A fresh interpreter with the fp32 servers' environment: SGLang's own plugin loader finds the
    shim, applies its hooks, and an fp32 RMSNorm.forward_cuda then runs forward_native (on CPU; the
    upstream CUDA path would call flashinfer's fp16/bf16-only rmsnorm)."""
    import subprocess
    import sys

    work = str(tmp_path)
    e2e.write_fp32_shim(e2e.fp32_shim_dir(work))
    env = dict(os.environ, **e2e.fp32_server_env(work), SGLANG_PLUGINS=e2e.FP32_SHIM_ENTRY)
    code = "\n".join([
        "import torch",
        "from sglang.srt.plugins import load_plugins",
        "load_plugins()",
        "from sglang.srt.layers.layernorm import RMSNorm",
        "from sglang.jit_kernel.norm import can_use_fused_inplace_qknorm",
        "assert hasattr(RMSNorm.forward_cuda, '__wrapped__'), 'RMSNorm.forward_cuda not hooked'",
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

    def __init__(self, e2e, name, model, rotation=None, config=None, hp_dtype=None):
        from types import SimpleNamespace

        self.e2e, self.model, self.rotation, self.config, self.hp = e2e, model, rotation, config, hp_dtype
        self.spec = SimpleNamespace(name=name)
        self.t_ready, self.error, self.log_path = 1.0, None, "-"

    def alive(self):
        return True

    def log_text(self):
        return ""

    def generate(self, payload, timeout=None):
        ids = list(payload["input_ids"])
        new = self.e2e.random_prompt(payload["sampling_params"]["max_new_tokens"], len(ids), vocab=256)
        lp = self.e2e.teacher_forced_logprobs(self.model, [ids + new], rotation=self.rotation, config=self.config,
                                              prompt_lens=[len(ids)], hp_dtype=self.hp)[0]
        meta = {"output_token_logprobs": [[lp[len(ids) - 1 + j], t, None] for j, t in enumerate(new)],
                "completion_tokens": len(new), "finish_reason": {"type": "length"}}
        if payload.get("logprob_start_len") == 0:
            meta["input_token_logprobs"] = [[None, ids[0], None]] + [[lp[i], ids[i + 1], None] for i in range(len(ids) - 1)]
        return {"output_ids": new, "meta_info": meta}


@pytest.fixture(scope="module")
def c_run(e2e, tiny_qwen3, tmp_path_factory):
    """A Run of check c with --c-fp32 on the tiny checkpoint: references from precompute()."""
    from sglang_oscar.calibrate.model import geometry_of
    from sglang_oscar.rotation import RotationSet

    path, _ = tiny_qwen3
    out = tmp_path_factory.mktemp("c_run")
    args = e2e.parse_args(["--only", "c", "--c-fp32", "--out", str(out / "out"), "--c-prompt-lens", "40,64",
                           "--c-decode-tokens", "4"])
    run = e2e.Run(args)
    run.models["qwen3"] = path
    run.hf["qwen3"] = e2e.load_hf(path, "cpu")
    ident = RotationSet.data_free(geometry_of(run.hf["qwen3"].config), "identity")
    for kind in ("layer", "head"):
        run.rot[f"qwen3:{kind}"] = str(out / f"rot_{kind}.safetensors")
        ident.save(run.rot[f"qwen3:{kind}"])
    e2e.precompute(run)
    return run


def _c_servers(e2e, run, fp32_hp=torch.float32):
    cfg = run.data["c_config"]
    srv = {"qwen3-bf16": _FakeServer(e2e, "qwen3-bf16", run.hf["qwen3"]),
           e2e.C_FP32_FLOOR: _FakeServer(e2e, e2e.C_FP32_FLOOR, run.hf["qwen3-fp32"])}
    for kind in ("layer", "head"):
        rs = run.data[f"c_rot_{kind}"]
        srv[f"qwen3-int2-{kind}"] = _FakeServer(e2e, f"qwen3-int2-{kind}", run.hf["qwen3"], rs, cfg)
        name = e2e.C_FP32_SERVERS[kind]
        srv[name] = _FakeServer(e2e, name, run.hf["qwen3-fp32"], rs, cfg, fp32_hp)
    return srv


def test_check_c_fp32_criterion(e2e, c_run):
    import torch as _t

    run = c_run
    assert run.hf["qwen3-fp32"].dtype == _t.float32 and run.hf["qwen3"].dtype == _t.bfloat16
    assert {"c_hf_fp32", "c_oracle_fp32_layer", "c_oracle_fp32_head", "c_oracle_layer", "c_hf_bf16"} <= set(run.data)
    run.servers = _c_servers(e2e, run)
    res = e2e.check_c(run)
    assert res.status == e2e.PASS, res.measured
    d = res.detail
    assert d["settings"]["criterion"] == "fp32" and d["bf16_pass"] is True
    for kind in ("layer", "head"):
        assert d["fp32"][kind]["prefill_mean"] == 0 and d["fp32"][kind]["decode_mean"] == 0
        assert d["fp32"][kind]["server"] == e2e.C_FP32_SERVERS[kind] and d[kind]["server"] == f"qwen3-int2-{kind}"
        assert d["fp32"][kind]["quantization_effect_mean"] > 1e-3 and d[kind]["prefill_mean"] == 0
        assert all(r["decode_vs_oracle"]["n"] == 4 for r in d["fp32"][kind]["rows"])
    assert d["fp32"]["noise_floor_mean"] == 0 and d["bf16_noise_floor_mean"] == 0
    assert "--dtype float32 servers" in res.measured and "BF16 servers (reported" in res.measured
    # an fp32 server whose windows held BF16 rows would not match the fp32 references
    run.servers = _c_servers(e2e, run, fp32_hp=None)
    off = e2e.check_c(run)
    assert off.detail["fp32"]["layer"]["prefill_mean"] > 0 and off.detail["layer"]["prefill_mean"] == 0
    # a missing fp32 server: c fails, the BF16 comparison is still reported
    run.servers = {k: v for k, v in _c_servers(e2e, run).items() if k != e2e.C_FP32_SERVERS["head"]}
    miss = e2e.check_c(run)
    assert miss.status == e2e.FAIL and "fp32 comparison could not be evaluated" in miss.measured
    assert miss.detail["bf16_pass"] is True and "error" in miss.detail["fp32"]


def test_check_c_without_fp32_keeps_the_bf16_criterion(e2e, c_run):
    import argparse

    run = c_run
    saved = run.args
    run.args = argparse.Namespace(**{**vars(saved), "c_fp32": False})
    try:
        run.servers = {k: v for k, v in _c_servers(e2e, run).items() if not k.endswith("fp32")}
        res = e2e.check_c(run)
        assert res.status == e2e.PASS and "fp32" not in res.detail and res.detail["settings"]["criterion"] == "bf16"
        assert res.measured.startswith("mean |served - oracle| logprob: layer: prefill 0, decode 0")
        del run.servers["qwen3-int2-head"]
        with pytest.raises(e2e.CheckError):  # as before: run_check reports "could not be evaluated"
            e2e.check_c(run)
    finally:
        run.args = saved


# ----------------------------------------------------------------------------- client side


def test_parse_generation_and_compare(e2e):
    resp = {"output_ids": [5, 9, 7], "meta_info": {
        "finish_reason": {"type": "length", "length": 3}, "completion_tokens": 3, "cached_tokens": 0,
        "input_token_logprobs": [[None, 1, None], [-2.5, 4, None], [-3.0, 8, None]],
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 9, None], [-0.3, 7, None]],
        "output_top_logprobs": [[[-0.1, 5, None], [-1.1, 6, None]], [[-0.2, 9, None], [-0.25, 3, None]],
                                [[-0.3, 7, None], [-2.3, 1, None]]]}}
    r = e2e.parse_generation(resp)
    assert r["tokens"] == [5, 9, 7] and r["logprobs"] == [-0.1, -0.2, -0.3]
    assert r["input_logprobs"] == [-2.5, -3.0] and r["finish_reason"] == "length" and r["completion_tokens"] == 3
    assert r["margins"] == pytest.approx([1.0, 0.05, 2.0])
    same = e2e.compare_generations(r, dict(r))
    assert same["tokens_equal"] and same["bit_identical"] and same["max_abs_dlogprob"] == 0.0
    assert same["ref_min_margin"] == pytest.approx(0.05)
    other = dict(r, tokens=[5, 3, 7], logprobs=[-0.1005, -0.25, -0.3])
    d = e2e.compare_generations(r, other)
    assert not d["tokens_equal"] and d["first_diff"] == 1 and d["ref_margin_at_diff"] == pytest.approx(0.05)
    assert d["max_abs_dlogprob"] == pytest.approx(5e-4)  # over the common prefix only
    shorter = e2e.compare_generations(r, dict(r, tokens=[5, 9], logprobs=[-0.1, -0.2]))
    assert shorter["first_diff"] == 2 and not shorter["tokens_equal"]
    assert e2e.abs_diff_stats([1.0, 2.0, 3.0], [1.5, 2.0]) == {"mean": 0.25, "max": 0.5, "n": 2}
    assert math.isnan(e2e.abs_diff_stats([], [1.0])["mean"])
    p = e2e.generate_payload([1, 2], 4, input_logprobs=True)
    assert p["logprob_start_len"] == 0 and p["sampling_params"] == {"max_new_tokens": 4, "temperature": 0,
                                                                     "ignore_eos": True}
    assert "logprob_start_len" not in e2e.generate_payload([1], 1) and e2e.generate_payload([1], 1, top_logprobs=0).get(
        "top_logprobs_num") is None


class _SSE(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(0.05)  # "prefill"
        for i in range(1, n + 1):
            chunk = {"output_ids": list(range(i)), "meta_info": {"completion_tokens": i}}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
            time.sleep(0.02)
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *a):
        pass


def test_stream_decode_rate_excludes_the_first_chunk(e2e):
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = e2e.stream_decode_rate(f"http://127.0.0.1:{srv.server_port}", [1, 2, 3], 6, timeout=30)
    finally:
        srv.shutdown()
    assert r["tokens"] == 6
    assert 5 <= r["decode_tok_s"] <= 5 / 0.1  # 5 tokens after the first, ~20 ms apart
    assert r["ttft_s"] >= 0.05 and r["e2e_s"] > r["ttft_s"]


def test_log_parsers(e2e):
    log = "\n".join([
        "[2026] max_total_num_tokens=123456, chunked_prefill_size=8192, max_prefill_tokens=16384",
        "Prefill batch. #new-seq: 1, #new-token: 64, #cached-token: 32, token usage: 0.12, #running-req: 3, #queue-req: 5",
        "Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: --kv-cache-dtype int2 does not support X",
        "[2026] Scheduler hit an exception", "full memory leak detected! [full] total=10, available=9",
    ])
    assert e2e.max_total_tokens_from_log(log) == 123456 and e2e.max_total_tokens_from_log("nothing") is None
    assert e2e.last_error(log) == "ValueError: --kv-cache-dtype int2 does not support X"
    assert e2e.last_error("just a line\n\n") == "just a line"
    assert e2e.leak_lines(log) == ["full memory leak detected! [full] total=10, available=9"]
    st = e2e._log_stats(log)
    assert st["max_queue_req"] == 5 and st["max_token_usage"] == 0.12 and st["cached_tokens_total"] == 32
    assert st["tracebacks"] == 1


def test_load_prompts(e2e):
    ps = e2e.load_prompts(64, 100, 8192, seed=3)
    lens = [len(p) for p in ps]
    assert len(ps) == 64 and min(lens) >= 100 and max(lens) <= 8192 and max(lens) > 4 * min(lens)
    shared = [p for i, p in enumerate(ps) if i % 4 == 0 and len(p) > e2e.LOAD_SHARED_PREFIX + 16]
    assert len(shared) >= 2 and all(p[:e2e.LOAD_SHARED_PREFIX] == shared[0][:e2e.LOAD_SHARED_PREFIX] for p in shared)
    assert ps == e2e.load_prompts(64, 100, 8192, seed=3) and ps != e2e.load_prompts(64, 100, 8192, seed=4)


# ----------------------------------------------------------------------------- results


def test_table_json_and_exit_code(e2e, tmp_path):
    R = e2e.CheckResult
    results = [R("a", e2e.PASS, "3/3 same | ok", {"x": float("nan"), "t": (1, 2)}),
               R("g", e2e.FAIL, "1.20x (target >= 1.5x)", {"ratio": 1.2})]
    table = e2e.format_table(results)
    lines = table.splitlines()
    assert lines[0] == "| check | what | measured | result |" and len(lines) == 4
    assert lines[2] == f"| a | {e2e.CHECKS['a']} | 3/3 same \\| ok | **PASS** |"
    assert lines[3].endswith("| **FAIL** |")
    jpath, mpath = e2e.write_results(str(tmp_path), results, {"command": "gpu_e2e.py --only a,g", "wall_s": 1.5})
    obj = json.load(open(jpath))
    assert obj["passed"] is False and [r["status"] for r in obj["results"]] == ["PASS", "FAIL"]
    assert obj["results"][0]["detail"] == {"x": None, "t": [1, 2]} and obj["results"][1]["title"] == e2e.CHECKS["g"]
    md = open(mpath).read()
    assert table in md and "- command: gpu_e2e.py --only a,g" in md and "## g:" in md
    assert e2e.overall_exit_code(results) == 1
    assert e2e.overall_exit_code(results[:1]) == 0 and e2e.overall_exit_code([]) == 1


def test_dry_run_prints_every_server(e2e, capsys):
    assert e2e.main(["--dry-run", "--only", "f,i", "--python", "py"]) == 0
    out = capsys.readouterr().out.splitlines()
    heads = [ln for ln in out if ln.startswith("# ")]
    assert len(heads) == 7 and any("long-int2 [f]" in h for h in heads)
    cmds = [shlex.split(ln) for ln in out if not ln.startswith("# ")]
    assert all(c[:3] == ["py", "-m", "sglang.launch_server"] for c in cmds)


def test_plugin_entry_point_is_seen(e2e):
    ep = e2e.plugin_entry_point()
    assert ep["oscar"] and ep["value"] == "sglang_oscar.plugin:register" and "oscar" not in ep["others"]


def test_budget_exhaustion_is_reported_as_not_run(e2e, tmp_path):
    """A check the --budget left no time for is SKIP (not run, and not a pass), not FAIL."""
    assert e2e._unevaluated_status({"long-int2": f"server not healthy after 22 s (x; {e2e.BUDGET_CUT}; rerun)"}) \
        == e2e.SKIP
    assert e2e._unevaluated_status({"long-bf16": "time budget of 370 s used up",
                                    "long-int2": f"not healthy ({e2e.BUDGET_CUT})"}) == e2e.SKIP
    assert e2e._unevaluated_status({"long-int2": "exited with code 1: CUDA out of memory"}) == e2e.FAIL
    assert e2e._unevaluated_status({}) == e2e.FAIL
    run = e2e.Run(e2e.parse_args(["--only", "a", "--budget", "1", "--out", str(tmp_path / "o")]))
    run.deadline = time.time() - 1.0
    run.run_check("a", lambda r: pytest.fail("must not run"))
    res = run.results["a"]
    assert res.status == e2e.SKIP and "--only a" in res.measured
