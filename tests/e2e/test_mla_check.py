"""The MLA device check's judging (``tests.e2e.mla_check``) on fake servers, and its tiny model's
config: the fields SGLang 0.5.16's DeepSeek-V3 code reads are saved. GLM-5 (DSA) families:
test_mla_check_dsa.py."""

from __future__ import annotations

import json
import os

import pytest

from . import checkpoints, mla_check, mla_models
from .mla_fakes import FakeServer, M3Server, no_idle_wait, record_servers  # noqa: F401  (no_idle_wait: autouse)
from .mla_fakes import answers as _answers
from .mla_fakes import fake_build as _fake_build


@pytest.mark.parametrize("shifted,dlp,failed", [(None, 0.0, None), ("int2-chunk64", 0.05, "chunked"),
                                                ("bf16", 0.03, None), ("int2-window", 0.2, "window")])
def test_mla_check_judges_the_answers(tmp_path, monkeypatch, shifted, dlp, failed):
    """Equal answers pass; int2-chunk64 off int2 by 0.05 fails "chunked" (tolerance 0.02); BF16 off
    by 0.03 passes (int2 vs BF16 is reported, int2-window vs BF16 allows 0.05); int2-window off BF16
    by 0.2 fails "window". The oracle verdict: a stand-in report within, and one outside, its bound."""
    port = None if shifted is None else mla_check.BASE_PORT + list(mla_check.SERVERS).index(shifted)
    monkeypatch.setattr(mla_check, "ServerProcess", FakeServer)
    monkeypatch.setattr(mla_check, "http_json", _answers(port, dlp))
    _fake_build(monkeypatch)
    monkeypatch.setattr(mla_check, "oracle_report", lambda *a: {"served_vs_oracle_bf16": 0.15, "oracle_fp32_vs_bf16": 0.1})
    rc = mla_check.main(["--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "no-model")])
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert (rc == 0) == (failed is None)
    assert res["verdict"] == {k: k != failed for k in ("serves", "window", "chunked", "radix", "load", "oracle")}
    assert res["capacity"]["ratio"] == 4608 / 1088 and all(res["radix"][n]["cached_tokens"] == [400] * 3 for n in ("int2", "bf16"))
    assert os.path.exists(tmp_path / "mla_check.md")


def test_same_greedy_forgives_only_ties():
    """A divergence counts as rounding only where the reference's top-2 margin is a BF16 tie (at
    most TIE_MARGIN: the device run's divergences were at 0.0 and 0.0156); equal tokens always
    pass; no margins, no forgiveness."""
    ref = [{"tokens": [1, 2, 3, 4], "margins": [0.9, 0.0156, 0.05, 0.7]}]
    assert mla_check.same_greedy([{"tokens": [1, 2, 3, 4]}], ref) == (True, [(None, None)])
    assert mla_check.same_greedy([{"tokens": [1, 5, 9, 9]}], ref) == (True, [(1, 0.0156)])  # a tie at BF16
    assert mla_check.same_greedy([{"tokens": [1, 2, 6, 6]}], ref) == (False, [(2, 0.05)])
    assert mla_check.same_greedy([{"tokens": [1, 2, 6, 6]}], ref, tie=0.1) == (True, [(2, 0.05)])
    assert mla_check.same_greedy([{"tokens": [8]}], [{"tokens": [1]}], tie=1.0) == (False, [(0, None)])


def test_mla_check_kimi_linear_family_serves_dummy_weights_without_an_oracle(tmp_path, monkeypatch):
    """--family kimi_linear: its config has MLA layers 1 and 3 between KDA layers 0 and 2; every server
    loads dummy weights scaled by the harness's dummy shim (its folder on PYTHONPATH, its switch set);
    everything but the oracle is judged: a chunked answer off by 0.5 fails "chunked"."""
    from sglang_oscar.rotation.geometry import ModelGeometry

    info = mla_models.build_kimi_linear(str(tmp_path / "kimi"))
    geo = ModelGeometry.from_hf_config(str(tmp_path / "kimi"))
    assert geo.layer_ids == info["mla_layers"] == [1, 3] and list(geo.linear_layer_ids) == info["kda_layers"]
    started = record_servers(monkeypatch)
    port = mla_check.BASE_PORT + list(mla_check.SERVERS).index("int2-chunk64")
    monkeypatch.setattr(mla_check, "http_json", _answers(port, 0.5))
    monkeypatch.setattr(mla_check, "oracle_report", lambda *a: pytest.fail("no oracle for kimi_linear"))
    rc = mla_check.main(["--family", "kimi_linear", "--out", str(tmp_path), "--budget", "5",
                         "--model", str(tmp_path / "k2")])
    res = json.loads((tmp_path / "mla_check.json").read_text())
    judged = ["serves", "window", "rotated", "chunked", "radix", "load"]
    assert rc == 1 and res["family"] == "kimi_linear" and res["judged"] == judged
    assert res["verdict"] == {k: k != "chunked" for k in judged}
    cfg = json.loads((tmp_path / "kimi" / "config.json").read_text())  # bf16 (SGLang's KDA conv), 2,400-token load
    assert cfg["dtype"] == "bfloat16" and cfg["max_position_embeddings"] >= mla_check.LOAD_LENS[1] + mla_check.NEW_TOKENS
    argvs, envs = [s.argv for s in started.values()], [s.env for s in started.values()]
    rotation = {n: s.argv[s.argv.index("--oscar-rotation") + 1] for n, s in started.items() if "--oscar-rotation" in s.argv}
    assert rotation == {"int2-window": str(tmp_path / checkpoints.IDENTITY_ROTATION)}
    window = started["int2-window"].argv
    assert window[window.index("--port") + 1] == str(mla_check.BASE_PORT + 1)
    from .dummy_shim import DUMMY_ENV, DUMMY_SHIM_MODULE

    assert all(e[DUMMY_ENV] == "1" for e in envs)
    shim_dir = envs[0]["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.exists(os.path.join(shim_dir, f"{DUMMY_SHIM_MODULE}.py"))
    assert all("--load-format" in a and a[a.index("--load-format") + 1] == "dummy" for a in argvs) and len(argvs) == 5


def test_mla_check_oracle_verdict_fails_outside_its_bound(tmp_path, monkeypatch):
    """served vs the BF16-model oracle 0.25 with the oracle's own move 0.1: over 2 x 0.1, "oracle" fails."""
    monkeypatch.setattr(mla_check, "ServerProcess", FakeServer)
    monkeypatch.setattr(mla_check, "http_json", _answers(None, 0.0))
    _fake_build(monkeypatch)
    monkeypatch.setattr(mla_check, "oracle_report", lambda *a: {"served_vs_oracle_bf16": 0.25, "oracle_fp32_vs_bf16": 0.1})
    assert mla_check.main(["--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m")]) == 1
    assert json.loads((tmp_path / "mla_check.json").read_text())["verdict"]["oracle"] is False


def test_mla_check_minimax_m3_families(tmp_path, monkeypatch, caplog):
    """--family minimax_m3 / minimax_m3_dense: SGLang reads the saved config as MiniMax-M3 with sparse
    layers 1 and 3 (layer 3 without an index value); minimax_m3's selection (8 blocks of 16) covers
    less than every prompt, minimax_m3_dense's (32 x 64) more than every prompt and its answer. The
    judge finds the M3 pool in the int2 logs and the capacity in the real startup line
    (:func:`~sglang_oscar.plugin.minimax_serving.log_minimax_sizes`), totals with the BF16 index keys."""
    import logging
    from types import SimpleNamespace

    import torch
    from sglang.srt.configs.model_config import (get_minimax_sparse_attention_config,
                                                 get_minimax_sparse_disable_value_layer_ids,
                                                 get_minimax_sparse_layer_ids, is_minimax_sparse)
    from transformers import AutoConfig

    from sglang_oscar.config import OscarConfig
    from sglang_oscar.plugin import minimax_serving

    for family, (block, topk) in (("minimax_m3", mla_models.M3_SPARSE), ("minimax_m3_dense", mla_models.M3_DENSE)):
        info = mla_check.FAMILIES[family][0](str(tmp_path / family))
        hf = AutoConfig.from_pretrained(str(tmp_path / family))
        sparse_cfg = get_minimax_sparse_attention_config(hf)
        assert is_minimax_sparse(hf) and get_minimax_sparse_layer_ids(sparse_cfg) == ([0, 2], [1, 3])
        assert get_minimax_sparse_disable_value_layer_ids(sparse_cfg) == [3] and hf.rotary_dim == 64
        assert (info["block_size"], info["topk_blocks"]) == (block, topk)
        assert mla_check.server_env(family, str(tmp_path))  # dummy weights: the scaling shim
    assert 16 * 8 < min(mla_check.PROMPT_LENS) and 64 * 32 > max(mla_check.PROMPT_LENS) + mla_check.NEW_TOKENS

    kvc = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf), layer_info=SimpleNamespace(start_layer=0, end_layer=4),
                          model_dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="sglang_oscar"):
        minimax_serving.log_minimax_sizes(kvc, OscarConfig(), 2, 128, 128, 1000)
    line = caplog.records[-1].getMessage()
    # 4 layers x 2 kv heads x (36 + 36) INT2 bytes; BF16 512 per kv head and layer; index keys: layer 1
    # key + value, layer 3 key only, 128 x 2 bytes each
    index = (2 + 1) * 128 * 2
    assert f"total {4 * 2 * 72 + index} bytes/token (BF16: {4 * 2 * 512 + index}" in line

    class M3Sized(M3Server):  # and the real startup line
        def log_text(self, argv):
            return "" if "auto" in argv else f"sglang-oscar: {line}\n" + super().log_text(argv)

    started = record_servers(monkeypatch, M3Sized)
    monkeypatch.setattr(mla_check, "http_json", _answers(None, 0.0))
    argv = ["--family", "minimax_m3", "--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m")]
    rc = mla_check.main(argv)
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert rc == 0 and res["verdict"] == {k: True for k in ("serves", "window", "rotated", "chunked", "radix", "load")}
    assert res["capacity"]["ratio"] == (4 * 2 * 512 + index) / (4 * 2 * 72 + index)
    assert len(started) == 5 and all(s.argv[s.argv.index("--load-format") + 1] == "dummy" for s in started.values())
    # named, the reported floor: SGLang's BF16 server chunked, compared with the one-prefill BF16 server
    started.clear()
    assert mla_check.main([*argv, "--servers", "bf16,bf16-chunk64,int2-window"]) == 0
    res = json.loads((tmp_path / "mla_check.json").read_text())
    floor = [s.argv for s in started.values() if s.argv[s.argv.index("--kv-cache-dtype") + 1] == "auto"
             and "--chunked-prefill-size" in s.argv]
    assert len(floor) == 1 and floor[0][floor[0].index("--chunked-prefill-size") + 1] == "64"
    assert not any(f.startswith("--oscar") for f in floor[0])
    assert {(r["server"], r["vs"]) for r in res["rows"]} >= {("bf16-chunk64", "bf16"), ("int2-window", "bf16")}
    assert mla_check.FAMILY_REF["minimax_m3_dense"] == {"int2-window-chunk64": "int2-window"}
    # the MLA pool's log line is not the M3 pool: "serves" fails on it
    monkeypatch.setattr(mla_check, "ServerProcess", FakeServer)
    assert mla_check.main(["--family", "minimax_m3_dense", "--out", str(tmp_path), "--budget", "5",
                           "--model", str(tmp_path / "m2")]) == 1
    assert json.loads((tmp_path / "mla_check.json").read_text())["verdict"]["serves"] is False


