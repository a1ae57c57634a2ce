"""CPU tests of check h (``--tp2``) over several families: the command line, the TP 1 / TP 2 server
pairs (argv equal but for ``--tp-size 2`` and the ports) and check h against stand-in servers (one
row per family, each TP 2 server alone, a failing family not hiding the others)."""

from __future__ import annotations

import shlex
import time

import pytest

from . import __main__ as entry
from . import check_h, client, config, servers
from .run import Run, needed_models
from .test_checks_fake_servers import _prompts, _Server

H_ALL = ("qwen3", "gemma3", "gemma4", "gpt_oss", "qwen3_next", "qwen3_5", "minimax_m2")


def _rot(fams):
    rot = {f"{m}:{k}": f"/r/{m}_{k}" for m in fams for k in ("layer", "head", "identity", "mismatch")}
    rot.update({"gemma4:onedim": "/r/onedim", "gpt_oss:centred": "/r/centred", "qwen3_next:linear": "/r/linear",
                "qwen3_5:linear": "/r/linear35"})
    return rot


def _strip(cmd, flags=("--port", "--nccl-port")):
    """argv without ``flags`` and their values."""
    out, skip = [], False
    for x in cmd:
        if skip:
            skip = False
        elif x in flags:
            skip = True
        else:
            out.append(x)
    return out


# ----------------------------------------------------------------------------- command line


def test_h_families_on_the_command_line():
    a = config.parse_args(["--tp2", "--only", "h", "--families", "gemma4,qwen3_next"])
    assert a.checks == ["h"] and config.h_families(a) == ["gemma4", "qwen3_next"]
    assert config.h_families(config.parse_args(["--tp2"])) == ["qwen3"]  # the default: qwen3 only, as before
    assert config.h_families(config.parse_args(["--tp2", "--families", "moe,gemma3,llama"])) == ["gemma3"]
    assert config.h_families(config.parse_args(["--tp2", "--families", ",".join(H_ALL)])) == list(H_ALL)
    assert set(config.H_FAMILIES) == set(config.MODEL_FAMILIES) - set(config.B_ONLY_FAMILIES) - {"long"}
    for bad in (["--only", "h", "--families", "gemma4"],  # h without --tp2
                ["--only", "h", "--families", "qwen3"],
                ["--tp2", "--only", "h", "--families", "moe,llama"],  # only b-only families
                ["--tp2", "--families", "llama"],
                ["--tp2", "--only", "h", "--families", "moe"]):
        with pytest.raises(SystemExit):
            config.parse_args(bad)
    # h's families are among the checkpoints built (no extra qwen3 any more)
    assert needed_models(["h"], ["gemma4", "qwen3_next"]) == ["gemma4", "qwen3_next"]
    assert needed_models(["h"], ["moe", "gemma3"]) == ["gemma3"]
    assert needed_models(list("abcdefghi")) == ["qwen3", "moe", "llama", "long"]


# ----------------------------------------------------------------------------- servers


