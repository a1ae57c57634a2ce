"""CPU tests of the device harness (``tests/e2e``): command line, server specs and argv, dry run,
entry point, time budget."""

from __future__ import annotations

import os
import shlex
import time

import pytest

from . import config, families, fp32_shim, results, servers, smoke, window_shim
from . import __main__ as entry
from .run import Run

# ----------------------------------------------------------------------------- arguments


def test_parse_args_defaults_and_selection(tmp_path):
    a = config.parse_args(["--out", str(tmp_path)])
    assert a.checks == list("abcdefgi")  # h only with --tp2
    assert a.work == str(tmp_path) + "_work"  # checkpoints stay out of the results folder
    assert a.c_prompt_lens == [1024, 1800]
    assert config.parse_args(["--tp2"]).checks == list("abcdefghi")
    assert config.parse_args(["--only", "c,a"]).checks == ["a", "c"]
    assert config.parse_args(["--only", "gfd"]).checks == ["d", "f", "g"]
    assert config.parse_args(["--only", "h", "--tp2"]).checks == ["h"]
    assert config.parse_args(["--only", "c", "--c-prompt-lens", "64,128"]).c_prompt_lens == [64, 128]
    assert a.c_fp32 is False and config.parse_args(["--only", "c", "--c-fp32"]).c_fp32 is True
    assert a.b_lens == list(config.B_LENS) and a.d_lens == list(config.D_LENS) and a.h_lens == list(config.H_LENS)
    for bad in (["--only", "h"], ["--only", "a,z"], ["--only", ""], ["--load-min-len", "900", "--load-max-len", "100"],
                ["--b-lens", "40,1020"], ["--d-lens", "x"], ["--c-prompt-lens", "1"]):
        with pytest.raises(SystemExit):
            config.parse_args(bad)


def test_server_specs_and_commands(tmp_path):
    args = config.parse_args(["--tp2", "--out", str(tmp_path)])
    rot = {f"{m}:{k}": f"/r/{m}_{k}.safetensors" for m in ("qwen3", "moe", "llama")
           for k in ("layer", "head", "identity", "mismatch")}
    specs = servers.server_specs(args, rot)
    names = [s.name for s in specs]
    assert len(names) == len(set(names))
    ports = [s.port for s in specs]
    assert len(set(ports)) == len(ports) and min(ports) == args.base_port
    by = {s.name: s for s in specs}
    # every check is served; phase 2 holds exactly the servers that must run alone
    assert set("".join(s.checks for s in specs)) == set("abcdefghi")
    assert {s.name for s in specs if s.phase == 2} == {"qwen3-int2-head-tp2", "long-bf16", "long-int2"}
    allowed = by["qwen3-plugin-off"].env["SGLANG_PLUGINS"].split(",")
    assert allowed and "oscar" not in allowed and set(allowed) >= set(servers.plugin_entry_point()["others"])
    assert by["qwen3-bf16"].checks == "abc"  # shared by a, b and c
    for s in specs:
        cmd = servers.launch_command(s, "/m", "python")
        assert cmd.count("--attention-backend") == 1
        assert cmd[cmd.index("--port") + 1] == str(s.port)
        assert "--max-running-requests" in cmd  # bounds the INT2 ring/sink arenas
        if s.phase == 1:
            assert cmd[cmd.index("--max-total-tokens") + 1] == str(s.pool_tokens)
        if "int2" in s.args:
            assert cmd[cmd.index("--kv-cache-dtype") + 1] == "int2"
    # the sizing pair: same fraction, no pool cap, group 128 for int2
    lb, li = servers.launch_command(by["long-bf16"], "/m"), servers.launch_command(by["long-int2"], "/m")
    assert "--max-total-tokens" not in lb + li
    assert lb[lb.index("--mem-fraction-static") + 1] == li[li.index("--mem-fraction-static") + 1] == "0.5"
    assert li[li.index("--kv-cache-quant-group-size") + 1] == "128" and "--kv-cache-dtype" not in lb
    fi = servers.launch_command(by["bad-flag-flashinfer"], "/m")
    assert fi[fi.index("--attention-backend") + 1] == "flashinfer"
    # BF16 logits of the tiny models tie: every server computes float32 logits unless asked not to
    assert all("--enable-fp32-lm-head" in s.args for s in specs)
    plain = servers.server_specs(config.parse_args(["--only", "a", "--no-fp32-lm-head", "--server-args", "--log-level debug"]), rot)
    assert all("--enable-fp32-lm-head" not in s.args and s.args[-2:] == ["--log-level", "debug"] for s in plain)
    dp = servers.launch_command(by["bad-flag-dp-attention"], "/m")
    assert dp[dp.index("--dp-size") + 1] == "2"  # dp 1 would silently turn dp-attention off upstream
    full = by["qwen3-int2-full"].args
    assert full[full.index("--oscar-sink-tokens") + 1] == str(config.B_SINK)
    assert full[full.index("--oscar-rotation") + 1] == rot["qwen3:identity"]
    assert max(args.b_lens) + args.greedy_tokens <= config.B_SINK  # check b really quantizes nothing
    tp2 = servers.launch_command(by["qwen3-int2-head-tp2"], "/m")
    assert tp2[tp2.index("--tp-size") + 1] == "2" and "--oscar-rotation" in tp2
    assert set(servers.server_specs(config.parse_args(["--only", "i"]), rot)[0].checks) == {"i"}
    # --int2-args reach the int2 servers only (e.g. the einsum rotate engine)
    eng = servers.server_specs(config.parse_args(["--int2-args", "--oscar-rotate-engine torch"]), rot)
    with_int2 = [sp for sp in eng if "int2" in sp.args]
    assert with_int2 and all(sp.args[sp.args.index("--oscar-rotate-engine") + 1] == "torch" for sp in with_int2)
    assert all("--oscar-rotate-engine" not in sp.args for sp in eng if "int2" not in sp.args)
    # --dtype float32 servers only with --c-fp32, used by c alone
    assert not any("--dtype" in s.args or s.name in fp32_shim.C_FP32_SERVERS.values() for s in specs)