def test_mla_check_window_servers_read_sglangs_rows_under_the_identity_rotation(tmp_path, monkeypatch):
    """--servers bf16,int2-window,int2-window-hadamard on minimax_m3: three servers; int2-window
    (the window item, as the main harness's check b) gets an identity rotation file for the model's
    geometry, written outside the model folder, int2-window-hadamard (the rotated item) int2-window's
    flags without a rotation (the default Hadamard); only the items whose servers ran are judged; an
    unknown name is refused before any server starts."""
    import torch

    from sglang_oscar.rotation import RotationSet

    started = record_servers(monkeypatch, M3Server)
    monkeypatch.setattr(mla_check, "http_json", _answers(None, 0.0))
    model = tmp_path / "m"
    rc = mla_check.main(["--family", "minimax_m3", "--out", str(tmp_path), "--budget", "5", "--model", str(model),
                         "--servers", "bf16,int2-window,int2-window-hadamard"])
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert rc == 0 and res["verdict"] == {"serves": True, "window": True, "rotated": True}
    assert res["judged"] == ["serves", "window", "rotated"] and list(started) == ["bf16", "int2-window", mla_check.HADAMARD]
    window, hadamard = started["int2-window"].argv, started[mla_check.HADAMARD].argv
    path = window[window.index("--oscar-rotation") + 1]
    assert path == str(tmp_path / checkpoints.IDENTITY_ROTATION) and not list(model.glob("*.safetensors"))
    assert window[window.index("--oscar-sink-tokens") + 1] == hadamard[hadamard.index("--oscar-sink-tokens") + 1] == "2048"
    assert "--oscar-rotation" not in hadamard
    rs = RotationSet.load(path)
    assert sorted(rs.k) == [0, 1, 2, 3] and all(torch.equal(m, torch.eye(m.shape[-1]).expand_as(m))
                                                for m in [*rs.k.values(), *rs.v.values()])
    assert {("int2-window", "bf16"), ("int2-window-hadamard", "bf16")} <= {(r["server"], r["vs"]) for r in res["rows"]}
    assert "not judged (their servers not in --servers): chunked, radix, load" in (tmp_path / "mla_check.md").read_text()
    started.clear()
    for bad in ("bf16,int3", "bf16,bf16"):
        with pytest.raises(SystemExit):
            mla_check.main(["--family", "minimax_m3", "--out", str(tmp_path), "--servers", bad])
    assert started == {}


