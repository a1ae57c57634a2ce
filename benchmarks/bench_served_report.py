"""The report of ``benchmarks/bench_served.py``: one markdown table per model with int2's ratios to
the best BF16 / FP8 server of each cell, the PNG plots, the output files, and ``--merge`` of runs
split over device calls."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import tarfile
from pathlib import Path
from typing import Any, Sequence


def label(n: int) -> str:
    """A context length as the table writes it (``8K``; tokens when not a multiple of 1024)."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def base_format(fmt: str) -> str:
    """A server's format without the ``#n`` suffix :func:`merge` gives a format's later runs."""
    return fmt.split("#")[0]


def _fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def best(table: dict[str, dict], kind: str, key: str) -> float | None:
    """The best value of ``key`` among the formats named ``kind``, ``kind-*`` or ``kind#n`` (merged
    repeats): the shortest TTFT (keys ``t*``), else the largest (pool, concurrent requests, tokens/s);
    None when none has it."""
    vals = [v[key] for f, v in table.items() if re.match(rf"{kind}(-|#|$)", f) and v.get(key)]
    return (min if key.startswith("t") else max)(vals) if vals else None


def render_table(results: dict[str, Any]) -> str:
    """One markdown table per model: format rows; capacity, TTFT and decode tokens/s columns; the
    int2 row's cells carry (int2/BF16, int2/FP8) ratios against the best BF16 (formats ``bf16*``) and
    the best FP8 (``fp8*``) server measured at that cell: the largest pool / tokens/s, the shortest
    TTFT (for TTFT the ratio is int2 over it, lower is better)."""
    lines = []
    by_model: dict[str, dict[str, dict]] = {}
    for s in results["servers"]:
        by_model.setdefault(s["model"], {})[s["format"]] = s
    for model, servers in by_model.items():
        pts = sorted({(r["context"], r["batch"]) for s in servers.values() for r in s["runs"] if r["kind"] == "decode"})
        ttfts = sorted({r["context"] for s in servers.values() for r in s["runs"] if r["batch"] == 1})

        def vals(s: dict) -> dict[str, float | None]:
            cap = s.get("capacity") or {}
            v: dict[str, float | None] = {"pool": cap.get("max_total_num_tokens"),
                                          "cap": (cap.get("concurrent") or {}).get("128K")}
            for r in s["runs"]:
                if r.get("status", "").startswith("ok"):
                    if r["batch"] == 1:
                        v[f"t{r['context']}"] = r["ttft_s"][0]
                    if r["kind"] == "decode":
                        v[f"d{r['context']}x{r['batch']}"] = r["decode_tok_s"]
            return v

        table = {f: vals(s) for f, s in servers.items()}
        keys = ["pool", "cap"] + [f"t{c}" for c in ttfts] + [f"d{c}x{b}" for c, b in pts]
        heads = ["KV tokens", "128K reqs"] + [f"TTFT {label(c)} (s)" for c in ttfts] + \
            [f"{label(c)} x {b} (tok/s)" for c, b in pts]
        lines += [f"### {model}", "", "| format | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
        for f, v in table.items():
            cells = []
            for k in keys:
                x = v.get(k)
                cell = _fmt(x, 3 if k.startswith("t") else 0 if k in ("pool", "cap") else 1)
                if f.startswith("int2") and x:
                    rs = [f"{x / b:.2f}x" if (b := best(table, kind, k)) else "-" for kind in ("bf16", "fp8")]
                    cell += f" ({rs[0]} / {rs[1]})"
                cells.append(cell)
            status = servers[f].get("status", "")
            lines.append(f"| {f}{'' if status == 'ok' else ' (' + status + ')'} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("int2 cells: (int2 / best BF16, int2 / best FP8) of the servers above. Decode tok/s: all requests "
                 "together while all decode. Skipped points and reasons: results.json.")
    return "\n".join(lines)


def plot(results: dict[str, Any], out: Path) -> list[str]:
    """decode.png (tokens/s vs context, a line per format -- the runs of a format merged with
    ``--merge`` as one line; rows models, columns batches) and capacity.png (concurrent 128K requests
    per format and model). Returns the names written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed")
        return []
    servers = results["servers"]
    models = list(dict.fromkeys(s["model"] for s in servers))
    batches = sorted({r["batch"] for s in servers for r in s["runs"] if r["kind"] == "decode"}) or [1]
    color = {f: f"C{i}" for i, f in enumerate(dict.fromkeys(base_format(s["format"]) for s in servers))}
    fig, axes = plt.subplots(len(models), len(batches), figsize=(4 * len(batches), 3.2 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            # a format measured in several merged runs ("int2", "int2#2") is one line
            for f in dict.fromkeys(base_format(s["format"]) for s in servers if s["model"] == m):
                pts = sorted((r["context"], r["decode_tok_s"]) for s in servers if s["model"] == m
                             and base_format(s["format"]) == f for r in s["runs"] if r["kind"] == "decode"
                             and r["batch"] == b and r.get("decode_tok_s"))
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f, color=color[f])
            ax.set_xscale("log", base=2)
            ax.set_title(f"{m}, batch {b}", fontsize=9)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("decode tokens/s")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=120)
    fig2, ax = plt.subplots(figsize=(2 + 2 * len(models), 3.5))
    fmts = list(color)
    for k, f in enumerate(fmts):  # a format merged from several runs: its first run's capacity
        ys = [next(((s.get("capacity") or {}).get("concurrent", {}).get("128K") or 0 for s in servers
                    if s["model"] == m and base_format(s["format"]) == f), 0) for m in models]
        ax.bar([i + k / (len(fmts) + 1) for i in range(len(models))], ys, width=1 / (len(fmts) + 1), label=f,
               color=color[f])
    ax.set_xticks([i + (len(fmts) - 1) / (2 * (len(fmts) + 1)) for i in range(len(models))])
    ax.set_xticklabels(models)
    ax.set_ylabel("concurrent 128K requests")
    ax.legend()
    fig2.tight_layout()
    fig2.savefig(out / "capacity.png", dpi=120)
    return ["decode.png", "capacity.png"]


def write_outputs(results: dict[str, Any], a: argparse.Namespace, logs: Path | None) -> None:
    """Write ``results.json``, ``results.md`` (the table of :func:`render_table`), the plots and, when
    ``logs`` is a folder, ``logs.tgz`` to ``a.out`` (which must exist); print the table."""
    out = Path(a.out)
    has_logs = logs is not None and logs.is_dir()
    table = render_table(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(f"# bench_served ({results['meta'].get('date')}, commit "
                                    f"{results['meta'].get('commit')})\n\n`{shlex.join(results['meta']['argv'])}`\n\n"
                                    + table + "\n")
    plots: list[str] = []
    try:
        plots = plot(results, out) or []
    except Exception as exc:  # noqa: BLE001  plots must not lose the table
        print(f"plots failed: {type(exc).__name__}: {exc}")
    if has_logs:
        with tarfile.open(out / "logs.tgz", "w:gz") as tar:
            tar.add(logs, arcname="logs")
    written = ["results.md", *plots] + (["logs.tgz"] if has_logs else [])
    print("\n" + table + f"\n\nwrote {out}/results.json, {', '.join(written)}")


def merge(paths: Sequence[str], a: argparse.Namespace) -> dict[str, Any]:
    """One results dict from several runs' ``results.json`` (servers concatenated, in order, those a
    run skipped left out; a format measured again for one model keeps every row, the repeats suffixed
    ``#2``, ``#3``, ...), written to ``--out``."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    servers, seen = [], {}
    for r in runs:
        for s in r["servers"]:
            if str(s.get("status", "")).startswith("skip"):
                continue
            key = (s["model"], s["format"])
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1:
                s = {**s, "format": f"{s['format']}#{seen[key]}"}
            servers.append(s)
    meta = {"date": runs[0]["meta"].get("date"), "commit": ", ".join(dict.fromkeys(r["meta"].get("commit") or "?"
                                                                                    for r in runs)),
            "argv": ["bench_served.py", "--merge", ",".join(paths)], "merged": [r["meta"] for r in runs]}
    results = {"meta": meta, "servers": servers}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    write_outputs(results, a, None)
    with (Path(a.out) / "results.md").open("a") as f:
        f.write("\nRuns merged:\n\n" + "".join(f"* {m.get('date')}, {m.get('gpu', '?')}, commit {m.get('commit')}: "
                                                 f"`{shlex.join(m['argv'])}`\n" for m in meta["merged"]))
    return results


