"""sglang-oscar quality on a tiny random Qwen3 model (GPT-OSS for the sink case): the table's rows, values and
data checks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sglang_oscar.calibrate import CalibrationError
from sglang_oscar.calibrate.prompts import PromptSet
from sglang_oscar.calibrate.quality import (check_disjoint, kivi_int2_key_reads, read_records, run_quality,
                                            select_prompt_set)
from sglang_oscar.cli.main import main
from sglang_oscar.quant.baselines import kivi_bits_per_element
from sglang_oscar.quant.bits import bits_per_element

from quality_helpers import load_script

SEQ, SINK, RECENT, RES = 128, 4, 16, 16
QUALITY_ARGS = ["--seq-len", SEQ, "--calib-tokens", 2048, "--eval-tokens", 512, "--sink", SINK, "--recent", RECENT,
                "--kivi-residual", RES, "--kivi-group", 16, "--kivi-group", 8, "--min-tokens", 1000, "--device", "cpu",
                "--no-progress"]
ROWS = ["bf16", "bf16-oracle", "naive-int2", "kivi-g16", "kivi-g8", "hadamard", "hadamard+win", "hadamard+lm",
        "hadamard+lm+win", "oscar-layer",
        "oscar-layer+win", "oscar-layer+lm", "oscar-layer+lm+win", "oscar-head", "oscar-head+win", "oscar-head+lm",
        "oscar-head+lm+win", "kvcov-head", "kvcov-head+win", "hadamard+c", "hadamard+c+win", "oscar-layer+c",
        "oscar-layer+c+win", "oscar-head+c", "oscar-head+c+win", "kvcov-head+c", "kvcov-head+c+win"]


def _write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d["text"], "key": d["key"], "split": d["split"]}) + "\n" for d in docs))


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory, text_tree, train_script):
    """A random tiny Qwen3 (large q/k init: attention far from uniform) with a trained byte-level BPE
    and calib.jsonl (train split) / heldout.jsonl (held-out split)."""
    import transformers as tf

    out = tmp_path_factory.mktemp("random_ckpt")
    docs = train_script.collect_documents([str(text_tree)], max_bytes=10**9, heldout_frac=0.2, seed=0)
    tok = train_script.train_tokenizer([d["text"] for d in docs if d["split"] == "train"], 384)
    cfg = tf.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.normal_(0.0, 0.25)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _write_jsonl(out / "calib.jsonl", [d for d in docs if d["split"] == "train"])
    _write_jsonl(out / "heldout.jsonl", [d for d in docs if d["split"] == "heldout"])
    return out


@pytest.fixture(scope="module")
def report(random_ckpt, tmp_path_factory):
    res = tmp_path_factory.mktemp("quality")
    rc = main(["quality", "--model", str(random_ckpt), "--out-dir", str(res), "--work-dir", str(res / "work"),
               *[str(a) for a in QUALITY_ARGS]])
    assert rc == 0
    return json.loads((res / "quality.json").read_text()), (res / "quality.md").read_text(), res


def _own_ppl(ckpt):
    """Teacher-forced perplexity of the model's own attention on the held-out sequences (the same
    selection as the command: seed 1, at most one sequence per file)."""
    from sglang_oscar.calibrate.model import load_model

    model, tok = load_model(str(ckpt), dtype="float32", device="cpu")
    ps, _ = select_prompt_set(tok, str(ckpt / "heldout.jsonl"), budget=512, seq_len=SEQ, seed=1, max_seq_per_file=1)
    nll, n = 0.0, 0
    with torch.no_grad():
        for s in ps.sequences:
            ids = torch.tensor([s])
            logits = model(input_ids=ids).logits.float()
            nll += float(torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum"))
            n += len(s) - 1
    return math.exp(nll / n), ps


def test_rows_and_bf16(report, random_ckpt):
    rep, md, res = report
    rows = {r["name"]: r for r in rep["rows"]}
    assert [r["name"] for r in rep["rows"]] == ROWS
    own, ps = _own_ppl(random_ckpt)
    assert rep["sequences"] == len(ps.sequences) == 4 and rep["eval_len"] == SEQ
    # the held-out files here are longer than SEQ tokens: four sequences, four different held-out files
    held_keys = {r["key"] for r in read_records(str(random_ckpt / "heldout.jsonl"))}
    names = [name for seq in rep["heldout"]["sources"] for name, _, _ in seq]
    assert rep["heldout_files"] == len(set(names)) == len(names) == 4 and set(names) <= held_keys
    assert rep["heldout"]["max_tokens_per_document"] == SEQ and rep["heldout"]["tokens_sha256"] == ps.meta["tokens_sha256"]
    calib_names = {name for seq in rep["calibration"]["prompts"]["sources"] for name, _, _ in seq}
    assert rep["calib_files"] == len(calib_names) == 2048 // SEQ and not calib_names & held_keys
    assert f"4 sequences x {SEQ} tokens ({4 * (SEQ - 1)} scored) from 4 held-out files" in md
    assert f"calibration 2048 tokens from {rep['calib_files']} train files" in md
    assert rows["bf16"]["ppl"] == pytest.approx(own, rel=1e-6)
    assert rep["bf16_ppl_spread"] < 1e-6 * own  # every perplexity call scored the same BF16 run
    assert rows["bf16-oracle"]["ppl"] == pytest.approx(own, rel=1e-3)  # the harness itself (BF16-rounded K/V)
    assert rows["bf16"]["error_db"] < -40 and rows["bf16"]["int2_read_fraction"] == 0.0
    for r in rep["rows"]:
        assert math.isfinite(r["ppl"]) and math.isfinite(r["error_db"])
        assert r["ppl_rel_change"] == pytest.approx(r["ppl"] / own - 1.0, rel=1e-6, abs=1e-9)
    # files: table, JSON, statistics and both fitted rotations
    table, spec_md = md.split("Spectral concentration")
    assert table.count("\n| ") == len(ROWS) + 1 and "| kvcov-head+win |" in table
    # the spectrum diagnostic: one row per layer, the same numbers as the JSON
    spec = rep["spectrum"]
    assert sorted(spec, key=int) == [str(i) for i in range(len(spec))] and len(spec) >= 2
    assert spec_md.count("\n| ") == len(spec) + 1 and f"head_dim {rep['head_dim']}" in spec_md
    for lid, r in spec.items():
        for t in "qkv":
            assert 1.0 / rep["head_dim"] <= r[f"{t}_top1"] <= r[f"{t}_top1_max"] <= 1.0
            assert 1.0 <= r[f"{t}_eff_dim"] <= rep["head_dim"]
        assert f"| {lid} | {r['q_top1']:.3f} | {r['q_eff_dim']:.1f} |" in spec_md
    assert {p.name for p in (res / "work").iterdir()} >= {"stats.safetensors", "rot_oscar.safetensors",
                                                          "rot_oscar-perhead.safetensors",
                                                          "rot_perhead-kv.safetensors",
                                                          "rot_oscar_centred.safetensors"}
    # centering costs no bits (the means are per-layer constants) and changes the cache
    for name in ("hadamard", "oscar-layer", "oscar-head", "kvcov-head"):
        for win in ("", "+win"):
            plain, centred = rows[name + win], rows[name + "+c" + win]
            assert centred["bits_128k"] == plain["bits_128k"] and centred["bits_eval"] == plain["bits_eval"]
            assert centred["error_db"] != plain["error_db"]


def test_error_ordering(report):
    rep = report[0]
    err = {r["name"]: r["error_db"] for r in rep["rows"]}
    ppl = {r["name"]: r["ppl"] for r in rep["rows"]}
    # naive per-token symmetric INT2 is the worst cache; every INT2 cache is far above the BF16 floor
    for name in ROWS[3:]:
        assert err["naive-int2"] > err[name] + 1.0, name
    assert min(err[n] for n in ROWS[2:]) > err["bf16"] + 15
    # fitted rotations are real rotations of the same format: a random model has no structure for them to
    # exploit, so they land next to the data-free Hadamard (on trained models they are compared on the GPU)
    for name, base in (("oscar-layer", "hadamard"), ("oscar-head", "hadamard"), ("oscar-layer+lm", "oscar-layer"),
                       ("oscar-head+lm", "oscar-head"), ("hadamard+lm", "hadamard")):
        assert abs(err[name] - err[base]) < 2.0, name
    assert len({err[n] for n in ("hadamard", "oscar-layer", "oscar-head")}) == 3
    # BF16 windows help every OSCAR-format cache
    for base in ("hadamard", "hadamard+lm", "oscar-layer", "oscar-layer+lm", "oscar-head", "oscar-head+lm"):
        assert err[base + "+win"] < err[base] - 1.0, base
    # smaller KIVI groups cost bits and buy accuracy
    assert err["kivi-g8"] < err["kivi-g16"]
    # a random model's perplexity moves by up to ~0.6% in either direction under any cache, so one row's
    # change ranks nothing (naive INT2 moved it less than some windowed rows); summed over the eleven
    # (cache, cache + windows) pairs, the BF16 windows take away most of the change
    bases = [n for n in ROWS[5:] if not n.endswith("+win") and n + "+win" in ppl]
    assert len(bases) == 11
    moved = {n: abs(ppl[n] - ppl["bf16"]) for n in ppl}
    assert sum(moved[n + "+win"] for n in bases) < 0.75 * sum(moved[n] for n in bases), moved


def test_kvcov_rows_use_the_perhead_kv_rotation(report, random_ckpt):
    """The kvcov-head rows are upstream's per-head recipe: the saved rotation is U_desc H of each kv head's
    raw K / V second moment, and the rows' error and perplexity are those of that rotation."""
    from sglang_oscar.calibrate.error import functional_error
    from sglang_oscar.calibrate.model import load_model
    from sglang_oscar.calibrate.ppl import perplexity
    from sglang_oscar.calibrate.stats import CalibrationStats
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet
    from sglang_oscar.rotation.hadamard import default_hadamard

    rep, _, res = report
    rows = {r["name"]: r for r in rep["rows"]}
    rs = RotationSet.load(str(res / "work" / "rot_perhead-kv.safetensors"))
    stats = CalibrationStats.load(str(res / "work" / "stats.safetensors"))
    assert rs.metadata["objective"] == "cov_eig_hadamard_perhead"
    for lid in (0, 1):
        n = stats.tokens_per_layer(1)[lid]
        for which, key in (("k", "k_sum"), ("v", "v_sum")):
            r = (rs.k if which == "k" else rs.v)[lid].double()
            cov = stats.sums[key][lid] / n
            assert r.shape == (2, 32, 32)
            for h in range(2):
                u = r[h] @ default_hadamard(32).T  # R = U_desc H -> U_desc (fp32 file: tolerances 1e-5)
                lam = torch.diagonal(u.T @ cov[h] @ u)
                assert torch.all(lam[:-1] >= lam[1:] - 1e-5 * lam[0]), (lid, which, h)
                assert torch.allclose(u.T @ cov[h] @ u, torch.diag(lam), atol=1e-5 * float(lam[0]))
    model, tok = load_model(str(random_ckpt), dtype="float32", device="cpu")
    ps, _ = select_prompt_set(tok, str(random_ckpt / "heldout.jsonl"), budget=512, seq_len=SEQ, seed=1, max_seq_per_file=1)
    cfg = OscarConfig(sink_tokens=SINK, recent_tokens=RECENT)
    err = functional_error(model, ps, {"kv": rs}, cfg, include_baselines=False, progress=False)
    assert rows["kvcov-head+win"]["error_db"] == pytest.approx(err["overall_db"]["kv"], abs=1e-6)
    ppl = perplexity(model, ps, rs, OscarConfig(sink_tokens=0, recent_tokens=0), window_mode="decode", progress=False)
    assert rows["kvcov-head"]["ppl"] == pytest.approx(ppl["int2"]["ppl"], rel=1e-6)
    assert rows["kvcov-head"]["error_db"] != rows["oscar-head"]["error_db"]