def test_mla_check_load_needs_every_answer_a_clean_log_and_the_strict_checks(tmp_path, monkeypatch):
    """load: 64 requests of 32-2400 tokens, a quarter sharing a prefix, to the int2 server only, which
    alone runs with SGLang's strict memory checks; one failed request, or a leak report appearing in
    the int2 log during the load, fails "load" and nothing else."""
    prompts = mla_check.load_prompts()
    lens = [len(p) for p in prompts]
    assert len(prompts) == 64 and min(lens) >= 32 and max(lens) <= 2400 and min(lens) < 200 < 1500 < max(lens)
    head = mla_check.random_prompt(mla_check.LOAD_SHARED_PREFIX, 55 + 7, mla_models.VOCAB)
    assert sum(p[:len(head)] == head for p in prompts) >= 4 and all(3 <= t < mla_models.VOCAB for p in prompts for t in p)
    for fault in ("none", "request", "leak"):
        started = record_servers(monkeypatch)
        answers = _answers(None, 0.0)
        calls = []

        def http_json(url, payload=None, timeout=None):
            if payload is not None and len(payload["input_ids"]) in lens and not payload.get("logprob_start_len"):
                calls.append(url)
                if fault == "request" and len(calls) == 5:
                    raise RuntimeError("HTTP 500")
                if fault == "leak" and len(calls) == 9:
                    with open(started["int2"].log_path, "a") as f:
                        f.write("ValueError: token_to_kv_pool_allocator memory leak detected!\n")
            return answers(url, payload, timeout)

        monkeypatch.setattr(mla_check, "http_json", http_json)
        _fake_build(monkeypatch)
        monkeypatch.setattr(mla_check, "oracle_report", lambda *a: {"served_vs_oracle_bf16": 0.0, "oracle_fp32_vs_bf16": 0.1})
        rc = mla_check.main(["--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m")])
        res = json.loads((tmp_path / "mla_check.json").read_text())
        assert {k for k, v in res["verdict"].items() if not v} == (set() if fault == "none" else {"load"}), fault
        assert (rc == 0) == (fault == "none") and len(calls) == 64
        assert all(u.startswith(f"http://fake:{mla_check.BASE_PORT + 2}") for u in calls)  # the int2 server
        assert res["load"]["completed"] == (63 if fault == "request" else 64)
        assert bool(res["load"]["leak_lines"]) == (fault == "leak")
    assert started["int2"].env["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY"] == "1"
    assert all("SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE" not in (s.env or {}) for n, s in started.items() if n != "int2")


