"""Quick device smoke test of the served INT2 path: BF16 vs int2 servers on a tiny seeded Qwen3.

Usage (on a GPU box with sglang 0.5.16 and this plugin installed):
    python scripts/serve_smoke.py [--tp2] [--out DIR]

Builds a tiny Qwen3 (head_dim 128, GQA 4:1, peaky logits), launches concurrently a BF16 server,
an int2 server with default windows and an int2 server with small windows (sink 16, recent 32:
most of a 400-token prompt is read through INT2), optionally an int2 server with ``--tp 2``;
sends the same prompts with greedy decoding and prints the tokens agreement with BF16. A quick
check that the plugin serves; ``scripts/gpu_e2e.sh`` runs the acceptance checks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import requests


def build_model(path: str) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192,
                      torch_dtype="bfloat16", tie_word_embeddings=False, initializer_range=0.08)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def launch(model: str, port: int, extra: list[str], log: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
           "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
           "--skip-tokenizer-init", "--mem-fraction-static", "0.08", "--cuda-graph-max-bs", "4", *extra]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait(port: int, proc: subprocess.Popen, timeout: float = 300) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            return False
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return True
        except requests.RequestException:
            pass
        time.sleep(2)
    return False


def generate(port: int, ids: list[int], n: int) -> list[int]:
    r = requests.post(f"http://127.0.0.1:{port}/generate", timeout=120, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    r.raise_for_status()
    return r.json()["output_ids"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp2", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    model = "/tmp/smoke-qwen3"
    build_model(model)
    servers = {
        "bf16": (31000, ["--kv-cache-dtype", "auto"]),
        "int2": (31001, ["--kv-cache-dtype", "int2"]),
        "int2_small_windows": (31002, ["--kv-cache-dtype", "int2", "--oscar-sink-tokens", "16",
                                        "--oscar-recent-tokens", "32"]),
    }
    if args.tp2:
        servers["int2_tp2"] = (31003, ["--kv-cache-dtype", "int2", "--tp", "2"])
    procs = {k: launch(model, p, extra, os.path.join(args.out, f"smoke_{k}.log")) for k, (p, extra) in servers.items()}
    results = {}
    try:
        healthy = {k: wait(servers[k][0], procs[k]) for k in servers}
        prompts = [[(7 * i + 3 * j) % 2000 + 5 for j in range(400)] for i in range(3)]
        for k, ok in healthy.items():
            if not ok:
                results[k] = "NOT HEALTHY"
                continue
            results[k] = [generate(servers[k][0], p, 24) for p in prompts]
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    base = results.get("bf16")
    ok = True
    for k, v in results.items():
        if isinstance(v, str) or isinstance(base, str):
            print(f"{k:>20}: {v if isinstance(v, str) else 'bf16 failed'}")
            ok = False
            continue
        agree = sum(a == b for x, y in zip(v, base) for a, b in zip(x, y)) / sum(len(x) for x in base)
        print(f"{k:>20}: token agreement with bf16 {agree:.3f}; first: {v[0][:12]}")
    with open(os.path.join(args.out, "smoke.json"), "w") as f:
        json.dump(results, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
