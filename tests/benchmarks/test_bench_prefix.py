"""CPU tests of benchmarks/bench_prefix.py: server commands (bench_served's, radix cache on), the
load's shape, and a whole run against fake servers that keep a prefix cache like SGLang's radix tree."""

from __future__ import annotations

import json
import shlex
import signal
import socket
import sys

import pytest
from test_bench_served import _load_script

bp = _load_script("bench_prefix")
bs = sys.modules["bench_served"]


def test_server_commands_are_bench_served_ones_with_the_radix_cache(capsys):
    assert bp.main(["--dry-run", "--formats", "bf16-t64,int2-fold", "--concurrency", "48",
                    "--int2-args", "--oscar-sink-tokens 32"]) == 0
    out = capsys.readouterr().out
    cmds = [shlex.split(line[2:]) for line in out.splitlines() if line.startswith("$ ")]
    assert len(cmds) == 2 and "16 groups x 32 requests (512)" in out
    for argv, fmt in zip(cmds, ("bf16-t64", "int2-fold")):
        assert "--disable-radix-cache" not in argv
        assert argv[argv.index("--max-running-requests") + 1] == "48"
        assert argv[argv.index("--kv-cache-dtype") + 1] == bs.FORMATS[fmt][0]
    assert cmds[1][-4:] == ["--oscar-fold-rotations", "on", "--oscar-sink-tokens", "32"]
    assert "--oscar-sink-tokens" not in cmds[0]


def test_load_shares_each_group_prefix_and_nothing_else():
    a = bp.parse_args(["--groups", "3", "--per-group", "4", "--prefix-len", "50", "--suffix-len", "7"])
    load = bp.make_load(a, seed=1)
    assert [len(g) for g in load] == [4, 4, 4] and {len(ids) for g in load for ids in g} == {57}
    assert all(len({tuple(ids[:50]) for ids in g}) == 1 for g in load)
    assert len({tuple(g[0][:50]) for g in load}) == 3  # distinct prefixes
    assert len({tuple(ids[50:]) for g in load for ids in g}) == 12  # distinct suffixes
    other = bp.make_load(a, seed=2, groups=1)
    assert other[0][0][:50] not in [g[0][:50] for g in load]  # the warm-up does not pre-cache the timed load
    with pytest.raises(SystemExit):
        bp.parse_args(["--per-group", "0"])


