"""compare (paired statistics) and eval-recipe (serve + eval + compare, one command)."""

from __future__ import annotations

import json
import math
import shlex
import statistics
import textwrap
from pathlib import Path

import pytest

from evals_fakes import FakeOpenAIServer, completion, gpqa_rows, write_jsonl
from sglang_oscar.cli.main import main
from sglang_oscar.evals import launcher
from sglang_oscar.evals.compare import compare_runs
from sglang_oscar.evals.errors import EvalError
from sglang_oscar.evals.recipe_run import run_recipe
from sglang_oscar.evals.runner import EvalSettings, run_eval

HERE = Path(__file__).resolve().parent


@pytest.fixture
def aime_file(tmp_path) -> Path:
    p = tmp_path / "aime.jsonl"
    write_jsonl(p, [{"id": f"p{i}", "problem": f"Problem {i}: compute it.", "answer": str(100 + i)}
                    for i in range(6)])
    return p


def answer_right_on(indices: set[int]):
    def responder(body):
        text = body["messages"][-1]["content"]
        i = int(text.split("Problem ")[1].split(":")[0])
        value = 100 + i if i in indices else 7
        return completion(f"<think>work</think>The answer is $\\boxed{{{value}}}$.")

    return responder


def run(tmp_path, responder, out, data, seeds=(0, 1)) -> Path:
    with FakeOpenAIServer(responder) as srv:
        run_eval(EvalSettings(task="aime25", model="fake-model", base_url=srv.base_url,
                              out_dir=tmp_path / out, seeds=list(seeds), threads=2,
                              data_file=str(data), retries=0, progress=False))
    return tmp_path / out


def test_compare_refuses_what_cannot_be_paired_and_names_the_fix(tmp_path, aime_file):
    """The same folder twice, a damaged metrics.json (named, with the fix), and
    runs of different models or sizes (warned: their means are over different things)."""
    a = run(tmp_path, answer_right_on({0, 1}), "a", aime_file)
    with pytest.raises(EvalError, match="both runs are .*: pass the control and the treatment folders"):
        compare_runs(a, a)
    b = run(tmp_path, answer_right_on({0}), "b", aime_file, seeds=(0,))
    c = compare_runs(a, b)
    assert any("different samples or seeds (n 6 vs 6, seeds ['0', '1'] vs ['0'])" in w for w in c["warnings"]), c
    m = json.loads((b / "metrics.json").read_text())
    (b / "metrics.json").write_text(json.dumps({k: v for k, v in m.items() if k != "seeds"}))
    with pytest.raises(EvalError, match=r"metrics.json lacks seeds .*re-run the eval into"):
        compare_runs(a, b)
    (b / "metrics.json").write_text("{broken")
    with pytest.raises(EvalError, match=r"b/metrics.json is not valid JSON .*re-run the eval into"):
        compare_runs(a, b)


def test_paired_difference_values(tmp_path, aime_file):
    a = run(tmp_path, answer_right_on({0, 1, 2, 3}), "a", aime_file)
    b = run(tmp_path, answer_right_on({0, 1, 4}), "b", aime_file)
    c = compare_runs(a, b)
    assert c["a"]["mean"] == pytest.approx(4 / 6) and c["a"]["std"] == 0.0
    assert c["b"]["mean"] == pytest.approx(3 / 6) and c["b"]["seeds"] == [0, 1]
    p = c["paired"]
    d = [0, 0, -1, -1, 1, 0] * 2
    assert p["n"] == 12 and p["per_seed_n"] == {"0": 6, "1": 6}
    assert p["diff"] == pytest.approx(sum(d) / 12)
    # The two seeds of a question are not independent: the standard error is over the 6
    # questions' mean differences, not over the 12 (seed, question) pairs.
    per_question = [0, 0, -1, -1, 1, 0]
    assert p["n_questions"] == 6
    assert p["se"] == pytest.approx(statistics.stdev(per_question) / math.sqrt(6))
    assert (p["only_a"], p["only_b"], p["both"], p["neither"]) == (4, 2, 4, 2)
    assert c["warnings"] == []