def test_mla_check_sigterm_stops_every_server_and_judges_what_was_answered(tmp_path, monkeypatch):
    """A device call's timeout (SIGTERM) while the int2 server answers: every server is stopped, the
    partial answers are written and judged, the unjudged items are named and the check fails. timeout(1)
    signals the process and then its group, so a second SIGTERM arrives while the servers stop."""
    import signal

    class Signalling(FakeServer):
        stopped = False

        def stop(self, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)
            self.stopped = True

    started = record_servers(monkeypatch, Signalling)
    answers = _answers(None, 0.0)
    int2_port = f":{mla_check.BASE_PORT + list(mla_check.SERVERS).index('int2')}/"

    def http_json(url, payload=None, timeout=None):
        if int2_port in url:
            os.kill(os.getpid(), signal.SIGTERM)
        return answers(url, payload, timeout)

    monkeypatch.setattr(mla_check, "http_json", http_json)
    _fake_build(monkeypatch)
    monkeypatch.setattr(mla_check, "oracle_report", lambda *a: pytest.fail("no oracle after a termination"))
    before = signal.getsignal(signal.SIGTERM)
    rc = mla_check.main(["--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m")])
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert rc == 1 and list(started) == list(mla_check.SERVERS) and all(s.stopped for s in started.values())
    assert res["terminated"].startswith(f"signal {int(signal.SIGTERM)}") and "int2" not in res["servers"]
    assert isinstance(res["servers"]["bf16"], list) and "load" not in res and "oracle" not in res["verdict"]
    assert "not judged (fails the check): " in (tmp_path / "mla_check.md").read_text()
    assert signal.getsignal(signal.SIGTERM) == before


