"""Fake servers and answers for the CPU tests of ``tests.e2e.mla_check`` (test_mla_check*.py)."""

from __future__ import annotations

import os

import pytest

from . import mla_check, mla_models


@pytest.fixture(autouse=True)
def no_idle_wait(monkeypatch):
    """The load item's idle wait (SGLang's strict leak check runs then) is for real servers only."""
    monkeypatch.setattr(mla_check.time, "sleep", lambda s: None)


class FakeServer:
    """A healthy server whose log names the INT2 latent pool (the expanded pool under
    ``--oscar-mla-storage expanded``; nothing for BF16) and its bytes per token. It keeps what it was
    started with (``argv``, ``env``, ``log_path``, and ``name``: the check's server name) for tests
    to assert on; subclasses change the log through :meth:`log_text`."""

    def __init__(self, argv, port, log_path, log_header, env=None):
        self.argv, self.env, self.log_path = list(argv), env, log_path
        self.name = os.path.basename(log_path).removeprefix("mla_").removesuffix(".log")
        self.base_url = f"http://fake:{port}"
        with open(log_path, "w") as f:
            f.write("KV Cache is allocated\n" + self.log_text(argv))

    def log_text(self, argv) -> str:
        if "auto" in argv:
            return ""
        if "--oscar-mla-storage" in argv:
            return ("sglang-oscar: INT2 KV cache, MLA expanded (4 layers x 8 heads x K 192 / V 128; BF16 latent 4608, "
                    "INT2 latent 1088): 10240 bytes/token (BF16: 40960, 4.00x fewer); tokens: 10 (0.00 GiB)\n"
                    "sglang-oscar: INT2 MLA expanded pool: 10 slots x 4 layers x 8 heads (K 192 / V 128)\n")
        return ("sglang-oscar: INT2 KV cache, MLA latent (4 layers x c_kv 512 + k_pe 64): 1088 bytes/token "
                "(BF16: 4608, 4.24x fewer); tokens: 10\nsglang-oscar: INT2 MLA latent pool: ...\n")

    def start(self):
        pass

    def alive(self):
        return True

    def poll_health(self, *args, **kwargs):
        return "healthy"

    def stop(self, **kwargs):
        pass


class M3Server(FakeServer):
    """A server whose int2 log names MiniMax-M3's pool (no capacity line)."""

    def log_text(self, argv) -> str:
        return "" if "auto" in argv else "sglang-oscar: MiniMax-M3 pool: INT2 main K/V 10 slots ...\n"


def record_servers(monkeypatch, cls=FakeServer) -> dict[str, FakeServer]:
    """Start a ``cls`` for each server ``mla_check`` starts; returns ``{name: server}``, filled in
    start order (clear it between two runs of the check)."""
    started: dict[str, FakeServer] = {}

    def start(*args, **kwargs):
        srv = cls(*args, **kwargs)
        assert srv.name not in started, f"server {srv.name} started twice"
        started[srv.name] = srv
        return srv
    monkeypatch.setattr(mla_check, "ServerProcess", start)
    return started


def answers(shift_port: int | None, dlp: float):
    def http_json(url, payload=None, timeout=None):
        if payload is None:  # GET /health, /health_generate
            return {}
        n = len(payload["input_ids"])
        lp = -0.5 - (dlp if shift_port is not None and url.endswith(f":{shift_port}/generate") else 0.0)
        return {"output_ids": [7] * mla_check.NEW_TOKENS,
                "meta_info": {"output_token_logprobs": [[lp, 7]] * mla_check.NEW_TOKENS,
                              "input_token_logprobs": [[None, 3]] + [[lp, 3]] * (n - 1), "cached_tokens": 400}}
    return http_json


def fake_build(monkeypatch, family: str = "deepseek_v3"):
    """A DeepSeek-V3 family without weights: its config alone, which the window servers' identity
    rotation reads."""
    _, flags, judged = mla_check.FAMILIES[family]

    def build(path):
        mla_models.deepseek_v3_config().save_pretrained(path)
        return {"kv_lora_rank": 512}
    monkeypatch.setitem(mla_check.FAMILIES, family, (build, flags, judged))
