"""CPU tests of checks a, b, d and i against stand-in servers: the comparisons, tolerances and
the PASS / FAIL decisions, without SGLang."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from . import check_a, check_b, check_d, check_e, check_fg, check_i, client, config
from .run import Run


class _Server:
    """Answers /generate deterministically from the prompt (``shift`` changes the tokens, ``dlp``
    the log-probs); a repeated prompt reports it as cached (radix hit)."""

    def __init__(self, name, shift=0, dlp=0.0, env=None, radix_dlp=0.0):
        self.spec = SimpleNamespace(name=name, env=env or {})
        self.t_ready, self.error, self.log_path = 1.0, None, "-"
        self.shift, self.dlp, self.seen, self.radix_dlp = shift, dlp, set(), radix_dlp

    def alive(self):
        return True

    def log_text(self):
        return ""

    def generate(self, payload, timeout=None):
        ids = payload["input_ids"]
        n = payload["sampling_params"]["max_new_tokens"]
        toks = [(sum(ids) + 7 * i + (self.shift if i == n - 1 else 0)) % 97 + 3 for i in range(n)]
        hit = tuple(ids) in self.seen
        dlp = self.dlp + (self.radix_dlp if hit else 0.0)  # a radix hit's rounding, when asked for
        meta = {"output_token_logprobs": [[-0.1 * (i + 1) - dlp, t, None] for i, t in enumerate(toks)],
                "output_top_logprobs": [[[-0.1, t, None], [-2.0, 0, None]] for t in toks],
                "cached_tokens": len(ids) - 1 if hit else 0, "completion_tokens": n}
        if payload.get("logprob_start_len") == 0:
            meta["input_token_logprobs"] = [[None, ids[0], None]] + [[-1.0 - self.dlp, t, None] for t in ids[1:]]
        self.seen.add(tuple(ids))
        return {"output_ids": toks, "meta_info": meta}


def _run(tmp_path, servers, *argv, **data):
    run = Run(config.parse_args(["--out", str(tmp_path / "out"), "--greedy-tokens", "4", *argv]))
    run.servers = {s.spec.name: s for s in servers}
    run.data.update(data)
    run.meta["entry_point"] = {"oscar": True}
    return run


def _prompts(*lens):
    return [{"prompt": list(range(3, 3 + n)), "min_margin": 1.5, "tokens": []} for n in lens]


def test_check_a_passes_on_identical_servers_and_fails_on_a_shift(tmp_path):
    same = _run(tmp_path, [_Server("qwen3-plugin-off", env={"SGLANG_PLUGINS": "x"}), _Server("qwen3-bf16")],
                greedy_bf16={"qwen3": _prompts(10, 20)})
    res = check_a.check_a(same)
    assert res.status == config.PASS and res.measured.startswith("2/2 prompts same tokens, 2/2 bit-identical")
    assert res.detail["plugin_disabled_env"] == {"SGLANG_PLUGINS": "x"}
    off = _run(tmp_path, [_Server("qwen3-plugin-off"), _Server("qwen3-bf16", dlp=0.01)],
               greedy_bf16={"qwen3": _prompts(10)})
    res = check_a.check_a(off)  # same tokens, log-probs 0.01 apart: over --a-tol 1e-3
    assert res.status == config.FAIL and "max |dlogprob| output 0.01" in res.measured
    same.meta["entry_point"] = {"oscar": False}
    assert check_a.check_a(same).status == config.FAIL


def test_check_b_needs_every_family_identical(tmp_path):
    servers = [_Server(f"{m}-{k}") for m in ("qwen3", "moe", "llama") for k in ("bf16", "int2-full")]
    data = {"greedy_bf16": {m: _prompts(8, 16) for m in ("qwen3", "moe", "llama")}}
    assert check_b.check_b(_run(tmp_path, servers, **data)).status == config.PASS
    servers[-1] = _Server("llama-int2-full", shift=1)  # the last greedy token differs
    res = check_b.check_b(_run(tmp_path, servers, **data))
    assert res.status == config.FAIL and "llama 0/2" in res.measured and "qwen3 2/2" in res.measured
    assert res.detail["models"]["llama"][0]["first_diff"] == 3


def test_check_b_judges_a_routed_family_on_fp32_twins(tmp_path):
    """gpt_oss (MoE): a BF16 int2-full server whose last token flips fails b alone; with fp32 twins of
    both servers present, they decide and the BF16 pair is reported."""
    data = {"greedy_bf16": {"gpt_oss": _prompts(8, 16)}}
    bf16 = [_Server("gpt_oss-bf16-hf-window"), _Server("gpt_oss-int2-full", shift=1)]
    res = check_b.check_b(_run(tmp_path, bf16, "--families", "gpt_oss", **data))
    assert res.status == config.FAIL and "gpt_oss 0/2" in res.measured
    twins = [_Server("gpt_oss-fp32-hf-window"), _Server("gpt_oss-int2-full-fp32")]
    res = check_b.check_b(_run(tmp_path, bf16 + twins, "--families", "gpt_oss", **data))
    assert res.status == config.PASS, res.measured
    assert "gpt_oss judged on fp32 servers 2/2 (max |dlogprob| 0) (BF16, reported: 0/2" in res.measured
    bad = [twins[0], _Server("gpt_oss-int2-full-fp32", shift=1)]
    assert check_b.check_b(_run(tmp_path, bf16 + bad, "--families", "gpt_oss", **data)).status == config.FAIL


def test_check_d_radix_chunk_and_eager(tmp_path):
    names = ("qwen3-int2-layer", "qwen3-int2-layer-chunk64", "qwen3-int2-layer-eager")
    res = check_d.check_d(_run(tmp_path, [_Server(n) for n in names], greedy_layer=_prompts(12, 30)))
    assert res.status == config.PASS, res.measured
    assert [r["radix_cached_tokens"] for r in res.detail["prompts"]] == [11, 29]
    assert res.detail["chunked_prompt_logprobs"]["n"] == 29
    res = check_d.check_d(_run(tmp_path, [_Server(names[0]), _Server(names[1], dlp=0.05), _Server(names[2])],
                               greedy_layer=_prompts(12)))
    assert res.status == config.FAIL and "chunk 64: 1/1 same" in res.measured  # same tokens, log-probs off


def test_check_d_judges_the_radix_hit_on_the_fp32_server_when_there_is_one(tmp_path):
    """A BF16 radix hit 0.05 off (over --d-tol 0.02) fails d without an fp32 server and passes with a
    clean one (reported beside it); an fp32 hit off fails too."""
    names = ("gemma4-int2-layer", "gemma4-int2-layer-chunk64", "gemma4-int2-layer-eager")

    def run_d(*fp32):
        servers = [_Server(names[0], radix_dlp=0.05), _Server(names[1]), _Server(names[2]), *fp32]
        run = _run(tmp_path, servers, "--families", "gemma4")
        run.fdata("gemma4")["greedy_layer"] = _prompts(12, 30)
        return check_d.check_d(run)

    assert run_d().status == config.FAIL
    res = run_d(_Server("gemma4-int2-layer-fp32"))
    assert res.status == config.PASS, res.measured
    assert "judged on the fp32 server: 2/2 same (2 bit-identical" in res.measured and "radix hit" in res.measured
    assert run_d(_Server("gemma4-int2-layer-fp32", radix_dlp=0.05)).status == config.FAIL


def test_check_d_judges_a_routed_familys_chunking_on_fp32_servers(tmp_path):
    """gpt_oss (MoE): a BF16 chunk-64 server 0.05 off is reported, the fp32 chunk-64 twin decides;
    without the twin (no --c-fp32 servers) the BF16 pair decides."""
    names = ("gpt_oss-int2-layer", "gpt_oss-int2-layer-chunk64", "gpt_oss-int2-layer-eager")

    def run_d(*fp32):
        servers = [_Server(names[0]), _Server(names[1], dlp=0.05), _Server(names[2]), *fp32]
        run = _run(tmp_path, servers, "--families", "gpt_oss")
        run.fdata("gpt_oss")["greedy_layer"] = _prompts(12, 30)
        return check_d.check_d(run)

    assert run_d().status == config.FAIL
    res = run_d(_Server("gpt_oss-int2-layer-fp32"), _Server("gpt_oss-int2-layer-chunk64-fp32"))
    assert res.status == config.PASS, res.measured
    assert "chunk 64 judged on fp32 servers: 2/2 same (2 bit-identical" in res.measured
    assert res.detail["chunked_prompt_logprobs_bf16"]["mean"] == pytest.approx(0.05)
    bad = run_d(_Server("gpt_oss-int2-layer-fp32"), _Server("gpt_oss-int2-layer-chunk64-fp32", dlp=0.05))
    assert bad.status == config.FAIL


def test_check_e_sigterm_does_not_wait_for_the_load_requests(tmp_path):
    """A device call's timeout (SIGTERM) while check e's requests wait on the servers: the check ends at
    once, so the harness stops the servers (which ends the requests) before the timeout's kill."""
    import signal
    import threading

    from sglang_oscar.serving_launcher import sigterm_exits

    stopped, first = threading.Event(), threading.Lock()

    class Stuck(_Server):
        def generate(self, payload, timeout=None):
            if first.acquire(blocking=False):  # one SIGTERM, to the main thread as timeout(1)'s kill reaches it,
                time.sleep(0.5)  # once that thread waits on the requests (a signal just before its wait is lost)
                signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
            stopped.wait(60)
            raise RuntimeError("the server was stopped")

    run = _run(tmp_path, [Stuck("qwen3-int2-load"), Stuck("qwen3-bf16-load")], "--load-requests", "4")
    t = time.time()
    try:
        with pytest.raises(SystemExit), sigterm_exits():
            check_e.check_e(run)
        assert time.time() - t < 30
    finally:
        stopped.set()


