"""Quick device smoke test of the served INT2 path: BF16 vs int2 servers on a tiny seeded Qwen3.

    python -m tests.e2e.smoke [--tp2] [--out DIR]      (GPU machine, after ``source device/env.sh``)

Builds a tiny random Qwen3 (head_dim 128, GQA 4:1), launches concurrently (through
:mod:`sglang_oscar.serving_launcher`) a BF16 server, an int2 server with the default windows and
an int2 server with small windows (sink 16, recent 32: most of a 400-token prompt is read through
INT2), and with ``--tp2`` an int2 server with ``--tp 2``; sends the same prompts with greedy
decoding and prints each server's token agreement with BF16. Exit 1 when a server does not become
healthy or a request fails. A quick check that the plugin serves; ``python -m tests.e2e`` runs the
acceptance checks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sglang_oscar.serving_launcher import ServerProcess

from .client import generate_payload, http_json, parse_generation

BASE_PORT = 31000
SERVERS = {
    "bf16": ["--kv-cache-dtype", "auto"],
    "int2": ["--kv-cache-dtype", "int2"],
    "int2_small_windows": ["--kv-cache-dtype", "int2", "--oscar-sink-tokens", "16", "--oscar-recent-tokens", "32"],
}


def build_model(path: str) -> None:
    """Save a seeded random bf16 Qwen3 (4 layers, hidden 512, 16 heads / 4 kv heads, head_dim 128) to ``path``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=8192,
                      torch_dtype="bfloat16", tie_word_embeddings=False, initializer_range=0.08)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def server_argv(model: str, port: int, extra: list[str]) -> list[str]:
    """argv of one smoke server: triton attention, no tokenizer, a small static memory fraction."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend", "none",
            "--skip-tokenizer-init", "--mem-fraction-static", "0.08", "--cuda-graph-max-bs", "4", *extra]


def agreement(tokens: list[list[int]], base: list[list[int]]) -> float:
    """Fraction of positions where two lists of greedy continuations agree."""
    return sum(a == b for x, y in zip(tokens, base) for a, b in zip(x, y)) / sum(len(x) for x in base)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.e2e.smoke", description=__doc__.split("\n")[0])
    ap.add_argument("--tp2", action="store_true", help="also an int2 server with --tp 2 (two GPUs)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--model", default="/tmp/smoke-qwen3", help="where the tiny model is written")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    build_model(args.model)
    extras = dict(SERVERS)
    if args.tp2:
        extras["int2_tp2"] = ["--kv-cache-dtype", "int2", "--tp", "2"]
    servers = {}
    for i, (name, extra) in enumerate(extras.items()):
        argv_ = server_argv(args.model, BASE_PORT + i, extra)
        servers[name] = ServerProcess(argv_, port=BASE_PORT + i, log_path=os.path.join(args.out, f"smoke_{name}.log"),
                                      log_header="$ " + " ".join(argv_))
    results: dict[str, object] = {}
    try:
        for srv in servers.values():
            srv.start()
        prompts = [[(7 * i + 3 * j) % 2000 + 5 for j in range(400)] for i in range(3)]
        for name, srv in servers.items():
            if srv.poll_health(300, interval=2.0) != "healthy":
                results[name] = "NOT HEALTHY"
                continue
            try:
                results[name] = [parse_generation(http_json(srv.base_url + "/generate",
                                                            generate_payload(p, 24, top_logprobs=0),
                                                            timeout=120))["tokens"] for p in prompts]
            except RuntimeError as exc:
                results[name] = f"REQUEST FAILED: {exc}"
    finally:
        for srv in servers.values():
            srv.stop(grace=30.0)
    base = results.get("bf16")
    ok = True
    for name, toks in results.items():
        if isinstance(toks, str) or isinstance(base, str):
            print(f"{name:>20}: {toks if isinstance(toks, str) else 'bf16 failed'}")
            ok = False
            continue
        print(f"{name:>20}: token agreement with bf16 {agreement(toks, base):.3f}; first: {toks[0][:12]}")
    with open(os.path.join(args.out, "smoke.json"), "w") as f:
        json.dump(results, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