def test_c_fp32_server_specs(tmp_path):
    rot = {f"{m}:{k}": f"/r/{m}_{k}.safetensors" for m in ("qwen3", "moe", "llama")
           for k in ("layer", "head", "identity", "mismatch")}
    plain = {s.name: s for s in servers.server_specs(config.parse_args(["--tp2", "--out", str(tmp_path)]), rot)}
    args = config.parse_args(["--tp2", "--c-fp32", "--out", str(tmp_path)])
    specs = servers.server_specs(args, rot)
    by = {s.name: s for s in specs}
    names = [s.name for s in specs]
    assert len(names) == len(set(names)) and len({s.port for s in specs}) == len(specs)
    fp32 = [*fp32_shim.C_FP32_SERVERS.values(), fp32_shim.C_FP32_FLOOR]
    assert set(fp32) <= set(by) and set(by) - set(fp32) == set(plain)
    # the servers shared with d and h are untouched (same flags, checks and environment)
    for name in plain:
        assert (by[name].args, by[name].checks, by[name].env, by[name].phase) == (
            plain[name].args, plain[name].checks, plain[name].env, plain[name].phase)
    assert by["qwen3-int2-layer"].checks == "cd" and by["qwen3-int2-head"].checks == "ch"
    only_d = {s.name for s in servers.server_specs(config.parse_args(["--only", "d", "--c-fp32", "--out", str(tmp_path)]),
                                                      rot)}
    assert "qwen3-int2-layer-fp32" in only_d and "qwen3-int2-head-fp32" not in only_d and "qwen3-fp32" not in only_d
    shim = fp32_shim.fp32_shim_dir(args.work)
    for name in fp32:
        s = by[name]
        cmd = servers.launch_command(s, "/m", "py")
        # d judges its radix hit on the fp32 layer server
        assert s.checks == ("cd" if name.endswith("-int2-layer-fp32") else "c") and s.phase == 1
        assert cmd[cmd.index("--dtype") + 1] == "float32"
        path = s.env["PYTHONPATH"].split(os.pathsep)
        assert path[0] == shim and s.env["TRITON_F32_DEFAULT"] == "ieee"
        assert "--enable-fp32-lm-head" in s.args
    for kind, name in fp32_shim.C_FP32_SERVERS.items():
        a = by[name].args
        assert a[a.index("--kv-cache-dtype") + 1] == "int2" and a[a.index("--oscar-rotation") + 1] == rot[f"qwen3:{kind}"]
        assert a[a.index("--oscar-sink-tokens") + 1] == str(config.C_SINK)
        assert a[a.index("--oscar-recent-tokens") + 1] == str(config.C_RECENT)
        # the same flags as the BF16 server of the same rotation, plus --dtype float32 and fp32 pairs
        assert a[a.index("--oscar-scale-dtype") + 1] == config.C_FP32_SCALE_DTYPE == "float32"
        base = by[f"qwen3-int2-{kind}"].args
        assert [x for x in a if x not in ("--dtype", "float32", "--oscar-scale-dtype")] == base
    assert "--kv-cache-dtype" not in by[fp32_shim.C_FP32_FLOOR].args
    # c not selected: no fp32 servers of c's even with --c-fp32, d's fp32 layer server only with d
    assert not set(fp32) & {s.name for s in servers.server_specs(config.parse_args(["--only", "a,b", "--c-fp32"]), rot)}