def test_check_i_reads_exit_code_time_and_message(tmp_path):
    class _Exited:
        def __init__(self, name, rc, msg, loaded=False):
            self.spec = SimpleNamespace(name=name, args=["--x"])
            self.proc = SimpleNamespace(poll=lambda: rc)
            self.t_start, self.t_exit, self.rc = time.time() - 5, time.time(), rc
            self.text = ("Load weight begin\n" if loaded else "") + msg + "\n"

        def alive(self):
            return False

        def log_text(self):
            return self.text

        def wait_exit(self, timeout):
            return self.rc

        def stop(self):
            pass

    msgs = {"bad-rotation-other-model": "ValueError: rotation file has 3 layers, the model 4 (another model?)",
            "bad-rotation-missing": "FileNotFoundError: /w/no_such_rotation.safetensors does not exist",
            "bad-group-size": "ValueError: --kv-cache-quant-group-size 48: group size must divide head_dim",
            "bad-flag-flashinfer": "ValueError: --kv-cache-dtype int2 needs --attention-backend oscar, not flashinfer",
            "bad-flag-dp-attention": "ValueError: --enable-dp-attention (dp-attention) is not supported with int2"}
    run = _run(tmp_path, [_Exited(n, 1, m) for n, m in msgs.items()])
    res = check_i.check_i(run)
    assert res.status == config.PASS and res.measured.startswith("5/5 refused before loading weights"), res.measured
    run.servers["bad-group-size"] = _Exited("bad-group-size", 1, msgs["bad-group-size"], loaded=True)
    run.servers["bad-flag-flashinfer"] = _Exited("bad-flag-flashinfer", 0, msgs["bad-flag-flashinfer"])
    res = check_i.check_i(run)
    assert res.status == config.FAIL and "failed: bad-group-size, bad-flag-flashinfer" in res.measured
    rows = {r["case"]: r for r in res.detail["cases"]}
    assert rows["bad-group-size"]["weights_loaded"] and rows["bad-flag-flashinfer"]["exit_code"] == 0
    assert rows["bad-rotation-missing"]["seconds"] == pytest.approx(5, abs=1)


