"""CPU tests of benchmarks/bench_prefix.py: server commands (bench_served's, radix cache on), the
load's shape, and a whole run against fake servers that keep a prefix cache like SGLang's radix tree."""

from __future__ import annotations

import json
import shlex
import sys
import time

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
PREFIX = PREFIX_LEN
cache, lock = set(), threading.Lock()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = req["input_ids"]
        with lock:  # a finished request's prefix is cached, as in SGLang's radix tree
            hit = PREFIX if tuple(ids[:PREFIX]) in cache else 0
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


def test_run_with_fake_servers(tmp_path):
    """Start, warm-up, the timed load (seeds first, so every other request hits its group's prefix),
    the table with int2 / BF16, results and logs written."""
    pytest.importorskip("sglang_oscar.serving_launcher")
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_SERVER.replace("PYTHON", sys.executable).replace("PREFIX_LEN", "300"))
    fake.chmod(0o755)
    out = tmp_path / "out"
    port = 20000 + (int(time.time() * 1000) % 20000)
    rc = bp.main(["--formats", "bf16,int2", "--groups", "4", "--per-group", "5", "--prefix-len", "300",
                  "--suffix-len", "20", "--output-len", "3", "--concurrency", "8", "--python", str(fake),
                  "--port", str(port), "--out", str(out), "--work", str(tmp_path / "work"),
                  "--startup-timeout", "30"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert [s["status"] for s in res["servers"]] == ["ok", "ok"]
    for s in res["servers"]:
        r = s["load"]
        assert r["requests"] == 20 and r["prompt_tokens"] == 20 * 320 and r["completion_tokens"] == 60
        assert r["cached_tokens"] == 4 * 4 * 300  # the 16 non-seed requests, whole prefix each
        assert r["computed_tokens"] == 4 * 320 + 16 * 20
        assert r["hit_ratio"] == pytest.approx(4800 / 6400, abs=1e-4)
        # wall_s is rounded to 1 ms: the rate lies between the rates of its rounding bounds
        assert 20 / (r["wall_s"] + 5e-4) - 0.01 <= r["requests_per_s"] <= 20 / max(r["wall_s"] - 5e-4, 1e-4) + 0.01
        assert s["warmup"]["requests"] == 5  # one group of the warm-up's own prefixes
        assert s["warmup"]["cached_tokens"] == 4 * 300
    md = (out / "results.md").read_text()
    assert "| bf16 | 20 |" in md and "| **int2 / best BF16** |" in md
    assert (out / "logs.tgz").exists()