@pytest.mark.parametrize("only", ["h", "a,b,c,d,e,f,h,i"])
def test_h_server_pairs_differ_by_tp_size_only(tmp_path, only):
    """Per family: ``<f>-int2-head`` (phase 1, c's per-head server) and ``<f>-int2-head-tp2``
    (phase 2, alone) whose argv differ exactly by ``--tp-size 2`` and the ports: the family's own
    flags (Gemma-4's config remap, Qwen3-Next's fixed state pool, the windows, the pool cap) reach
    both."""
    args = config.parse_args(["--tp2", "--only", only, "--families", "moe," + ",".join(H_ALL), "--out", str(tmp_path)])
    specs = servers.server_specs(args, _rot(("moe",) + H_ALL))
    by = {s.name: s for s in specs}
    assert len(by) == len(specs) and len({s.port for s in specs}) == len(specs)
    tp2 = [s for s in specs if s.tp > 1]
    assert [s.name for s in tp2] == [servers.h_tp2_name(f) for f in H_ALL]  # in --families order, no moe
    for f in H_ALL:
        ref, two = by[servers.h_reference_name(f)], by[servers.h_tp2_name(f)]
        assert ref.name == f"{f}-int2-head" and two.name == f"{f}-int2-head-tp2"
        assert (ref.phase, ref.tp, two.phase, two.tp, two.checks) == (1, 1, 2, 2, "h")
        assert "h" in ref.checks and ref.checks == ("ch" if "c" in only else "h")
        assert two.model == ref.model == f and two.env == ref.env and two.pool_tokens == ref.pool_tokens == args.pool_tokens
        c1, c2 = servers.launch_command(ref, "/m", "py"), servers.launch_command(two, "/m", "py")
        assert c2[c2.index("--tp-size") + 1] == "2" and "--tp-size" not in c1
        i = c2.index("--tp-size")
        assert _strip(c2[:i] + c2[i + 2:]) == _strip(c1), f
        assert c1[c1.index("--port") + 1] != c2[c2.index("--port") + 1]
        assert c2[c2.index("--oscar-rotation") + 1] == f"/r/{f}_head"
        assert c2[c2.index("--kv-cache-dtype") + 1] == "int2"
        assert c2[c2.index("--oscar-sink-tokens") + 1] == str(config.C_SINK)
    a2 = {f: by[servers.h_tp2_name(f)].args for f in H_ALL}
    assert "--json-model-override-args" in a2["gemma4"] and "--json-model-override-args" not in a2["gemma3"]
    assert a2["qwen3_next"][a2["qwen3_next"].index("--max-mamba-cache-size") + 1] == str(
        servers.sglang_override_args("qwen3_next", max_running=16)[1])
    assert not any("-int2-head" in s.name for s in specs if s.model == "moe")  # b-only: no h, like c


def test_default_tp2_servers_unchanged(tmp_path):
    """--tp2 with the default families: one TP 2 server (qwen3's), started after phase 1 as before."""
    rot = _rot(("qwen3", "moe", "llama"))
    specs = servers.server_specs(config.parse_args(["--tp2", "--out", str(tmp_path)]), rot)
    assert [s.name for s in specs if s.tp > 1] == ["qwen3-int2-head-tp2"]
    assert {s.name for s in specs if "int2-head" in s.name} == {"qwen3-int2-head", "qwen3-int2-head-tp2"}
    only = servers.server_specs(config.parse_args(["--tp2", "--only", "h"]), rot)
    assert [(s.name, s.phase) for s in only] == [("qwen3-int2-head", 1), ("qwen3-int2-head-tp2", 2)]


def test_h_dry_run_plan(capsys):
    fams = "qwen3,gemma4,qwen3_next,minimax_m2,gpt_oss"
    assert entry.main(["--dry-run", "--tp2", "--only", "h", "--families", fams, "--python", "py"]) == 0
    out = capsys.readouterr().out.splitlines()
    heads = [ln for ln in out if ln.startswith("# ")]
    assert heads == [f"# {f}-int2-head [h] (phase 1)" for f in fams.split(",")] + \
        [f"# {f}-int2-head-tp2 [h] (phase 2)" for f in fams.split(",")]
    cmds = [shlex.split(ln) for ln in out if not ln.startswith("# ")]
    assert [c.count("--tp-size") for c in cmds] == [0] * 5 + [1] * 5


# ----------------------------------------------------------------------------- check h, stand-in servers


class _HServer(_Server):
    """A stand-in server with a URL and a log (``max_total_num_tokens`` on its scheduler line);
    ``down`` never becomes healthy."""

    def __init__(self, name, *, tokens=None, down=False, **kw):
        super().__init__(name, **kw)
        self.url = f"http://fake/{name}"
        self.log = f"max_total_num_tokens={tokens}\n" if tokens else ""
        self.alive_ = not down
        if down:
            self.t_ready, self.error = None, "exited with code 1: RuntimeError: unbalanced memory"

    def alive(self):
        return self.alive_

    def log_text(self):
        return self.log