def test_checks_on_the_sliding_window_families(tmp_path):
    """--families gemma3,gemma4: a, b and d compare each family's servers (b against the BF16 server
    with the HF window, a against the unpatched one); i counts gemma4's own cases."""
    fams = ("gemma3", "gemma4")
    srv = [_Server(f"{m}-{k}", env={"SGLANG_PLUGINS": "x"} if k == "plugin-off" else None) for m in fams
           for k in ("plugin-off", "bf16", "bf16-hf-window", "int2-full", "int2-layer", "int2-layer-chunk64",
                     "int2-layer-eager")]
    run = _run(tmp_path, srv, "--families", "gemma3,gemma4", greedy_bf16={m: _prompts(8, 16) for m in fams})
    for m in fams:
        run.fdata(m)["greedy_layer"] = _prompts(12)
    a, b, d = check_a.check_a(run), check_b.check_b(run), check_d.check_d(run)
    assert a.status == b.status == d.status == config.PASS, (a.measured, d.measured)
    assert a.measured.startswith("gemma3: 2/2 prompts same tokens") and " | gemma4: 2/2" in a.measured
    assert "gemma3 2/2" in b.measured and "gemma4 2/2" in b.measured and set(d.detail["families"]) == set(fams)
    run.servers["gemma4-bf16-hf-window"] = _Server("gemma4-bf16-hf-window", shift=1)  # b reads this baseline
    assert check_b.check_b(run).status == config.FAIL and check_a.check_a(run).status == config.PASS
    run.servers["gemma4-int2-layer-eager"] = _Server("gemma4-int2-layer-eager", shift=1)
    assert check_d.check_d(run).status == config.FAIL
    assert "family:gemma4" in run.data and "greedy_layer" not in run.data  # qwen3 keeps run.data itself

    class _Exited:
        def __init__(self, name, case, msg):
            self.spec = SimpleNamespace(name=name, args=["--x"], case=case)
            self.proc = SimpleNamespace(poll=lambda: 1)
            self.t_start, self.t_exit, self.text = time.time() - 3, time.time(), msg + "\n"

        def alive(self):
            return False

        def log_text(self):
            return self.text

        def wait_exit(self, timeout):
            return 1

    msg = ("RotationError: rot_onedim.safetensors: layer 2 (full) K rotation has shape (128, 128), expected (256, 256) "
           "(per layer) or (1, 256, 256) (per kv head) for head_dim 256 and 1 kv heads")
    run.servers = {"gemma4-bad-rotation-one-head-dim": _Exited("gemma4-bad-rotation-one-head-dim",
                                                               "bad-rotation-one-head-dim", msg),
                   "gemma4-bad-rotation-other-model": _Exited("gemma4-bad-rotation-other-model", "bad-rotation-other-model",
                                                              "ValueError: rotation file: missing layer [5]")}
    res = check_i.check_i(run)
    assert res.status == config.PASS and res.measured.startswith("2/2 refused"), res.measured
    run.servers["gemma4-bad-rotation-one-head-dim"].text = "ValueError: rotation file is broken\n"
    assert check_i.check_i(run).status == config.FAIL


