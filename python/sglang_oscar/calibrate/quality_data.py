"""The data of the quality table (:mod:`.quality`): calibration / evaluation sequence selection
from a checkpoint's ``calib.jsonl`` / ``heldout.jsonl`` and the check that the two are disjoint.

:func:`select_prompt_set` picks one file's sequences (per document, round robin, or packed);
:func:`check_disjoint` refuses a shared token sequence, a shared document or a record of the
wrong split. Both are re-exported by :mod:`.quality`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from . import CalibrationError
from .prompts import parse_jsonl


# ----------------------------------------------------------------------------- disjointness
def read_records(path: str) -> list[dict[str, Any]]:
    """The JSON records of a ``.jsonl`` file (one object per non-empty line).

    Raises:
        CalibrationError: a line that is not a JSON object with a ``text`` field.
    """
    with open(path, encoding="utf-8") as f:
        return parse_jsonl(f.read(), path)


def _doc_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_disjoint(calib, heldout, calib_records: list[dict] | None = None,
                   heldout_records: list[dict] | None = None) -> dict[str, Any]:
    """Refuse calibration and evaluation data that overlap.

    Args:
        calib, heldout: :class:`.prompts.PromptSet` of the calibration / evaluation sequences.
        calib_records, heldout_records: their source records (``{"text", optional "split"}``).

    Returns:
        ``{"shared_sequences": 0, "shared_documents": 0, "calib_sequences", "heldout_sequences", ...}``.

    Raises:
        CalibrationError: a token sequence (by :func:`.prompts.sequence_hash`) or a document in
        both, or a record whose ``split`` is not ``train`` (calibration) / ``heldout`` (evaluation).
    """
    from .prompts import sequence_hash

    ch = {sequence_hash(s) for s in calib.sequences}
    hh = {sequence_hash(s) for s in heldout.sequences}
    shared = ch & hh
    if shared:
        raise CalibrationError(f"{len(shared)} evaluation sequences are also calibration sequences: the data is not held out")
    rep: dict[str, Any] = {"shared_sequences": 0, "calib_sequences": len(ch), "heldout_sequences": len(hh)}
    if calib_records is not None and heldout_records is not None:
        for recs, want, what in ((calib_records, "train", "calibration"), (heldout_records, "heldout", "evaluation")):
            bad = [r.get("split") for r in recs if "split" in r and r["split"] != want]
            if bad:
                raise CalibrationError(f"{len(bad)} {what} documents come from split {bad[0]!r}, not {want!r}")
        cd = {_doc_hash(r["text"]) for r in calib_records}
        hd = {_doc_hash(r["text"]) for r in heldout_records}
        if cd & hd:
            raise CalibrationError(f"{len(cd & hd)} documents are both calibration and evaluation documents")
        rep.update(shared_documents=0, calib_documents=len(cd), heldout_documents=len(hd))
    return rep


# ----------------------------------------------------------------------------- data selection
def select_prompt_set(tokenizer, path: str, *, budget: int, seq_len: int, seed: int, max_seq_per_file: int = 1,
                      records: list[dict] | None = None):
    """The sequences of one JSONL document file (``calib.jsonl`` / ``heldout.jsonl``).

    Args:
        tokenizer: the checkpoint's tokenizer.
        path: the JSONL file, one record ``{"text", "key", "split"}`` per source file.
        budget, seq_len, seed: token budget, tokens per sequence and the shuffle seed.
        max_seq_per_file: at most this many sequences per file, round robin
            (:func:`.prompts.build_per_document_prompt_set`); ``0``: packed selection, all
            documents packed in a seeded order (:func:`.prompts.build_prompt_set` with ``pack=True``).
        records: the file's records if already read (:func:`read_records`).

    Returns:
        ``(prompt_set, records)``; ``prompt_set.meta["files"]`` is the number of distinct files
        (records) with tokens in the sequences. It is ``None`` under ``max_seq_per_file=0``,
        which does not track sources.

    Raises:
        CalibrationError: malformed JSONL, no text, ``max_seq_per_file < 0``.
    """
    from .prompts import Documents, build_per_document_prompt_set, build_prompt_set

    if max_seq_per_file < 0:
        raise CalibrationError(f"max_seq_per_file must be >= 0, not {max_seq_per_file}")
    recs = records if records is not None else read_records(path)
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    docs = Documents([r["text"] for r in recs], "jsonl", path, sha)
    if max_seq_per_file == 0:
        ps = build_prompt_set(tokenizer, path, budget=budget, seed=seed, seq_len=seq_len, pack=True, documents=docs)
        ps.meta.update(selection="packed", files=None)
    else:
        names = [str(r.get("key", i)) for i, r in enumerate(recs)]
        ps = build_per_document_prompt_set(tokenizer, docs, budget=budget, seq_len=seq_len, seed=seed,
                                           max_seq_per_doc=max_seq_per_file, names=names)
        ps.meta["files"] = ps.meta["documents_used"]
    return ps, recs