def test_mla_check_expanded_family_flags_logs_and_oracle(tmp_path, monkeypatch):
    """--family deepseek_v3_expanded: only the int2 servers get ``--oscar-mla-storage expanded`` and
    groups of 64; the judge finds the expanded pool and the capacity in their startup lines, and the
    oracle is asked for expanded storage."""
    storages = []
    started = record_servers(monkeypatch)  # FakeServer logs the expanded pool's startup lines
    monkeypatch.setattr(mla_check, "http_json", _answers(None, 0.0))
    _, flags, judged = mla_check.FAMILIES["deepseek_v3_expanded"]
    monkeypatch.setitem(mla_check.FAMILIES, "deepseek_v3_expanded",
                        (lambda path: mla_models.deepseek_v3_config().save_pretrained(path) or {"kv_lora_rank": 512},
                         flags, judged))

    def oracle(model, prompts, served, storage="latent"):
        storages.append(storage)
        return {"served_vs_oracle_bf16": 0.01, "oracle_fp32_vs_bf16": 0.01}

    monkeypatch.setattr(mla_check, "oracle_report", oracle)
    rc = mla_check.main(["--family", "deepseek_v3_expanded", "--out", str(tmp_path), "--budget", "5",
                         "--model", str(tmp_path / "m")])
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert rc == 0 and set(res["verdict"]) == set(judged) and storages == ["expanded"]
    assert res["capacity"] == {"int2_bytes_per_token": 10240, "bf16_bytes_per_token": 40960, "ratio": 4.0}
    flag = ["--oscar-mla-storage", "expanded", "--kv-cache-quant-group-size", "64"]
    for name, srv in started.items():
        has = any(srv.argv[i:i + 4] == flag for i in range(len(srv.argv)))
        assert has == (name != "bf16"), name


@pytest.mark.parametrize("family,cached,changed,fail_repeats,passes", [
    ("deepseek_v3", [384, 896, 1472], None, None, True),
    ("deepseek_v3", [0, 640, 0], None, None, False),  # a dense latent cache keeps every prompt
    ("kimi_linear", [0, 640, 0], None, None, False),  # under the mamba radix cache too
    ("kimi_linear", [320, 832, 1408], None, None, True),
    ("deepseek_v3", [384, 896, 1472], "int2", None, False),  # a repeat's greedy tokens changed
    ("deepseek_v3", [384, 896, 1472], "bf16", None, True),  # bf16's repeats are reported only
    ("deepseek_v3", [384, 896, 1472], None, "bf16", True),
    ("deepseek_v3", [384, 896, 1472], None, "int2", False)])