def test_check_f_per_pool_ratios(tmp_path):
    """f on a hybrid SWA model: both pools of SGLang's startup line, each ratio against the target."""
    log = ("max_total_num_tokens=9\nUse sliding window memory pool. full_layer_tokens=1000, swa_layer_tokens=800\n"
           "Use sliding window memory pool. full_layer_tokens=1200, swa_layer_tokens=960\n")
    assert client.swa_pool_tokens_from_log(log) == {"full": 1200, "swa": 960}
    assert client.swa_pool_tokens_from_log("max_total_num_tokens=9") is None
    run = _run(tmp_path, [], "--families", "gemma4")
    res = {"gemma4-sizing-bf16": {"pools": {"full": 1200, "swa": 960}},
           "gemma4-sizing-int2": {"pools": {"full": 7200, "swa": 5760}}}
    ok, text = check_fg._pool_ratios(run, res, "gemma4")
    assert ok and text == "gemma4: full pool int2 7200 / BF16 1200 = 6.00x, swa pool int2 5760 / BF16 960 = 6.00x"
    res["gemma4-sizing-int2"]["pools"]["swa"] = 4000
    assert check_fg._pool_ratios(run, res, "gemma4")[0] is False
    assert check_fg._pool_ratios(run, {"gemma4-sizing-bf16": res["gemma4-sizing-bf16"]}, "gemma4") is None


