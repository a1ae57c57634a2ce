"""Compare two evaluation runs (e.g. the BF16 control and the INT2 arm).

For each run: accuracy mean ± std over its seeds (full denominators, from ``samples.jsonl``
and ``run.json``). Then the paired difference B - A over the samples both runs finished:
same seed, same sample index, and the same prompt (checked through ``prompt_sha``, so GPQA
permutations are identical). Within each common seed only the *contiguous prefix* of sample
indices that both runs completed is used (scoring "whatever finished" of a partial run favours
short answers, spec §9.5). Both rows of a pair must also have been graded against the same
gold answer (``gold_sha``). The standard error of the mean difference treats the questions,
not the (seed, question) pairs, as independent: the seeds of one question are correlated, so
it is the cluster-robust standard error over questions (= std of each question's mean
difference over seeds / sqrt(questions) when every question has the same seeds). The
discordant counts (right in A only / in B only) are reported as well.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from sglang_oscar.evals import stats
from sglang_oscar.evals.errors import EvalError
from sglang_oscar.evals.runner import METRICS_FILE, RUN_FILE, SAMPLES_FILE, read_rows


def _same_gold(ra: dict[str, Any], rb: dict[str, Any]) -> bool:
    if ra.get("gold_sha") is not None and rb.get("gold_sha") is not None:
        return ra["gold_sha"] == rb["gold_sha"]
    return str(ra.get("gold")) == str(rb.get("gold"))


def _load(run: str | Path) -> tuple[dict[str, Any], dict[str, Any], dict]:
    d = Path(run)
    if not d.is_dir():
        raise FileNotFoundError(f"run folder {d} does not exist")
    for name in (RUN_FILE, METRICS_FILE, SAMPLES_FILE):
        if not (d / name).exists():
            raise FileNotFoundError(f"{d} is not an eval run folder: {name} is missing")
    loaded = []
    for name in (RUN_FILE, METRICS_FILE):
        try:
            loaded.append(json.loads((d / name).read_text(encoding="utf-8")))
        except ValueError as exc:
            raise EvalError(f"{d / name} is not valid JSON ({exc}); re-run the eval into {d} to rewrite it") from None
    record, metrics = loaded
    missing = [k for k in ("task", "model", "n", "seeds") if k not in metrics]
    if missing:
        raise EvalError(f"{d / METRICS_FILE} lacks {', '.join(missing)} (damaged or from another tool); re-run the "
                        f"eval into {d} to rewrite it")
    rows = read_rows(d / SAMPLES_FILE)
    return record, metrics, rows


def _summary(metrics: dict[str, Any]) -> dict[str, Any]:
    accs = [c["accuracy"] for c in metrics["seeds"].values()]
    return {
        "task": metrics["task"],
        "model": metrics["model"],
        "n": metrics["n"],
        "seeds": [int(s) for s in metrics["seeds"]],
        "mean": stats.mean(accs) if accs else float("nan"),
        "std": stats.std(accs),
        "truncated": metrics.get("truncated", 0),
        "complete": metrics.get("complete", False),
    }


def compare_runs(run_a: str | Path, run_b: str | Path) -> dict[str, Any]:
    """Compare two run folders (A = control, B = treatment). Returns ``{"a", "b"}``
    summaries, ``"paired"`` statistics (n, n_questions, diff = B - A, se, discordant counts,
    per-seed n) and ``"warnings"``. Raises FileNotFoundError for a missing folder/file and
    :class:`EvalError` for runs that cannot be paired (task, seeds, prompts, gold answers)."""
    if Path(run_a).resolve() == Path(run_b).resolve():
        raise EvalError(f"both runs are {run_a}: pass the control and the treatment folders")
    rec_a, met_a, rows_a = _load(run_a)
    rec_b, met_b, rows_b = _load(run_b)
    if met_a["task"] != met_b["task"]:
        raise EvalError(f"cannot compare a {met_a['task']} run with a {met_b['task']} run")
    warnings: list[str] = []
    da, db = rec_a.get("defining", {}), rec_b.get("defining", {})
    for key in ("model", "max_tokens", "temperature", "top_p", "top_k", "system_prompt", "prompt_version"):
        if da.get(key) != db.get(key):
            warnings.append(f"the runs differ in {key}: {da.get(key)!r} vs {db.get(key)!r}")

    if met_a["n"] != met_b["n"] or sorted(met_a["seeds"]) != sorted(met_b["seeds"]):
        # each run's mean is over its own samples and seeds; the paired difference uses the common ones
        warnings.append(f"the runs cover different samples or seeds (n {met_a['n']} vs {met_b['n']}, seeds "
                        f"{sorted(met_a['seeds'])} vs {sorted(met_b['seeds'])}): the two means are over different "
                        "questions; only the paired difference uses the same ones")
    seeds = sorted(set(int(s) for s in met_a["seeds"]) & set(int(s) for s in met_b["seeds"]))
    if not seeds:
        raise EvalError("the two runs have no seed in common: nothing to pair")
    a_vals: list[int] = []
    b_vals: list[int] = []
    questions: list[int] = []
    per_seed: dict[str, int] = {}
    dropped = 0
    for seed in seeds:
        n = 0
        idx = 0
        while True:
            ra, rb = rows_a.get((seed, idx)), rows_b.get((seed, idx))
            if ra is None or rb is None or ra.get("status") != "ok" or rb.get("status") != "ok":
                break
            if ra.get("prompt_sha") != rb.get("prompt_sha"):
                raise EvalError(
                    f"seed {seed} sample {idx} was asked different prompts in the two runs "
                    f"({ra.get('prompt_sha')} vs {rb.get('prompt_sha')}): not a paired comparison"
                )
            if not _same_gold(ra, rb):
                raise EvalError(
                    f"seed {seed} sample {idx} was graded against different gold answers in "
                    f"the two runs ({ra.get('gold')!r} vs {rb.get('gold')!r}): the data files "
                    "differ; re-grade both with the same data (eval --regrade)"
                )
            a_vals.append(int(bool(ra.get("correct"))))
            b_vals.append(int(bool(rb.get("correct"))))
            questions.append(idx)
            n += 1
            idx += 1
        both_done = sum(
            1
            for (s, i), ra in rows_a.items()
            if s == seed and ra.get("status") == "ok" and rows_b.get((s, i), {}).get("status") == "ok"
        )
        dropped += both_done - n
        per_seed[str(seed)] = n
    if dropped:
        warnings.append(
            f"{dropped} sample(s) finished in both runs lie beyond the common contiguous prefix "
            "and were left out of the paired difference"
        )
    p = stats.paired(a_vals, b_vals, clusters=questions)
    return {
        "a": {"path": str(run_a), **_summary(met_a)},
        "b": {"path": str(run_b), **_summary(met_b)},
        "paired": {**p, "per_seed_n": per_seed},
        "warnings": warnings,
    }


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN/inf float replaced by None (strict JSON has no NaN)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.2f}"


def format_comparison(c: dict[str, Any]) -> str:
    """The comparison as a few human-readable lines."""
    a, b, p = c["a"], c["b"], c["paired"]
    lines = [f"task {a['task']}"]
    for tag, r in (("A", a), ("B", b)):
        lines.append(
            f"{tag}: {r['path']} ({r['model']}): {_pct(r['mean'])} ± {_pct(r['std'])} "
            f"over seeds {r['seeds']} (n = {r['n']} per seed, truncated {r['truncated']}"
            f"{'' if r['complete'] else ', INCOMPLETE'})"
        )
    lines.append(
        f"paired B - A over {p['n']} common samples: {_pct(p['diff'])} pp ± {_pct(p['se'])} "
        f"(paired std error over {p.get('n_questions', p['n'])} questions); A {_pct(p['acc_a'])} vs B {_pct(p['acc_b'])}; "
        f"right only in A: {p['only_a']}, only in B: {p['only_b']}"
    )
    for w in c["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