def _h_run(tmp_path, monkeypatch, fams, tp2_kw=None, ref_kw=None, *argv):
    """A Run of check h on ``fams`` with stand-in servers: TP 1 references in ``run.servers`` (their
    /server_info answers 65536), TP 2 servers that ``run.start`` hands out (their /server_info
    fails: the log line decides); ``run.events`` records start / stop, so a test sees them alone."""
    run = Run(config.parse_args(["--tp2", "--only", "h", "--families", ",".join(fams), "--out", str(tmp_path / "out"),
                                 "--greedy-tokens", "4", *argv]))
    run.specs = servers.server_specs(run.args, _rot(fams))
    run.servers = {servers.h_reference_name(f): _HServer(servers.h_reference_name(f), tokens=1, **(ref_kw or {}).get(f, {}))
                   for f in fams}
    run.data["greedy_head"] = {f: _prompts(10, 20, 30) for f in fams}
    tp2 = {servers.h_tp2_name(f): _HServer(servers.h_tp2_name(f), tokens=60000, **(tp2_kw or {}).get(f, {}))
           for f in fams}
    run.events = []

    def start(specs):
        out = []
        for s in specs:
            assert not [n for n, srv in run.servers.items() if n.endswith("-tp2") and srv.alive_], "TP 2 servers overlap"
            run.events.append(("start", s.name))
            srv = tp2[s.name]
            run.servers[s.name] = srv
            out.append(srv)
        return out

    def stop(srvs):
        for srv in srvs:
            run.events.append(("stop", srv.spec.name))
            srv.alive_ = False

    monkeypatch.setattr(run, "start", start)
    monkeypatch.setattr(run, "wait_ready", lambda srvs: None)
    monkeypatch.setattr(run, "stop", stop)

    def http_json(url, payload=None, timeout=None):
        if url.endswith("-tp2/server_info") or url.endswith("-tp2/get_server_info"):
            raise RuntimeError(f"{url}: HTTP 404")
        return {"max_total_num_tokens": 65536}

    monkeypatch.setattr(client, "http_json", http_json)
    check_h.collect_h_reference(run)
    return run


def test_check_h_one_row_per_family(tmp_path, monkeypatch):
    fams = ("gemma4", "qwen3_next")
    run = _h_run(tmp_path, monkeypatch, fams)
    assert set(run.data["h_ref"]) == set(fams) and not run.data.get("h_ref_error")
    res = check_h.check_h(run)
    assert res.status == config.PASS, res.measured
    parts = res.measured.split(" | ")
    assert [p.split(":")[0] for p in parts] == list(fams)
    assert all(": 3/3 prompts same greedy tokens tp2 vs tp1" in p for p in parts)
    # the capacity line: TP 2 from its log (no /server_info), TP 1 from /server_info; reported, not judged
    assert all("per-rank max_total_num_tokens tp2 60000 / tp1 65536" in p and "reported, not judged" in p for p in parts)
    for f in fams:
        cap = res.detail["families"][f]["capacity"]
        assert cap == {"tp1": {"tokens": 65536, "source": "server_info"}, "tp2": {"tokens": 60000, "source": "log"}}
        assert len(res.detail["families"][f]["prompts"]) == 3
    # each TP 2 server alone: started, compared and stopped before the next family's starts
    assert run.events == [("start", "gemma4-int2-head-tp2"), ("stop", "gemma4-int2-head-tp2"),
                          ("start", "qwen3_next-int2-head-tp2"), ("stop", "qwen3_next-int2-head-tp2")]


def test_check_h_fails_when_one_familys_tokens_differ(tmp_path, monkeypatch):
    fams = ("qwen3", "gemma4", "minimax_m2")
    run = _h_run(tmp_path, monkeypatch, fams, {"gemma4": {"shift": 1}})
    res = check_h.check_h(run)
    assert res.status == config.FAIL
    parts = dict(p.split(": ", 1) for p in res.measured.split(" | "))
    assert parts["gemma4"].startswith("0/3 prompts same") and parts["qwen3"].startswith("3/3")
    assert parts["minimax_m2"].startswith("3/3")
    assert res.detail["families"]["gemma4"]["prompts"][0]["first_diff"] == 3
    # log-probs past --h-tol with identical tokens: the garbage guard fails that family
    run = _h_run(tmp_path, monkeypatch, fams, {"minimax_m2": {"dlp": 0.5}})
    res = check_h.check_h(run)
    assert res.status == config.FAIL and "minimax_m2: 3/3 prompts same greedy tokens tp2 vs tp1, max |dlogprob| 0.5" \
        in res.measured


