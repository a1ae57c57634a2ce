"""Calibration / evaluation prompts: sources, seeded sampling, token budget.

Sources (``source`` string):

* a **text file**: documents are separated by blank lines;
* a **JSONL file** (``.jsonl``): one JSON object per line with a ``"text"`` field (name set by
  ``text_field``);
* ``task:<name>`` (``task:gpqa``, ``task:math500``, ...): the evaluation prompts of that task
  (``sglang_oscar.evals``), rendered through the tokenizer's chat template -- what upstream
  calibrated on (GPQA-Diamond prompts, spec §8.1);
* otherwise a ``datasets`` name ``NAME[:CONFIG[:SPLIT]]`` (e.g.
  ``Salesforce/wikitext:wikitext-2-raw-v1:test``) or a local folder of data files that
  ``datasets.load_dataset`` reads (split ``train`` by default), field ``text_field``.

Sampling: documents are shuffled with ``random.Random(seed)`` and consumed in that order until
``budget`` tokens are collected (the last sequence is cut to the budget). ``pack=True`` joins
documents (EOS-separated) into one stream cut into ``seq_len`` blocks (text files and datasets
by default); ``pack=False`` makes every document its own sequence, truncated to ``seq_len``
(JSONL and tasks by default; a document of fewer than 2 tokens is skipped). Every sequence starts with the tokens the tokenizer adds to an
empty string (BOS where the model uses one).

Data shorter than the budget -> :class:`ShortDataWarning` with the token count; no text at all
-> :class:`CalibrationError`. ``PromptSet.meta`` records the source and its sha256, the sha256 of
all token sequences and a short hash per sequence (:func:`sequence_hash`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import warnings
from typing import Any

from . import CalibrationError, ShortDataWarning

DEFAULT_BUDGET = 30000
DEFAULT_SEQ_LEN = 2048
_FILE_SUFFIXES = (".txt", ".text", ".jsonl", ".json", ".md")


@dataclasses.dataclass
class Documents:
    """The documents of one prompts source, before tokenization.

    Attributes:
        texts: one entry per document: a string, or a list of chat messages (task sources).
        kind: ``"text"``, ``"jsonl"``, ``"task"`` or ``"dataset"`` (decides the default packing).
        source: the source as given (or a description for tasks).
        sha256: hash of the source's content (file bytes, rendered task prompts or dataset texts).
    """

    texts: list[Any]  # str, or list of chat messages for task sources
    kind: str  # "text" | "jsonl" | "task" | "dataset"
    source: str
    sha256: str


@dataclasses.dataclass
class PromptSet:
    """Token sequences for a forward pass, and their provenance."""

    sequences: list[list[int]]
    meta: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)


def sequence_hash(tokens: list[int]) -> str:
    """Short (16 hex digits) sha256 of one token sequence: recorded per calibration sequence so
    that ``error``/``ppl`` can count held-out sequences that were also calibrated on."""
    return hashlib.sha256(json.dumps([int(t) for t in tokens]).encode()).hexdigest()[:16]


def _sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def load_documents(source: str, text_field: str = "text") -> Documents:
    """Read the documents of ``source`` (module docstring).

    Raises:
        FileNotFoundError: a file path that does not exist. CalibrationError: malformed JSONL,
        a record without ``text_field``, an unknown task, or a dataset that cannot be loaded.
    """
    if os.path.isfile(source):
        with open(source, "rb") as f:
            raw = f.read()
        sha = _sha256_bytes(raw)
        text = raw.decode("utf-8", errors="replace")
        if source.endswith(".jsonl"):
            docs = []
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise CalibrationError(f"{source}:{n}: not valid JSON ({exc.msg})") from None
                if not isinstance(obj, dict) or text_field not in obj:
                    raise CalibrationError(f"{source}:{n}: record has no {text_field!r} field")
                docs.append(str(obj[text_field]))
            return Documents(docs, "jsonl", source, sha)
        docs = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
        return Documents([d for d in docs if d], "text", source, sha)
    if source.startswith("task:"):
        return _task_documents(source[len("task:"):])
    if not os.path.isdir(source) and (source.lower().endswith(_FILE_SUFFIXES) or source.startswith((".", "/", "~"))):
        raise FileNotFoundError(f"prompts file {source} does not exist")
    return _dataset_documents(source, text_field)


def _task_documents(task: str) -> Documents:
    try:
        from ..evals.datasets import load_task_data
        from ..evals.tasks import build_prompt
    except ImportError as exc:  # the evals part is optional for calibration
        raise CalibrationError(f"task:{task} needs sglang_oscar.evals ({exc})") from None
    data = load_task_data(task)
    msgs = [build_prompt(task, s, seed=0).messages for s in data.samples]
    sha = _sha256_bytes(json.dumps(msgs, sort_keys=True, ensure_ascii=False).encode())
    return Documents(msgs, "task", f"task:{task} ({data.source})", sha)


def _dataset_documents(spec: str, text_field: str) -> Documents:
    parts = spec.split(":")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    try:
        import datasets
    except ImportError:
        raise CalibrationError(f"{spec!r} is not a file; loading it as a dataset needs the `datasets` package") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise CalibrationError(
            f"prompts source {spec!r} is neither an existing file nor a loadable dataset "
            f"(datasets.load_dataset({name!r}, {config!r}, split={split!r}): {type(exc).__name__}: {first})"
        ) from None
    if text_field not in ds.column_names:
        raise CalibrationError(f"dataset {spec!r} has no column {text_field!r} (columns: {ds.column_names})")
    docs = [str(t).strip() for t in ds[text_field]]
    docs = [d for d in docs if d]
    sha = _sha256_bytes("\n\n".join(docs).encode())
    return Documents(docs, "dataset", spec, sha)


def _prefix_tokens(tokenizer) -> list[int]:
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    return [int(i) for i in ids if i != eos]


def _encode(tokenizer, doc) -> list[int]:
    if isinstance(doc, list):  # chat messages
        if getattr(tokenizer, "chat_template", None):
            out = tokenizer.apply_chat_template(doc, add_generation_prompt=True, tokenize=True)
            if isinstance(out, dict) or hasattr(out, "keys"):
                out = out["input_ids"]
            return [int(i) for i in out]
        doc = "\n\n".join(m["content"] for m in doc)
    return [int(i) for i in tokenizer(doc, add_special_tokens=False)["input_ids"]]


def build_prompt_set(
    tokenizer,
    source: str,
    *,
    budget: int = DEFAULT_BUDGET,
    seed: int = 0,
    seq_len: int = DEFAULT_SEQ_LEN,
    pack: bool | None = None,
    text_field: str = "text",
    documents: Documents | None = None,
) -> PromptSet:
    """Tokenize and sample ``source`` into sequences of at most ``seq_len`` tokens, ``budget`` in all.

    Raises:
        CalibrationError: empty data, or budget/seq_len not positive.
    """
    if budget <= 0 or seq_len <= 1:
        raise CalibrationError(f"token budget ({budget}) must be positive and seq_len ({seq_len}) > 1")
    docs = documents or load_documents(source, text_field)
    if not docs.texts:
        raise CalibrationError(f"prompts source {docs.source} is empty: no text to calibrate on")
    if pack is None:
        pack = docs.kind in ("text", "dataset")
    order = list(range(len(docs.texts)))
    random.Random(seed).shuffle(order)
    prefix = _prefix_tokens(tokenizer)
    room = seq_len - len(prefix)
    if room <= 0:
        raise CalibrationError(f"seq_len {seq_len} leaves no room after the {len(prefix)} prefix tokens")
    eos = tokenizer.eos_token_id
    seqs: list[list[int]] = []
    total = 0
    used_docs = 0
    if pack:
        stream: list[int] = []
        for i in order:
            ids = _encode(tokenizer, docs.texts[i])
            if not ids:
                continue
            used_docs += 1
            stream.extend(ids + ([eos] if eos is not None else []))
            while len(stream) >= room and total < budget:
                take = min(room, budget - total - len(prefix))
                if take <= 0:
                    break
                seqs.append(prefix + stream[:take])
                total += len(seqs[-1])
                stream = stream[room:]
            if total >= budget:
                break
        if total < budget and stream:
            take = min(len(stream), max(budget - total - len(prefix), 0))
            if take > 0:
                seqs.append(prefix + stream[:take])
                total += len(seqs[-1])
    else:
        for i in order:
            ids = _encode(tokenizer, docs.texts[i])
            if not ids:
                continue
            used_docs += 1
            seq = ids[:seq_len] if prefix and ids[: len(prefix)] == prefix else prefix + ids[:room]
            seq = seq[: budget - total]
            if len(seq) < 2:  # a one-token document: nothing to attend over; the next one may be longer
                if budget - total < 2:
                    break
                continue
            seqs.append(seq)
            total += len(seq)
            if total >= budget:
                break
    if total == 0:
        raise CalibrationError(f"prompts source {docs.source} is empty: it tokenizes to no tokens")
    if total < budget:
        warnings.warn(
            ShortDataWarning(
                f"calibration data {docs.source} has only {total} tokens ({len(docs.texts)} documents), fewer than "
                f"the token budget of {budget}; using all {total} tokens"
            ),
            stacklevel=2,
        )
    h = hashlib.sha256()
    for s in seqs:
        h.update(json.dumps(s).encode())
    seq_hashes = [sequence_hash(s) for s in seqs]
    meta = {
        "source": docs.source,
        "kind": docs.kind,
        "sha256": docs.sha256,
        "tokens_sha256": h.hexdigest(),
        "budget": budget,
        "tokens": total,
        "seed": seed,
        "seq_len": seq_len,
        "pack": pack,
        "num_sequences": len(seqs),
        "num_documents": len(docs.texts),
        "documents_used": used_docs,
        "sequence_sha256": seq_hashes,
    }
    return PromptSet(seqs, meta)