def test_dry_run_prints_every_server(capsys):
    assert entry.main(["--dry-run", "--only", "f,i", "--python", "py"]) == 0
    out = capsys.readouterr().out.splitlines()
    heads = [ln for ln in out if ln.startswith("# ")]
    assert len(heads) == 7 and any("long-int2 [f]" in h for h in heads)
    cmds = [shlex.split(ln) for ln in out if not ln.startswith("# ")]
    assert all(c[:3] == ["py", "-m", "sglang.launch_server"] for c in cmds)


def test_plugin_entry_point_is_seen():
    ep = servers.plugin_entry_point()
    assert ep["oscar"] and ep["value"] == "sglang_oscar.plugin:register" and "oscar" not in ep["others"]


def test_budget_exhaustion_is_reported_as_not_run(tmp_path):
    """A check the --budget left no time for is SKIP (not run, and not a pass), not FAIL."""
    assert results.unevaluated_status({"long-int2": f"server not healthy after 22 s (x; {config.BUDGET_CUT}; rerun)"}) \
        == config.SKIP
    assert results.unevaluated_status({"long-bf16": "time budget of 370 s used up",
                                    "long-int2": f"not healthy ({config.BUDGET_CUT})"}) == config.SKIP
    assert results.unevaluated_status({"long-int2": "exited with code 1: CUDA out of memory"}) == config.FAIL
    assert results.unevaluated_status({}) == config.FAIL
    run = Run(config.parse_args(["--only", "a", "--budget", "1", "--out", str(tmp_path / "o")]))
    run.deadline = time.time() - 1.0
    run.run_check("a", lambda r: pytest.fail("must not run"))
    res = run.results["a"]
    assert res.status == config.SKIP and "--only a" in res.measured


