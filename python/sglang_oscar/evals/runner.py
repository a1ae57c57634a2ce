"""Resumable evaluation run: ask every (seed, sample) once, grade, record, summarise.

Output folder (``--out``):

* ``run.json``: the settings that define the run (task, model, sampling parameters, system
  prompt, prompt version) plus bookkeeping (data source, seeds, base URL, versions). It is
  written only after the server accepted ``--model``. Resuming into a folder whose defining
  settings differ is refused once ``samples.jsonl`` holds a row (before that the folder has
  nothing to protect and is simply re-initialised).
* ``samples.jsonl``: one JSON object per line and per (seed, sample index), appended as soon
  as the sample is graded: ``seed, index, id, prompt_sha, prompt, gold, gold_sha, status``
  (ok | rejected | error), ``response, reasoning, finish_reason, truncated, extracted,
  normalized, correct, note, error, usage, attempts, elapsed_s``. When a key appears more than
  once the last line wins. A kept row whose gold answer (``gold_sha``: the gold, and for
  HumanEval the tests) differs from the data file's is refused on resume, or re-graded
  with ``--regrade``.
  Rows with status ``ok`` are finished; ``rejected``/``error`` rows are asked again on the next
  run. A line cut short by a crash is dropped on resume.
* ``metrics.json``: per seed ``n`` (the full denominator), ``correct``, ``accuracy``,
  ``truncated``, ``no_answer``, ``rejected``, ``errors``, ``missing``; over seeds
  ``accuracy_mean`` and ``accuracy_std`` (n - 1), ``complete``. No timestamps, so an
  interrupted-and-resumed run gives a file identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sglang_oscar.evals import stats
from sglang_oscar.evals.client import (
    DEFAULT_BACKOFF_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_RETRIES,
    ChatClient,
    Completion,
    SamplingParams,
)
from sglang_oscar.evals.datasets import LoadedDataset, Sample, load_task_data
from sglang_oscar.evals.errors import EvalError, MassRejection
from sglang_oscar.evals.tasks import PROMPT_VERSION, Prompt, build_prompt, check_task, grade

RUN_FILE = "run.json"
SAMPLES_FILE = "samples.jsonl"
METRICS_FILE = "metrics.json"

# Abort when more than this fraction of the answers received in a run are rejections/errors,
# once at least MIN_ATTEMPTS_FOR_ABORT answers (or all pending ones) came back.
ABORT_FRACTION = 0.5
MIN_ATTEMPTS_FOR_ABORT = 8


@dataclass
class EvalSettings:
    """Everything one ``sglang-oscar eval`` run needs (the CLI flags)."""

    task: str
    model: str
    base_url: str
    out_dir: Path
    seeds: list[int] = field(default_factory=lambda: [0])
    params: SamplingParams = field(default_factory=SamplingParams)
    threads: int = 32
    n_examples: int | None = None
    data_file: str | None = None
    system_prompt: str | None = None
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT_S
    retries: int = DEFAULT_RETRIES
    backoff: float = DEFAULT_BACKOFF_S
    humaneval_timeout: float = 10.0
    regrade: bool = False
    progress: bool = True

    def defining(self) -> dict[str, Any]:
        """Settings that must not change when a run is resumed."""
        return {
            "task": self.task,
            "model": self.model,
            "max_tokens": self.params.max_tokens,
            "temperature": self.params.temperature,
            "top_p": self.params.top_p,
            "top_k": self.params.top_k,
            "system_prompt": self.system_prompt,
            "prompt_version": PROMPT_VERSION,
        }


# ----------------------------------------------------------------------------- files


def read_rows(path: Path, repair: bool = False) -> dict[tuple[int, int], dict[str, Any]]:
    """Rows of ``samples.jsonl`` keyed by (seed, index), last line wins. With ``repair`` a
    trailing partial line (crash mid-write) is cut off the file."""
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    if not path.exists():
        return rows
    data = path.read_bytes()
    if repair and data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as fh:
            fh.truncate(cut)
        data = data[:cut]
    for raw in data.splitlines():
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
            rows[(int(row["seed"]), int(row["index"]))] = row
        except (ValueError, KeyError, TypeError):
            continue  # an unreadable line is treated as not done
    return rows


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _check_run_file(out: Path, settings: EvalSettings, has_rows: bool) -> dict[str, Any]:
    """The existing run record (``{}`` if none); EvalError when it holds samples asked with
    different defining settings."""
    path = out / RUN_FILE
    defining = settings.defining()
    record: dict[str, Any] = {}
    if path.exists():
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise EvalError(f"{path} is not valid JSON ({exc}); use a new --out folder") from None
        old = record.get("defining", {})
        diffs = [
            f"{k}: {old.get(k)!r} -> {v!r}" for k, v in defining.items() if old.get(k) != v
        ]
        if diffs and not has_rows:
            return {}  # nothing was asked under the old settings: start afresh
        if diffs:
            raise EvalError(
                f"{out} holds a run with different settings ({'; '.join(diffs)}); "
                "resume with the same settings or use another --out folder"
            )
    return record


# ----------------------------------------------------------------------------- metrics


def compute_metrics(
    settings: EvalSettings,
    samples: list[Sample],
    rows: dict[tuple[int, int], dict[str, Any]],
) -> dict[str, Any]:
    """The ``metrics.json`` dict of ``rows`` (keyed by (seed, index)) over ``samples`` and
    the settings' seeds: per-seed counts with the full denominator, mean ± std over seeds."""
    per_seed: dict[str, Any] = {}
    accs: list[float] = []
    totals = {"truncated": 0, "no_answer": 0, "rejected": 0, "errors": 0, "missing": 0}
    for seed in settings.seeds:
        c = {"n": len(samples), "correct": 0, "truncated": 0, "no_answer": 0, "rejected": 0,
             "errors": 0, "missing": 0}
        for s in samples:
            row = rows.get((seed, s.index))
            if row is None:
                c["missing"] += 1
                continue
            status = row.get("status")
            if status == "rejected":
                c["rejected"] += 1
                continue
            if status != "ok":
                c["errors"] += 1
                continue
            c["correct"] += int(bool(row.get("correct")))
            c["truncated"] += int(bool(row.get("truncated")))
            c["no_answer"] += int(row.get("extracted") is None)
        c["accuracy"] = c["correct"] / c["n"] if c["n"] else 0.0
        accs.append(c["accuracy"])
        for k in totals:
            totals[k] += c[k]
        per_seed[str(seed)] = c
    return {
        "task": settings.task,
        "model": settings.model,
        "n": len(samples),
        "n_seeds": len(settings.seeds),
        "seeds": per_seed,
        "accuracy_mean": stats.mean(accs) if accs else 0.0,
        "accuracy_std": stats.std(accs),
        **totals,
        "complete": totals["missing"] == 0 and totals["rejected"] == 0 and totals["errors"] == 0,
        "sampling": settings.params.as_dict(),
        "sample_ids_first_last": [samples[0].id, samples[-1].id] if samples else [],
    }