def test_check_f_skip_sliding(tmp_path):
    """--oscar-skip-layers sliding, judged on SGLang's own allocation lines (format of the Gemma-4
    sizing servers, 2026-12-03): the sliding pool BF16 at the BF16 server's bytes per token, the full
    pool uint8; the plugin's per-kind line is parsed and reported."""
    line = ("[2026-12-03 07:07:18] sglang-oscar: {fmt} KV cache, {kind} layers ({n} x {h} kv heads x {d}/{d}): "
            "{b} bytes/token (BF16: {bf}, {r}x fewer); tokens: {t} (1.00 GiB)")
    log = "\n".join([line.format(fmt="INT2", kind="full", n=2, h=1, d=256, b=288, bf=2048, r="7.11", t=5000),
                     line.format(fmt="BF16 (--oscar-skip-layers)", kind="sliding", n=4, h=2, d=128, b=4096, bf=4096,
                                 r="1.00", t=4000)])
    kinds = client.kind_bytes_from_log(log)
    assert kinds == {"full": {"format": "int2", "bytes": 288, "bf16_bytes": 2048, "tokens": 5000},
                     "sliding": {"format": "bf16", "bytes": 4096, "bf16_bytes": 4096, "tokens": 4000}}
    alloc = "[2026-12-03 07:04:23] KV Cache is allocated. dtype: {dt}, #tokens: {n}, K size: {k} GB, V size: {k} GB"
    bf16_log = "\n".join([alloc.format(dt="torch.bfloat16", n=1_000_000, k="1.91"),
                          alloc.format(dt="torch.bfloat16", n=1_250_000, k="1.19")])
    assert client.kv_allocations_from_log(bf16_log)[0] == {"dtype": "torch.bfloat16", "tokens": 1_000_000,
                                                           "k_gb": 1.91, "v_gb": 1.91}
    skip_log = "\n".join([alloc.format(dt="torch.bfloat16", n=4_000_000, k="7.63"),
                          alloc.format(dt="torch.uint8", n=5_000_000, k="0.67")])
    res = {"gemma4-sizing-bf16": {"pools": {"full": 1_250_000, "swa": 1_000_000},
                                  "allocations": client.kv_allocations_from_log(bf16_log)},
           "gemma4-sizing-int2-skip-sliding": {"pools": {"full": 5_000_000, "swa": 4_000_000}, "kinds": kinds,
                                               "allocations": client.kv_allocations_from_log(skip_log)}}
    ok, text = check_fg._skip_sliding(res, "gemma4")
    assert ok, text
    assert "sliding pool torch.bfloat16 4096 B/token (BF16 server torch.bfloat16 4102)" in text  # GiB, 2 decimals
    assert "full pool torch.uint8 288 B/token, 5000000 tokens" in text and "plugin: sliding BF16 4096" in text
    res["gemma4-sizing-int2-skip-sliding"]["allocations"][0]["dtype"] = "torch.uint8"  # the flag not applied
    assert check_fg._skip_sliding(res, "gemma4")[0] is False
    assert check_fg._skip_sliding({}, "gemma4") is None


def test_check_f_hybrid_families(tmp_path):
    """f on gpt_oss (hybrid SWA: both pools) and qwen3_next (one KV pool, pool ``kv``; SGLang's
    mamba state pool reported from its log line, not judged)."""
    log = ("max_total_num_tokens=5000\nMamba Cache is allocated. max_mamba_cache_size: 40, conv_state size: 0.01GB, "
           "ssm_state size: 0.52GB \nMamba Cache is allocated. max_mamba_cache_size: 48, conv_state size: 0.02GB, "
           "ssm_state size: 0.63GB intermediate_ssm_state_cache size: 0.00GB\n")
    assert client.mamba_pool_from_log(log) == {"slots": 48, "conv_gb": 0.02, "ssm_gb": 0.63}
    assert client.mamba_pool_from_log("max_total_num_tokens=9") is None
    run = _run(tmp_path, [], "--families", "gpt_oss,qwen3_next", "--only", "f")
    mamba = {"slots": 48, "conv_gb": 0.02, "ssm_gb": 0.63}
    res = {"gpt_oss-sizing-bf16": {"pools": {"full": 1000, "swa": 800}},
           "gpt_oss-sizing-int2": {"pools": {"full": 6000, "swa": 4800}},
           "qwen3_next-sizing-bf16": {"pools": {"kv": 1000}, "mamba_pool": mamba},
           "qwen3_next-sizing-int2": {"pools": {"kv": 6100}, "mamba_pool": mamba}}
    ok, text = check_fg._pool_ratios(run, res, "gpt_oss")
    assert ok and text == "gpt_oss: full pool int2 6000 / BF16 1000 = 6.00x, swa pool int2 4800 / BF16 800 = 6.00x"
    ok, text = check_fg._pool_ratios(run, res, "qwen3_next")
    assert ok and text == ("qwen3_next: kv pool int2 6100 / BF16 1000 = 6.10x; mamba pool int2 48 slots (conv 0.02 GB, "
                           "ssm 0.63 GB), BF16 48 slots (conv 0.02 GB, ssm 0.63 GB)")
    del res["qwen3_next-sizing-bf16"]["mamba_pool"]
    assert check_fg._pool_ratios(run, res, "qwen3_next")[1].endswith("BF16 not logged")