def test_server_on_a_busy_port_reports_it_and_never_starts(tmp_path):
    """The shared launcher refuses a busy port (another server would answer); the harness records it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        spec = servers.ServerSpec("busy", "qwen3", [], "a", port=s.getsockname()[1], mem_fraction=0.4)
        srv = servers.Server(spec, "/m", str(tmp_path), "python").start()
        assert srv.proc is None and "already in use" in srv.error and not srv.alive()
        assert srv.wait_healthy(1.0) is False and srv.stop() is None


def test_smoke_servers_and_agreement():
    argv = smoke.server_argv("/m", 31002, smoke.SERVERS["int2_small_windows"])
    assert argv[1:3] == ["-m", "sglang.launch_server"] and argv[argv.index("--port") + 1] == "31002"
    assert argv.count("--kv-cache-dtype") == 1 and argv[argv.index("--kv-cache-dtype") + 1] == "int2"
    assert argv[argv.index("--oscar-sink-tokens") + 1] == "16" and argv[argv.index("--oscar-recent-tokens") + 1] == "32"
    assert smoke.server_argv("/m", 1, smoke.SERVERS["bf16"])[-2:] == ["--kv-cache-dtype", "auto"]
    assert smoke.agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == 0.75


def test_server_start_log_and_exit_of_a_failing_launch(tmp_path):
    """A launch that fails at once (a stand-in interpreter): the log starts with the command line,
    the exit is time-stamped, and the error names the exit code and the log's last error line."""
    fake = tmp_path / "fake_python"
    fake.write_text("#!/bin/sh\necho 'starting'\necho 'ValueError: --kv-cache-quant-group-size 48 is not supported'\nexit 3\n")
    fake.chmod(0o755)
    spec = servers.ServerSpec("bad", "qwen3", ["--kv-cache-dtype", "int2"], "i", port=_free_port(), mem_fraction=0.4,
                              env={"SGLANG_PLUGINS": "x"})
    srv = servers.Server(spec, "/m", str(tmp_path / "logs"), str(fake)).start()
    assert srv.wait_healthy(30.0) is False
    assert srv.error == "exited with code 3: ValueError: --kv-cache-quant-group-size 48 is not supported"
    assert srv.wait_exit(30.0) == 3 and srv.t_exit is not None and srv.t_exit >= srv.t_start
    log = srv.log_text().splitlines()
    assert log[0].startswith("$ SGLANG_PLUGINS=x ") and shlex.split(log[0])[2:5] == [str(fake), "-m", "sglang.launch_server"]
    assert log[1:] == ["starting", "ValueError: --kv-cache-quant-group-size 48 is not supported"]
    assert srv.stop() == 3 and not srv.alive()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_families_option_servers_and_dry_run(tmp_path, capsys):
    """--families gemma3,gemma4: every check's servers per family (gemma4's carry SGLang's Gemma-4
    remap), the one-head-dim bad launch, a sizing pair per family for f; qwen3 servers gone."""
    import json

    from .run import needed_models

    assert config.parse_args([]).families == ["qwen3", "moe", "llama"]
    for bad in (["--families", "gpt2"], ["--families", "long"], ["--families", ""], ["--tp2", "--families", "moe,llama"]):
        with pytest.raises(SystemExit):
            config.parse_args(bad)
    args = config.parse_args(["--only", "a,b,c,d,e,f,i", "--families", "gemma3,gemma4", "--c-fp32", "--out", str(tmp_path)])
    assert config.main_families(args) == ["gemma3", "gemma4"]
    assert config.main_families(config.parse_args(["--families", "moe,llama"])) == ["moe"]
    assert config.c_prompt_lens(args, "gemma4") == [4 * config.SWA_WINDOW, 1024, 1800]
    assert config.c_prompt_lens(args, "qwen3") == [1024, 1800]
    assert needed_models(args.checks, args.families) == ["gemma3", "gemma4"]
    assert needed_models(list("abcdefgi")) == ["qwen3", "moe", "llama", "long"]  # the default, unchanged
    rot = {f"{m}:{k}": f"/r/{m}_{k}" for m in ("gemma3", "gemma4") for k in ("layer", "head", "identity", "mismatch")}
    rot["gemma4:onedim"] = "/r/gemma4_onedim"
    specs = servers.server_specs(args, rot)
    by = {s.name: s for s in specs}
    assert len(by) == len(specs) and len({s.port for s in specs}) == len(specs)
    assert not any(s.model in ("qwen3", "long") for s in specs)
    for m in ("gemma3", "gemma4"):
        for suffix in ("plugin-off", "bf16", "int2-full", "int2-layer", "int2-head", "int2-layer-fp32", "int2-head-fp32",
                       "fp32", "int2-layer-chunk64", "int2-layer-eager", "int2-load", "bf16-load", "sizing-bf16",
                       "sizing-int2"):
            assert by[f"{m}-{suffix}"].model == m, suffix
        assert by[f"{m}-int2-layer"].args[by[f"{m}-int2-layer"].args.index("--oscar-rotation") + 1] == rot[f"{m}:layer"]
        assert by[f"{m}-sizing-int2"].phase == 2 and by[f"{m}-sizing-int2"].checks == "f"
        # b's BF16 baseline decodes over the HF window (window shim); a keeps SGLang's own server
        hw = by[f"{m}-bf16-hf-window"]
        assert hw.checks == "b" and hw.env[window_shim.WINDOW_ENV] == "1" and by[f"{m}-bf16"].checks == "ac"
        assert hw.env["PYTHONPATH"].split(os.pathsep)[0] == fp32_shim.fp32_shim_dir(args.work) and not by[f"{m}-bf16"].env
    for s in specs:
        has = "--json-model-override-args" in s.args
        assert has == (s.model == "gemma4"), s.name
        if has:
            remap = json.loads(s.args[s.args.index("--json-model-override-args") + 1])
            assert remap == {"head_dim": 256, "num_key_value_heads": 1, "swa_head_dim": 128, "swa_v_head_dim": 128,
                             "swa_num_key_value_heads": 2}
    bad = {s.name: s for s in specs if s.expect_fail}
    assert set(bad) == {"bad-rotation-other-model", "bad-rotation-missing", "bad-group-size", "bad-flag-flashinfer",
                        "bad-flag-dp-attention", "gemma4-bad-rotation-other-model", "gemma4-bad-rotation-one-head-dim"}
    assert bad["bad-group-size"].model == "gemma3"  # generic cases: not on gemma4 (SGLang asserts its backends)
    one = bad["gemma4-bad-rotation-one-head-dim"]
    assert one.case == "bad-rotation-one-head-dim" and one.args[one.args.index("--oscar-rotation") + 1] == rot["gemma4:onedim"]
    # the dry run lists them, with the checkpoint of each family
    assert entry.main(["--dry-run", "--only", "b,i", "--families", "gemma3,gemma4", "--python", "py"]) == 0
    out = capsys.readouterr().out.splitlines()
    heads = [ln for ln in out if ln.startswith("# ")]
    assert any(h.startswith("# gemma4-int2-full [b]") for h in heads) and any("one-head-dim" in h for h in heads)
    cmds = [shlex.split(ln) for ln in out if not ln.startswith("# ")]
    assert {c[c.index("--model-path") + 1].rsplit("-", 1)[-1] for c in cmds} == {"gemma3", "gemma4"}


