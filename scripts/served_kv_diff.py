"""Served K/V rows against the oracle's, layer by layer (check c on a sliding-window family).

An int2 server started with ``OSCAR_E2E_DUMP_KV=<folder>`` and the harness's fp32 shim on its
PYTHONPATH (``tests/e2e/fp32_shim.py``, ``_dump_extend_kv``) saves the q / K / V rows its backend
receives for the first whole-prompt extend of each length. This script feeds the same token ids
through the oracle (``tests.e2e.oracle.teacher_forced_logprobs``, pure prefill) on the checkpoint
loaded in fp32 and in fp64, records the rows the oracle quantizes, and prints per layer:

* rel. L2 of K and V: served vs oracle fp32, and oracle fp32 vs fp64 (fp32 arithmetic's own error);
* INT2 codes (with the dump's rotation, fp32 pairs, c's windows) that differ between the served
  rows and the oracle's fp32 rows, and between the oracle's fp32 and fp64 rows;
* replay: the oracle's attention (extend windows, fp32 HP tier and pairs) on the served layer's
  own q / K / V against the output the served backend returned, rel. L2. This isolates the INT2
  path (rotations, quantizing write, windows, kernels) from the model code around it: it is
  ~1e-6 when the served attention computes what the oracle computes on the same inputs.

Served rows as far from the oracle as fp32 arithmetic is from fp64 mean the served model computes
the same K/V as transformers up to rounding; a layer far beyond that points at a served op.

  PYTHONPATH=python:. python scripts/served_kv_diff.py --dump kv_30000_256.pt [--model tiny-gemma4 \\
      --rotation rot-gemma4/rot_layer.safetensors]     (default: the server's own, from its argv)

device/c_dump.sh runs it on the GPU machine after check c.
"""

from __future__ import annotations

import argparse
import json

import torch

import sglang_oscar.reference.attention as refattn
from sglang_oscar.config import OscarConfig
from sglang_oscar.quant.packing import unpack_quarter
from sglang_oscar.rotation import RotationSet
from tests.e2e.checkpoints import load_hf
from tests.e2e.config import C_RECENT, C_SINK
from tests.e2e.oracle import teacher_forced_logprobs

_BUILD = refattn.build_cache


def oracle_rows(model, ids: list[int], rs: RotationSet, cfg: OscarConfig) -> list[tuple]:
    """(k, v, rotation_k, rotation_v, k_mean, v_mean) that the oracle quantizes, one per layer, in call order."""
    rec = []

    def spy(k, v, rk, rv, config, hp_dtype=torch.bfloat16, k_mean=None, v_mean=None, **kw):
        rec.append((k.detach().double(), None if v is None else v.detach().double(), rk, rv, k_mean, v_mean))
        return _BUILD(k, v, rk, rv, config, hp_dtype, k_mean=k_mean, v_mean=v_mean, **kw)

    refattn.build_cache = spy
    try:
        with torch.no_grad():
            teacher_forced_logprobs(model, [ids], rotation=rs, config=cfg, hp_dtype=torch.float32)
    finally:
        refattn.build_cache = _BUILD
    return rec


