"""CPU tests of benchmarks/bench_full_pool.py and its fill shim: how many requests fill a pool, the
server commands and environment, the shim's hooks (SGLang's extend kernels and the INT2 extend plan
write zeros; decode untouched), the table's ratios, and a whole run against fake servers."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import inspect
import json
import shlex
import sys
import time
from collections import defaultdict

import pytest
import torch
from test_bench_served import _load_script, write_fake_server

fs = _load_script("fill_shim")
bfp = _load_script("bench_full_pool")
bs = sys.modules["bench_served"]


def _args(*argv: str) -> argparse.Namespace:
    return bfp.parse_args(list(argv))


@pytest.mark.parametrize("pool, ctx, cap, want", [
    (5_209_007, 131072, None, 39),  # int2's Qwen3-8B pool (bench_served, tree ea0142d): 39 x 131,239 <= 0.99 pool
    (749_412, 131072, None, 5),  # BF16's: 5 x 131,205 fits, 6 x 131,206 does not
    (5_209_007, 131072, 20, 20),
    (100_000, 131072, None, 0),
])
def test_requests_that_fit(pool, ctx, cap, want):
    a = _args()  # decode 64: new = 128 + B
    b = bfp.requests_that_fit(pool, ctx, a, cap)
    assert b == want
    if b:
        assert b * (ctx + 128 + b) <= 0.99 * pool
    if cap is None and b:
        assert (b + 1) * (ctx + 128 + b + 1) > 0.99 * pool


@pytest.mark.parametrize("argv, message", [
    (["--contexts", "0"], "--contexts needs one or more positive"), (["--contexts", ","], "--contexts needs"),
    (["--max-requests", "0"], "--max-requests must be at least 1"),
    (["--chunked-prefill-size", "0"], "--chunked-prefill-size must be a positive"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bfp.parse_args(argv)
    assert message in capsys.readouterr().err


def test_dry_run_commands_and_moe_refusal(capsys):
    assert bfp.main(["--dry-run", "--contexts", "32k,128k", "--int2-args", "--oscar-sink-tokens 32"]) == 0
    out = capsys.readouterr().out
    cmds = [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("$ ")]
    assert len(cmds) == 2 and "OSCAR_BENCH_FAST_FILL=1" in out
    running = [int(c[c.index("--max-running-requests") + 1]) for c in cmds]
    assert [int(c[c.index("--cuda-graph-max-bs-decode") + 1]) for c in cmds] == running
    assert running[1] > 5 * running[0]  # int2's pool holds ~7x BF16's 32K requests
    assert cmds[1][-4:] == ["--oscar-fold-rotations", "on", "--oscar-sink-tokens", "32"]
    with pytest.raises(SystemExit, match="MoE model.*--real-prefill"):
        bfp.main(["--dry-run", "--model", "qwen3-30b-a3b"])
    assert bfp.main(["--dry-run", "--model", "qwen3-30b-a3b", "--real-prefill"]) == 0
    assert "fill: real prefill" in capsys.readouterr().out


def test_server_env_installs_the_shim_as_an_sglang_plugin(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    env = bfp.server_env(_args("--work", str(tmp_path)))
    shim = str(tmp_path / "fill_shim")
    assert env == {"PYTHONPATH": f"{shim}:/elsewhere", fs.FILL_ENV: "1"}
    monkeypatch.setenv("SGLANG_PLUGINS", "oscar")  # SGLang's allowlist: the shim joins it
    assert bfp.server_env(_args("--work", str(tmp_path)))["SGLANG_PLUGINS"] == "oscar,oscar_bench_fill"
    eps = [ep for d in importlib.metadata.distributions(path=[shim]) for ep in d.entry_points]
    assert [(ep.group, ep.name, ep.value) for ep in eps] == [
        ("sglang.srt.plugins", "oscar_bench_fill", "oscar_bench_fill_shim:fill_register")]
    assert (tmp_path / "fill_shim" / "oscar_bench_fill_shim.py").read_text() == (
        bfp.Path(fs.__file__).read_text())
    assert bfp.server_env(_args("--work", str(tmp_path), "--real-prefill")) == {}


def test_marker_file_once_a_fill_ran(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    monkeypatch.setenv(fs.MARKER_ENV, str(marker))
    monkeypatch.setattr(fs, "_marked", False)
    backend = argparse.Namespace()
    fs.sglang_extend_writes_zeros(None, backend)
    assert not marker.exists()  # installing the fills is not running one
    backend.extend_attention_fwd_unified(torch.ones(1), torch.ones(1))
    assert marker.exists()
    marker.unlink()
    backend.extend_attention_fwd(*[torch.ones(1)] * 4)
    assert not marker.exists()  # once per process


def test_register_only_with_the_env(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.delenv(fs.FILL_ENV, raising=False)
    fs.fill_register()
    assert not HookRegistry._hooks
    monkeypatch.setenv(fs.FILL_ENV, "1")
    fs.fill_register()
    fs.fill_register()  # once per target
    got = {t: [(k, h.__name__) for k, h, _ in hooks] for t, hooks in HookRegistry._hooks.items()}
    assert got == {fs.SGLANG_TARGET: [(HookType.AFTER, "sglang_extend_writes_zeros")],
                   fs.INT2_TARGET: [(HookType.AROUND, "int2_extend_writes_zeros")]}


def test_sglang_extend_kernels_become_zero_fills():
    """The hook replaces the two kernels SGLang's ``forward_extend`` calls with ``o`` at the positions
    the zero fills clear (read from SGLang's source); other arguments are left alone."""
    import sglang.srt.layers.attention.triton_backend as tb

    seen = {}
    for node in ast.walk(ast.parse(inspect.getsource(tb.TritonAttnBackend))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("extend_attention_fwd", "extend_attention_fwd_unified"):
            seen.setdefault(node.func.attr, set()).add(ast.unparse(node.args[3 if node.func.attr == "extend_attention_fwd" else 1]))
    assert "o.view(-1, layer.tp_q_head_num, layer.v_head_dim)" in seen["extend_attention_fwd"]
    assert seen["extend_attention_fwd_unified"] == {"o.view(-1, layer.tp_q_head_num, layer.v_head_dim)"}
    assert "self.extend_attention_fwd = " in inspect.getsource(tb.TritonAttnBackend.__init__)

    backend = argparse.Namespace()  # (the fills' marker: test_marker_file_once_a_fill_ran)
    assert fs.sglang_extend_writes_zeros("init result", backend) == "init result"
    q, k, o = torch.ones(3, 2), torch.ones(3, 2), torch.ones(3, 2)
    backend.extend_attention_fwd(q, k, k, o, k, k)
    assert torch.equal(o, torch.zeros(3, 2)) and torch.equal(q, torch.ones(3, 2)) and torch.equal(k, torch.ones(3, 2))
    o.fill_(1)
    backend.extend_attention_fwd_unified(q, o, k, k)
    assert torch.equal(o, torch.zeros(3, 2)) and torch.equal(q, torch.ones(3, 2))


def _extend_plan(return_lse: bool):
    """A real ExtendPlan (CPU) of 12 query rows, 4 q heads, D 64 (``tests/kernels``' pool fixture), its buffers."""
    sys.path.insert(0, str(bfp.Path(__file__).resolve().parents[1] / "kernels"))
    from kv_fixtures import build_pool, make_config
    from sglang_oscar.kernels import ExtendPlan

    pool = build_pool([17, 5], 2, 64, 64, make_config(sink=4, recent=8), hp_dtype=torch.float32, window_mode="extend")
    tables = (pool.hp_index, pool.req_to_token, pool.req_pool_indices, torch.tensor([0, 7, 12]),
              torch.tensor([10, 0]), torch.tensor([7, 5]))
    bufs = (pool.k_codes, pool.k_pairs, pool.v_codes, pool.v_pairs, pool.hp_k, pool.hp_v)
    plan = ExtendPlan(pool.layout, 4, 12, bufs, *tables, sink=4, q_dtype=torch.float32, mma_dtype=torch.float32,
                      return_lse=return_lse, out_dtype=torch.float16)
    return plan, bufs


@pytest.mark.parametrize("return_lse", [False, True])
def test_int2_extend_plan_returns_zeros_of_its_shape(return_lse):
    """The kernel never runs: zeros [N, H_q, D_v] in the plan's dtype, the LSE's shape when asked,
    ``out`` zeroed in place."""
    plan, bufs = _extend_plan(return_lse)
    never = lambda *a, **k: pytest.fail("the extend kernel ran")  # noqa: E731
    got = fs.int2_extend_writes_zeros(never, plan, torch.randn(12, 4, 64), *bufs, sm_scale=0.125)
    o, lse = got if return_lse else (got, None)
    assert o.shape == (12, 4, 64) and o.dtype == torch.float16 and not o.any()
    if return_lse:
        assert lse.shape == (12, 4) and lse.dtype == torch.float32 and not lse.any()
    out = torch.ones(12, 4, 64, dtype=torch.float16)
    got = fs.int2_extend_writes_zeros(never, plan, torch.randn(12, 4, 64), *bufs, out=out)
    assert (got[0] if return_lse else got) is out and not out.any()


def test_hooks_apply_through_sglangs_registry(monkeypatch):
    """Registered and applied as SGLang's plugin loader does, on the real classes: ``ExtendPlan.run``
    answers zeros, SGLang's backend ``__init__`` is wrapped (both restored after the test)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang_oscar.kernels import ExtendPlan

    monkeypatch.setattr(HookRegistry, "_hooks", defaultdict(list))
    monkeypatch.setattr(HookRegistry, "_patched", set())
    monkeypatch.setattr(ExtendPlan, "run", ExtendPlan.run)
    monkeypatch.setattr(TritonAttnBackend, "__init__", TritonAttnBackend.__init__)
    monkeypatch.setenv(fs.FILL_ENV, "1")
    init = TritonAttnBackend.__init__
    fs.fill_register()
    HookRegistry.apply_hooks()
    assert TritonAttnBackend.__init__ is not init and TritonAttnBackend.__init__.__wrapped__ is init
    plan, bufs = _extend_plan(False)
    o = plan.run(torch.randn(12, 4, 64), *bufs, sm_scale=0.125)
    assert o.shape == (12, 4, 64) and not o.any()


def test_table_ratio_per_context_against_the_best_bf16():
    def server(fmt, pool, runs):
        return {"format": fmt, "status": "ok", "capacity": {"max_total_num_tokens": pool}, "runs": [
            {"context": c, "batch": b, "status": "ok", "decode_tok_s": t, "per_request_tok_s": t / b,
             "prefill_all_s": 1.0, "window_steps": 64} for c, b, t in runs]}

    res = {"servers": [server("bf16", 749_412, [(131072, 5, 100.0)]),
                       server("bf16-t64", 749_412, [(131072, 5, 140.0), (32768, 22, 900.0)]),
                       server("int2-fold", 5_209_007, [(131072, 39, 840.0), (32768, 158, 2700.0)]),
                       {"format": "fp8", "status": "launch failed", "runs": []}]}
    md = bfp.table(res)
    assert "| **int2-fold / best BF16** | 128K | | | **6.00x** |" in md
    assert "| **int2-fold / best BF16** | 32K | | | **3.00x** |" in md
    assert "| int2-fold | 128K | 5,209,007 | 39 | 840.0 | 21.54 |" in md
    assert md.rstrip().endswith("not measured: fp8: launch failed")


# the fake server of test_bench_served, which also checks what bench_full_pool promises SGLang: the fill
# shim importable from its PYTHONPATH and switched on, never more requests than --max-running-requests
# or tokens than the pool, and a fill mark from the first prefill (fp8 stands for a server whose plugin
# loader skipped the shim: no mark)
FAKE_SETUP = """if os.environ.get("OSCAR_BENCH_FAST_FILL") != "1":
    sys.exit("no fill shim in the environment")
import oscar_bench_fill_shim
running = int(sys.argv[sys.argv.index("--max-running-requests") + 1])
active = []"""
FAKE_ON_REQUEST = """if kv != "fp8_e4m3":
            oscar_bench_fill_shim._mark()
        active.append(len(req["input_ids"]) + req["sampling_params"]["max_new_tokens"])
        assert len(active) <= running and sum(active) <= pool, 'over the pool'"""
FAKE_AFTER = 'active.remove(len(req["input_ids"]) + req["sampling_params"]["max_new_tokens"])'


def test_run_with_fake_servers(tmp_path, capsys):
    """Start (with the shim on the server's path), capacity, warm-up, a pool-full point per format,
    stop, outputs; a server whose warm-up left no fill mark is stopped; then --merge of two runs."""
    fake = write_fake_server(tmp_path / "fake_python", {"auto": 60000, "int2": 200000, "fp8_e4m3": 100000},
                             # token gaps long beside a loaded machine's thread start-up: the all-decoding
                             # window (~0.5 s) stays open however late the last request starts streaming
                             {"auto": 0.04, "int2": 0.02, "fp8_e4m3": 0.02}, setup=FAKE_SETUP,
                             on_request=FAKE_ON_REQUEST, after_request=FAKE_AFTER, prefill_s=1e-6)
    out, port = tmp_path / "out", 20000 + (int(time.time() * 1000) % 20000)
    argv = ["--formats", "bf16,int2,fp8", "--contexts", "16k", "--decode-tokens", "8", "--python", str(fake),
            "--port", str(port), "--out", str(out), "--work", str(tmp_path / "work"), "--startup-timeout", "30"]
    assert bfp.main(argv) == 0
    res = json.loads((out / "results.json").read_text())
    runs = {s["format"]: s["runs"][0] for s in res["servers"] if s["runs"]}
    # B (16,384 + 16 + B) <= 0.99 pool: 3 of 60,000 tokens (4 need 65,616), 12 of 200,000 (13 need 213,369)
    assert [s["status"] for s in res["servers"]] == ["ok", "ok", "error"]
    assert "the fill shim did not run in the warm-up prefill" in res["servers"][2]["error"]
    assert (runs["bf16"]["batch"], runs["int2"]["batch"]) == (3, 12)
    assert all(r["status"].startswith("ok") and r["decode_tok_s"] > 0 for r in runs.values())
    md = (out / "results.md").read_text()
    assert "| **int2 / best BF16** | 16K |" in md and "fill_shim, prefill attention skipped" in md
    assert (out / "logs.tgz").exists()
    merged = tmp_path / "merged"
    assert bfp.main(["--merge", f"{out}/results.json,{out}/results.json", "--out", str(merged)]) == 0
    assert (merged / "results.md").read_text().count("| **int2 / best BF16** | 16K |") == 2