def test_sink_and_hybrid_families_servers_and_dry_run(tmp_path, capsys):
    """--families gpt_oss,qwen3_next: every check's servers per family (no config remap), the
    generic bad launches on qwen3_next (SGLang asserts its own backend list for GPT-OSS), each
    family's own bad rotation (gpt_oss centred, qwen3_next linear layers), a sizing pair per family
    for f; c leads with a prompt 4x the window on gpt_oss only."""
    from .run import needed_models

    fams = ("gpt_oss", "qwen3_next")
    args = config.parse_args(["--only", "a,b,c,d,e,f,i", "--families", ",".join(fams), "--out", str(tmp_path)])
    assert config.main_families(args) == list(fams) and needed_models(args.checks, args.families) == list(fams)
    assert config.c_prompt_lens(args, "gpt_oss") == [4 * config.SWA_WINDOW, 1024, 1800]
    assert config.c_prompt_lens(args, "qwen3_next") == [1024, 1800]
    rot = {f"{m}:{k}": f"/r/{m}_{k}" for m in fams for k in ("layer", "head", "identity", "mismatch")}
    rot.update({"gpt_oss:centred": "/r/gpt_oss_centred", "qwen3_next:linear": "/r/qwen3_next_linear"})
    specs = servers.server_specs(args, rot)
    by = {s.name: s for s in specs}
    assert len(by) == len(specs) and len({s.port for s in specs}) == len(specs)
    for m in fams:
        for suffix in ("plugin-off", "bf16", "int2-full", "int2-layer", "int2-head", "int2-layer-chunk64",
                       "int2-layer-eager", "int2-load", "bf16-load", "sizing-bf16", "sizing-int2"):
            assert by[f"{m}-{suffix}"].model == m, suffix
        assert by[f"{m}-sizing-int2"].phase == 2 and by[f"{m}-sizing-int2"].checks == "f"
    assert not any("--json-model-override-args" in s.args for s in specs)
    # b's baseline: the HF window for the sliding-window family only
    assert "gpt_oss-bf16-hf-window" in by and "qwen3_next-bf16-hf-window" not in by and "qwen3_next-bf16" in by
    # qwen3_next servers that start together get a fixed state pool; the sizing pair keeps SGLang's split
    for s in specs:
        if s.model == "qwen3_next" and not s.expect_fail:
            a = s.args
            fixed = a[a.index("--max-mamba-cache-size") + 1] if "--max-mamba-cache-size" in a else None
            assert fixed == (str(families.STATE_SLOTS_PER_REQUEST * s.max_running) if s.phase == 1 else None), s.name
    assert by["qwen3_next-int2-load"].max_running == args.load_requests
    # f's group size divides every head_dim (gpt_oss: 64)
    for m, g in (("gpt_oss", "64"), ("qwen3_next", "128")):
        a = by[f"{m}-sizing-int2"].args
        assert a[a.index("--kv-cache-quant-group-size") + 1] == g
    bad = {s.name: s for s in specs if s.expect_fail}
    assert set(bad) == {"bad-rotation-other-model", "bad-rotation-missing", "bad-group-size", "bad-flag-flashinfer",
                        "bad-flag-dp-attention", "gpt_oss-bad-rotation-other-model", "gpt_oss-bad-rotation-centred",
                        "bad-rotation-linear-layers"}  # qwen3_next's cases: no prefix (the generic family)
    assert bad["bad-group-size"].model == bad["bad-rotation-linear-layers"].model == "qwen3_next"  # not gpt_oss
    for name, key in (("gpt_oss-bad-rotation-centred", "gpt_oss:centred"), ("bad-rotation-linear-layers", "qwen3_next:linear")):
        s = bad[name]
        assert s.case == name.replace("gpt_oss-", "") and s.args[s.args.index("--oscar-rotation") + 1] == rot[key]
    alone = {s.name for s in servers.server_specs(config.parse_args(["--only", "i", "--families", "gpt_oss"]), rot)}
    assert alone == {"bad-rotation-other-model", "bad-rotation-missing", "bad-group-size", "bad-flag-dp-attention",
                     "bad-rotation-centred"}  # no flashinfer case: SGLang refuses it for GPT-OSS itself
    assert entry.main(["--dry-run", "--only", "b,f,i", "--families", ",".join(fams), "--python", "py"]) == 0
    out = capsys.readouterr().out.splitlines()
    heads = [ln for ln in out if ln.startswith("# ")]
    for h in ("# gpt_oss-int2-full [b]", "# qwen3_next-sizing-int2 [f]", "# gpt_oss-bad-rotation-centred [i]",
              "# bad-rotation-linear-layers [i]"):
        assert any(x.startswith(h) for x in heads), h
    cmds = [shlex.split(ln) for ln in out if not ln.startswith("# ")]
    assert {c[c.index("--model-path") + 1].rsplit("-", 1)[-1] for c in cmds} == set(fams)
    assert any(c[c.index("--oscar-rotation") + 1].endswith("rot-gpt_oss/rot_centred.safetensors")
               for c in cmds if "--oscar-rotation" in c)