def test_mla_check_radix_repeats_every_prompt(tmp_path, monkeypatch, family, cached, changed, fail_repeats, passes):
    """The int2 and bf16 servers answer every prompt a second time. radix passes when every int2 repeat
    is served from the cache (Kimi-Linear's mamba radix cache too) with its first answer's greedy tokens; bf16's repeats (a changed token, a failed request) are reported and
    move no verdict, and failed repeats keep the server's first answers (window still judged)."""
    sent = {}
    ports = {mla_check.BASE_PORT + list(mla_check.SERVERS).index(n): n for n in ("int2", "bf16")}

    def http_json(url, payload=None, timeout=None):
        if payload is None:
            return {}
        n = len(payload["input_ids"])
        key = (url, tuple(payload["input_ids"]))
        sent[key] = sent.get(key, 0) + 1
        server = ports.get(int(url.rsplit(":", 1)[1].split("/")[0]))
        repeat = sent[key] == 2 and n in mla_check.PROMPT_LENS
        if repeat and server == fail_repeats:
            raise RuntimeError("HTTP 500")
        i = mla_check.PROMPT_LENS.index(n) if repeat else 0
        tok = 9 if repeat and server == changed and i == 2 else 7
        return {"output_ids": [tok] * mla_check.NEW_TOKENS,
                "meta_info": {"output_token_logprobs": [[-0.5, tok]] * mla_check.NEW_TOKENS,
                              "input_token_logprobs": [[None, 3]] + [[-0.5, 3]] * (n - 1),
                              "cached_tokens": cached[i] if repeat else 0}}

    monkeypatch.setattr(mla_check, "ServerProcess", FakeServer)
    monkeypatch.setattr(mla_check, "http_json", http_json)
    _fake_build(monkeypatch)
    monkeypatch.setattr(mla_check, "oracle_report", lambda *a: {"served_vs_oracle_bf16": 0.0, "oracle_fp32_vs_bf16": 0.1})
    mla_check.main(["--family", family, "--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m")])
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert res["verdict"]["radix"] is passes and res["verdict"]["window"] is True
    for name in ("int2", "bf16"):
        assert len(res["servers"][name]) == len(mla_check.PROMPT_LENS)
        if name == fail_repeats:
            assert name not in res["radix"] and res["radix_repeats"][name].startswith("REQUEST FAILED")
        else:
            assert res["radix"][name]["cached_tokens"] == cached
            assert res["radix"][name]["same"] is (name != changed)
    assert "radix (repeats vs first answers; bf16 reported)" in (tmp_path / "mla_check.md").read_text()


def test_every_judged_item_has_its_servers_in_the_family_defaults():
    """Each family's default servers (its judged items' own) cover every item it judges, so a default run
    judges them all; reported servers are never needed."""
    for family, (_, _, judged) in mla_check.FAMILIES.items():
        defaults = {*mla_check.SERVERS, *([mla_check.HADAMARD] if "rotated" in judged else [])}
        assert len(defaults) <= 5 and not set(mla_check.OPT_IN_ITEMS) & set(judged)
        for item in judged:
            assert mla_check.NEEDS.get(item, set()) <= defaults, (family, item)
        assert not set(mla_check.FAMILY_SERVERS.get(family, {})) & set().union(*mla_check.NEEDS.values()), family


@pytest.mark.parametrize("family,servers,shift,verdict,rc", [
    ("minimax_m3", None, 0.2, {"rotated": False}, 1),  # the rotated window 0.2 off BF16: fails "rotated"
    ("deepseek_v3", "bf16,int2-window,int2-window-hadamard", 0.2, {"serves": True, "window": True}, 0),
    ("deepseek_v3", "int2-window-hadamard", 0.0, {"serves": False}, 1)])  # no server of a judged item
