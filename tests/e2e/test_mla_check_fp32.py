"""The MLA device check's ``--dtype float32`` twins (``int2-fp32``, ``bf16-fp32``) and their
``oracle-fp32`` item, on fake servers."""

from __future__ import annotations

import json
import os

import pytest

from . import mla_check
from .fp32_shim import FP32_SHIM_MODULE
from .mla_fakes import FakeServer, no_idle_wait, record_servers  # noqa: F401  (no_idle_wait: an autouse fixture)
from .mla_fakes import answers, fake_build

EXPANDED = ["--oscar-mla-storage", "expanded", "--kv-cache-quant-group-size", "64"]


def _run(tmp_path, monkeypatch, family, servers, report, dead=()):
    """main() on fake servers (those named in ``dead`` never healthy; ``report`` an exception: the
    oracle raises it; a function: the oracle calls it); returns (rc, results, {server: argv}, {server:
    env}, oracle calls)."""
    calls = []

    class Dying(FakeServer):
        def poll_health(self, *args, **kwargs):
            return "dead" if self.name in dead else "healthy"

    def oracle(model, prompts, served, storage="latent"):
        calls.append((sorted(served), storage))
        if isinstance(report, Exception):
            raise report
        return report() if callable(report) else report

    started = record_servers(monkeypatch, Dying)
    monkeypatch.setattr(mla_check, "http_json", answers(None, 0.0))
    monkeypatch.setattr(mla_check, "oracle_report", oracle)
    fake_build(monkeypatch, family)
    rc = mla_check.main(["--family", family, "--out", str(tmp_path), "--budget", "5", "--model", str(tmp_path / "m"),
                         "--servers", servers])
    argvs, envs = {n: s.argv for n, s in started.items()}, {n: s.env for n, s in started.items()}
    return rc, json.loads((tmp_path / "mla_check.json").read_text()), argvs, envs, calls


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_expanded"])
@pytest.mark.parametrize("fp32_error,passes", [(0.012, True), (0.021, False)])
def test_fp32_twins_serve_in_fp32_and_judge_against_the_fp32_oracle(tmp_path, monkeypatch, family, fp32_error, passes):
    """int2-fp32 and bf16-fp32 launch with --dtype float32 and the fp32 environment (IEEE Triton dots,
    CPU RoPE tables, the fp32 shim first on PYTHONPATH), the int2 twin with the family's int2 flags;
    the oracle sees every answered server; oracle-fp32 passes at 0.012 and fails at 0.021 (tol 0.02),
    while the BF16 oracle item keeps its own bound."""
    report = {"served_vs_oracle_bf16": 0.03, "oracle_fp32_vs_bf16": 0.05, "int2_effect_oracle_vs_fp32_model": 0.2,
              "fp32_server_vs_oracle_fp32": fp32_error, "fp32_floor_vs_fp32_model": 1e-6}
    rc, res, argvs, envs, calls = _run(tmp_path, monkeypatch, family, "bf16,int2,int2-fp32,bf16-fp32", report)
    storage = "expanded" if family.endswith("expanded") else "latent"
    assert calls == [(["bf16-fp32", "int2", "int2-fp32"], storage)]
    assert "oracle-fp32" in res["judged"] and res["verdict"]["oracle-fp32"] is passes and res["verdict"]["oracle"]
    assert rc == (0 if passes else 1) and res["oracle"]["fp32_floor_vs_fp32_model"] == 1e-6
    for name, argv in argvs.items():
        fp32 = name.endswith("-fp32")
        assert (argv[argv.index("--dtype") + 1] == "float32") if fp32 else "--dtype" not in argv, name
        assert (envs[name].get("TRITON_F32_DEFAULT") == "ieee") == fp32 and (envs[name].get("OSCAR_E2E_CPU_ROPE") == "1") == fp32
        has_expanded = any(argv[i:i + 4] == EXPANDED for i in range(len(argv)))
        assert has_expanded == (storage == "expanded" and name.startswith("int2")), name
    shims = envs["int2-fp32"]["PYTHONPATH"].split(os.pathsep)[0]
    assert os.path.exists(os.path.join(shims, f"{FP32_SHIM_MODULE}.py"))
    rows = {r["server"]: r["vs"] for r in res["rows"]}
    assert rows["int2-fp32"] == "int2" and rows["bf16-fp32"] == "bf16"  # reported beside the judged items
    md = (tmp_path / "mla_check.md").read_text()
    assert "fp32_server_vs_oracle_fp32" in md