def test_minimax_m2_family_servers():
    """--families minimax_m2: a-e and i on its servers (the generic bad launches too: SGLang has no
    backend assert of its own for MiniMax), a sizing pair for f, no HF-window baseline (no sliding
    window), no fixed state pool (no linear-attention layers)."""
    args = config.parse_args(["--only", "a,b,c,d,e,f,i", "--families", "minimax_m2"])
    assert config.main_families(args) == ["minimax_m2"] and config.c_prompt_lens(args, "minimax_m2") == [1024, 1800]
    rot = {f"minimax_m2:{k}": f"/r/{k}" for k in ("layer", "head", "identity", "mismatch")}
    by = {s.name: s for s in servers.server_specs(args, rot)}
    for suffix in ("plugin-off", "bf16", "int2-full", "int2-layer", "int2-head", "int2-layer-chunk64",
                   "int2-layer-eager", "int2-load", "bf16-load", "sizing-bf16", "sizing-int2"):
        assert by[f"minimax_m2-{suffix}"].model == "minimax_m2", suffix
    assert servers.b_baseline("minimax_m2") == "minimax_m2-bf16" and by["minimax_m2-bf16"].checks == "abc"
    assert {"bad-rotation-other-model", "bad-group-size", "bad-flag-flashinfer"} <= {s.name for s in by.values() if s.expect_fail}
    assert not any("--max-mamba-cache-size" in s.args or "--json-model-override-args" in s.args for s in by.values())
    a = by["minimax_m2-sizing-int2"].args
    assert a[a.index("--kv-cache-quant-group-size") + 1] == "128" and by["minimax_m2-sizing-int2"].phase == 2


