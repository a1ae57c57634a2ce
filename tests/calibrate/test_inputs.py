"""Prompt sources, budgets and sampling; bad input gives clear errors."""

from __future__ import annotations

import json

import pytest

from calib_tiny import build_model, make_text, make_tokenizer, save_model
from sglang_oscar.calibrate import CalibrationError, ShortDataWarning
from sglang_oscar.calibrate.model import check_model_path, geometry_of, load_model, looks_local
from sglang_oscar.calibrate.prompts import Documents, build_prompt_set, load_documents
from sglang_oscar.cli.main import main


def _text_file(path, docs):
    path.write_text("\n\n".join(docs) + "\n")
    return str(path)


def test_text_and_jsonl_sources(tokenizer, tmp_path):
    docs = make_text(10, 50, 3)
    txt = _text_file(tmp_path / "a.txt", docs)
    jl = tmp_path / "a.jsonl"
    jl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    for src, kind, pack in ((txt, "text", True), (str(jl), "jsonl", False)):
        d = load_documents(src)
        assert d.kind == kind and d.texts == docs and len(d.sha256) == 64
        ps = build_prompt_set(tokenizer, src, budget=200, seq_len=64)
        assert ps.num_tokens == 200 and ps.meta["pack"] is pack
        assert all(len(s) <= 64 for s in ps.sequences)
    # packed text: full blocks of seq_len except the last
    ps = build_prompt_set(tokenizer, txt, budget=200, seq_len=64)
    assert [len(s) for s in ps.sequences] == [64, 64, 64, 8]


def test_seeded_sampling(tokenizer, tmp_path):
    txt = _text_file(tmp_path / "a.txt", make_text(30, 40, 5))
    a = build_prompt_set(tokenizer, txt, budget=300, seq_len=50, seed=0)
    b = build_prompt_set(tokenizer, txt, budget=300, seq_len=50, seed=0)
    c = build_prompt_set(tokenizer, txt, budget=300, seq_len=50, seed=1)
    assert a.sequences == b.sequences and a.meta["tokens_sha256"] == b.meta["tokens_sha256"]
    assert a.sequences != c.sequences and a.meta["sha256"] == c.meta["sha256"]


def test_datasets_source_local_directory(tokenizer, tmp_path):
    d = tmp_path / "ds"
    d.mkdir()
    (d / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in make_text(8, 40, 1)))
    ps = build_prompt_set(tokenizer, str(d), budget=100, seq_len=40)
    assert ps.meta["kind"] == "dataset" and ps.num_tokens == 100


def test_short_data_warns_with_count(tokenizer, tmp_path):
    txt = _text_file(tmp_path / "a.txt", make_text(2, 30, 1))
    with pytest.warns(ShortDataWarning, match=r"has only (\d+) tokens .* budget of 30000") as rec:
        ps = build_prompt_set(tokenizer, txt, seq_len=64)
    assert rec[0].filename == __file__  # attributed to the caller of build_prompt_set
    assert 0 < ps.num_tokens < 30000
    # through the CLI too (the warning names the count)
    out = tmp_path / "s.safetensors"
    mdir = save_model(build_model("qwen3"), tokenizer, tmp_path / "m")
    with pytest.warns(ShortDataWarning, match=f"only {ps.num_tokens} tokens"):
        assert main(["calibrate", "--model", str(mdir), "--prompts", txt, "--seq-len", "64", "--out", str(out), "--no-progress"]) == 0


