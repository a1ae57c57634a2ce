"""How evaluation / calibration sequences are chosen from document files: many files, a per-file cap,
round robin, deterministic, calibration (train split) disjoint from evaluation (held-out split)."""

from __future__ import annotations

import json
import random
import warnings
from collections import Counter

import pytest

from sglang_oscar.calibrate import CalibrationError, ShortDataWarning
from sglang_oscar.calibrate.prompts import Documents, build_per_document_prompt_set, build_prompt_set, sequence_hash
from sglang_oscar.calibrate.quality import check_disjoint, read_records, select_prompt_set

SEQ = 64
STRIDE = 100_000  # token id of position p of document d: d * STRIDE + p + 1 (0 is EOS)


class IdTokenizer:
    """One token per whitespace-separated integer; EOS 0, optional BOS prefix."""

    eos_token_id = 0

    def __init__(self, bos: int | None = None):
        self.bos = bos

    def __call__(self, text, add_special_tokens=True):
        ids = [int(w) for w in text.split()]
        return {"input_ids": ([self.bos] if add_special_tokens and self.bos is not None else []) + ids}


def _corpus(lengths: list[int]) -> Documents:
    texts = [" ".join(str(d * STRIDE + p + 1) for p in range(n)) for d, n in enumerate(lengths)]
    return Documents(texts, "jsonl", "synthetic", "0" * 64)