def test_qwen3_5_family_servers_and_dry_run(tmp_path, capsys):
    """--families qwen3_5 --c-fp32 (its device call, docs/e2e_models.md): qwen3_next's treatment on
    the Qwen3.5 wrapper's folder -- 14 concurrent servers (fp32 twins for b and d's chunk 64: a routed
    MoE) with a fixed state pool, the generic bad launches on it (SGLang asserts no backend list of its
    own for Qwen3.5) plus its linear-layers file, f's sizing pair alone with SGLang's own state split;
    the dry run lists them."""
    from .run import needed_models

    args = config.parse_args(["--only", "a,b,c,d,e,f,i", "--families", "qwen3_5", "--c-fp32", "--out", str(tmp_path)])
    assert config.main_families(args) == ["qwen3_5"] and needed_models(args.checks, args.families) == ["qwen3_5"]
    assert config.c_prompt_lens(args, "qwen3_5") == [1024, 1800]
    rot = {f"qwen3_5:{k}": f"/r/{k}" for k in ("layer", "head", "identity", "mismatch", "linear")}
    specs = servers.server_specs(args, rot)
    phase1 = {s.name for s in specs if s.phase == 1 and not s.expect_fail}
    assert phase1 == {f"qwen3_5-{x}" for x in (
        "plugin-off", "bf16", "int2-full", "fp32", "int2-full-fp32", "int2-layer", "int2-head", "int2-layer-fp32",
        "int2-head-fp32", "int2-layer-chunk64-fp32", "int2-layer-chunk64", "int2-layer-eager", "int2-load",
        "bf16-load")}
    for s in specs:
        a = s.args
        fixed = a[a.index("--max-mamba-cache-size") + 1] if "--max-mamba-cache-size" in a else None
        assert fixed == (str(families.STATE_SLOTS_PER_REQUEST * s.max_running) if s.name in phase1 else None), s.name
        assert "--json-model-override-args" not in a and s.model == "qwen3_5"
    bad = {s.name: s for s in specs if s.expect_fail}
    assert set(bad) == {"bad-rotation-other-model", "bad-rotation-missing", "bad-group-size", "bad-flag-flashinfer",
                        "bad-flag-dp-attention", "bad-rotation-linear-layers"}
    lin = bad["bad-rotation-linear-layers"].args
    assert lin[lin.index("--oscar-rotation") + 1] == "/r/linear"
    sizing = [s for s in specs if s.phase == 2]
    assert [s.name for s in sizing] == ["qwen3_5-sizing-bf16", "qwen3_5-sizing-int2"]
    assert sizing[1].args[sizing[1].args.index("--kv-cache-quant-group-size") + 1] == "128"
    assert entry.main(["--dry-run", "--only", "c,i", "--families", "qwen3_5", "--python", "py"]) == 0
    out = capsys.readouterr().out.splitlines()
    heads = [ln for ln in out if ln.startswith("# ")]
    assert any(h.startswith("# qwen3_5-int2-head [c]") for h in heads)
    assert any(h.startswith("# bad-rotation-linear-layers [i]") for h in heads)
    cmds = [shlex.split(ln) for ln in out if not ln.startswith("# ")]
    assert {c[c.index("--model-path") + 1].rsplit("/", 1)[-1] for c in cmds} == {"tiny-qwen3_5"}
    assert any(c[c.index("--oscar-rotation") + 1].endswith("rot-qwen3_5/rot_linear.safetensors")
               for c in cmds if "--oscar-rotation" in c)