def format_metrics(m: dict[str, Any]) -> str:
    """A few human-readable lines summarising a metrics dict."""
    lines = [
        f"{m['task']} | {m['model']} | n = {m['n']} x {m['n_seeds']} seed(s)",
        f"accuracy {100 * m['accuracy_mean']:.2f} ± {100 * m['accuracy_std']:.2f} "
        "(mean ± std over seeds)",
    ]
    for seed, c in m["seeds"].items():
        lines.append(
            f"  seed {seed}: {100 * c['accuracy']:.2f} ({c['correct']}/{c['n']}), truncated "
            f"{c['truncated']}, no answer {c['no_answer']}, rejected {c['rejected']}, "
            f"errors {c['errors']}, missing {c['missing']}"
        )
    if not m["complete"]:
        lines.append("  INCOMPLETE: missing/rejected/errored samples count as wrong; re-run to resume")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- run


def _row(seed: int, sample: Sample, prompt: Prompt, comp: Completion) -> dict[str, Any]:
    return {
        "seed": seed,
        "index": sample.index,
        "id": sample.id,
        "prompt_sha": prompt.sha,
        "prompt": prompt.messages,
        "gold": prompt.gold,
        "gold_sha": prompt.gold_sha,
        "status": comp.status,
        "response": comp.content,
        "reasoning": comp.reasoning,
        "finish_reason": comp.finish_reason,
        "truncated": comp.finish_reason == "length",
        "extracted": None,
        "normalized": None,
        "correct": False,
        "note": None,
        "error": comp.error,
        "usage": comp.usage,
        "attempts": comp.attempts,
        "elapsed_s": round(comp.elapsed_s, 3),
        **({"meta": prompt.meta} if prompt.meta else {}),
    }


