"""Markdown report of ``benchmarks.bench_decode`` (table, write cost, config sweep)."""

from __future__ import annotations

from sglang_oscar.kernels.configs import STAGES1_MIN_PAIRS


def fmt_ms(t):
    """A time in ms as text (microseconds under 1 ms; ``-`` for ``None``)."""
    return "-" if t is None else (f"{t * 1e3:.1f} us" if t < 1 else f"{t:.3f} ms")


def ratio_txt(x) -> str:
    """A speed-up as ``1.23x`` (``-`` when missing)."""
    return "-" if not x else f"{x:.2f}x"


def render(rows, extra, copy_bw, info, default_config, elapsed, smoke, *, geometry: dict, timing_mode: str) -> str:
    """The markdown report of :func:`benchmarks.bench_decode.main`: ``geometry`` holds the layer's
    ``hq``, ``hkv``, ``d``, ``sink``, ``recent``; ``timing_mode`` ``graph`` or ``do_bench``."""
    HQ, HKV, D, SINK, RECENT = (geometry[k] for k in ("hq", "hkv", "d", "sink", "recent"))
    lines = []
    lines.append(f"### Decode attention, Qwen3-8B layer ({HQ} q / {HKV} kv heads, head_dim {D}), "
                 f"sink {SINK} + recent {RECENT}")
    lines.append("")
    lines.append(f"device: {info.get('device')}; torch {info.get('torch')}, triton {info.get('triton')}, "
                 f"sglang {info.get('sglang')}; copy bandwidth (read+write) **{copy_bw / 1e12:.2f} TB/s**; "
                 f"run {elapsed:.0f} s{' (SMOKE: interpreter timings are meaningless)' if smoke else ''}; "
                 f"timing: {timing_mode}" + (" (CUDA graph of 16 calls, 256 MB L2 flush before each, flush time "
                                                "subtracted)" if timing_mode == "graph" else ""))
    lines.append(f"INT2 pool layout: `{info.get('pool_layout')}` (bench_decode.apply_pool_layout: slot order and "
                 "storage of the INT2 rows; SGLang's BF16 kernel reads the same slot ids)")
    engines = sorted({r["engine"] for r in rows if r.get("engine")})
    lines.append(f"INT2 default engine (stage 1): {', '.join(engines) or 'n/a'} (``config=None`` runs the Gluon "
                 "kernel where it applies, kernels/decode/gluon_stage1.py, else the Triton one)")
    lines.append(f"INT2 default Triton config: `{default_config}` below {STAGES1_MIN_PAIRS} (request, kv head) pairs "
                 "per step, `num_stages` 1 and no `defer_sums` from there (configs.STAGES1_MIN_PAIRS)")
    lines.append("")
    lines.append("| ctx | batch | INT2 default | INT2 best | SGLang triton BF16 (best splits) | SDPA BF16 | "
                 "INT2 BW (best) | BF16 BW (fastest) | INT2 / fastest BF16 speed-up | best INT2 config |")
    lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['ctx']} | {r['batch']} | failed: {r['error']} |||||||| |")
            continue

        def bw(nbytes, t):
            return "-" if not t else f"{nbytes / (t * 1e-3) / 1e12:.2f} TB/s ({nbytes / (t * 1e-3) / copy_bw * 100:.0f}%)"
        bf_t = r.get("bf16_best")
        bf_bytes = r["bytes_sdpa"] if bf_t == r.get("sdpa") else r["bytes_sglang"]
        sg = fmt_ms(r.get("sglang")) + (f" [{r.get('sglang_splits')}]" if r.get("sglang") else f" {r.get('sglang_note', '')}")
        lines.append(
            f"| {r['ctx']} | {r['batch']} | {fmt_ms(r['int2'])} | {fmt_ms(r['int2_best'])} | {sg} | "
            f"{fmt_ms(r.get('sdpa'))} ({r.get('sdpa_backend')}) | {bw(r['bytes_int2'], r['int2_best'])} | "
            f"{bw(bf_bytes, bf_t)} | {ratio_txt(r.get('ratio'))} | "
            f"{r['int2_best_cfg']} |")
    lines.append("")
    rows = [r for r in rows if "error" not in r]
    no_hp = [r for r in rows if r.get("int2_no_hp")]
    if no_hp:
        lines.append("Stage-removed variants (default config): " + "; ".join(
            f"ctx {r['ctx']} b {r['batch']}: full {fmt_ms(r['int2'])}, INT2 tier only (sink=recent=0) "
            f"{fmt_ms(r['int2_no_hp'])}" for r in no_hp))
    if extra.get("write_ms") is not None:
        lines.append(
            f"Write (quantize+scatter K,V + HP copy) of {extra['write_batch']} tokens: {fmt_ms(extra['write_ms'])}: "
            f"{extra['write_frac'] * 100:.1f}% of the INT2 decode step at batch {extra['write_batch']}, "
            f"ctx {extra['write_ctx']} (per layer; every token is written in INT2 when it is written and the BF16 "
            f"windows are copies, docs/design.md).")
        rs = [r for r in (1, 2, 4) if extra.get(f"write_ms_r{r}") is not None]
        if rs:
            best = min(extra[f"write_ms_r{r}"] for r in rs)
            lines.append("Rows per program (write): " + "; ".join(
                f"{r}: {fmt_ms(extra[f'write_ms_r{r}'])}" for r in rs)
                + f"; best {best / extra['write_decode_ms'] * 100:.1f}% of the step.")
    elif extra.get("write_error"):
        lines.append(f"Write timing failed: {extra['write_error']}")
    sweep_keys = sorted({k for r in rows for k in r.get("sweep", {})})
    if sweep_keys:
        lines.append("")
        lines.append("INT2 config sweep (time; WRONG = output differs from the default's by > 2e-2 rel. L2):")
        lines.append("")
        lines.append("| ctx | batch | " + " | ".join(f"`{k}`" for k in sweep_keys) + " |")
        lines.append("|---:|---:|" + "---:|" * len(sweep_keys))
        for r in rows:
            cells = []
            for k in sweep_keys:
                v = r["sweep"].get(k)
                cells.append(fmt_ms(v) if isinstance(v, float) else str(v))
            lines.append(f"| {r['ctx']} | {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def step_row_cells(int2, bf: dict) -> str:
    """The table cells shared by the per-layer benchmarks (``bench_layer_step``, ``bench_latent``):
    ``INT2 time | fastest BF16 time (kernel) | INT2 / BF16 | every BF16 kernel's time`` from the INT2
    time and a ``{kernel: time}`` dict (ms; the dict may be empty)."""
    best = min(bf, key=bf.get) if bf else None
    ratio = f"{int2 / bf[best]:.2f}x" if best else "-"
    kernels = ", ".join(f"{k} {fmt_ms(t)}" for k, t in bf.items())
    return f"{fmt_ms(int2)} | {fmt_ms(bf[best]) if best else '-'} ({best}) | {ratio} | {kernels}"


def emit_row(rows: list, row: str, device) -> None:
    """Append ``row`` to ``rows`` and print it; on a GPU give the cached memory back (call it after
    dropping the point's tensors, so the next, larger point finds room)."""
    import torch

    rows.append(row)
    print(row, flush=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def write_table(rows: list, out: str | None) -> str:
    """``rows`` joined as one markdown table (written to ``out`` when given); returns the text."""
    text = "\n".join(rows) + "\n"
    if out:
        with open(out, "w") as f:
            f.write(text)
    return text