def test_routed_family_fp32_twins_and_skip_sliding_sizing(tmp_path):
    """--c-fp32 on gpt_oss (MoE, hybrid SWA): b's fp32 pair (baseline with the window shim's and the
    fp32 shim's environment; fp32 MoE runner), d's fp32 chunk-64 twin, and f's skip-sliding sizing
    server; none of them for gemma3 (no MoE, one pool)."""
    from .fp32_shim import FP32_FAMILY_ARGS
    from .window_shim import WINDOW_ENV

    rot = {f"{m}:{k}": f"/r/{m}_{k}" for m in ("gpt_oss", "gemma3") for k in ("layer", "head", "identity", "mismatch")}
    args = config.parse_args(["--only", "b,c,d,f", "--families", "gpt_oss,gemma3", "--c-fp32", "--out", str(tmp_path)])
    by = {s.name: s for s in servers.server_specs(args, rot)}
    base, full = by["gpt_oss-fp32-hf-window"], by["gpt_oss-int2-full-fp32"]
    for s in (base, full):
        assert s.checks == "b" and s.args[s.args.index("--dtype") + 1] == "float32"
        assert s.args[s.args.index("--moe-runner-backend") + 1] == FP32_FAMILY_ARGS["gpt_oss"][1]
        assert s.env["TRITON_F32_DEFAULT"] == "ieee"
    assert base.env[WINDOW_ENV] == "1" and WINDOW_ENV not in full.env
    assert full.args[full.args.index("--oscar-rotation") + 1] == rot["gpt_oss:identity"]
    chunk = by["gpt_oss-int2-layer-chunk64-fp32"]
    assert chunk.checks == "d" and chunk.args[chunk.args.index("--chunked-prefill-size") + 1] == "64"
    skip = by["gpt_oss-sizing-int2-skip-sliding"]
    assert skip.phase == 2 and skip.args[skip.args.index("--oscar-skip-layers") + 1] == "sliding"
    assert not {n for n in by if n.startswith("gemma3-") and ("fp32-hf-window" in n or "full-fp32" in n
                                                               or "chunk64-fp32" in n or "skip-sliding" in n)}


def test_sigterm_exits_once_and_restores_the_handler():
    """A device call's timeout: timeout(1) signals the command, then its process group. The first
    SIGTERM exits (128 + 15) through the caller's ``finally``, the second one arrives there and is
    ignored, and the previous handler is back after the block."""
    import signal

    from sglang_oscar.serving_launcher import sigterm_exits

    before, reached = signal.getsignal(signal.SIGTERM), []
    with pytest.raises(SystemExit) as info:
        with sigterm_exits():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(5)  # interrupted: the handler runs in this (main) thread
                reached.append("slept through")
            finally:
                assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                reached.append("finally done")
    assert info.value.code == 128 + signal.SIGTERM and reached == ["finally done"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_stop_all_stops_every_server_at_once_with_its_grace():
    """Four servers wait for each other inside ``stop`` (a barrier): only parallel stops get through,
    and ``grace`` reaches each one (the server's own default when not given)."""
    import threading

    from sglang_oscar.serving_launcher import stop_all

    barrier, graces = threading.Barrier(4, timeout=30), []

    class FakeServer:
        def stop(self, grace=15.0):
            barrier.wait()
            graces.append(grace)

    stop_all([FakeServer() for _ in range(4)], grace=30.0)
    stop_all(FakeServer() for _ in range(4))
    stop_all([])
    assert graces == [30.0] * 4 + [15.0] * 4


def test_tree_commit_prefers_the_callers_commit(tmp_path, monkeypatch):
    """$OSCAR_COMMIT names the tree (a device copy's .git can be stale); without it, git's HEAD of the
    folder; outside a repository, None."""
    import subprocess

    from sglang_oscar.serving_launcher import tree_commit

    from .config import ROOT

    monkeypatch.setenv("OSCAR_COMMIT", "abc1234")
    assert tree_commit(tmp_path) == "abc1234"
    monkeypatch.delenv("OSCAR_COMMIT")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert tree_commit(ROOT) == head and len(head) >= 7
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert tree_commit(tmp_path) is None


def test_score_std_per_family(tmp_path):
    """Gemma-4's tiny checkpoint is sharpened to scores of std 1.0 (its oracle is reproducible there),
    the others to 1.5; --score-std, when given, holds for every family."""
    args = config.parse_args(["--out", str(tmp_path)])
    assert [config.score_std_of(args, f) for f in ("qwen3", "gemma3", "gemma4", "gpt_oss")] == [1.5, 1.5, 1.0, 1.5]
    args = config.parse_args(["--out", str(tmp_path), "--score-std", "1.2"])
    assert {config.score_std_of(args, f) for f in ("qwen3", "gemma4")} == {1.2}