# 2 huge documents (the failure of the packed selection: a few long files supply everything),
# 20 documents of 1-3 sequences, 10 short ones
LENGTHS = [50 * SEQ, 40 * SEQ] + [SEQ + 7 * i for i in range(20)] + [SEQ // 4 + i for i in range(10)]
N_LONG = sum(n >= SEQ for n in LENGTHS)  # 22


def _decode(seqs, bos=None):
    """``{document: [positions]}`` in sequence order, read off the token ids themselves (not the metadata)."""
    pos: dict[int, list[int]] = {}
    for s in seqs:
        for t in s[1:] if bos is not None else s:
            if t not in (0, bos):
                pos.setdefault((t - 1) // STRIDE, []).append((t - 1) % STRIDE)
    return pos


def _select(budget, k=1, seed=1, lengths=LENGTHS, bos=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShortDataWarning)
        return build_per_document_prompt_set(IdTokenizer(bos), _corpus(lengths), budget=budget, seq_len=SEQ, seed=seed,
                                             max_seq_per_doc=k)


def test_one_sequence_per_file():
    ps = _select(16 * SEQ, lengths=LENGTHS[:N_LONG])  # files of at least SEQ tokens
    pos = _decode(ps.sequences)
    assert len(ps.sequences) == 16 and all(len(s) == SEQ for s in ps.sequences)
    # 16 sequences from 16 different files, each the start of its file
    assert len(pos) == ps.meta["documents_used"] == 16
    assert all(p == list(range(SEQ)) for p in pos.values())
    assert ps.meta["single_document_sequences"] == 16 and ps.meta["max_tokens_per_document"] == SEQ
    assert [src[0][0] for src in ps.meta["sources"]] == [str(s[0] // STRIDE) for s in ps.sequences]
    # with short files too (packed together), 16 sequences cover at least 16 files
    mixed = _select(16 * SEQ)
    pos = _decode(mixed.sequences)
    assert len(pos) == mixed.meta["documents_used"] >= 16 and max(len(p) for p in pos.values()) == SEQ
    # packing every document in the same seeded order draws the same budget from a few files
    old = build_prompt_set(IdTokenizer(), "synthetic", budget=16 * SEQ, seed=1, seq_len=SEQ, pack=True,
                           documents=_corpus(LENGTHS))
    assert old.num_tokens == mixed.num_tokens and len(_decode(old.sequences)) < 8


def test_all_files_and_packing_of_short_ones():
    with pytest.warns(ShortDataWarning, match="at most 1 sequence") as rec:
        ps = build_per_document_prompt_set(IdTokenizer(), _corpus(LENGTHS), budget=10**6, seq_len=SEQ, seed=3,
                                           max_seq_per_doc=1)
    assert rec[0].filename == __file__  # attributed to the caller of the selection
    pos = _decode(ps.sequences)
    assert len(pos) == ps.meta["documents_used"] == len(LENGTHS)  # every file, the short ones packed
    short = range(N_LONG, len(LENGTHS))
    assert all(pos[d] == list(range(LENGTHS[d])) for d in short)  # a short file whole, once
    assert all(pos[d] == list(range(SEQ)) for d in range(N_LONG))  # a long file: its first SEQ tokens only
    assert ps.num_tokens == N_LONG * SEQ + sum(LENGTHS[d] + 1 for d in short)  # + one EOS per short file
    # 215 tokens of short files: 3 packed sequences of several files and a partly filled one
    assert len(ps.sequences) == N_LONG + 4 and ps.meta["packed_sequences"] >= 3
    assert ps.meta["single_document_sequences"] + ps.meta["packed_sequences"] == len(ps.sequences)
    assert max(len(s) for s in ps.sequences) == SEQ
    contrib = Counter()
    for src in ps.meta["sources"]:
        for name, _, n in src:
            contrib[name] += n
    assert max(contrib.values()) == ps.meta["max_tokens_per_document"] == SEQ


def test_cap_and_round_robin():
    # the budget of one sequence per long file: with a cap of 3 no file gives a second block, as with a cap of 1
    first = _select(N_LONG * SEQ, k=3)
    assert first.sequences == _select(N_LONG * SEQ, k=1).sequences
    assert max(max(p) for p in _decode(first.sequences).values()) < SEQ
    # no budget limit: each file gives at most 3 blocks, in passes
    ps = _select(10**6, k=3)
    pos = _decode(ps.sequences)
    for d, n in enumerate(LENGTHS):
        want = min(n, 3 * SEQ) // SEQ * SEQ if n >= SEQ else n
        assert pos[d] == list(range(want)), d
    assert pos[0] == pos[1] == list(range(3 * SEQ))  # the huge files are capped
    assert ps.meta["max_tokens_per_document"] == ps.meta["max_tokens_per_document_cap"] == 3 * SEQ
    offsets = [src[0][1] for src in ps.meta["sources"] if len(src) == 1 and src[0][2] == SEQ]
    # pass order: all first blocks (offset 0), then second blocks, then third blocks
    assert offsets == sorted(offsets) and offsets.count(0) == N_LONG and offsets[-1] == 2 * SEQ
    # a second block only after every file has given its tokens: pass 1 is 25 sequences and 23 tokens here
    two = _select((N_LONG + 4) * SEQ, k=2)
    pos = _decode(two.sequences)
    assert len(pos) == len(LENGTHS) and two.num_tokens == (N_LONG + 4) * SEQ
    seconds = {d: p[SEQ:] for d, p in pos.items() if len(p) > SEQ}
    assert len(seconds) == 1 and next(iter(seconds.values())) == list(range(SEQ, 2 * SEQ - 23))


def test_deterministic_and_seeded():
    a, b = _select(16 * SEQ, seed=5), _select(16 * SEQ, seed=5)
    assert a.sequences == b.sequences and a.meta == b.meta
    c = _select(16 * SEQ, seed=6)
    assert set(_decode(c.sequences)) != set(_decode(a.sequences))


def test_prefix_budget_cut_and_errors():
    bos = 999_999_999
    ps = _select(5 * SEQ + 10, bos=bos, lengths=LENGTHS[:N_LONG])
    assert [len(s) for s in ps.sequences] == [SEQ] * 5 + [10]  # the last sequence is cut to the budget
    assert all(s[0] == bos for s in ps.sequences) and ps.num_tokens == 5 * SEQ + 10
    pos = _decode(ps.sequences, bos=bos)
    assert len(pos) == 6 and ps.meta["max_tokens_per_document"] == SEQ - 1  # room = SEQ - 1 after BOS
    with pytest.raises(CalibrationError, match="max_seq_per_doc"):
        build_per_document_prompt_set(IdTokenizer(), _corpus(LENGTHS), budget=100, seq_len=SEQ, max_seq_per_doc=0)
    with pytest.raises(CalibrationError, match="no text"):
        build_per_document_prompt_set(IdTokenizer(), Documents([], "jsonl", "x", ""), budget=100, seq_len=SEQ)


# ----------------------------------------------------------------------------- files on disk, real tokenizer
def _write_tree(root, train_script, frac):
    """Python-like files: 2 huge held-out files (like run 1's), 40 medium and 12 short files."""
    rng = random.Random(0)
    words = ["def", "return", "self", "value", "import", "class", "None", "for", "in", "if", "x", "y", "data"]

    def body(n_lines, tag):
        return "\n".join(f"{' ' * 4 * rng.randint(0, 2)}{' '.join(rng.choices(words, k=rng.randint(3, 8)))} "
                         f"# {tag} {i}" for i in range(n_lines)) + "\n"

    huge, i = [], 0
    while len(huge) < 2:  # names that the trainer's split puts in held-out
        key = f"big/huge{i}.py"
        if train_script.split_of(key, frac) == "heldout":
            huge.append(key)
        i += 1
    for key in huge:
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_text(body(2000, key))
    for f in range(52):
        path = root / f"pkg{f % 5}" / f"mod{f}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body(rng.randint(30, 60) if f < 40 else rng.randint(3, 5), f"m{f}"))
    return huge


def test_heldout_files_calibration_disjoint(tmp_path, train_script):
    frac, seq = 0.3, 128
    huge = _write_tree(tmp_path / "text", train_script, frac)
    docs = train_script.collect_documents([str(tmp_path / "text")], max_bytes=10**9, heldout_frac=frac, seed=0)
    train = [d for d in docs if d["split"] == "train"]
    held = [d for d in docs if d["split"] == "heldout"]
    assert set(huge) <= {d["key"] for d in held}
    tok = train_script.train_tokenizer([d["text"] for d in train], 384)
    for name, ds in (("calib.jsonl", train), ("heldout.jsonl", held)):
        train_script._write_jsonl(str(tmp_path / name), ds)
    held_recs = read_records(str(tmp_path / "heldout.jsonl"))
    n_ids = [len(tok(r["text"], add_special_tokens=False)["input_ids"]) for r in held_recs]
    k = sum(n >= seq for n in n_ids)  # held-out files that fill a sequence on their own
    assert k >= 8

    ev, recs = select_prompt_set(tok, str(tmp_path / "heldout.jsonl"), budget=k * seq, seq_len=seq, seed=1)
    assert recs == held_recs and len(ev.sequences) == k and ev.meta["selection"] == "per-document"
    names = [src[0][0] for src in ev.meta["sources"]]
    assert ev.meta["files"] == len(set(names)) == k and all(len(src) == 1 for src in ev.meta["sources"])
    assert ev.meta["max_tokens_per_document"] == seq  # the two huge files give one sequence each, like any file
    # the recorded source of every sequence is true: its tokens are the start of that file
    by_key = {r["key"]: r["text"] for r in held_recs}
    for s, src in zip(ev.sequences, ev.meta["sources"]):
        key, off, n = src[0]
        assert off == 0 and n == seq and s == tok(by_key[key], add_special_tokens=False)["input_ids"][:seq]
    # ... whereas packing all held-out documents in the seeded order draws the budget from few files
    old, _ = select_prompt_set(tok, str(tmp_path / "heldout.jsonl"), budget=k * seq, seq_len=seq, seed=1,
                               max_seq_per_file=0)
    assert old.meta["files"] is None and old.meta["selection"] == "packed"

    cal, cal_recs = select_prompt_set(tok, str(tmp_path / "calib.jsonl"), budget=16 * seq, seq_len=seq, seed=0)
    cal_names = {name for src in cal.meta["sources"] for name, _, _ in src}
    assert cal.meta["files"] == len(cal_names) >= 16 and {r["split"] for r in cal_recs} == {"train"}
    assert not cal_names & {r["key"] for r in held_recs}
    assert not {sequence_hash(s) for s in cal.sequences} & {sequence_hash(s) for s in ev.sequences}
    rep = check_disjoint(cal, ev, cal_recs, held_recs)
    assert rep["shared_sequences"] == rep["shared_documents"] == 0
    # same inputs, same selection
    again, _ = select_prompt_set(tok, str(tmp_path / "heldout.jsonl"), budget=k * seq, seq_len=seq, seed=1)
    assert again.sequences == ev.sequences and json.dumps(again.meta) == json.dumps(ev.meta)
    with pytest.raises(CalibrationError, match="max_seq_per_file"):
        select_prompt_set(tok, str(tmp_path / "heldout.jsonl"), budget=seq, seq_len=seq, seed=1, max_seq_per_file=-1)
