"""eval and the server behind it: answers of one server per folder (SGLang's /server_info), servers that
are not OpenAI-compatible, runs whose answers are all empty."""

from __future__ import annotations

import json

import pytest

from evals_fakes import FakeOpenAIServer, completion, gpqa_responder
from sglang_oscar.evals.errors import EvalError
from sglang_oscar.evals.runner import run_eval
from test_evals_runner import gpqa_file, settings  # noqa: F401  (gpqa_file: a fixture)


def test_answers_of_another_server_are_not_mixed_into_a_folder(tmp_path, gpqa_file, capsys):
    """A finished bf16 folder evaluated again against an int2 server on the same URL must not report the
    bf16 answers as the int2 server's: the server's identity (SGLang's /server_info) is recorded and a
    different one is refused, finished or not; the same server gets a note that nothing was asked."""
    bf16 = {"model_path": "m", "kv_cache_dtype": "auto", "dtype": "bfloat16", "quantization": None}
    int2 = {**bf16, "kv_cache_dtype": "int2"}
    with FakeOpenAIServer(gpqa_responder, server_info=bf16) as srv:
        run_eval(settings(tmp_path, srv.base_url, gpqa_file, out="run"))
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["server"]["kv_cache_dtype"] == "auto"
    capsys.readouterr()
    with FakeOpenAIServer(gpqa_responder, server_info=bf16) as srv:
        run_eval(settings(tmp_path, srv.base_url, gpqa_file, out="run"))
        assert srv.requests == []
    assert "all 24 answers are already in" in capsys.readouterr().err
    with FakeOpenAIServer(gpqa_responder, server_info=int2) as srv:
        with pytest.raises(EvalError, match=r"holds answers of another server \(kv_cache_dtype: 'auto' -> 'int2'\); "
                                            r"use another --out folder"):
            run_eval(settings(tmp_path, srv.base_url, gpqa_file, out="run"))
        assert srv.requests == []
    # with nothing to ask, a server that reports no identity (not SGLang) leaves the record as it was
    with FakeOpenAIServer(gpqa_responder) as srv:
        run_eval(settings(tmp_path, srv.base_url, gpqa_file, out="run"))
    assert json.loads((tmp_path / "run" / "run.json").read_text())["server"] == record["server"]
    # new answers are not asked of a server that cannot be told apart from the recorded one
    with FakeOpenAIServer(gpqa_responder) as srv:
        with pytest.raises(EvalError, match=r"holds answers of a server with kv_cache_dtype 'auto', and the server at "
                                            r".* cannot be identified \(it reports none"):
            run_eval(settings(tmp_path, srv.base_url, gpqa_file, out="run", seeds=[0, 1, 2]))
        assert srv.requests == []
    # answers of an unidentified server kept, then an SGLang one: the folder's server stays unknown
    with FakeOpenAIServer(gpqa_responder) as srv:
        run_eval(settings(tmp_path, srv.base_url, gpqa_file, out="anon", seeds=[0]))
    with FakeOpenAIServer(gpqa_responder, server_info=int2) as srv:
        run_eval(settings(tmp_path, srv.base_url, gpqa_file, out="anon", seeds=[0, 1]))
    assert json.loads((tmp_path / "anon" / "run.json").read_text())["server"] is None


def test_a_server_that_is_not_openai_compatible_is_named_at_once(tmp_path, gpqa_file):
    """An HTML 404 at /v1/models (a web server, a wrong --base-url) is named by the preflight, not taken as
    a reachable server whose every request then fails for minutes under a max-tokens hint."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Html404(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = b"<!DOCTYPE HTML><title>404</title>"
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Html404)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        with pytest.raises(EvalError, match=r"/v1/models answers HTTP 404 with an HTML page: not an OpenAI-compatible "
                                            r"server; check --base-url"):
            run_eval(settings(tmp_path, url, gpqa_file))
    finally:
        httpd.shutdown()


def test_a_run_of_empty_answers_says_so(tmp_path, gpqa_file, capsys):
    """Every completion empty: the run is complete (and scored 0), and the warning names the likely cause."""
    with FakeOpenAIServer(lambda body: completion("")) as srv:
        metrics = run_eval(settings(tmp_path, srv.base_url, gpqa_file))
    assert metrics["complete"] and metrics["accuracy_mean"] == 0.0
    assert "warning: 24 of 24 answers are empty (scored as wrong)" in capsys.readouterr().err


def test_identity_keys_are_fields_sglang_reports():
    """/server_info returns dataclasses.asdict(ServerArgs): a key that is not a field would always read None."""
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    from sglang_oscar.evals.client import IDENTITY_KEYS

    assert set(IDENTITY_KEYS) <= {f.name for f in dataclasses.fields(ServerArgs)}


def test_int2_servers_are_told_apart_by_their_oscar_settings(tmp_path, gpqa_file):
    """Two int2 servers differing only in the INT2 settings (not ServerArgs fields) are told apart by
    what SGLang's scheduler reports of the plugin's config in /server_info's internal_states."""
    base = {"model_path": "m", "kv_cache_dtype": "int2", "dtype": "bfloat16", "quantization": None}

    def info(recent):
        return {**base, "internal_states": [{"_oscar_config": {"recent_tokens": recent, "group_size": 128}}]}

    with FakeOpenAIServer(gpqa_responder, server_info=info(256)) as srv:
        run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0]))
    assert json.loads((tmp_path / "run" / "run.json").read_text())["server"]["oscar"]["recent_tokens"] == 256
    with FakeOpenAIServer(gpqa_responder, server_info=info(64)) as srv:
        with pytest.raises(EvalError, match=r"holds answers of another server \(oscar: .*'recent_tokens': 256.* -> "
                                            r".*'recent_tokens': 64"):
            run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0, 1]))
        assert srv.requests == []


def test_an_int2_servers_config_reaches_server_info_as_sglang_sends_it(tmp_path, gpqa_file):
    """The scheduler's internal state as SGLang 0.5.16 builds and sends it (``vars(server_args)`` through
    ``msgspec_to_builtins``, msgpack to the tokenizer process, /server_info's JSON): the plugin's
    ``OscarConfig`` arrives as a plain dict, which the eval records as the server's ``oscar`` identity."""
    import dataclasses

    import msgspec
    from sglang.srt.managers.io_struct import GetInternalStateReqOutput
    from sglang.srt.utils.msgspec_utils import msgspec_to_builtins

    from sglang_oscar.config import OscarConfig

    config = OscarConfig(recent_tokens=128, group_size=64, skip_layers="sliding")
    state = msgspec_to_builtins({"kv_cache_dtype": "int2", "_oscar_config": config, "_oscar_given": {}})
    sent = msgspec.msgpack.encode(GetInternalStateReqOutput(internal_state=state))
    received = msgspec.msgpack.decode(sent, type=GetInternalStateReqOutput).internal_state
    info = json.loads(json.dumps(msgspec_to_builtins({"model_path": "m", "kv_cache_dtype": "int2",
                                                      "internal_states": [received]})))
    with FakeOpenAIServer(gpqa_responder, server_info=info) as srv:
        run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0]))
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())["server"]["oscar"]
    assert recorded == json.loads(json.dumps(dataclasses.asdict(config)))
    assert recorded["recent_tokens"] == 128 and recorded["skip_layers"] == "sliding"
