"""End-to-end device harness of the served INT2 KV cache.

Runs upstream SGLang 0.5.16 servers (``python -m sglang.launch_server``, started through
:mod:`sglang_oscar.serving_launcher`) with the sglang-oscar plugin on tiny seeded checkpoints
built here, and checks the served INT2 path against BF16 serving, against itself (radix reuse,
chunked prefill, CUDA graphs, tensor parallelism) and against the PyTorch reference oracle
(``sglang_oscar.reference``) computed in this process.

    bash device/e2e.sh [--only a,b,c] [--tp2] [more options]      # on the GPU machine
    python -m tests.e2e --only b,d,g [--tp2] [--int2-args=...]     # the same, environment ready

Checks (one table row each, one module each; ``docs/serving.md`` "Device checks" explains them):

a. plugin installed, ``--kv-cache-dtype auto``: greedy output identical to a plugin-disabled server
b. int2, BF16 windows covering the whole sequence, identity rotation: greedy tokens identical to BF16
   (Qwen3, Qwen3-MoE, Llama)
c. int2 quantizing (sink 16 / recent 32): served log-probabilities vs the oracle, prefill
   (``input_token_logprobs``, extend windows) and decode (``output_token_logprobs`` of the served
   greedy tokens, teacher-forced: extend windows for prompt positions, decode windows after),
   per-layer and per-head fitted rotations; with ``--c-fp32`` the same comparison on
   ``--dtype float32`` servers against the oracle on the fp32 model (HP tier fp32) is the
   criterion and the BF16 one is reported
d. radix reuse, chunked prefill 64, CUDA graph off: identical tokens and log-probabilities
e. 64 concurrent mixed-length requests with SGLang's strict memory-leak checks on
f. ``max_total_num_tokens`` int2 vs BF16 at the same ``--mem-fraction-static`` (servers run alone)
g. decode tok/s at 32K context, batch 1, int2 vs BF16 (servers run alone; f and g share
   ``check_fg``)
h. (``--tp2``) ``--tp 2`` vs ``--tp 1`` with a per-head rotation: identical greedy output, per family
   (each but the b-only ``moe``/``llama``; ``max_total_num_tokens`` of both reported)
i. bad input (mismatched / missing rotation, bad group size, unsupported flags): the launch exits
   non-zero before loading weights and names the problem

``--families`` (default ``qwen3,moe,llama``) picks the model families: b runs on each, a/c/d/e/i
(and h) on each but the b-only ``moe``/``llama``; ``gemma3``, ``gemma4`` and ``gpt_oss`` (attention sinks) are
sliding-window models (window 64; c adds a prompt 4x the window, f a sizing pair per family compared
pool by pool), ``qwen3_next`` a linear-attention hybrid (f: its KV pool, the mamba pool reported) and
``qwen3_5`` the same hybrid in Qwen3.5's multimodal wrapper (SGLang's ``qwen3_5.py`` model code, a processor
in its folder).

Independent servers start concurrently with a capped KV pool (``--max-total-tokens``) and a
modest ``--mem-fraction-static``; the sizing/throughput pair (f, g) and the TP=2 servers (h, one
per family) run alone afterwards. Writes ``$OUT/e2e.json``, ``$OUT/e2e.md`` and ``$OUT/logs/*.log``; prints the
table last; exits 1 if a selected check does not pass.

Greedy comparisons between two servers are tie-sensitive on random-weight models, so prompts are
screened first: for each prompt length several seeded candidates are generated greedily in this
process (HF BF16 for the BF16-path checks; the oracle for the INT2-path checks) and the one with
the largest minimum top-1/top-2 margin is used; the margins are reported.

Modules: ``config`` (check letters, sizes, command line), ``families`` (model configs),
``checkpoints`` (tiny seeded models, rotation files), ``oracle`` (reference log-probabilities, prompt screening), ``client`` (HTTP
requests, answer parsing, log parsing, comparisons), ``servers`` (server specs and processes),
``fp32_shim`` (the ``--dtype float32`` servers' SGLang plugin), ``results`` (table, JSON),
``run`` (run state, setup, references), ``check_a`` ... ``check_i``, ``__main__`` (the run).
This file imports nothing: the fp32 servers import ``tests.e2e.fp32_shim`` at startup.
"""
