"""The MLA device check on its GLM-5 families (``glm5``, ``glm5_dense``: DSA under SGLang's ``dsa``
backend): servers, flags and environments on fake servers, and the dense model's oracle."""

from __future__ import annotations

import json
import os

import pytest

from . import checkpoints, mla_check, mla_models
from .mla_fakes import FakeServer, no_idle_wait, record_servers  # noqa: F401  (no_idle_wait: an autouse fixture)
from .mla_fakes import answers as _answers


def test_mla_check_glm5_reports_the_bf16_rows_chunked_and_judges_radix_without_bf16(tmp_path, monkeypatch):
    """--family glm5: by default the five servers of its judged items; named, the reported server
    int2-window-chunk64 is compared with int2-window (not judged); a BF16 server that never gets
    healthy fails "serves" and leaves "window" and "rotated" unjudged, while radix is still judged on
    the int2 server alone."""
    class NoBF16(FakeServer):
        def poll_health(self, *args, **kwargs):
            return "unhealthy" if "auto" in self.argv else "healthy"

    started = record_servers(monkeypatch, NoBF16)
    servers = [*mla_check.SERVERS, "int2-window-chunk64", mla_check.HADAMARD]
    port = mla_check.BASE_PORT + servers.index("int2-window-chunk64")
    monkeypatch.setattr(mla_check, "http_json", _answers(port, 0.03))
    _, flags, judged = mla_check.FAMILIES["glm5"]
    # DeepSeek-V3's config stands in for GLM-5's: the same latent geometry, which the identity rotation reads
    monkeypatch.setitem(mla_check.FAMILIES, "glm5", (lambda path: mla_models.deepseek_v3_config().save_pretrained(path)
                                                     or {"index_topk": 256}, flags, judged))
    argv = ["--family", "glm5", "--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "g")]
    assert mla_check.main(argv) == 1  # the BF16 server never serves
    argvs = [s.argv for s in started.values()]
    assert [a[a.index("--port") + 1] for a in argvs] == [str(mla_check.BASE_PORT + i) for i in range(5)]
    assert not any("--chunked-prefill-size" in a and "2048" in a for a in argvs)  # no reported server
    started.clear()
    rc = mla_check.main([*argv, "--servers", ",".join(servers)])
    res = json.loads((tmp_path / "mla_check.json").read_text())
    assert rc == 1 and res["servers"]["bf16"] == "NOT HEALTHY" and list(started) == servers
    chunked = started["int2-window-chunk64"].argv
    assert chunked[chunked.index("--chunked-prefill-size") + 1] == "64"  # chunked, every key from the BF16 rows
    assert chunked[chunked.index("--oscar-sink-tokens") + 1] == "2048"
    rotated = {n: s.argv[s.argv.index("--oscar-rotation") + 1] for n, s in started.items() if "--oscar-rotation" in s.argv}
    assert rotated == dict.fromkeys(["int2-window", "int2-window-chunk64"], str(tmp_path / checkpoints.IDENTITY_ROTATION))
    assert res["verdict"] == {"serves": False, "chunked": True, "radix": True, "load": True}
    row = next(r for r in res["rows"] if r["server"] == "int2-window-chunk64")
    assert row["vs"] == "int2-window" and abs(row["prompt_dlp_mean"] - 0.03) < 1e-9


def test_glm5_dense_keeps_every_position_of_every_prompt(tmp_path):
    """--family glm5_dense: the glm5 model with GLM-5's own top-k 2048, above every prompt (the
    indexer then selects every position), served with glm5's flags, environment and servers."""
    build, flags, judged = mla_check.FAMILIES["glm5_dense"]
    info = build(str(tmp_path / "g"))
    cfg = json.loads((tmp_path / "g" / "config.json").read_text())
    assert info["index_topk"] == cfg["index_topk"] == mla_models.GLM5_DENSE_TOPK > max(mla_check.PROMPT_LENS)
    assert cfg["architectures"] == ["GlmMoeDsaForCausalLM"] and mla_models.GLM5_TOPK < min(mla_check.PROMPT_LENS)
    assert flags == mla_check.FAMILIES["glm5"][1] and judged == (*mla_check.FAMILIES["glm5"][2], "oracle")
    assert mla_check.server_env("glm5_dense", str(tmp_path)) == {"SGLANG_DSA_FUSE_TOPK": "0"}
    assert mla_check.FAMILY_REF["glm5_dense"] == {"int2-window-chunk64": "int2-window"}
    # the oracle item on this model: served answers equal to the fp32 oracle's give 0 against it and the
    # BF16 copy's own rounding against the BF16 oracle; the INT2 effect is visible
    from . import mla_oracle
    from .checkpoints import random_prompt

    prompts = [random_prompt(n, s, mla_models.VOCAB) for s, n in enumerate((48, 96))]
    seen = {}
    orig = mla_oracle.prompt_logprobs

    def keep(model, ids):
        out = orig(model, ids)
        seen.setdefault(next(model.parameters()).dtype, []).append(out)
        return out
    import torch

    mp = pytest.MonkeyPatch()
    mp.setattr(mla_oracle, "prompt_logprobs", keep)
    try:
        first = mla_check.oracle_report(str(tmp_path / "g"), prompts, {"int2": [{"input_logprobs": [0.0]}] * 2})
        o32, hf = seen[torch.float32][:2], seen[torch.float32][2:4]  # the patched fp32 oracle's, the plain model's
        served = [{"input_logprobs": lp.tolist()} for lp in o32]
        rep = mla_check.oracle_report(str(tmp_path / "g"), prompts, {"int2": served})
        n_bf16 = len(seen[torch.bfloat16])
        # the fp32 twins alone: no BF16 oracle; int2-fp32 against the fp32 oracle, bf16-fp32 against the fp32 model
        fp32 = mla_check.oracle_report(str(tmp_path / "g"), prompts, {
            "int2-fp32": served, "bf16-fp32": [{"input_logprobs": (lp + 0.01).tolist()} for lp in hf]})
    finally:
        mp.undo()
    assert rep["served_vs_oracle_fp32"] < 1e-6 and rep["int2_effect_oracle_vs_fp32_model"] > 1e-3
    assert rep["served_vs_oracle_bf16"] == pytest.approx(rep["oracle_fp32_vs_bf16"]) and first["served_vs_oracle_fp32"] > 0
    assert "fp32_server_vs_oracle_fp32" not in rep and len(seen[torch.bfloat16]) == n_bf16
    assert fp32["fp32_server_vs_oracle_fp32"] < 1e-6 and fp32["fp32_floor_vs_fp32_model"] == pytest.approx(0.01, rel=1e-3)
    assert "served_vs_oracle_bf16" not in fp32 and fp32["int2_effect_oracle_vs_fp32_model"] == pytest.approx(rep["int2_effect_oracle_vs_fp32_model"], rel=1e-6)


def test_mla_check_glm5_dense_bf16_servers_decode_with_flashmla(tmp_path, monkeypatch):
    """--family glm5_dense: the servers without int2 (bf16, plugin-off) decode with SGLang's FlashMLA
    sparse kernel (FA3, its Hopper default, is not in the device bundle); the int2 servers keep
    SGLang's defaults (their attention is ours), and glm5 (top-k 256) has no such flag."""
    started = record_servers(monkeypatch)
    monkeypatch.setattr(mla_check, "http_json", _answers(None, 0.0))
    monkeypatch.setattr(mla_check, "oracle_report", lambda *a, **k: {"served_vs_oracle_bf16": 0.0,
                                                                      "oracle_fp32_vs_bf16": 0.0})
    flag = ["--dsa-decode-backend", "flashmla_sparse"]
    for family in ("glm5_dense", "glm5"):
        _, flags, judged = mla_check.FAMILIES[family]
        monkeypatch.setitem(mla_check.FAMILIES, family, (lambda path: mla_models.deepseek_v3_config().save_pretrained(path)
                                                         or {"index_topk": 2048}, flags, judged))
        started.clear()
        mla_check.main(["--family", family, "--out", str(tmp_path / family), "--budget", "5",
                        "--model", str(tmp_path / "m"), "--servers", "bf16,plugin-off,int2,int2-window"])
        assert list(started) == ["bf16", "plugin-off", "int2", "int2-window"]
        for name, srv in started.items():
            has = any(srv.argv[i:i + 2] == flag for i in range(len(srv.argv)))
            assert has == (family == "glm5_dense" and "int2" not in srv.argv), (family, name)


def test_mla_check_batch_invariant_int2_servers(tmp_path, monkeypatch):
    """--batch-invariant: only the int2 servers get the shim folder first on PYTHONPATH and
    $OSCAR_E2E_BATCH_INVARIANT (SGLang's batch-invariant GEMMs), the family's own environment kept;
    the result says so."""
    from .fp32_shim import BATCH_INVARIANT_ENV

    started = record_servers(monkeypatch)
    monkeypatch.setattr(mla_check, "http_json", _answers(None, 0.0))
    _, flags, judged = mla_check.FAMILIES["glm5"]
    monkeypatch.setitem(mla_check.FAMILIES, "glm5", (lambda path: mla_models.deepseek_v3_config().save_pretrained(path)
                                                     or {"index_topk": 256}, flags, judged))
    rc = mla_check.main(["--family", "glm5", "--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m"),
                         "--servers", "bf16,int2,int2-chunk64", "--batch-invariant"])
    assert rc == 0 and json.loads((tmp_path / "mla_check.json").read_text())["batch_invariant_int2"] is True
    shim = str(tmp_path / "shims")
    for name, env in ((n, s.env or {}) for n, s in started.items()):
        int2 = "int2" in name
        assert env.get("SGLANG_DSA_FUSE_TOPK") == "0", name
        assert (env.get(BATCH_INVARIANT_ENV) == "1") == int2, name
        assert env.get("PYTHONPATH", "").split(os.pathsep)[0] == shim if int2 else "PYTHONPATH" not in env, name
    assert os.path.isfile(os.path.join(shim, "oscar_e2e_fp32_shim.py"))