def _apply_grade(task: str, row: dict[str, Any], sample: Sample, prompt: Prompt,
                 settings: EvalSettings) -> None:
    g, note = grade(task, row["response"], sample, prompt,
                    humaneval_timeout=settings.humaneval_timeout)
    row["gold"] = prompt.gold
    row["gold_sha"] = prompt.gold_sha
    row["extracted"] = g.extracted
    row["normalized"] = g.normalized
    row["correct"] = bool(g.correct)
    row["truncated"] = bool(row.get("finish_reason") == "length" or g.truncated)
    row["note"] = note


def run_eval(
    settings: EvalSettings,
    *,
    dataset: LoadedDataset | None = None,
    client: ChatClient | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run (or resume) one evaluation; returns the metrics dict (also in metrics.json).

    ``dataset`` / ``client`` replace the loaded data and the HTTP client (tests);
    ``on_result`` is called with every new row. Raises :class:`EvalError` (bad settings,
    changed data or settings under the same folder, wrong model, mass rejection, unreachable
    server)."""
    check_task(settings.task)
    if not settings.seeds:
        raise EvalError("no seeds given")
    if len(set(settings.seeds)) != len(settings.seeds):
        raise EvalError(f"duplicate seeds: {settings.seeds}")
    if settings.threads < 1:
        raise EvalError("--threads must be at least 1")

    ds = dataset or load_task_data(settings.task, settings.data_file)
    samples = list(ds.samples)
    if settings.n_examples is not None:
        if settings.n_examples < 1:
            raise EvalError("--n-examples must be at least 1")
        if settings.n_examples > len(samples):
            print(f"note: --n-examples {settings.n_examples} > {len(samples)} available; using all",
                  file=sys.stderr)
        samples = samples[: settings.n_examples]

    out = Path(settings.out_dir)
    if out.exists() and not out.is_dir():
        raise EvalError(f"--out {out} is a file: pass a folder for the run")
    out.mkdir(parents=True, exist_ok=True)
    with _lock_folder(out):  # one run writes a folder at a time
        samples_path = out / SAMPLES_FILE
        rows = read_rows(samples_path, repair=True)
        record = _check_run_file(out, settings, has_rows=bool(rows))
        prompts = {
            (seed, s.index): build_prompt(settings.task, s, seed, settings.system_prompt)
            for seed in settings.seeds
            for s in samples
        }
        _check_kept_rows(samples_path, rows, prompts, settings.regrade)

        pending = [
            (seed, s)
            for seed in settings.seeds
            for s in samples
            if rows.get((seed, s.index), {}).get("status") != "ok"
        ]
        if client is None:
            client = ChatClient(
                settings.base_url,
                settings.model,
                request_timeout=settings.request_timeout,
                retries=settings.retries,
                backoff=settings.backoff,
            )
        if pending:
            # Before run.json is written: a mistyped --model must not be locked into the folder.
            client.check_model()
        identity = _check_server(out, record, rows, client, bool(pending), len(prompts) - len(pending))

        seeds_seen = sorted(set(record.get("seeds", [])) | set(settings.seeds))
        from sglang_oscar import __version__ as pkg_version  # noqa: PLC0415

        record.update(
            {
                "defining": settings.defining(),
                "seeds": seeds_seen,
                "data_source": ds.source,
                "n_examples": settings.n_examples,
                "threads": settings.threads,
                "sglang_oscar_version": pkg_version,
            }
        )
        if pending:  # the server that answers this run (nothing asked: the record stays the answering one's)
            record["last_base_url"] = settings.base_url
            record["server"] = identity
        _write_json(out / RUN_FILE, record)

        by_index = {s.index: s for s in samples}
        if settings.regrade:
            for key, row in rows.items():
                if key in prompts and row.get("status") == "ok":
                    _apply_grade(settings.task, row, by_index[key[1]], prompts[key], settings)
            tmp = samples_path.with_name(SAMPLES_FILE + ".tmp")
            with open(tmp, "w", encoding="utf-8") as fh:
                for row in rows.values():
                    fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            os.replace(tmp, samples_path)

        total = len(samples) * len(settings.seeds)
        try:
            if pending:
                _ask(settings, client, pending, prompts, rows, samples_path, total, on_result)
        finally:
            metrics = compute_metrics(settings, samples, rows)
            _write_json(out / METRICS_FILE, metrics)
        _warn_empty(rows, prompts)
        return metrics


def _lock_folder(out: Path):
    """An exclusive lock on ``out/.lock``: the open file, to use in a ``with`` block (closing it, or
    the process ending, releases the lock). :class:`EvalError` when another eval holds it: two runs
    appending to one ``samples.jsonl`` would each ask every sample."""
    import errno
    import fcntl

    fh = open(out / ".lock", "w")  # noqa: SIM115  (returned open: the caller's with-block closes it)
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # a filesystem without flock
            print(f"warning: cannot lock {out} ({exc.strerror}): do not run two evals into it at once",
                  file=sys.stderr)
            return fh
        fh.close()
        raise EvalError(f"another sglang-oscar eval is writing to {out}; wait for it, or use another --out folder") \
            from None
    return fh


def _warn_empty(rows: dict, prompts: dict) -> None:
    """Say so when most answers are empty: they are scored as wrong, yet the run counts as complete
    (a reasoning parser that moves the whole answer out of ``content`` looks like this)."""
    ok = [r for key, r in rows.items() if key in prompts and r.get("status") == "ok"]
    empty = sum(1 for r in ok if not (r.get("response") or "").strip())
    if ok and empty * 2 > len(ok):
        print(f"warning: {empty} of {len(ok)} answers are empty (scored as wrong); check the server's output, e.g. "
              "a --reasoning-parser that leaves no final answer in content", file=sys.stderr)


def _check_server(out: Path, record: dict[str, Any], rows: dict, client, pending: bool, kept: int):
    """The identity to record for this run (:meth:`ChatClient.server_identity`; ``None`` when unknown
    or when kept answers came from an unidentified server); :class:`EvalError` when ``out`` holds
    answers of another server, or when new answers would be asked of a server that cannot be told
    apart from the one recorded (a bf16 run resumed against an int2 server on the same port). Says on
    stderr when answers are kept, and when nothing is asked at all."""
    identity, failure = client.server_identity() if (pending or rows) else (None, None)
    recorded = record.get("server")
    if rows and identity is not None and recorded is not None and identity != recorded:
        diffs = "; ".join(f"{k}: {recorded.get(k)!r} -> {v!r}" for k, v in identity.items() if recorded.get(k) != v)
        raise EvalError(f"{out} holds answers of another server ({diffs}); use another --out folder for the "
                        f"server at {client.base_url}")
    if rows and pending and recorded is not None and identity is None:
        why = failure or "it reports none (not SGLang's /server_info)"
        raise EvalError(f"{out} holds answers of a server with kv_cache_dtype {recorded.get('kv_cache_dtype')!r}, and "
                        f"the server at {client.base_url} cannot be identified ({why}): use another --out folder, or "
                        "re-run once its /server_info answers")
    if rows and not pending:
        print(f"note: all {kept} answers are already in {out} (from {record.get('last_base_url', 'an earlier run')}); "
              "nothing was asked", file=sys.stderr)
    elif kept:
        print(f"note: resuming {out}: {kept} answers kept", file=sys.stderr)
    # kept answers of an unidentified server: the folder's server stays unknown
    return identity if (recorded is not None or not rows) else None


def _check_kept_rows(samples_path: Path, rows: dict[tuple[int, int], dict[str, Any]],
                     prompts: dict[tuple[int, int], Prompt], regrade: bool) -> None:
    """Every recorded row must have been asked the prompt asked now, and every kept (ok)
    row graded against today's gold answer (unless ``regrade`` will re-grade it)."""
    for key, p in prompts.items():
        row = rows.get(key)
        if row is None:
            continue
        if row.get("prompt_sha") != p.sha:
            raise EvalError(
                f"{samples_path}: seed {key[0]} sample {key[1]} was asked a different prompt "
                f"({row.get('prompt_sha')} vs {p.sha} now): the dataset or prompt changed; "
                "use another --out folder"
            )
        if row.get("status") != "ok" or regrade:
            continue  # asked again, or re-graded against the current gold
        if not gold_matches(row, p):
            raise EvalError(
                f"{samples_path}: seed {key[0]} sample {key[1]} was graded against a different "
                f"gold answer ({row.get('gold')!r} vs {p.gold!r} now"
                f"{'' if row.get('gold') != p.gold else ', or different tests'}): the dataset "
                "changed; re-run with --regrade to re-grade the recorded responses against "
                "the current answers, or use another --out folder"
            )


def gold_matches(row: dict[str, Any], prompt: Prompt) -> bool:
    """Whether a recorded row was graded against ``prompt``'s reference (gold answer, and
    HumanEval's tests): by ``gold_sha``, or by ``gold`` for rows written before it existed."""
    if row.get("gold_sha") is not None:
        return row["gold_sha"] == prompt.gold_sha
    return "gold" not in row or str(row["gold"]) == prompt.gold


def _ask(settings, client, pending, prompts, rows, samples_path, total, on_result) -> None:
    jobs: queue.Queue = queue.Queue()
    results: queue.Queue = queue.Queue()
    stop = threading.Event()
    for job in pending:
        jobs.put(job)

    def worker() -> None:
        while not stop.is_set():
            try:
                seed, sample = jobs.get_nowait()
            except queue.Empty:
                return
            prompt = prompts[(seed, sample.index)]
            try:
                comp = client.chat(prompt.messages, settings.params)
                results.put((seed, sample, prompt, comp, None))
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                results.put((seed, sample, prompt, None, exc))

    threads = [
        threading.Thread(target=worker, name=f"eval-worker-{i}", daemon=True)
        for i in range(min(settings.threads, len(pending)))
    ]
    for t in threads:
        t.start()

    bar = None
    if settings.progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=total - len(pending), desc=f"{settings.task}",
                   unit="sample", dynamic_ncols=True, file=sys.stderr)
    attempted = bad = correct = answered = 0
    first_bad: str | None = None
    first_status = "rejected"
    received = 0
    try:
        with open(samples_path, "a", encoding="utf-8") as fh:
            while received < len(pending):
                try:
                    seed, sample, prompt, comp, exc = results.get(timeout=0.5)
                except queue.Empty:
                    continue
                received += 1
                if exc is not None:
                    raise exc
                row = _row(seed, sample, prompt, comp)
                if comp.status == "ok":
                    _apply_grade(settings.task, row, sample, prompt, settings)
                    answered += 1
                    correct += int(row["correct"])
                else:
                    bad += 1
                    if first_bad is None:
                        first_bad, first_status = comp.error, comp.status
                attempted += 1
                rows[(seed, sample.index)] = row
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
                fh.flush()
                if on_result is not None:
                    on_result(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(acc=f"{correct / answered:.3f}" if answered else "-", bad=bad)
                if attempted >= min(len(pending), MIN_ATTEMPTS_FOR_ABORT) and bad > ABORT_FRACTION * attempted:
                    hint = ("e.g. max tokens beyond the context length: --context-length / YaRN in the recipe, "
                            "or a smaller --max-tokens" if first_status == "rejected" else
                            "the server failed or timed out: see its log, or raise --request-timeout")
                    raise MassRejection(
                        f"aborting: {bad} of {attempted} requests were rejected or failed "
                        f"(first: {first_bad}); they were not scored as answers. Fix the cause "
                        f"({hint}) and re-run the same command: finished samples are kept"
                    )
    finally:
        stop.set()
        client.stop()
        if bar is not None:
            bar.close()