def test_empty_and_missing_prompts(tokenizer, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n  \n")
    with pytest.raises(CalibrationError, match="empty"):
        build_prompt_set(tokenizer, str(empty))
    with pytest.raises(FileNotFoundError):
        build_prompt_set(tokenizer, str(tmp_path / "nope.txt"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(CalibrationError, match="no 'text' field"):
        build_prompt_set(tokenizer, str(bad))
    mdir = save_model(build_model("qwen3"), tokenizer, tmp_path / "m")
    rc = main(["calibrate", "--model", str(mdir), "--prompts", str(empty), "--out", str(tmp_path / "s.safetensors")])
    assert rc == 2 and "is empty" in capsys.readouterr().err


def test_model_without_attention_layers(tmp_path, capsys):
    from transformers import MambaConfig

    cfg = MambaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, state_size=4)
    with pytest.raises(CalibrationError, match="no attention layers"):
        geometry_of(cfg)
    d = tmp_path / "mamba"
    d.mkdir()
    cfg.save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    (tmp_path / "prompts.txt").write_text(make_text(2, 40, 0)[0])
    rc = main(["calibrate", "--model", str(d), "--prompts", str(tmp_path / "prompts.txt"), "--out", str(tmp_path / "s.safetensors")])
    assert rc == 2 and "no attention layers" in capsys.readouterr().err


def test_unsupported_architecture(tokenizer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, NemotronConfig

    # a decoder whose attention does not dispatch through transformers' AttentionInterface
    cfg = NemotronConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    d = save_model(AutoModelForCausalLM.from_config(cfg), tokenizer, tmp_path / "nemotron")
    txt = _text_file(tmp_path / "a.txt", make_text(5, 50, 0))
    rc = main(["calibrate", "--model", str(d), "--prompts", txt, "--tokens", "100", "--out", str(tmp_path / "s.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and "unsupported architecture" in err
    # a config transformers cannot build as a causal LM at all
    bad = tmp_path / "weird"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "oscar_nonexistent_arch", "num_hidden_layers": 2,
                                                 "num_attention_heads": 4, "hidden_size": 64}))
    rc = main(["calibrate", "--model", str(bad), "--prompts", txt, "--out", str(tmp_path / "s2.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and "oscar_nonexistent_arch" in err


def test_statistics_or_rotation_from_another_model_cli(model_dirs, prompt_files, tmp_path, capsys):
    stats = tmp_path / "q.safetensors"
    assert main(["calibrate", "--model", str(model_dirs["qwen3"]), "--prompts", str(prompt_files["calib"]),
                 "--tokens", "512", "--seq-len", "128", "--out", str(stats), "--no-progress"]) == 0
    capsys.readouterr()
    rc = main(["fit", "--stats", str(stats), "--config", str(model_dirs["llama"]), "--min-tokens", "1",
               "--out", str(tmp_path / "r.safetensors")])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot be used" in err and "qwen3" in err
    rot = tmp_path / "qrot.safetensors"
    assert main(["fit", "--stats", str(stats), "--min-tokens", "1", "--out", str(rot)]) == 0
    capsys.readouterr()
    for verb in ("error", "ppl"):
        rc = main([verb, "--model", str(model_dirs["gemma3"]), "--prompts", str(prompt_files["heldout"]),
                   "--tokens", "256", "--seq-len", "128", "--rotation", str(rot), "--sink", "4", "--recent", "8"])
        err = capsys.readouterr().err
        assert rc == 2 and "does not fit this model" in err, err


def test_no_pack_skips_short_documents_instead_of_stopping(tokenizer):
    """A document of fewer than 2 tokens is skipped; the documents after it are still used."""
    long_docs = make_text(6, 20, 4)
    short_docs = [d.split()[0] for d in make_text(6, 5, 5)]  # one token each
    docs = Documents([d for pair in zip(short_docs, long_docs) for d in pair], "jsonl", "mem", "0" * 64)
    want = sum(len(tokenizer(d, add_special_tokens=False)["input_ids"]) for d in long_docs)
    with pytest.warns(ShortDataWarning):
        ps = build_prompt_set(tokenizer, "mem", budget=10_000, seq_len=64, pack=False, documents=docs)
    assert ps.num_tokens == want and len(ps.sequences) == len(long_docs)
    assert ps.meta["documents_used"] == len(docs.texts)
    # the budget still stops consumption
    ps = build_prompt_set(tokenizer, "mem", budget=30, seq_len=64, pack=False, documents=docs)
    assert ps.num_tokens == 30


def test_zero_token_budget_is_refused(model_dirs, tmp_path, capsys):
    txt = _text_file(tmp_path / "a.txt", make_text(5, 50, 0))
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--model", str(model_dirs["qwen3"]), "--prompts", txt, "--tokens", "0",
              "--out", str(tmp_path / "s.safetensors")])
    assert exc.value.code == 2 and "must be a positive integer, got 0" in capsys.readouterr().err
    assert not (tmp_path / "s.safetensors").exists()
    with pytest.raises(CalibrationError, match="must be positive"):
        build_prompt_set(make_tokenizer(), txt, budget=0)


def test_public_helpers_are_documented():
    from sglang_oscar.calibrate import error, ppl, prompts, recipes, run
    from sglang_oscar.calibrate.model import model_id_of
    from sglang_oscar.calibrate.oracle import RotationCache, latent_fake_quant
    from sglang_oscar.calibrate.stats import CalibrationStats
    from sglang_oscar.rotation.latent import LatentRotationSet

    for obj in (prompts.Documents, run.args_key, run.summary, CalibrationStats.metadata, RotationCache.get, error._db,
                ppl._nll, model_id_of, recipes.default_paths, LatentRotationSet.matrix):
        assert obj.__doc__ and obj.__doc__.strip() and not obj.__doc__.startswith(obj.__name__ + "("), obj
    assert "float32 ``[R, R]``" in latent_fake_quant.__doc__


def test_missing_model_directory(tmp_path, monkeypatch, capsys):
    """A local-looking --model that does not exist says so (not Hugging Face's repo-id error)."""
    missing = str(tmp_path / "nomodel")
    msg = r"model directory .*nomodel does not exist \(pass a local HF checkpoint directory or a Hub id like Qwen/Qwen3-8B\)"
    with pytest.raises(FileNotFoundError, match=msg):
        load_model(missing, device="cpu")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for rel in ("./nomodel", "../nomodel", "~/nomodel", "a/b/nomodel"):
        with pytest.raises(FileNotFoundError, match=r"model directory " + rel.replace(".", r"\.") + " does not exist"):
            load_model(rel, device="cpu")
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    with pytest.raises(NotADirectoryError, match="is a file, not a model directory"):
        load_model(str(a_file), device="cpu")
    # the CLI verbs that load a model report it as a usage error
    txt = _text_file(tmp_path / "a.txt", make_text(2, 20, 0))
    for verb in ("calibrate", "error", "ppl"):
        rc = main([verb, "--model", missing, "--prompts", txt, "--out", str(tmp_path / f"{verb}.out")])
        err = capsys.readouterr().err
        assert rc == 2 and "does not exist (pass a local HF checkpoint directory" in err and "Repo id" not in err
    # Hub ids are still Hub ids (nothing is downloaded here); a ~ path that exists is expanded
    for hub_id in ("Qwen/Qwen3-8B", "gpt2"):
        assert not looks_local(hub_id) and check_model_path(hub_id) == hub_id
    (tmp_path / "ckpt").mkdir()
    assert looks_local("ckpt") and check_model_path("~/ckpt") == str(tmp_path / "ckpt")
    # dir/name under an existing local directory is local (train_small_lm's default runs/small_lm)
    (tmp_path / "runs").mkdir()
    assert looks_local("runs/small_lm") and not looks_local("nosuchorg/small_lm")
    with pytest.raises(FileNotFoundError, match=r"model directory runs/small_lm does not exist"):
        load_model("runs/small_lm", device="cpu")


def test_rotation_names_never_collide(monkeypatch):
    """`error --rotation a/rot b/rot c/rot`, all fitted by one method: the second is renamed by its file, and
    a third that would take that name too is refused rather than silently replacing it."""
    from types import SimpleNamespace

    from sglang_oscar.calibrate import CalibrationError, fit
    from sglang_oscar.calibrate.verb_inputs import rotations_from_specs

    monkeypatch.setattr(fit, "load_rotation_any", lambda path: SimpleNamespace(metadata={"method": "oscar"}, path=path))
    got = rotations_from_specs(["a/rot.safetensors", "b/rot.safetensors"])
    assert {k: v.path for k, v in got.items()} == {"oscar": "a/rot.safetensors", "oscar:rot.safetensors": "b/rot.safetensors"}
    with pytest.raises(CalibrationError, match="'oscar:rot.safetensors' is already taken.*NAME=PATH"):
        rotations_from_specs(["a/rot.safetensors", "b/rot.safetensors", "c/rot.safetensors"])
    named = rotations_from_specs(["x=a/rot.safetensors", "y=b/rot.safetensors", "c/rot.safetensors"])
    assert sorted(named) == ["oscar", "x", "y"]


def test_unavailable_task_prompts_name_calibrates_own_flag(monkeypatch):
    """The recipes' default calib_data task:gpqa without hub access: the error names calibrate's --prompts /
    compute_rotation.sh's --data, not eval's --data-file (which neither has)."""
    from sglang_oscar.evals import datasets
    from sglang_oscar.evals.errors import DatasetUnavailable

    monkeypatch.setattr(datasets, "hub_token", lambda: None)  # GPQA is gated: refused before any network
    with pytest.raises(DatasetUnavailable, match="gated") as exc:
        load_documents("task:gpqa")
    assert "--prompts FILE" in str(exc.value) and "compute_rotation.sh --data FILE" in str(exc.value)
    assert "--data-file" not in str(exc.value)
    with pytest.raises(DatasetUnavailable, match="--data-file PATH"):  # eval's own hint is unchanged
        datasets.load_task_data("gpqa")


@pytest.mark.parametrize("verb", ["calibrate", "error", "ppl"])
def test_prompts_are_read_before_the_model_loads(verb, tmp_path, capsys):
    """A missing prompts file is named before the model is looked for (here: a model path that does not
    exist either), so a data mistake costs seconds, not a large model's load."""
    from sglang_oscar.cli.main import main

    rc = main([verb, "--model", str(tmp_path / "no-model"), "--prompts", str(tmp_path / "missing.txt"),
               "--out", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "prompts file" in err and "missing.txt" in err and "no-model" not in err