REPORT = {"served_vs_oracle_bf16": 0.03, "oracle_fp32_vs_bf16": 0.05, "int2_effect_oracle_vs_fp32_model": 0.2,
          "fp32_server_vs_oracle_fp32": 0.01, "fp32_floor_vs_fp32_model": 1e-6}


@pytest.mark.parametrize("dead,serves", [("bf16-fp32", True), ("int2-fp32", False)])
def test_only_the_judged_fp32_twin_belongs_to_serves(tmp_path, monkeypatch, dead, serves):
    """A bf16-fp32 that never becomes healthy leaves the check passing (it is reported only); an
    int2-fp32 that does not fails serves and leaves oracle-fp32 unjudged."""
    rc, res, _, _, calls = _run(tmp_path, monkeypatch, "deepseek_v3", "bf16,int2,int2-fp32,bf16-fp32", REPORT,
                                dead=(dead,))
    assert res["servers"][dead] == "NOT HEALTHY" and res["verdict"]["serves"] is serves and rc == (0 if serves else 1)
    assert calls == [(sorted({"int2", "int2-fp32", "bf16-fp32"} - {dead}), "latent")]
    assert ("oracle-fp32" in res["verdict"]) is serves


def test_an_oracle_that_raises_fails_both_oracle_items(tmp_path, monkeypatch):
    """The oracle's exception fails oracle and oracle-fp32 and is kept in the results."""
    rc, res, _, _, _ = _run(tmp_path, monkeypatch, "deepseek_v3", "bf16,int2,int2-fp32", RuntimeError("no GPU"))
    assert rc == 1 and res["verdict"]["oracle"] is False and res["verdict"]["oracle-fp32"] is False
    assert res["oracle"] == "failed: RuntimeError: no GPU"


def test_a_timeout_during_the_oracle_still_writes_the_verdict(tmp_path, monkeypatch):
    """A SIGTERM (the device call's timeout) while the oracle computes: the table and the verdict
    are written, the oracle items are named unjudged with the termination, and SIGTERM's handler is
    restored."""
    import signal

    def oracle():
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("the SIGTERM did not stop the oracle")

    before = signal.getsignal(signal.SIGTERM)
    rc, res, _, _, _ = _run(tmp_path, monkeypatch, "deepseek_v3", "bf16,int2,int2-fp32", oracle)
    md = (tmp_path / "mla_check.md").read_text()
    assert rc == 1 and res["terminated"] == f"signal {int(signal.SIGTERM)} while computing the oracle"
    assert "oracle" not in res["verdict"] and res["verdict"]["serves"] and "oracle" not in res
    assert "not judged (fails the check): oracle, oracle-fp32; terminated: signal" in md
    assert signal.getsignal(signal.SIGTERM) == before


def test_fp32_floor_alone_is_reported_not_judged(tmp_path, monkeypatch):
    """bf16-fp32 without int2-fp32: the oracle runs for the floor's report, oracle-fp32 is not judged
    and says which server it needs."""
    rc, res, _, _, calls = _run(tmp_path, monkeypatch, "deepseek_v3", "bf16,bf16-fp32",
                                {"int2_effect_oracle_vs_fp32_model": 0.2, "fp32_floor_vs_fp32_model": 2e-6})
    assert calls == [(["bf16-fp32"], "latent")] and rc == 0
    assert "oracle-fp32" not in res["verdict"] and "oracle-fp32" not in res["judged"]
    assert res["oracle"]["fp32_floor_vs_fp32_model"] == 2e-6
    assert "oracle-fp32" in (tmp_path / "mla_check.md").read_text().split("not judged (their servers")[1]


@pytest.mark.parametrize("family", ["glm5_dense", "kimi_linear", "minimax_m3"])
def test_fp32_twins_are_refused_where_sglang_cannot_serve_fp32(tmp_path, monkeypatch, capsys, family):
    """A family outside the DeepSeek-V3 ones: --servers naming an fp32 twin stops before any model is
    built, naming the twins, the family and the alternative."""
    monkeypatch.setitem(mla_check.FAMILIES, family, (lambda path: pytest.fail("built"), *mla_check.FAMILIES[family][1:]))
    with pytest.raises(SystemExit) as exc:
        mla_check.main(["--family", family, "--out", str(tmp_path), "--servers", "int2,int2-fp32"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "int2-fp32" in err and f"--family {family} in fp32" in err and "--batch-invariant" in err