def test_compare_mean_std_over_seeds_and_cli(tmp_path, aime_file, capsys):
    a = run(tmp_path, answer_right_on({0, 1, 2}), "a", aime_file, seeds=(0, 1, 2))
    b = run(tmp_path, answer_right_on({0, 1, 2, 3, 4, 5}), "b", aime_file, seeds=(1, 2))
    # make seed 0 of run a differ: rewrite one answer as wrong
    rows = [json.loads(l) for l in (a / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        if r["seed"] == 0 and r["index"] == 0:
            r["correct"] = False
    (a / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = json.loads((a / "metrics.json").read_text())
    m["seeds"]["0"]["accuracy"] = 2 / 6
    (a / "metrics.json").write_text(json.dumps(m))
    c = compare_runs(a, b)
    accs = [2 / 6, 3 / 6, 3 / 6]
    assert c["a"]["mean"] == pytest.approx(statistics.mean(accs))
    assert c["a"]["std"] == pytest.approx(statistics.stdev(accs))
    assert c["b"]["mean"] == 1.0 and c["b"]["std"] == 0.0
    assert c["paired"]["n"] == 12  # only the common seeds 1 and 2
    assert c["paired"]["diff"] == pytest.approx(0.5)
    out_json = tmp_path / "cmp.json"
    assert main(["compare", str(a), str(b), "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "A: " in text and "B: " in text and "paired B - A over 12 common samples: 50.00 pp" in text
    assert "over 6 questions" in text
    assert json.loads(out_json.read_text())["paired"]["n"] == 12


def test_compare_uses_contiguous_prefix_of_partial_runs(tmp_path, aime_file):
    a = run(tmp_path, answer_right_on({0, 1, 2, 3}), "a", aime_file)
    b = run(tmp_path, answer_right_on({0, 1, 4}), "b", aime_file)
    lines = (b / "samples.jsonl").read_text().splitlines()
    kept = [l for l in lines if not (json.loads(l)["seed"] == 0 and json.loads(l)["index"] == 2)]
    (b / "samples.jsonl").write_text("\n".join(kept) + "\n")
    c = compare_runs(a, b)
    assert c["paired"]["per_seed_n"] == {"0": 2, "1": 6}
    assert c["paired"]["n"] == 8
    assert any("3 sample(s) finished in both runs lie beyond the common contiguous prefix" in w
               for w in c["warnings"])


def test_compare_refuses_unpaired_runs(tmp_path, aime_file):
    a = run(tmp_path, answer_right_on({0}), "a", aime_file)
    other = tmp_path / "other.jsonl"
    write_jsonl(other, [{"problem": f"Problem {i}: another one.", "answer": "1"} for i in range(6)])
    b = run(tmp_path, answer_right_on({0}), "b", other)
    with pytest.raises(EvalError, match="different prompts"):
        compare_runs(a, b)
    c = run(tmp_path, answer_right_on({0}), "c", aime_file, seeds=(5,))
    with pytest.raises(EvalError, match="no seed in common"):
        compare_runs(a, c)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        compare_runs(a, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not an eval run folder"):
        compare_runs(a, tmp_path / "empty")


# ----------------------------------------------------------------------------- eval-recipe

RECIPE = """
[model]
hf_id = "Qwen/Qwen3-8B"
family = "qwen3"
served = true

[rotation]
method = "hadamard"

[quant]
group_size = 128

[serve]
port = {port}
env = {{ FAKE_SGLANG_MODE = "ok" }}

[eval]
tasks = ["gpqa"]
seeds = [0, 1]
max_tokens = 1024
threads = 2
"""


def _recipe(tmp_path, port) -> Path:
    d = tmp_path / "recipes" / "qwen3-8b"
    d.mkdir(parents=True)
    p = d / "recipe.toml"
    p.write_text(textwrap.dedent(RECIPE).format(port=port))
    return p


def test_eval_recipe_dry_run_prints_every_command(tmp_path, capsys):
    p = _recipe(tmp_path, 31999)
    data = tmp_path / "g.jsonl"
    write_jsonl(data, gpqa_rows(4))
    out = tmp_path / "runs"
    rc = main(["eval-recipe", "--recipe", str(p), "--out", str(out), "--data-file", f"gpqa={data}",
               "--dry-run"])
    assert rc == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if not l.startswith("#")]
    assert len(lines) == 5  # serve + eval per arm, then compare
    serve_bf16, eval_bf16, serve_int2, eval_int2, cmp = (shlex.split(l) for l in lines)
    assert "--kv-cache-dtype" in serve_bf16 and serve_bf16[serve_bf16.index("--kv-cache-dtype") + 1] == "auto"
    assert serve_int2[serve_int2.index("--kv-cache-dtype") + 1] == "int2"
    assert eval_bf16[:2] == ["sglang-oscar", "eval"]
    assert eval_bf16[eval_bf16.index("--base-url") + 1] == "http://127.0.0.1:31999"
    assert eval_bf16[eval_bf16.index("--out") + 1] == str(out / "bf16" / "gpqa")
    assert eval_int2[eval_int2.index("--out") + 1] == str(out / "int2" / "gpqa")
    assert eval_bf16[eval_bf16.index("--seeds") + 1: eval_bf16.index("--seeds") + 3] == ["0", "1"]
    assert eval_bf16[eval_bf16.index("--data-file") + 1] == str(data)
    assert cmp == ["sglang-oscar", "compare", str(out / "bf16" / "gpqa"), str(out / "int2" / "gpqa"),
                   "--json", str(out / "compare_gpqa.json")]
    # the printed eval command is accepted by the eval parser
    from sglang_oscar.cli.main import build_parser

    ns = build_parser().parse_args(eval_int2[1:])
    assert ns.task == "gpqa" and ns.seeds == [0, 1] and ns.max_tokens == 1024


def test_eval_recipe_end_to_end_with_stand_in_server(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launcher, "SERVER_ENTRY", [str(HERE / "evals_fake_sglang.py")])
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _recipe(tmp_path, port)
    data = tmp_path / "g.jsonl"
    write_jsonl(data, gpqa_rows(8))
    out = tmp_path / "runs"
    rc = run_recipe(p, ["bf16", "int2"], out, {"gpqa": str(data)}, health_interval=0.1,
                    health_timeout=60)
    assert rc == 0
    cmp = json.loads((out / "compare_gpqa.json").read_text())
    # the stand-in answers right with the bf16 arm and always 'A' with int2
    from sglang_oscar.evals.datasets import load_task_data
    from sglang_oscar.evals.tasks import build_prompt

    samples = load_task_data("gpqa", data).samples
    a_rate = [sum(build_prompt("gpqa", s, seed).gold == "A" for s in samples) / 8 for seed in (0, 1)]
    assert cmp["a"]["mean"] == 1.0
    assert cmp["b"]["mean"] == pytest.approx(sum(a_rate) / 2)
    assert cmp["paired"]["n"] == 16
    assert cmp["paired"]["diff"] == pytest.approx(sum(a_rate) / 2 - 1.0)
    assert (out / "bf16" / "server.log").read_text().count("fake sglang ready") == 1
    assert not launcher.port_in_use("127.0.0.1", port)  # servers stopped
    capsys.readouterr()
    # everything complete: nothing is served again
    rc = run_recipe(p, ["bf16", "int2"], out, {"gpqa": str(data)}, health_interval=0.1)
    assert rc == 0
    text = capsys.readouterr().out
    assert text.count("not serving it again") == 2
    assert json.loads((out / "int2" / "server.json").read_text())["server_flags"]["--model-path"] == "Qwen/Qwen3-8B"
    # flags that change no answer (the context limit, memory sizing) do not bar a resume
    p.write_text(p.read_text().replace("[serve]\n", "[serve]\nmem_fraction_static = 0.5\n"))
    assert run_recipe(p, ["bf16", "int2"], out, {"gpqa": str(data)}, health_interval=0.1) == 0
    p.write_text(p.read_text().replace("mem_fraction_static = 0.5\n", ""))
    # a changed recipe does not reuse the arms' answers: refused before any server starts
    p.write_text(p.read_text().replace("[quant]\n", "[quant]\nrecent_tokens = 64\n"))
    with pytest.raises(ValueError, match=r"int2 holds answers of another int2 server \(--oscar-recent-tokens '256' -> "
                                         r"'64'\); move .*int2 aside"):
        run_recipe(p, ["bf16", "int2"], out, {"gpqa": str(data)}, health_interval=0.1)
    p.write_text(p.read_text().replace("recent_tokens = 64\n", "").replace("max_tokens = 1024", "max_tokens = 512"))
    with pytest.raises(ValueError, match=r"gpqa holds answers asked with other eval settings \(max_tokens: 1024 -> 512\)"):
        run_recipe(p, ["bf16", "int2"], out, {"gpqa": str(data)}, health_interval=0.1)
    assert not launcher.port_in_use("127.0.0.1", port)


def test_eval_recipe_bad_input(tmp_path):
    from sglang_oscar.cli.main import build_parser
    from sglang_oscar.evals.cli import cmd_eval_recipe

    p = _recipe(tmp_path, 31998)
    with pytest.raises(ValueError, match="--data-file given for 'math500'"):
        run_recipe(p, ["bf16"], tmp_path / "o", {"math500": "x.jsonl"}, dry_run=True)
    assert main(["eval-recipe", "--recipe", str(p), "--data-file", "gpqa", "--dry-run"]) == 2
    # a dry run checks the data files too, and one file per task
    data = tmp_path / "g.jsonl"
    write_jsonl(data, gpqa_rows(2))
    for args, msg in ((["--data-file", f"gpqa={tmp_path / 'none.jsonl'}"], "none.jsonl does not exist"),
                      (["--data-file", f"gpqa={tmp_path}"], "is a directory: pass the data file in it"),
                      (["--data-file", f"gpqa={data}", "--data-file", f"gpqa={data}"], "gives gpqa twice")):
        ns = build_parser().parse_args(["eval-recipe", "--recipe", str(p), *args, "--dry-run"])
        with pytest.raises(ValueError, match=msg):
            cmd_eval_recipe(ns)


def test_eval_recipe_serves_on_the_given_port(tmp_path, capsys):
    """The busy-port message says "or use --port": eval-recipe takes it."""
    p = _recipe(tmp_path, 31997)
    assert main(["eval-recipe", "--recipe", str(p), "--port", "31555", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--port 31555" in out and "--base-url http://127.0.0.1:31555" in out and "31997" not in out


def test_paired_se_clusters_seeds_of_one_question():
    from sglang_oscar.evals import stats

    # 3 seeds x 4 questions, each question's difference identical across seeds
    per_q = [1, 0, -1, 1]
    a = [0, 1, 1, 0] * 3
    b = [1, 1, 0, 1] * 3
    clusters = [0, 1, 2, 3] * 3
    p = stats.paired(a, b, clusters=clusters)
    assert p["diff"] == pytest.approx(statistics.mean(per_q))
    assert p["se"] == pytest.approx(statistics.stdev(per_q) / math.sqrt(4))
    # unequal seeds per question: cluster-robust formula
    a2, b2, c2 = [0, 0, 1, 0, 1], [1, 1, 1, 0, 0], ["q0", "q0", "q1", "q2", "q2"]
    d = [1, 1, 0, 0, -1]
    m = sum(d) / 5
    sums = {"q0": (1 - m) + (1 - m), "q1": 0 - m, "q2": (0 - m) + (-1 - m)}
    expect = math.sqrt(3 / 2 * sum(v * v for v in sums.values())) / 5
    assert stats.paired(a2, b2, clusters=c2)["se"] == pytest.approx(expect)
    # without clusters: the classic std / sqrt(n)
    assert stats.paired(a2, b2)["se"] == pytest.approx(statistics.stdev(d) / math.sqrt(5))


def test_compare_refuses_changed_gold_answers(tmp_path, aime_file):
    a = run(tmp_path, answer_right_on({0}), "a", aime_file)
    b = run(tmp_path, answer_right_on({0}), "b", aime_file)
    rows = [json.loads(l) for l in (b / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        if r["index"] == 1:
            r["gold"], r["gold_sha"] = "999", "0" * 16
    (b / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(EvalError, match="different gold answers"):
        compare_runs(a, b)


def test_compare_without_common_samples_exits_1_and_writes_strict_json(tmp_path, aime_file, capsys):
    a = run(tmp_path, answer_right_on({0}), "a", aime_file)
    b = run(tmp_path, answer_right_on({0}), "b", aime_file)
    lines = (b / "samples.jsonl").read_text().splitlines()
    kept = [l for l in lines if json.loads(l)["index"] != 0]  # index 0 missing: empty prefix
    (b / "samples.jsonl").write_text("\n".join(kept) + "\n")
    out_json = tmp_path / "cmp.json"
    rc = main(["compare", str(a), str(b), "--json", str(out_json)])
    captured = capsys.readouterr()
    assert rc == 1
    assert "nothing to pair" in captured.err
    data = json.loads(out_json.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert data["paired"]["n"] == 0 and data["paired"]["diff"] is None and data["paired"]["se"] is None


def test_eval_recipe_continues_past_an_incomplete_arm(tmp_path, monkeypatch, capsys):
    """One always-rejected question makes each eval exit 1 (incomplete); eval-recipe still
    runs the int2 arm and the comparison, and exits 1."""
    monkeypatch.setattr(launcher, "SERVER_ENTRY", [str(HERE / "evals_fake_sglang.py")])
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = _recipe(tmp_path, port)
    p.write_text(p.read_text().replace('FAKE_SGLANG_MODE = "ok"', 'FAKE_SGLANG_MODE = "reject-one"'))
    data = tmp_path / "g.jsonl"
    write_jsonl(data, gpqa_rows(8))
    out = tmp_path / "runs"
    rc = run_recipe(p, ["bf16", "int2"], out, {"gpqa": str(data)}, health_interval=0.1,
                    health_timeout=60)
    assert rc == 1
    for arm in ("bf16", "int2"):
        m = json.loads((out / arm / "gpqa" / "metrics.json").read_text())
        assert m["rejected"] == 2 and not m["complete"]  # question 5 under both seeds
    cmp = json.loads((out / "compare_gpqa.json").read_text())
    assert cmp["paired"]["per_seed_n"] == {"0": 5, "1": 5}  # the prefix before question 5
    assert cmp["a"]["complete"] is False and cmp["b"]["complete"] is False
    assert "# incomplete" in capsys.readouterr().out
    assert not launcher.port_in_use("127.0.0.1", port)


def test_server_identity_reads_both_flag_spellings():
    """``--flag=value`` and ``--flag value`` are one flag in an arm's server record: a neutral flag (memory,
    port) stays out of it in either spelling, an answer-changing one is kept with its value."""
    from sglang_oscar.evals.recipe_run import _NEUTRAL_FLAGS, _flag_values

    values = _flag_values(["--tp-size", "2", "--mem-fraction-static=0.8", "--enable-cache-report",
                           "--json-model-override-args={\"a\": 1}", "--x", "p", "q"])
    assert values == {"--tp-size": "2", "--mem-fraction-static": "0.8", "--enable-cache-report": "",
                      "--json-model-override-args": "{\"a\": 1}", "--x": "p q"}
    assert "--mem-fraction-static" in _NEUTRAL_FLAGS