def test_check_h_a_failing_server_does_not_hide_the_others(tmp_path, monkeypatch):
    fams = ("gpt_oss", "qwen3_next", "gemma3")
    run = _h_run(tmp_path, monkeypatch, fams, {"gpt_oss": {"down": True}}, {"gemma3": {"down": True}})
    assert "gemma3" in run.data["h_ref_error"] and "gemma3" not in run.data["h_ref"]
    res = check_h.check_h(run)
    assert res.status == config.FAIL
    parts = dict(p.split(": ", 1) for p in res.measured.split(" | "))
    assert parts["gpt_oss"].startswith("could not be evaluated: server gpt_oss-int2-head-tp2 is not serving")
    assert parts["gemma3"].startswith("could not be evaluated: no tp1 reference: server gemma3-int2-head")
    assert parts["qwen3_next"].startswith("3/3 prompts same")
    assert set(res.detail["families"]) == {"qwen3_next"} and set(res.detail["errors"]) == {"gpt_oss", "gemma3"}
    # the failed TP 2 server was still stopped; gemma3's never started (no reference)
    assert ("stop", "gpt_oss-int2-head-tp2") in run.events and ("start", "gemma3-int2-head-tp2") not in run.events


def test_check_h_single_family_and_budget(tmp_path, monkeypatch):
    """One family (the default qwen3): its result is the check's; an unevaluated one raises (run_check
    reports "could not be evaluated"), as before. Several: a family the budget left no time for is
    not run; with the others passing the check is SKIP (not a pass)."""
    run = _h_run(tmp_path, monkeypatch, ("qwen3",))
    res = check_h.check_h(run)
    assert res.status == config.PASS and res.measured.startswith("3/3 prompts same greedy tokens tp2 vs tp1")
    assert res.detail["server"] == "qwen3-int2-head-tp2"
    down = _h_run(tmp_path, monkeypatch, ("qwen3",), {"qwen3": {"down": True}})
    with pytest.raises(check_h.CheckError):
        check_h.check_h(down)

    run = _h_run(tmp_path, monkeypatch, ("qwen3", "gemma4"))
    real = run.start

    def start_and_spend_the_budget(specs):
        run.deadline = time.time() - 1.0
        return real(specs)

    run.start = start_and_spend_the_budget
    res = check_h.check_h(run)
    assert res.status == config.SKIP, res.measured
    assert "gemma4: not run: time budget" in res.measured and "--only h --families gemma4" in res.measured
    assert res.measured.startswith("qwen3: 3/3")


# ----------------------------------------------------------------------------- screened prompts


def test_precompute_screens_h_prompts_per_family(tiny_qwen3, tiny_family, tmp_path):
    """precompute: ``data["greedy_head"][family]`` for each family of h, screened greedily on that
    family's own model through the oracle with its per-head rotation file (``<family>:head``)."""
    from sglang_oscar.calibrate.model import geometry_of
    from sglang_oscar.rotation import RotationSet

    from . import checkpoints, oracle
    from .run import precompute

    fams = {"qwen3": tiny_qwen3[0], "qwen3_next": tiny_family("qwen3_next")[0]}
    run = Run(config.parse_args(["--tp2", "--only", "h", "--families", "moe," + ",".join(fams), "--out",
                                 str(tmp_path / "out"), "--h-lens", "12,20", "--greedy-tokens", "3",
                                 "--screen-candidates", "2"]))
    for f, path in fams.items():
        run.models[f] = path
        run.hf[f] = checkpoints.load_hf(path, "cpu")
        run.rot[f"{f}:head"] = str(tmp_path / f"rot_{f}.safetensors")
        RotationSet.data_free(geometry_of(run.hf[f].config), "identity").save(run.rot[f"{f}:head"])
    precompute(run)
    got = run.data["greedy_head"]
    assert set(got) == set(fams)  # not moe (b-only)
    for f in fams:
        assert [len(p["prompt"]) for p in got[f]] == [12, 20]
        # the same screening on the family's own model and rotation reproduces its prompts
        want = oracle.screen_prompts(run.hf[f], [12, 20], 3, candidates=2, seed=run.args.seed + 33,
                                     rotation=RotationSet.load(run.rot[f"{f}:head"]), config=run.data["c_config"],
                                     vocab=run.hf[f].config.vocab_size)
        assert [p["prompt"] for p in got[f]] == [p["prompt"] for p in want]
        assert [p["tokens"] for p in got[f]] == [p["tokens"] for p in want]
