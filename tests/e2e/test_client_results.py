"""CPU tests of the device harness (``tests/e2e``): requests and answers, streamed decode rates,
log parsers, check e's load, the results table and files."""

from __future__ import annotations

import http.server
import json
import math
import threading
import time

import pytest

from . import check_e, client, config, results

# ----------------------------------------------------------------------------- client side


def test_parse_generation_and_compare():
    resp = {"output_ids": [5, 9, 7], "meta_info": {
        "finish_reason": {"type": "length", "length": 3}, "completion_tokens": 3, "cached_tokens": 0,
        "input_token_logprobs": [[None, 1, None], [-2.5, 4, None], [-3.0, 8, None]],
        "output_token_logprobs": [[-0.1, 5, None], [-0.2, 9, None], [-0.3, 7, None]],
        "output_top_logprobs": [[[-0.1, 5, None], [-1.1, 6, None]], [[-0.2, 9, None], [-0.25, 3, None]],
                                [[-0.3, 7, None], [-2.3, 1, None]]]}}
    r = client.parse_generation(resp)
    assert r["tokens"] == [5, 9, 7] and r["logprobs"] == [-0.1, -0.2, -0.3]
    assert r["input_logprobs"] == [-2.5, -3.0] and r["finish_reason"] == "length" and r["completion_tokens"] == 3
    assert r["margins"] == pytest.approx([1.0, 0.05, 2.0])
    same = client.compare_generations(r, dict(r))
    assert same["tokens_equal"] and same["bit_identical"] and same["max_abs_dlogprob"] == 0.0
    assert same["ref_min_margin"] == pytest.approx(0.05)
    other = dict(r, tokens=[5, 3, 7], logprobs=[-0.1005, -0.25, -0.3])
    d = client.compare_generations(r, other)
    assert not d["tokens_equal"] and d["first_diff"] == 1 and d["ref_margin_at_diff"] == pytest.approx(0.05)
    assert d["max_abs_dlogprob"] == pytest.approx(5e-4)  # over the common prefix only
    shorter = client.compare_generations(r, dict(r, tokens=[5, 9], logprobs=[-0.1, -0.2]))
    assert shorter["first_diff"] == 2 and not shorter["tokens_equal"]
    assert client.abs_diff_stats([1.0, 2.0, 3.0], [1.5, 2.0]) == {"mean": 0.25, "max": 0.5, "n": 2}
    assert math.isnan(client.abs_diff_stats([], [1.0])["mean"])
    p = client.generate_payload([1, 2], 4, input_logprobs=True)
    assert p["logprob_start_len"] == 0 and p["sampling_params"] == {"max_new_tokens": 4, "temperature": 0,
                                                                     "ignore_eos": True}
    assert "logprob_start_len" not in client.generate_payload([1], 1) and client.generate_payload([1], 1, top_logprobs=0).get(
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
            time.sleep(0.1)  # long beside a loaded machine's scheduling delays
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *a):
        pass


def test_stream_decode_rate_excludes_the_first_chunk():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = client.stream_decode_rate(f"http://127.0.0.1:{srv.server_port}", [1, 2, 3], 6, timeout=30)
    finally:
        srv.shutdown()
    assert r["tokens"] == 6 and r["ttft_s"] >= 0.05 and r["e2e_s"] > r["ttft_s"]
    # the 5 tokens after the first over the time after it (not 6, not from the request's start)
    assert r["decode_tok_s"] == pytest.approx(5 / (r["e2e_s"] - r["ttft_s"]))