def codes(k, v, rk, rv, km, vm, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """INT2 codes of K and V (unpacked) as the oracle stores them."""
    f = torch.float32
    kv = _BUILD(k.to(f), None if v is None else v.to(f), rk, rv, cfg, f, k_mean=km, v_mean=vm)
    return unpack_quarter(kv.k_quant.codes), unpack_quarter(kv.v_quant.codes)


def per_head(r: torch.Tensor, heads: int) -> torch.Tensor:
    """A ``[D, D]`` (per-layer) or ``[H_kv, D, D]`` rotation as ``[H_kv, D, D]``."""
    return r.float().expand(heads, *r.shape[-2:]) if r.dim() == 2 else r.float()


def model_frame_v(layer: dict, rv, vm) -> torch.Tensor:
    """The dumped V ``[T, H_kv, D_v]`` in the model's frame: a value-folded layer's ``v_proj`` emits
    ``(v - mean) R_v`` (docs/design.md, the fold), so ``v R_v^T + mean`` undoes it."""
    hkv, dv = layer["tp_k_head_num"], layer["v_head_dim"]
    v = layer["v"].reshape(-1, hkv, dv)
    if layer.get("value_folded"):
        v = torch.einsum("thd,hed->the", v, per_head(rv, hkv))
        if vm is not None:
            v = v + vm.float()
    return v


def replay(layer: dict, rk, rv, km, vm, cfg) -> torch.Tensor:
    """The oracle's output ``[T, H_q * D_v]`` for a dumped extend layer: its own q / K / V (V in the
    model frame), its sinks, extend windows, fp32 HP tier; SGLang's ``sliding_window_size`` is
    ``W - 1``. In the model frame, or for an output-folded layer in the rotated frame without the
    mean (``o_proj`` holds ``R_v^T`` and the mean), as that layer's backend returns it."""
    from sglang_oscar.reference.attention import build_cache, oscar_attention

    hq, hkv, dk, dv = (layer[n] for n in ("tp_q_head_num", "tp_k_head_num", "qk_head_dim", "v_head_dim"))
    q, k, v = layer["q"].reshape(-1, hq, dk), layer["k"].reshape(-1, hkv, dk), model_frame_v(layer, rv, vm)
    sw = layer["sliding_window"]
    window = sw + 1 if sw is not None and sw >= 0 else None
    kv = build_cache(k, v, rk, rv, cfg, torch.float32, k_mean=km, v_mean=vm)
    o = oscar_attention(q, k, v, rk, rv, cfg, q_positions=torch.arange(q.shape[0]), sm_scale=layer["scaling"],
                        sliding_window=window, window_mode="extend", cache=kv, k_mean=km, v_mean=vm,
                        sinks=layer.get("sinks"), counter_rotate=not layer.get("output_folded"))
    if layer.get("output_folded") and vm is not None:  # the folded o_proj's bias carries the mean
        o = o - torch.einsum("hd,hde->he", vm.float(), per_head(rv, hkv)).repeat_interleave(hq // hkv, dim=0)
    return o.reshape(q.shape[0], hq * dv)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dump", nargs="+", required=True, help="kv_<port>_<len>.pt files of one server")
    p.add_argument("--model", help="the tiny checkpoint the server loaded (default: its --model-path)")
    p.add_argument("--rotation", help="the server's --oscar-rotation file (default: from its argv)")
    p.add_argument("--out", help="write the table as JSON here")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's own)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    argv = torch.load(a.dump[0], map_location="cpu")["argv"]
    model_path = a.model or argv[argv.index("--model-path") + 1]
    rs = RotationSet.load(a.rotation or argv[argv.index("--oscar-rotation") + 1])
    cfg = OscarConfig(sink_tokens=C_SINK, recent_tokens=C_RECENT, scale_dtype="float32")
    models = {dt: load_hf(model_path, "cpu", dtype=dt) for dt in (torch.float32, torch.float64)}
    report = {}
    for path in a.dump:
        d = torch.load(path, map_location="cpu")
        ids = [int(x) for x in d["input_ids"]]
        o32, o64 = (oracle_rows(models[dt], ids, rs, cfg) for dt in (torch.float32, torch.float64))
        rows = []
        for lid, (r32, r64) in enumerate(zip(o32, o64)):
            k32, v32, rk, rv, km, vm = r32
            served = d["layers"][lid]
            ks = served["k"].reshape(k32.shape)
            vs = model_frame_v(served, rv, vm).reshape(v32.shape) if v32 is not None else None
            c_s, c_32, c_64 = (codes(k, v, rk, rv, km, vm, cfg) for k, v in ((ks, vs), (k32, v32), (r64[0], r64[1])))
            row = {"layer": lid, "tokens": k32.shape[0],
                   "k_rel_served_vs_oracle32": rel(ks, k32), "k_rel_oracle32_vs_64": rel(k32, r64[0]),
                   "k_codes_served_vs_oracle32": int((c_s[0] != c_32[0]).sum()),
                   "k_codes_oracle32_vs_64": int((c_32[0] != c_64[0]).sum()), "codes": c_32[0].numel()}
            if v32 is not None:
                row.update(v_rel_served_vs_oracle32=rel(vs, v32), v_rel_oracle32_vs_64=rel(v32, r64[1]),
                           v_codes_served_vs_oracle32=int((c_s[1] != c_32[1]).sum()),
                           v_codes_oracle32_vs_64=int((c_32[1] != c_64[1]).sum()))
            if "o" in served:
                row["replay_o_rel"] = rel(served["o"].reshape(-1, served["o"].shape[-1]),
                                          replay(served, rk, rv, km, vm, cfg).reshape(-1, served["o"].shape[-1]))
            rows.append(row)
            print(f"{path} layer {lid}: K rel served/oracle32 {row['k_rel_served_vs_oracle32']:.2e} "
                  f"oracle32/64 {row['k_rel_oracle32_vs_64']:.2e} | K codes differing served {row['k_codes_served_vs_oracle32']} "
                  f"fp32-vs-fp64 {row['k_codes_oracle32_vs_64']} of {row['codes']}"
                  + (f" | V rel {row['v_rel_served_vs_oracle32']:.2e} / {row['v_rel_oracle32_vs_64']:.2e}, codes "
                     f"{row['v_codes_served_vs_oracle32']} / {row['v_codes_oracle32_vs_64']}" if v32 is not None else "")
                  + (f" | replay o rel {row['replay_o_rel']:.2e}" if "replay_o_rel" in row else ""),
                  flush=True)
        report[path] = rows
    if a.out:
        json.dump(report, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