def test_mla_check_judges_rotated_only_where_the_family_lists_it(tmp_path, monkeypatch, family, servers, shift,
                                                                 verdict, rc):
    """int2-window-hadamard is judged as "rotated" (prompt mean <= 0.05 vs BF16) on the families without
    an oracle; on DeepSeek-V3, named, its row is reported and no verdict comes of it; a run whose only
    server is not a judged item's fails "serves" rather than passing on nothing."""
    names = servers.split(",") if servers else [*mla_check.SERVERS, mla_check.HADAMARD]
    record_servers(monkeypatch, M3Server if family == "minimax_m3" else FakeServer)
    monkeypatch.setattr(mla_check, "http_json", _answers(mla_check.BASE_PORT + names.index(mla_check.HADAMARD), shift))
    _fake_build(monkeypatch)
    monkeypatch.setattr(mla_check, "oracle_report", lambda *a: {"served_vs_oracle_bf16": 0.0, "oracle_fp32_vs_bf16": 0.1})
    argv = ["--family", family, "--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m")]
    assert mla_check.main([*argv, *(["--servers", servers] if servers else [])]) == rc
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert {k: res["verdict"][k] for k in verdict} == verdict
    assert ("rotated" in res["verdict"]) == (family == "minimax_m3")
    if servers and "bf16" in servers:
        row = next(r for r in res["rows"] if r["server"] == mla_check.HADAMARD)
        assert row["vs"] == "bf16" and abs(row["prompt_dlp_mean"] - shift) < 1e-9


@pytest.mark.parametrize("family", ["deepseek_v3", "minimax_m3"])
@pytest.mark.parametrize("servers,shift,verdict", [
    (None, None, {}),  # a default run starts neither opt-in server and judges neither item
    ("bf16,plugin-off,int2,int2-eager", None, {"plugin": True, "graph": True}),
    ("bf16,plugin-off,int2,int2-eager", ("plugin-off", 0.01), {"plugin": False, "graph": True}),
    ("bf16,plugin-off,int2,int2-eager", ("int2-eager", 0.05), {"plugin": True, "graph": False}),
    ("bf16,plugin-off,int2,int2-eager", ("int2-eager", 0.01), {"plugin": True, "graph": True})])
def test_mla_check_opt_in_plugin_and_graph_items(tmp_path, monkeypatch, family, servers, shift, verdict):
    """plugin-off (SGLANG_PLUGINS: every entry point the servers see but ours, the harness shims kept) must
    match the BF16 server to 1e-3; int2-eager (no CUDA graphs) must track int2 within 0.02. Both run
    only when --servers names them."""
    names = servers.split(",") if servers else None
    port = None if shift is None else mla_check.BASE_PORT + names.index(shift[0])
    started = record_servers(monkeypatch, M3Server if family == "minimax_m3" else FakeServer)
    monkeypatch.setattr(mla_check, "http_json", _answers(port, 0.0 if shift is None else shift[1]))
    monkeypatch.setattr(mla_check, "oracle_report", lambda *a: {"served_vs_oracle_bf16": 0.0, "oracle_fp32_vs_bf16": 0.1})
    _fake_build(monkeypatch)
    argv = ["--family", family, "--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m")]
    rc = mla_check.main([*argv, *(["--servers", servers] if servers else [])])
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert {k: v for k, v in res["verdict"].items() if k in mla_check.OPT_IN_ITEMS} == verdict
    assert rc == (0 if all(verdict.values()) else 1)
    if servers is None:
        assert not {"plugin-off", "int2-eager", "int2-tp2"} & set(started)
        hint = "opt-in servers (--servers): plugin with plugin-off, graph with int2-eager, tp with int2-tp2"
        assert hint + (", oracle-fp32 with int2-fp32" if family == "deepseek_v3" else "\n") in \
            (tmp_path / "mla_check.md").read_text()
        return
    argv_off, env_off = started["plugin-off"].argv, started["plugin-off"].env
    kept = env_off["SGLANG_PLUGINS"].split(",")
    assert "oscar" not in kept and "auto" in argv_off and res["plugins"]["oscar"] is True
    assert kept == (res["plugins"]["others"] or ["__no_plugin__"])
    # the dummy-weight families' servers load the weight shim: plugin-off keeps it (the same weights)
    assert ("oscar_e2e_dummy" in kept) == (family == "minimax_m3")
    assert "SGLANG_PLUGINS" not in (started["bf16"].env or {})
    argv_eager = started["int2-eager"].argv
    assert "--disable-cuda-graph" in argv_eager and "int2" in argv_eager
    assert "--disable-cuda-graph" not in started["int2"].argv
    assert res["verdict"]["serves"] is True


