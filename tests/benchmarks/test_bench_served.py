"""CPU tests of benchmarks/bench_served.py: configs, server commands, the plan (selectors, pool fit,
budget), the throughput arithmetic, the report; a fake streaming server stands in for SGLang."""

from __future__ import annotations

import http.server
import importlib.util
import json
import shlex
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load_script(name: str):
    """benchmarks/<name>.py by path (``benchmarks`` may also name this test folder on sys.path), as the
    script imports its report module when run as a file."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up; bench_served imports the report
    spec.loader.exec_module(mod)
    return mod


report = _load_script("bench_served_report")
models = _load_script("served_models")
bs = _load_script("bench_served")

PUBLISHED = {  # Hugging Face config.json values of the three models
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8),
    "qwen3-32b": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1),
}


def dry(capsys, *argv) -> tuple[list[list[str]], str]:
    assert bs.main(["--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    return [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("$ ")], out


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("model", bs.MODELS)
def test_configs_are_the_published_qwen3_shapes(model, tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text((bs.CONFIG_DIR / f"{model}.json").read_text())
    cfg = transformers.AutoConfig.from_pretrained(str(tmp_path))
    moe = model.endswith("a3b")
    assert type(cfg).__name__ == ("Qwen3MoeConfig" if moe else "Qwen3Config")
    for key, value in PUBLISHED[model].items():
        assert getattr(cfg, key) == value, key
    assert cfg.head_dim == 128 and cfg.vocab_size == 151936 and cfg.tie_word_embeddings is False
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    assert theta == 1_000_000
    # 128K prompts plus the new tokens without RoPE scaling (published: 40960 with YaRN x4)
    assert cfg.max_position_embeddings >= 131072 + 4096
    assert not cfg.use_sliding_window and cfg.num_hidden_layers == cfg.max_window_layers
    s = bs.Shape.load(model)
    total = {"qwen3-8b": 8.19e9, "qwen3-32b": 32.8e9, "qwen3-30b-a3b": 30.5e9}[model]
    assert abs(s.params - total) / total < 0.01  # the published parameter counts
    if moe:
        assert abs(s.matmul_params - 3.0e9) / 3.0e9 < 0.1  # "A3B": ~3B active (+ lm_head)


def test_dry_run_commands(capsys):
    cmds, out = dry(capsys, "--models", "qwen3-8b", "--server-args", "--foo 1", "--int2-args=--oscar-recent-tokens 128")
    assert len(cmds) == 3
    kv = {flag(c, "--kv-cache-dtype"): c for c in cmds}
    assert set(kv) == {"auto", "fp8_e4m3", "int2"}
    for c in cmds:
        assert c[1:3] == ["-m", "sglang.launch_server"]
        assert flag(c, "--load-format") == "dummy" and "--skip-tokenizer-init" in c
        assert flag(c, "--attention-backend") == "triton" and "--disable-radix-cache" in c
        assert flag(c, "--mem-fraction-static") == "0.85"  # one fraction for every format
        assert flag(c, "--cuda-graph-max-bs-decode") == "32" and flag(c, "--max-running-requests") == "32"
        assert "--disable-cuda-graph" not in c and "--disable-decode-cuda-graph" not in c
        assert flag(c, "--model-path").endswith("qwen3-8b") and c[c.index("--foo") + 1] == "1"
    assert "--oscar-recent-tokens" in kv["int2"] and "--oscar-recent-tokens" not in kv["auto"]
    assert len({flag(c, "--port") for c in cmds}) == 3
    assert "estimated wall time" in out and "planned" in out


def test_flashinfer_server_and_fraction(capsys):
    cmds, _ = dry(capsys, "--models", "qwen3-8b", "--formats", "bf16,int2", "--with-flashinfer",
                  "--mem-fraction-static", "0.6")
    backends = sorted((flag(c, "--kv-cache-dtype"), flag(c, "--attention-backend")) for c in cmds)
    assert backends == [("auto", "flashinfer"), ("auto", "triton"), ("int2", "triton")]
    assert {flag(c, "--mem-fraction-static") for c in cmds} == {"0.6"}


def test_plan_respects_selectors():
    a = bs.parse_args(["--models", "qwen3-32b", "--formats", "int2", "--contexts", "8K,131072", "--batches", "1,32",
                       "--budget", "100000"])
    plans = bs.make_plan(a)
    assert [(p.model, p.fmt) for p in plans] == [("qwen3-32b", "int2")]
    decode = {(i["context"], i["batch"]) for i in plans[0].items if i["kind"] == "decode"}
    assert decode == {(8192, 1), (8192, 32), (131072, 1), (131072, 32)}
    # TTFT of 32K is measured on its own (8K comes from the 8K x 1 decode point)
    assert [(i["context"], i["batch"]) for i in plans[0].items if i["kind"] == "ttft"] == [(32768, 1)]
    assert plans[0].items[0]["kind"] == "ttft"
    with pytest.raises(SystemExit):
        bs.parse_args(["--models", "llama-70b"])


def test_plan_skips_what_cannot_fit():
    a = bs.parse_args(["--budget", "100000"])
    plans = {p.name: p for p in bs.make_plan(a)}
    status = {(n, i["context"], i["batch"]): i["status"] for n, p in plans.items() for i in p.items}
    for fmt in ("bf16", "fp8", "int2"):  # 128K x 32 fits no 32B pool: 4.2M tokens
        assert status[(f"qwen3-32b-{fmt}", 131072, 32)].startswith("skip: does not fit")
    assert status[("qwen3-32b-int2", 131072, 8)] == "planned"
    assert status[("qwen3-32b-bf16", 131072, 8)].startswith("skip: does not fit")
    assert status[("qwen3-8b-bf16", 131072, 1)] == "planned"
    assert status[("qwen3-8b-int2", 131072, 32)] == "planned"  # ~39 x 128K in the int2 pool
    # capacity estimate: int2 holds ~7x the BF16 tokens at the same fraction (BF16 windows reserved)
    ratio = plans["qwen3-8b-int2"].est_pool_tokens / plans["qwen3-8b-bf16"].est_pool_tokens
    assert 6.0 < ratio < 7.2


def test_plan_budget_cheapest_first_and_same_points_for_all_formats():
    a = bs.parse_args(["--models", "qwen3-8b", "--budget", "400"])
    plans = bs.make_plan(a)
    planned = [{(i["context"], i["batch"]) for i in p.items if i["status"] == "planned"} for p in plans]
    assert (8192, 1) in planned[0] and (131072, 32) not in planned[2]
    assert planned[1] == planned[2]  # FP8 and int2 run the same points; BF16 a subset (its pool is smaller)
    assert planned[0] <= planned[1]
    costs = [i["est_s"] for i in plans[2].items if i["status"] == "planned"]
    assert costs == sorted(costs)
    tiny = bs.make_plan(bs.parse_args(["--models", "qwen3-8b", "--budget", "60"]))
    assert all(i["status"].startswith("skip") for p in tiny for i in p.items)


def ticks(t0, first, step, n, start=1):
    return [(first + k * step, start + k) for k in range(n)]


def test_summarize_window_throughput():
    # request A decodes from t=1 (10 tok/s), B from t=3 (10 tok/s); both run from t=3 to A's end at t=6
    recs = [{"t0": 0.0, "ticks": ticks(0, 1.0, 0.1, 51)}, {"t0": 0.0, "ticks": ticks(0, 3.0, 0.1, 51)}]
    r = bs.summarize(recs)
    assert r["ttft_s"] == [1.0, 3.0] and r["prefill_all_s"] == 3.0
    assert r["window_s"] == pytest.approx(3.0)
    assert r["decode_tok_s"] == pytest.approx(20.0, rel=0.05)  # two requests at 10 tok/s each
    assert r["per_request_tok_s"] == pytest.approx(10.0)
    assert r["completion_tokens"] == [51, 51]


def fake_results():
    def server(fmt, pool, tps, ttft):
        runs = [{"kind": "decode", "context": 8192, "batch": 1, "new_tokens": 66, "status": "ok",
                 "decode_tok_s": tps, "ttft_s": [ttft]},
                {"kind": "decode", "context": 131072, "batch": 8, "new_tokens": 200, "status": "skip: does not fit"}]
        return {"name": f"m-{fmt}", "model": "m", "format": fmt, "status": "ok", "runs": runs,
                "capacity": {"max_total_num_tokens": pool, "concurrent": {"128K": pool // 131136}}}

    return {"meta": {"date": "d", "commit": "c", "argv": ["bench_served.py"]},
            "servers": [server("bf16", 700000, 100.0, 0.5), server("fp8", 1400000, 133.3, 0.5),
                        server("int2", 4900000, 200.0, 0.6)]}


def test_table_ratios_and_outputs(tmp_path, capsys, monkeypatch):
    res = fake_results()
    table = report.render_table(res)
    assert "| format | KV tokens | 128K reqs | TTFT 8K (s) | 8K x 1 (tok/s) | 128K x 8 (tok/s) |" in table
    int2 = next(line for line in table.splitlines() if line.startswith("| int2"))
    assert "200.0 (2.00x / 1.50x)" in int2 and "4,900,000 (7.00x / 3.50x)" in int2
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as on the CPU box: plots skipped, rest written
    a = bs.parse_args(["--out", str(tmp_path / "out")])
    (tmp_path / "out").mkdir()
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "m-int2.log").write_text("x")
    report.write_outputs(res, a, logs)
    out = capsys.readouterr().out
    assert "plots skipped: matplotlib is not installed" in out
    assert json.loads((tmp_path / "out" / "results.json").read_text())["servers"][2]["format"] == "int2"
    assert "(2.00x / 1.50x)" in (tmp_path / "out" / "results.md").read_text()
    assert (tmp_path / "out" / "logs.tgz").stat().st_size > 0


def test_ratios_take_the_best_baseline_of_each_kind_and_runs_merge(tmp_path, capsys, monkeypatch):
    """int2's ratios use the fastest bf16* / fp8* server of each cell (shortest TTFT); --merge joins runs
    of several device calls, leaving out servers a run skipped and suffixing a repeated format."""
    res = fake_results()
    fast = fake_results()["servers"][0]
    fast.update(format="bf16-t64", name="m-bf16-t64")
    fast["runs"][0].update(decode_tok_s=160.0, ttft_s=[0.4])  # faster decode and TTFT than bf16
    fast["capacity"] = {"max_total_num_tokens": 600000, "concurrent": {"128K": 4}}  # smaller pool
    run2 = {"meta": {"date": "d2", "commit": "c2", "argv": ["bench_served.py", "--formats", "bf16-t64,int2"]},
            "servers": [fast, {"name": "m-int2", "model": "m", "format": "int2", "status": "skip: budget", "runs": []}]}
    paths = []
    no_git = fake_results()
    no_git["meta"]["commit"] = None  # collect_meta's value when git fails
    no_git["servers"] = no_git["servers"][:1]
    for k, r in enumerate((res, run2, fake_results(), no_git)):
        paths.append(str(tmp_path / f"r{k}.json"))
        Path(paths[-1]).write_text(json.dumps(r))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert bs.main(["--merge", ",".join(paths), "--out", str(tmp_path / "out")]) == 0
    merged = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [s["format"] for s in merged["servers"]] == ["bf16", "fp8", "int2", "bf16-t64", "bf16#2", "fp8#2",
                                                         "int2#2", "bf16#3"]
    assert merged["meta"]["commit"] == "c, c2, ?"
    table = (tmp_path / "out" / "results.md").read_text()
    int2 = next(line for line in table.splitlines() if line.startswith("| int2 |"))
    # decode 200 / best BF16 160, TTFT 0.6 / best 0.4, pool 4.9M / best 700K (bf16's, not the t64 one)
    assert "200.0 (1.25x / 1.50x)" in int2 and "0.600 (1.50x / 1.20x)" in int2 and "(7.00x / 3.50x)" in int2
    assert "commit c2: `bench_served.py --formats bf16-t64,int2`" in table
    cmds, _ = dry(capsys, "--models", "qwen3-8b", "--formats", "bf16-t64,fp8-t64")
    assert all(flag(c, "--triton-attention-num-kv-splits") == "64" and flag(c, "--attention-backend") == "triton"
               for c in cmds)


class _Stream(http.server.BaseHTTPRequestHandler):
    """Answers /generate like a --skip-tokenizer-init server: one SSE chunk per token."""

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["sampling_params"]["max_new_tokens"]
        assert body["stream"] and body["sampling_params"]["ignore_eos"] and len(body["input_ids"]) == 64
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(0.05)  # "prefill"
        for k in range(1, n + 1):
            chunk = {"output_ids": [7], "meta_info": {"completion_tokens": k}}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.02)  # long beside a loaded machine's thread start-up
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_measure_against_a_streaming_server():
    pytest.importorskip("sglang_oscar.serving_launcher")  # the repository's launcher (lead merges it)
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stream)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        r = bs.measure(url, 64, 3, 30, time.time() + 30, seed=1)
        assert r["status"].startswith("ok") and r["completion_tokens"] == [30, 30, 30]
        assert 25 < r["decode_tok_s"] < 2 * 3 * 50  # three streams of at most 50 tok/s
        assert bs.measure(url, 64, 1, 400, time.time() + 0.5, seed=1)["status"] == "timeout"
    finally:
        srv.shutdown()


FAKE_SERVER = r'''#!PYTHON
import http.server, json, os, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
kv = sys.argv[sys.argv.index("--kv-cache-dtype") + 1]
pool, rate = POOLS[kv], RATES[kv]
SETUP
print(f"max_total_num_tokens={pool}", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"max_total_num_tokens": pool} if self.path == "/server_info" else {}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ON_REQUEST
        self.send_response(200); self.end_headers()
        time.sleep(len(req["input_ids"]) * PREFILL_S)
        for k in range(1, req["sampling_params"]["max_new_tokens"] + 1):
            self.wfile.write(("data: " + json.dumps({"meta_info": {"completion_tokens": k}}) + "\n\n").encode())
            self.wfile.flush(); time.sleep(rate)
        self.wfile.write(b"data: [DONE]\n\n")
        AFTER_REQUEST
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def write_fake_server(path, pools: dict, rates: dict, *, setup: str = "pass", on_request: str = "pass",
                      after_request: str = "pass", prefill_s: float = 1e-7):
    """An executable at ``path`` standing in for ``python -m sglang.launch_server``: pool size
    (``pools[--kv-cache-dtype]`` tokens, on ``/server_info`` and in the log) and a streamed
    ``/generate`` (``prefill_s`` per prompt token, then one token per ``rates[kv]`` s); ``setup``
    (module level), ``on_request`` / ``after_request`` (in ``do_POST``, ``req`` the body) are lines
    of Python a test adds. Returns ``path``."""
    path.write_text(FAKE_SERVER.replace("PYTHON", sys.executable).replace("POOLS", repr(pools))
                    .replace("RATES", repr(rates)).replace("SETUP", setup).replace("ON_REQUEST", on_request)
                    .replace("AFTER_REQUEST", after_request).replace("PREFILL_S", repr(prefill_s)))
    path.chmod(0o755)
    return path


def test_run_with_fake_servers(tmp_path, capsys, monkeypatch):
    """The whole run (start, health, capacity, warm-up, points, stop, outputs) against fake servers
    that answer like SGLang: int2's 128K x 8 fits only its pool, the table carries the ratios."""
    pytest.importorskip("sglang_oscar.serving_launcher")
    # token gaps long beside a loaded machine's thread start-up: 8K x 8's all-decoding window (32 tokens,
    # ~0.5 s on int2) stays open however late the eighth request starts streaming
    fake = write_fake_server(tmp_path / "fake_python", {"auto": 300000, "fp8_e4m3": 600000, "int2": 2100000},
                             {"auto": 0.06, "fp8_e4m3": 0.03, "int2": 0.015})
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    port = 20000 + (int(time.time() * 1000) % 20000)
    out = tmp_path / "out"
    rc = bs.main(["--models", "qwen3-8b", "--contexts", "8k,128k", "--batches", "1,8", "--ttft-contexts", "32k",
                  "--decode-tokens", "16", "--budget", "100000", "--python", str(fake), "--port", str(port),
                  "--out", str(out), "--work", str(tmp_path / "work"), "--startup-timeout", "30"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    by = {s["format"]: s for s in res["servers"]}
    assert [s["status"] for s in res["servers"]] == ["ok", "ok", "ok"]
    assert by["int2"]["capacity"]["max_total_num_tokens"] == 2100000
    assert by["int2"]["capacity"]["concurrent"]["128K"] == 2100000 // (131072 + 16)
    runs = {(r["context"], r["batch"]): r for r in by["int2"]["runs"]}
    # "ok" or "ok (short decode window)": on a loaded box 8 streams may overlap for few steps
    assert runs[(131072, 8)]["status"].startswith("ok") and runs[(32768, 1)]["kind"] == "ttft"
    assert {(r["context"], r["batch"]): r["status"] for r in by["bf16"]["runs"]}[(131072, 8)].startswith(
        "skip: does not fit (pool 300000")
    bf16 = {(r["context"], r["batch"]): r for r in by["bf16"]["runs"]}
    assert runs[(8192, 8)]["decode_tok_s"] > bf16[(8192, 8)]["decode_tok_s"] > 0  # fake steps: 15 vs 60 ms
    assert (tmp_path / "work" / "qwen3-8b" / "config.json").exists()
    assert "| int2 |" in (out / "results.md").read_text()
    assert (out / "logs.tgz").exists()


def test_commands_parse_with_sglang_and_the_plugin():
    """Every server argv is accepted by SGLang 0.5.16's own parser (plugin flags included), with
    full flag names only, and means what the benchmark says."""
    pytest.importorskip("sglang.srt.server_args")
    from _support.server_args import oscar_server_parser

    a = bs.parse_args(["--models", "qwen3-30b-a3b", "--with-flashinfer", "--int2-args", "--oscar-sink-tokens 64",
                       "--formats", "bf16,fp8,int2,int2-fold"])
    fmts = []
    for p in bs.make_plan(a):
        ns = oscar_server_parser(allow_abbrev=False).parse_args(p.argv[3:])
        fmts.append(p.fmt)
        if bs.FORMATS[p.fmt][0] == "int2":  # the int2 servers alone take --int2-args; int2-fold adds the fold
            assert ns.oscar_sink_tokens == 64 and ns.oscar_fold_rotations == ("on" if p.fmt == "int2-fold" else None)
        assert ns.load_format == "dummy" and ns.skip_tokenizer_init and ns.disable_radix_cache
        assert ns.kv_cache_dtype == bs.FORMATS[p.fmt][0] and ns.attention_backend == bs.FORMATS[p.fmt][1]
        assert ns.disable_prefill_cuda_graph and not getattr(ns, "disable_decode_cuda_graph", False)
        assert ns.chunked_prefill_size == 8192 and ns.mem_fraction_static == 0.85
    assert fmts == ["bf16", "fp8", "int2", "int2-fold", "bf16-fi"]


def test_plots_with_a_stub_matplotlib(tmp_path, monkeypatch):
    """matplotlib is not installed here: a stub records the calls, so the plotting code's own logic runs."""
    from unittest import mock

    plt = mock.MagicMock()
    axes = [[mock.MagicMock() for _ in range(2)]]
    plt.subplots.side_effect = lambda *a, **k: (mock.MagicMock(), axes if k.get("squeeze") is False
                                                 else mock.MagicMock())
    mpl = mock.MagicMock(pyplot=plt)
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    res = fake_results()
    res["servers"][2]["runs"].append({"kind": "decode", "context": 32768, "batch": 8, "status": "ok",
                                      "decode_tok_s": 900.0, "ttft_s": [1.0]})
    assert report.plot(res, tmp_path) == ["decode.png", "capacity.png"]
    int2_line = [c for c in axes[0][0].plot.call_args_list if c.kwargs["label"] == "int2"][0]
    assert int2_line.args == ([8192], [200.0])
    assert axes[0][1].plot.call_args.args == ([32768], [900.0])  # batch 8: only int2 measured