def test_bits_and_reads(report):
    rep = report[0]
    rows = {r["name"]: r for r in rep["rows"]}
    d = 32
    assert rows["naive-int2"]["bits_eval"] == rows["naive-int2"]["bits_128k"] == 2.0 + 16 / d
    assert rows["hadamard"]["bits_eval"] == pytest.approx(bits_per_element(d, None, "float16", SEQ, 0, 0)) == 3.0
    assert rows["oscar-head+win"]["bits_eval"] == pytest.approx(2.0 + 32 / d + (SINK + RECENT) * 16 / SEQ)
    assert rows["oscar-layer+lm+win"]["bits_128k"] == pytest.approx(bits_per_element(d, None, "float16", 131072, SINK, RECENT))
    assert rows["kivi-g8"]["bits_eval"] == pytest.approx(kivi_bits_per_element(SEQ, d, residual=RES, key_group=8, value_group=8))
    assert rows["kivi-g16"]["bits_128k"] == pytest.approx(kivi_bits_per_element(131072, d, residual=RES, key_group=16,
                                                                                 value_group=16))
    assert rows["bf16"]["bits_eval"] == 16.0
    # INT2 read shares, by hand for T = 128 (every sequence is full length)
    pairs = SEQ * (SEQ + 1) // 2
    assert rows["naive-int2"]["int2_read_fraction"] == rows["oscar-head"]["int2_read_fraction"] == 1.0
    win = sum(max(0, i + 1 - SINK - RECENT) for i in range(SEQ))  # keys sink <= j <= i - recent
    assert rows["oscar-layer+win"]["int2_read_fraction"] == pytest.approx(win / pairs)
    assert rows["kivi-g8"]["int2_read_fraction"] == pytest.approx(kivi_int2_key_reads(SEQ, RES) / pairs)
    assert kivi_int2_key_reads(4, 2) == 0 + 2 + 2 + 4