def test_mla_check_plugin_item_needs_our_entry_point(tmp_path, monkeypatch):
    """Where the servers do not see the ``oscar`` entry point, plugin-off and bf16 are both SGLang alone:
    their equality proves nothing, and the plugin item fails."""
    monkeypatch.setattr(mla_check, "ServerProcess", FakeServer)
    monkeypatch.setattr(mla_check, "http_json", _answers(None, 0.0))
    monkeypatch.setattr(mla_check, "plugin_entry_point",
                        lambda pythonpath="": {"oscar": False, "value": None, "others": ["smg-zmq"]})
    _fake_build(monkeypatch)
    rc = mla_check.main(["--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m"),
                         "--servers", "bf16,plugin-off"])
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert rc == 1 and res["verdict"]["plugin"] is False and res["verdict"]["serves"] is True


@pytest.mark.parametrize("shift,rank_bytes,other_token,verdict", [
    (None, 1088, False, True),  # same tokens, each rank the whole latent: PASS
    (0.3, 1088, False, False),  # log-probs past TP_TOL (garbage guard)
    (None, 544, False, False),  # a rank sized as if the latent were split by head
    (None, 1088, True, False)])  # one other greedy token (no tie allowance, as check h)
def test_mla_check_opt_in_tp_item(tmp_path, monkeypatch, shift, rank_bytes, other_token, verdict):
    """int2-tp2 (--tp-size 2) against int2: the same greedy tokens, log-probs within TP_TOL, and a rank's
    bytes per token equal to TP 1's (the latent is not split by head); both pools' token counts reported."""
    class Server(FakeServer):  # a TP 2 log holds both ranks' lines
        def log_text(self, argv):
            if "--tp-size" not in argv:
                return super().log_text(argv) + ("max_total_num_tokens=11000, chunked_prefill_size=8192\n"
                                                 if "int2" in argv else "")
            rank = (f"sglang-oscar: INT2 KV cache, MLA latent (4 layers x c_kv 512 + k_pe 64): {rank_bytes} bytes/token "
                    "(BF16: 4608, 4.24x fewer); tokens: 12\nsglang-oscar: INT2 MLA latent pool: ...\n")
            return rank + "KV Cache is allocated\n" + rank + "max_total_num_tokens=12000, chunked_prefill_size=8192\n"

    servers = "int2,int2-tp2"
    started = record_servers(monkeypatch, Server)
    port = None if shift is None else mla_check.BASE_PORT + 1
    answer = _answers(port, shift or 0.0)

    def http_json(url, payload=None, timeout=None):
        got = answer(url, payload, timeout)
        if other_token and payload and url.endswith(f":{mla_check.BASE_PORT + 1}/generate"):
            got["output_ids"] = [8] + got["output_ids"][1:]
        return got

    monkeypatch.setattr(mla_check, "http_json", http_json)
    monkeypatch.setattr(mla_check, "oracle_report", lambda *a: {"served_vs_oracle_bf16": 0.0, "oracle_fp32_vs_bf16": 0.1})
    _fake_build(monkeypatch)
    rc = mla_check.main(["--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m"), "--servers", servers])
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert res["verdict"]["tp"] is verdict and rc == (0 if verdict else 1)
    assert res["tp"]["tp1"] == {"max_total_num_tokens": 11000, "bytes_per_token": 1088}
    assert res["tp"]["tp2"] == {"max_total_num_tokens": 12000, "bytes_per_token": rank_bytes}
    tp2 = started["int2-tp2"].argv
    assert tp2[tp2.index("--tp-size") + 1] == "2" and "--tp-size" not in started["int2"].argv
    assert "tp (per rank):" in (tmp_path / "mla_check.md").read_text()