FAKE_SERVER = r'''#!PYTHON
import http.server, json, sys, threading, time
port = int(sys.argv[sys.argv.index("--port") + 1])
kv = sys.argv[sys.argv.index("--kv-cache-dtype") + 1]
assert "--disable-radix-cache" not in sys.argv
if kv == FAIL_KV:
    sys.exit("RuntimeError: no GPU for this fake server")
PREFIX = PREFIX_LEN
cache, lock, seen = set(), threading.Lock(), []
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = req["input_ids"]
        with lock:  # a finished request's prefix is cached, as in SGLang's radix tree
            hit = PREFIX if tuple(ids[:PREFIX]) in cache else 0
            seen.append(1)
            if kv == KILL_KV and len(seen) == 12:  # a device call's timeout in the timed load's second phase
                import os, signal
                os.kill(os.getppid(), signal.SIGTERM)
        time.sleep((len(ids) - hit) * (2e-5 if kv == "auto" else 1e-5))
        with lock:
            cache.add(tuple(ids[:PREFIX]))
        n = req["sampling_params"]["max_new_tokens"]
        body = json.dumps({"output_ids": [5] * n, "meta_info": {"cached_tokens": hit, "completion_tokens": n,
                                                                 "prompt_tokens": len(ids)}}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _fake(tmp_path, kill_kv: str = "none", fail_kv: str = "none"):
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_SERVER.replace("PYTHON", sys.executable).replace("PREFIX_LEN", "300")
                    .replace("KILL_KV", repr(kill_kv)).replace("FAIL_KV", repr(fail_kv)))
    fake.chmod(0o755)
    return fake


def _free_port_pair() -> int:
    """A port p with p and p + 10 free (the two fake servers)."""
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            p = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", p + 10))
                    return p
                except OSError:
                    continue


def _argv(tmp_path, fake) -> list[str]:
    return ["--formats", "bf16,int2", "--groups", "4", "--per-group", "5", "--prefix-len", "300",
            "--suffix-len", "20", "--output-len", "3", "--concurrency", "8", "--python", str(fake),
            "--port", str(_free_port_pair()), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
            "--startup-timeout", "30"]


def test_run_with_fake_servers(tmp_path):
    """Start, warm-up, the timed load (seeds first, so every other request hits its group's prefix),
    the table with int2 / BF16, results and logs written."""
    pytest.importorskip("sglang_oscar.serving_launcher")
    assert bp.main(_argv(tmp_path, _fake(tmp_path))) == 0
    out = tmp_path / "out"
    res = json.loads((out / "results.json").read_text())
    assert [s["status"] for s in res["servers"]] == ["ok", "ok"]
    for s in res["servers"]:
        r = s["load"]
        assert r["requests"] == 20 and r["prompt_tokens"] == 20 * 320 and r["completion_tokens"] == 60
        assert r["cached_tokens"] == 4 * 4 * 300  # the 16 non-seed requests, whole prefix each
        assert r["computed_tokens"] == 4 * 320 + 16 * 20
        assert r["hit_ratio"] == pytest.approx(4800 / 6400, abs=1e-4)
        assert r["seed_wall_s"] + r["rest_wall_s"] == pytest.approx(r["wall_s"], abs=2e-4)
        # the walls are rounded to 0.1 ms: each rate lies between the rates of its rounding bounds
        for n, wall, rate in ((20, r["wall_s"], r["requests_per_s"]), (16, r["rest_wall_s"], r["rest_requests_per_s"])):
            assert n / (wall + 5e-5) - 0.01 <= rate <= n / max(wall - 5e-5, 1e-5) + 0.01
        assert r["latency_p50_s"] <= r["latency_p99_s"]
        assert s["warmup"]["requests"] == 5  # one group of the warm-up's own prefixes
        assert s["warmup"]["cached_tokens"] == 4 * 300
    md = (out / "results.md").read_text()
    ratio_row = next(line for line in md.splitlines() if line.startswith("| **int2 / best BF16** |"))
    assert ratio_row.count("x**") == 2 and "| bf16 | 20 |" in md and "not comparable" not in md
    assert (out / "logs.tgz").exists()


def test_sigterm_in_a_load_stops_the_server_and_writes_what_was_measured(tmp_path):
    """A device call's timeout during int2's timed load: SystemExit(143) after the server stopped, the
    BF16 result and int2's "interrupted" written, the previous SIGTERM handler back."""
    pytest.importorskip("sglang_oscar.serving_launcher")
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as info:
        bp.main(_argv(tmp_path, _fake(tmp_path, kill_kv="int2")))
    assert info.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [s["status"] for s in res["servers"]] == ["ok", "interrupted"]
    assert "load" not in res["servers"][1] and res["servers"][1]["warmup"]["requests"] == 5
    assert "int2: interrupted" in (tmp_path / "out" / "results.md").read_text()


def test_a_server_that_does_not_start_is_reported_and_the_next_one_runs(tmp_path):
    pytest.importorskip("sglang_oscar.serving_launcher")
    assert bp.main(_argv(tmp_path, _fake(tmp_path, fail_kv="auto"))) == 0  # one format measured
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [s["status"] for s in res["servers"]] == ["launch failed", "ok"]
    assert "no GPU for this fake server" in res["servers"][0]["error"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "bf16: launch failed" in md and "best BF16" not in md


def test_short_answers_fail_the_format(monkeypatch):
    """An aborted request (HTTP 200, fewer tokens, SGLang's abort) is a failure, not a fast completion."""
    import sglang_oscar.serving_launcher as sl

    a = bp.parse_args(["--groups", "1", "--per-group", "2", "--prefix-len", "8", "--suffix-len", "2",
                       "--output-len", "4"])
    answers = iter([{"meta_info": {"completion_tokens": 4, "cached_tokens": 0}},
                    {"meta_info": {"completion_tokens": 1, "cached_tokens": 8, "finish_reason": {"type": "abort"}}}])
    monkeypatch.setattr(sl, "http_json", lambda *args, **kw: next(answers))
    with pytest.raises(RuntimeError, match="came back with 1 of 4 tokens"):
        bp.run_load("http://x", bp.make_load(a, seed=1), a)