def test_disjoint_checks(report):
    rep = report[0]
    assert rep["disjoint"]["shared_sequences"] == 0 and rep["disjoint"]["shared_documents"] == 0
    assert rep["disjoint"]["calib_documents"] > rep["disjoint"]["heldout_documents"] > 0
    assert rep["calibration"]["tokens_per_layer_min"] == 2048
    a = PromptSet([[1, 2, 3], [4, 5, 6]], {})
    b = PromptSet([[7, 8, 9], [4, 5, 6]], {})
    with pytest.raises(CalibrationError, match="1 evaluation sequences are also calibration sequences"):
        check_disjoint(a, b)
    c = PromptSet([[7, 8, 9]], {})
    assert check_disjoint(a, c)["shared_sequences"] == 0
    with pytest.raises(CalibrationError, match="split 'train', not 'heldout'"):
        check_disjoint(a, c, [{"text": "x", "split": "train"}], [{"text": "y", "split": "train"}])
    with pytest.raises(CalibrationError, match="both calibration and evaluation documents"):
        check_disjoint(a, c, [{"text": "x"}], [{"text": "x"}])


@pytest.mark.filterwarnings("ignore::sglang_oscar.calibrate.ShortDataWarning")  # 7 held-out files as calibration
def test_refuses_overlapping_files(random_ckpt, tmp_path):
    heldout = str(random_ckpt / "heldout.jsonl")
    rc = main(["quality", "--model", str(random_ckpt), "--calib", heldout, "--heldout", heldout,
               "--out-dir", str(tmp_path), *[str(a) for a in QUALITY_ARGS]])
    assert rc == 2 and not (tmp_path / "quality.json").exists()