class _SSEOddChunks(http.server.BaseHTTPRequestHandler):
    """Chunks without ``completion_tokens`` (counted by ``output_ids``), a comment line, then an error."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] is True and body["input_ids"] == [1, 2]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in ({"output_ids": [4]}, {"output_ids": [4, 5], "meta_info": {}}):
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n: keep-alive\n\n")
        self.wfile.write(b'data: {"error": {"message": "boom"}}\n\n')

    def log_message(self, *a):
        pass


def test_stream_generate_counts_output_ids_and_raises_on_an_error_chunk():
    """The one stream parser (``serving_launcher.stream_generate``, also bench_served's): the token
    count falls back to ``len(output_ids)``, non-``data:`` lines are skipped, an error chunk raises."""
    from sglang_oscar.serving_launcher import stream_generate

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSEOddChunks)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ticks = []
    try:
        with pytest.raises(RuntimeError, match="boom"):
            for tick in stream_generate(f"http://127.0.0.1:{srv.server_port}/", {"input_ids": [1, 2]}, timeout=30):
                ticks.append(tick)
    finally:
        srv.shutdown()
    assert [n for _, n in ticks] == [1, 2] and ticks[0][0] <= ticks[1][0]


def test_log_parsers():
    log = "\n".join([
        "[2026] max_total_num_tokens=123456, chunked_prefill_size=8192, max_prefill_tokens=16384",
        "Prefill batch. #new-seq: 1, #new-token: 64, #cached-token: 32, token usage: 0.12, #running-req: 3, #queue-req: 5",
        "Traceback (most recent call last):", '  File "x.py", line 1', "ValueError: --kv-cache-dtype int2 does not support X",
        "[2026] Scheduler hit an exception", "full memory leak detected! [full] total=10, available=9",
    ])
    assert client.max_total_tokens_from_log(log) == 123456 and client.max_total_tokens_from_log("nothing") is None
    assert client.last_error(log) == "ValueError: --kv-cache-dtype int2 does not support X"
    assert client.last_error("just a line\n\n") == "just a line"
    assert client.leak_lines(log) == ["full memory leak detected! [full] total=10, available=9"]
    st = client.log_stats(log)
    assert st["max_queue_req"] == 5 and st["max_token_usage"] == 0.12 and st["cached_tokens_total"] == 32
    assert st["tracebacks"] == 1


def test_load_prompts():
    ps = check_e.load_prompts(64, 100, 8192, seed=3)
    lens = [len(p) for p in ps]
    assert len(ps) == 64 and min(lens) >= 100 and max(lens) <= 8192 and max(lens) > 4 * min(lens)
    shared = [p for i, p in enumerate(ps) if i % 4 == 0 and len(p) > check_e.LOAD_SHARED_PREFIX + 16]
    assert len(shared) >= 2 and all(p[:check_e.LOAD_SHARED_PREFIX] == shared[0][:check_e.LOAD_SHARED_PREFIX] for p in shared)
    assert ps == check_e.load_prompts(64, 100, 8192, seed=3) and ps != check_e.load_prompts(64, 100, 8192, seed=4)


# ----------------------------------------------------------------------------- results


def test_table_json_and_exit_code(tmp_path):
    R = results.CheckResult
    rows = [R("a", config.PASS, "3/3 same | ok", {"x": float("nan"), "t": (1, 2)}),
            R("g", config.FAIL, "1.20x (target >= 1.5x)", {"ratio": 1.2})]
    table = results.format_table(rows)
    lines = table.splitlines()
    assert lines[0] == "| check | what | measured | result |" and len(lines) == 4
    assert lines[2] == f"| a | {config.CHECKS['a']} | 3/3 same \\| ok | **PASS** |"
    assert lines[3].endswith("| **FAIL** |")
    jpath, mpath = results.write_results(str(tmp_path), rows, {"command": "python -m tests.e2e --only a,g", "wall_s": 1.5})
    obj = json.load(open(jpath))
    assert obj["passed"] is False and [r["status"] for r in obj["results"]] == ["PASS", "FAIL"]
    assert obj["results"][0]["detail"] == {"x": None, "t": [1, 2]} and obj["results"][1]["title"] == config.CHECKS["g"]
    md = open(mpath).read()
    assert table in md and "- command: python -m tests.e2e --only a,g" in md and "## g:" in md
    assert results.overall_exit_code(rows) == 1
    assert results.overall_exit_code(rows[:1]) == 0 and results.overall_exit_code([]) == 1


def test_per_family_keeps_the_families_it_could_evaluate():
    """A family whose servers are down is that family's FAIL; the other families' results stay in the
    check's line and detail; with one family the CheckError reaches the harness as before."""
    from tests.e2e.config import FAIL, PASS
    from tests.e2e.results import CheckError, CheckResult, per_family

    def one(q):
        if q == "gemma4":
            raise CheckError("server gemma4-int2-layer is not serving")
        return CheckResult("d", PASS, f"{q} 3/3", {"n": 3})

    res = per_family("d", ["gemma3", "gemma4"], one)
    assert res.status == FAIL
    assert res.measured == "gemma3: gemma3 3/3 | gemma4: could not be evaluated: server gemma4-int2-layer is not serving"
    assert res.detail["families"]["gemma3"] == {"n": 3}
    assert per_family("d", ["gemma3"], one).status == PASS
    with pytest.raises(CheckError, match="not serving"):
        per_family("d", ["gemma4"], one)
