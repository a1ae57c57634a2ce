"""Calibration / evaluation prompts: sources, seeded sampling, token budget.

Sources (``source`` string):

* a **text file**: documents are separated by blank lines;
* a **JSONL file** (``.jsonl``): one JSON object per line with a ``"text"`` string field (name set
  by ``text_field``); a ``.json`` file holds the same records as JSON Lines or as one JSON array;
  files must be UTF-8;
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

:func:`build_per_document_prompt_set` is the evaluation selection of ``sglang-oscar quality``
and ``tests/e2e/served_quality.py``. It draws sequences from as many different documents as the
budget allows: at most ``max_seq_per_doc`` sequences per document, taken round robin. Packing
documents in a shuffled order cuts a budget of a few sequences out of the first one or two
documents whenever those are long.

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


def parse_jsonl(text: str, source: str, text_field: str = "text") -> list[dict]:
    """The JSON objects of JSONL ``text`` (one per non-empty line), each with a ``text_field`` key.

    Raises:
        CalibrationError: a line that is not valid JSON or not an object with ``text_field``
        (the message names ``source`` and the line number).
    """
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{source}:{n}: not valid JSON ({exc.msg})") from None
        out.append(_check_record(obj, f"{source}:{n}", text_field))
    return out


_JSON_TYPES = {type(None): "null", bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}


def _check_record(obj: Any, where: str, text_field: str) -> dict:
    """``obj`` if it is a JSON object whose ``text_field`` is a string.

    Raises:
        CalibrationError: naming ``where`` (a non-string text would be calibrated on as its
        ``str()``: ``None``, ``5`` or a list's repr).
    """
    if not isinstance(obj, dict) or text_field not in obj:
        raise CalibrationError(f"{where}: record has no {text_field!r} field")
    if not isinstance(obj[text_field], str):
        kind = _JSON_TYPES.get(type(obj[text_field]), type(obj[text_field]).__name__)
        raise CalibrationError(f"{where}: the {text_field!r} field is a JSON {kind}, not a string: every record needs "
                               f"its text as a string (or pass --text-field with the field that holds it)")
    return obj


def _json_file_records(text: str, source: str, text_field: str) -> list[dict]:
    """The records of a ``.json`` file: a JSON array of objects, or JSON Lines.

    Raises:
        CalibrationError: anything else (a lone object, invalid JSON, records without a string
        ``text_field``), naming the file and the two accepted layouts.
    """
    layouts = "a .json prompts file holds a JSON array of objects or one JSON object per line (JSON Lines)"
    if not text.lstrip().startswith("["):
        try:
            return parse_jsonl(text, source, text_field)
        except CalibrationError as exc:
            raise CalibrationError(f"{exc}; {layouts}, each with a {text_field!r} string") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationError(f"{source}: not valid JSON ({exc.msg}, line {exc.lineno}); {layouts}") from None
    return [_check_record(obj, f"{source}: record {i}", text_field) for i, obj in enumerate(data)]


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
        try:  # no silent U+FFFD replacement: a binary or non-UTF-8 file would be calibrated on as garbage
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CalibrationError(
                f"prompts file {source} is not UTF-8 text (byte {exc.start} is {raw[exc.start:exc.start + 1]!r}): pass a "
                "UTF-8 text file (documents separated by blank lines) or a JSONL file, or convert it (e.g. iconv -t UTF-8)"
            ) from None
        lower = source.lower()
        if lower.endswith((".jsonl", ".json")):
            records = (parse_jsonl(text, source, text_field) if lower.endswith(".jsonl")
                       else _json_file_records(text, source, text_field))
            return Documents([obj[text_field] for obj in records], "jsonl", source, sha)
        docs = [p.strip() for p in text.replace("\r\n", "\n").split("\n\n")]
        return Documents([d for d in docs if d], "text", source, sha)
    if source.startswith("task:"):
        return _task_documents(source[len("task:"):])
    if not os.path.isdir(source) and (source.lower().endswith(_FILE_SUFFIXES) or source.startswith((".", "/", "~"))):
        raise FileNotFoundError(f"prompts file {source} does not exist")
    return _dataset_documents(source, text_field)


def _task_documents(task: str) -> Documents:
    from ..evals.datasets import load_task_data
    from ..evals.tasks import build_prompt

    # eval's hint names its --data-file flag, which calibrate and compute_rotation.sh do not have
    data = load_task_data(task, unavailable_hint="calibrate on a local text or JSONL file of prompts instead "
                                                 "(calibrate --prompts FILE; compute_rotation.sh --data FILE)")
    msgs = [build_prompt(task, s, seed=0).messages for s in data.samples]
    sha = _sha256_bytes(json.dumps(msgs, sort_keys=True, ensure_ascii=False).encode())
    return Documents(msgs, "task", f"task:{task} ({data.source})", sha)


def _dataset_documents(spec: str, text_field: str) -> Documents:
    parts = spec.split(":")
    name = parts[0]
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    import datasets  # the [calibrate] extra; the CLI names it when missing
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
    order, prefix, room = _shuffled_order_and_room(tokenizer, len(docs.texts), seed, seq_len)
    eos = tokenizer.eos_token_id
    seqs: list[list[int]] = []
    total = 0
    used_docs = 0
    cut = 0  # unpacked documents longer than a sequence (their tail is not used)
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
            own_prefix = bool(prefix) and ids[: len(prefix)] == prefix  # keeps seq_len tokens, not room
            cut += len(ids) > (seq_len if own_prefix else room)
            seq = ids[:seq_len] if own_prefix else prefix + ids[:room]
            seq = seq[: budget - total]
            if len(seq) < 2:  # a one-token document: nothing to attend over; the next one may be longer
                if budget - total < 2:
                    break
                continue
            seqs.append(seq)
            total += len(seq)
            if total >= budget:
                break
    _check_total(docs, total, budget, lambda: (
        f"calibration data {docs.source} has only {total} tokens ({len(docs.texts)} documents), fewer than "
        f"the token budget of {budget}; using all {total} tokens"
        + (f" ({cut} documents were longer than --seq-len {seq_len} and were cut: without packing each document "
           "gives one sequence; --pack uses all of their tokens)" if cut else "")))
    meta = _base_meta(docs, seqs, budget=budget, total=total, seed=seed, seq_len=seq_len, pack=pack)
    meta["documents_used"] = used_docs
    return PromptSet(seqs, meta)


def _shuffled_order_and_room(tokenizer, num_docs: int, seed: int, seq_len: int) -> tuple[list[int], list[int], int]:
    """Document order (``random.Random(seed)`` shuffle), the tokenizer's prefix tokens and the room
    left for document tokens in a sequence of ``seq_len``.

    Raises:
        CalibrationError: ``seq_len`` leaves no room after the prefix tokens.
    """
    order = list(range(num_docs))
    random.Random(seed).shuffle(order)
    prefix = _prefix_tokens(tokenizer)
    room = seq_len - len(prefix)
    if room <= 0:
        raise CalibrationError(f"seq_len {seq_len} leaves no room after the {len(prefix)} prefix tokens")
    return order, prefix, room


def _check_total(docs, total: int, budget: int, short_message) -> None:
    """The end of every prompt-set selection: no tokens at all -> :class:`CalibrationError`;
    fewer than ``budget`` -> :class:`ShortDataWarning` with ``short_message()`` (attributed to the
    selection function's caller).

    Raises:
        CalibrationError: the source tokenizes to no tokens.
    """
    if total == 0:
        raise CalibrationError(f"prompts source {docs.source} is empty: it tokenizes to no tokens")
    if total < budget:
        warnings.warn(ShortDataWarning(short_message()), stacklevel=3)


def _base_meta(docs: Documents, seqs: list[list[int]], *, budget: int, total: int, seed: int, seq_len: int,
               pack: bool) -> dict:
    """The ``PromptSet.meta`` keys every selection records (source, hashes, budget, sizes)."""
    h = hashlib.sha256()
    for s in seqs:
        h.update(json.dumps(s).encode())
    return {
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
        "sequence_sha256": [sequence_hash(s) for s in seqs],
    }


def build_per_document_prompt_set(
    tokenizer,
    documents: Documents,
    *,
    budget: int,
    seq_len: int = DEFAULT_SEQ_LEN,
    seed: int = 0,
    max_seq_per_doc: int = 1,
    names: list[str] | None = None,
) -> PromptSet:
    """``budget`` tokens of sequences of at most ``seq_len`` tokens, drawn from as many documents as possible.

    Documents are shuffled with ``random.Random(seed)`` and visited in that order, in passes:

    * pass 1: a document of at least ``room`` tokens (``seq_len`` minus the tokenizer's prefix
      tokens, :func:`_prefix_tokens`) gives one sequence of its own, its first ``room`` tokens.
      Shorter documents are joined, EOS-separated and in the same order, into packed sequences;
      a partly filled packed sequence is kept at the end of the pass.
    * pass ``r`` (2 .. ``max_seq_per_doc``): every document with at least ``r * room`` tokens gives
      its ``r``-th block of ``room`` tokens.

    So every document gets its first sequence before any gets a second (round robin), and no
    document contributes more than ``max_seq_per_doc * room`` tokens; the rest of a long document
    is not used. Selection stops when ``budget`` tokens are collected, and the last sequence is cut
    to the budget. The result is deterministic for given documents, tokenizer and seed.

    Args:
        documents: the texts (e.g. the records of ``heldout.jsonl``, one record per file).
        max_seq_per_doc: the per-document cap, in sequences (>= 1).
        names: one name per document for ``meta["sources"]`` (default: its index).

    Returns:
        A :class:`PromptSet`. Its ``meta`` has the keys of :func:`build_prompt_set`, plus
        ``selection`` (``"per-document"``), ``max_seq_per_document``, ``max_tokens_per_document_cap``,
        ``documents_used`` (distinct documents with at least one token in the sequences),
        ``max_tokens_per_document`` (the most tokens one document contributed, EOS included),
        ``single_document_sequences``, ``packed_sequences``, and ``sources``: one list per sequence
        of ``[name, first token offset in the document, tokens]``. The offsets exclude the prefix
        tokens and count the EOS that follows a packed document.

    Raises:
        CalibrationError: no documents, no tokens, a budget or ``seq_len`` that is too small, or
        ``max_seq_per_doc < 1``.

    Warns:
        ShortDataWarning: fewer than ``budget`` tokens under the per-document cap.
    """
    if budget <= 0 or seq_len <= 1:
        raise CalibrationError(f"token budget ({budget}) must be positive and seq_len ({seq_len}) > 1")
    if max_seq_per_doc < 1:
        raise CalibrationError(f"max_seq_per_doc must be >= 1, not {max_seq_per_doc}")
    docs = documents
    if not docs.texts:
        raise CalibrationError(f"prompts source {docs.source} is empty: no text to select from")
    if names is not None and len(names) != len(docs.texts):
        raise CalibrationError(f"{len(names)} names for {len(docs.texts)} documents")
    order, prefix, room = _shuffled_order_and_room(tokenizer, len(docs.texts), seed, seq_len)
    eos = tokenizer.eos_token_id
    sep = [eos] if eos is not None else []
    seqs: list[list[int]] = []
    spans_of: list[list[tuple[int, int, int]]] = []  # per sequence: (document, offset, tokens)
    contrib: dict[int, int] = {}
    total = 0

    def room_left() -> int:
        return budget - total - len(prefix)

    def full() -> bool:  # no sequence of >= 2 tokens with >= 1 document token fits any more
        return room_left() < max(1, 2 - len(prefix))

    def split_spans(spans, n):
        head, tail, left = [], [], n
        for d, off, cnt in spans:
            if left >= cnt:
                head.append((d, off, cnt))
            elif left > 0:
                head.append((d, off, left))
                tail.append((d, off + left, cnt - left))
            else:
                tail.append((d, off, cnt))
            left = max(left - cnt, 0)
        return head, tail

    def emit(tokens: list[int], spans) -> None:
        nonlocal total
        if full():
            return
        n = min(len(tokens), room_left())
        seqs.append(prefix + tokens[:n])
        total += len(seqs[-1])
        head, _ = split_spans(spans, n)
        spans_of.append(head)
        for d, _, cnt in head:
            contrib[d] = contrib.get(d, 0) + cnt

    long_docs: dict[int, list[int]] = {}  # documents that can give a second sequence
    buf: list[int] = []
    buf_spans: list[tuple[int, int, int]] = []
    for i in order:  # pass 1
        if full():
            break
        ids = _encode(tokenizer, docs.texts[i])
        if not ids:
            continue
        if len(ids) >= room:
            if max_seq_per_doc > 1 and len(ids) >= 2 * room:
                long_docs[i] = ids
            emit(ids[:room], [(i, 0, room)])
        else:
            piece = ids + sep
            buf.extend(piece)
            buf_spans.append((i, 0, len(piece)))
            if len(buf) >= room:
                head, buf_spans = split_spans(buf_spans, room)
                chunk, buf = buf[:room], buf[room:]
                emit(chunk, head)
    if buf and len(prefix) + len(buf) >= 2:
        emit(buf, buf_spans)
    for r in range(1, max_seq_per_doc):  # passes 2 ..
        for i in order:
            if full():
                break
            ids = long_docs.get(i)
            if ids is not None and len(ids) >= (r + 1) * room:
                emit(ids[r * room : (r + 1) * room], [(i, r * room, room)])
    _check_total(docs, total, budget, lambda: (
        f"{docs.source} gives only {total} tokens ({len(seqs)} sequences from {len(contrib)} of "
        f"{len(docs.texts)} documents) at most {max_seq_per_doc} sequence(s) of {seq_len} tokens per "
        f"document, fewer than the token budget of {budget}; using all {total} tokens (raise the "
        "per-document cap or add documents)"))
    label = (lambda d: names[d]) if names is not None else (lambda d: str(d))
    sources = [[[label(d), off, cnt] for d, off, cnt in sp] for sp in spans_of]
    meta = _base_meta(docs, seqs, budget=budget, total=total, seed=seed, seq_len=seq_len, pack=False)
    meta.update({
        "selection": "per-document",
        "max_seq_per_document": max_seq_per_doc,
        "max_tokens_per_document_cap": max_seq_per_doc * room,
        "documents_used": len(contrib),
        "max_tokens_per_document": max(contrib.values()),
        "single_document_sequences": sum(len(sp) == 1 for sp in spans_of),
        "packed_sequences": sum(len(sp) > 1 for sp in spans_of),
        "sources": sources,
    })
    return PromptSet(seqs, meta)