def test_missing_checkpoint_directory(tmp_path, capsys):
    """A missing --model names the directory, not <dir>/calib.jsonl."""
    missing = str(tmp_path / "nonexistent")
    with pytest.raises(FileNotFoundError, match=r"model directory .*nonexistent does not exist \(pass a local checkpoint"):
        run_quality(missing, out_dir=str(tmp_path / "out"))
    # also with explicit --calib / --heldout files
    calib = tmp_path / "c.jsonl"
    calib.write_text('{"text": "x"}\n')
    with pytest.raises(FileNotFoundError, match=r"model directory .*nonexistent does not exist"):
        run_quality(missing, out_dir=str(tmp_path / "out"), calib_path=str(calib), heldout_path=str(calib))
    with pytest.raises(NotADirectoryError, match=r"model path .*c\.jsonl is a file, not a model directory"):
        run_quality(str(calib), out_dir=str(tmp_path / "out"))
    rc = main(["quality", "--model", missing, "--out-dir", str(tmp_path / "out"), *[str(a) for a in QUALITY_ARGS]])
    err = capsys.readouterr().err
    assert rc == 2 and f"model directory {missing} does not exist" in err and "calib.jsonl does not exist" not in err
    assert not (tmp_path / "out").exists()


def test_rotation_ablation_script(report, random_ckpt, capsys):
    """scripts/rotation_ablation.py rebuilds the table's fitted rotations from the same statistics
    (OSCAR per head = qqt_asc_P / sst_asc_P, upstream per-head = ktk_desc_N / vtv_desc_N), scores
    Hadamard like the report's baseline, and names a misspelled or misplaced rotation."""
    from sglang_oscar.calibrate.stats import CalibrationStats
    from sglang_oscar.rotation import RotationSet

    mod = load_script("rotation_ablation")
    _, _, res = report
    stats = CalibrationStats.load(str(res / "work" / "stats.safetensors"))
    for (kk, kv), saved in ((("qqt_asc_P", "sst_asc_P"), "rot_oscar-perhead"), (("ktk_desc_N", "vtv_desc_N"), "rot_perhead-kv")):
        built = mod.build(stats, kk, kv)
        ref = RotationSet.load(str(res / "work" / f"{saved}.safetensors"))
        for lid in (0, 1):
            # the same eigh on the same float64 moments (same eigenvector signs); the files hold fp32
            for a, b in ((built.k[lid], ref.k[lid]), (built.v[lid], ref.v[lid])):
                assert a.shape == b.shape == (2, 32, 32)
                assert torch.allclose(a.double(), b.double(), atol=1e-5), (saved, lid)
    with pytest.raises(ValueError, match="a V objective, given for K"):
        mod.build(stats, "sst_asc_P", "had")
    with pytest.raises(ValueError, match=r"expected 'had' or <qqt\|ktk\|sst\|vtv>_<asc\|desc>_<P\|N>"):
        mod.build(stats, "qqt_up_P", "had")
    rc = mod.main(["--model", str(random_ckpt), "--stats", str(res / "work" / "stats.safetensors"), "--sink", str(SINK),
                   "--recent", str(RECENT), "--seq-len", str(SEQ), "--eval-tokens", "512", "--device", "cpu",
                   "--pairs", "had:had,ktk_desc_N:vtv_desc_N", "--o-proj", "--ppl"])
    out = capsys.readouterr().out

    def values(tag):
        return {ln.split(f" {tag}")[0].strip(): float(ln.split(tag)[1].split()[0]) for ln in out.splitlines()
                if f" {tag} " in ln}

    lines, proj, ppl = values("overall"), values("o_proj"), values("ppl")
    assert rc == 0 and lines["K:had V:had"] == lines["hadamard"]
    rows = {r["name"]: r for r in report[0]["rows"]}
    assert lines["K:ktk_desc_N V:vtv_desc_N"] == pytest.approx(rows["kvcov-head+win"]["error_db"], abs=0.02)
    # --ppl: the table's perplexities of the same caches (same sequences, windows, decode mode)
    assert ppl["K:had V:had"] == pytest.approx(rows["hadamard+win"]["ppl"], rel=1e-4)
    assert ppl["K:ktk_desc_N V:vtv_desc_N"] == pytest.approx(rows["kvcov-head+win"]["ppl"], rel=1e-4)
    # --o-proj: the reference is what the model's own o_proj computes (heads concatenated in the model's order)
    assert set(proj) == {"K:had V:had", "K:ktk_desc_N V:vtv_desc_N"} and all(v < 0 for v in proj.values())
    from sglang_oscar.calibrate.model import geometry_of, load_model

    model, tok = load_model(str(random_ckpt), dtype="float32", device="cpu")
    ps, _ = select_prompt_set(tok, str(random_ckpt / "heldout.jsonl"), budget=512, seq_len=SEQ, seed=1, max_seq_per_file=1)
    energy: dict[str, float] = {}
    hooks = [layer.self_attn.o_proj.register_forward_hook(
        lambda m, _i, o, lid=str(i): energy.__setitem__(lid, energy.get(lid, 0.0) + float(o.double().pow(2).sum())))
        for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        for s in ps.sequences:
            model(input_ids=torch.tensor([s]))
    for h in hooks:
        h.remove()
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation import RotationSet

    rep_o = mod.o_proj_error(model, ps, {"had": RotationSet.data_free(geometry_of(model.config), "hadamard")},
                             OscarConfig(sink_tokens=SINK, recent_tokens=RECENT))
    assert rep_o["overall_db"]["had"] == pytest.approx(proj["K:had V:had"], abs=0.01)
    assert set(rep_o["reference_energy"]) == set(energy) == {"0", "1"}
    for lid, e in energy.items():
        assert rep_o["reference_energy"][lid] == pytest.approx(e, rel=1e-4), lid


def test_rotation_ablation_refuses_bad_input(report, random_ckpt, tmp_path, capsys):
    """Bad arguments stop before the model is loaded, each with a message naming the fix."""
    import shutil

    mod = load_script("rotation_ablation")
    work = report[2] / "work"
    base = ["--model", str(random_ckpt), "--stats", str(work), "--seq-len", str(SEQ), "--eval-tokens", "512",
            "--device", "cpu"]
    for extra, msg in ((["--pairs", "sst_asc_P:had"], "a V objective, given for K"),
                       (["--pairs", "had"], "entries must be K:V"),
                       (["--sink", "64", "--recent", "64"], "nothing would be quantized"),
                       (["--sink", "-1"], "must be >= 0")):
        with pytest.raises(SystemExit) as exc:
            mod.main(base + extra)
        assert exc.value.code == 2 and msg in capsys.readouterr().err, extra
    with pytest.raises(SystemExit):
        mod.main(["--model", str(tmp_path / "missing"), "--stats", str(work)])
    assert "pass a local checkpoint directory written by scripts/train_small_lm.py" in capsys.readouterr().err
    # the same checkpoint under another name: statistics of "another model" unless allowed
    other = tmp_path / "renamed"
    shutil.copytree(random_ckpt, other)
    assert mod.main(["--model", str(other), *base[2:], "--sink", str(SINK), "--recent", str(RECENT),
                     "--pairs", "had:had"]) == 2
    assert "was made for another model than --model" in capsys.readouterr().err
    assert mod.main(["--model", str(other), *base[2:], "--sink", str(SINK), "--recent", str(RECENT),
                     "--pairs", "had:had", "--allow-other-model"]) == 0


def test_rotation_ablation_key_error_detail(report, random_ckpt):
    """--k-detail's sums, recomputed head by head with an explicit score matrix (kv head h serves
    queries h*G .. h*G+G-1), for a per-head and a per-layer set and a non-default format."""
    from sglang_oscar.calibrate.model import load_model
    from sglang_oscar.calibrate.oracle import oracle_capture
    from sglang_oscar.calibrate.stats import CalibrationStats
    from sglang_oscar.config import OscarConfig
    from sglang_oscar.quant.int2 import fake_quantize
    from sglang_oscar.rotation import RotationSet

    mod = load_script("rotation_ablation")
    stats = CalibrationStats.load(str(report[2] / "work" / "stats.safetensors"))
    sets = {"head": mod.build(stats, "qqt_asc_P", "had"),
            "layer": RotationSet.load(str(report[2] / "work" / "rot_oscar.safetensors"))}
    model, tok = load_model(str(random_ckpt), dtype="float32", device="cpu")
    ps, _ = select_prompt_set(tok, str(random_ckpt / "heldout.jsonl"), budget=256, seq_len=SEQ, seed=1, max_seq_per_file=1)
    cfg = OscarConfig(sink_tokens=SINK, recent_tokens=RECENT, group_size=16, scale_dtype="float32", k_clip_ratio=0.9)
    got = mod.key_error_detail(model, ps, sets, cfg)
    want = {n: {"key_mse": 0.0, "score_err": 0.0, "range_sq": 0.0} for n in sets}

    def on(call):
        q, k, _ = call.rows(0)
        g = q.shape[1] // k.shape[1]
        for name, rs in sets.items():
            r = rs.matrices(call.layer_id, "k").float()
            se, rg, n = 0.0, 0.0, 0
            for h in range(k.shape[1]):
                rh = r[h] if r.dim() == 3 else r
                y = (k[:, h].float() @ rh).to(torch.bfloat16).float()
                e = (fake_quantize(y, group_size=16, clip_ratio=0.9, scale_dtype="float32") - y) @ rh.T
                want[name]["key_mse"] += float(e.double().pow(2).sum())
                for j in range(g):
                    se += float((q[:, h * g + j].double() @ e.double().T).pow(2).sum())
                    n += q.shape[0] * e.shape[0]
                rg += float((y.amax(-1) - y.amin(-1)).double().pow(2).sum())
            want[name]["score_err"] += se / n
            want[name]["range_sq"] += rg / (k.shape[0] * k.shape[1])
        return None

    with oracle_capture(model, False, on, None):
        for s in ps.sequences:
            model(input_ids=torch.tensor([s]), use_cache=False)
    assert sets["layer"].k[0].dim() == 2  # the per-layer branch is exercised
    for name in sets:
        for key in want[name]:
            assert got[name][key] == pytest.approx(want[name][key], rel=1e-4), (name, key)


def test_a_model_with_attention_sinks_gets_no_centred_rows(tmp_path):
    """GPT-OSS's sink logits rule centring out (fit_rotations refuses it): the table leaves the centred
    rows out, as for a soft-capped model, rather than failing after the calibration."""
    import hashlib
    import random

    import transformers as tf

    from sglang_oscar.calibrate.prompts import sequence_hash
    from sglang_oscar.calibrate.quality import QualitySettings, quality_report

    def prompts(seed, n, length=192):
        rng = random.Random(seed)
        seqs = [[rng.randrange(3, 256) for _ in range(length)] for _ in range(n)]
        return PromptSet(seqs, {"source": f"random-{seed}", "sha256": str(seed), "seq_len": length,
                                "tokens_sha256": hashlib.sha256(json.dumps(seqs).encode()).hexdigest(),
                                "sequence_sha256": [sequence_hash(s) for s in seqs], "num_sequences": n})

    torch.manual_seed(0)
    cfg = tf.GptOssConfig(vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=2,
                          num_experts_per_tok=1, sliding_window=16, max_position_embeddings=512,
                          layer_types=["sliding_attention", "full_attention"])
    rep = quality_report(tf.GptOssForCausalLM(cfg).eval(), prompts(1, 12), prompts(2, 2),
                         QualitySettings(seq_len=192, sink=4, recent=8, min_tokens=64), work_dir=str(tmp_path),
                         progress=False)
    names = [r["name"] for r in rep["rows"]]
    assert "oscar-layer" in names and not any("+c" in n for n in names), names
