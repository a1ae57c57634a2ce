#!/usr/bin/env python
"""Train a small Qwen3-architecture language model on text that is available offline (issue 7).

The model is the real ``transformers`` Qwen3 architecture (``Qwen3Config`` / ``Qwen3ForCausalLM``:
GQA, QK-norm, RoPE; ``--moe`` for ``Qwen3MoeConfig``; ``--arch llama`` for a ``LlamaConfig`` of the
same sizes, i.e. without QK-norm, as an ablation), small enough to train in minutes, so that
the KV-cache accuracy table (``sglang-oscar quality``, docs/quality.md) runs on a *trained* model
and not on random weights.

Data: the ``.py/.md/.rst/.txt`` files of the CPython standard library and of the installed
packages (``sysconfig.get_paths()`` stdlib/purelib/platlib and ``site.getsitepackages()``), plus
any ``--text-dir``. Files are split **by file** into train / held-out with a deterministic hash of
their key (the last two path components, so vendored copies such as ``pip/_vendor/rich/x.py`` and
``rich/x.py`` land in the same split); identical contents are kept once. Files are read in a
seeded hash order until ``--max-mb`` of text is collected.

Outputs in ``--out``:

* the Hugging Face checkpoint (``config.json``, ``model.safetensors``) and the tokenizer: a
  byte-level BPE trained with ``tokenizers`` on the train split, saved as a
  ``PreTrainedTokenizerFast`` (``<|endoftext|>`` separates documents);
* ``calib.jsonl``: calibration documents (a seeded sample of the **train** split);
* ``heldout.jsonl``: evaluation documents (a seeded sample of the **held-out** split, never
  trained on); records are ``{"text", "key", "split"}``, one per file. ``sglang-oscar quality``
  and ``python -m tests.e2e.served_quality`` take at most ``--max-seq-per-file`` sequences from each file;
* ``train_log.jsonl`` (one line per logged step / evaluation) and ``train_summary.json``
  (``corpus.heldout_eval_files``: how many held-out files the held-out loss windows touch).

The trainer's own held-out loss is the mean over ``--eval-seqs`` evenly spaced ``--seq-len``
windows of the EOS-joined stream of (up to 2000) held-out files, so long files weigh more there.

Training: AdamW, linear warmup then cosine decay to 10 %, bf16 autocast on CUDA (fp32 on CPU),
random ``--seq-len`` windows of the token stream, seeded. The schedule runs over the wall-clock
budget ``--minutes`` (progress = elapsed / budget) unless ``--max-steps`` fixes it in steps. The
budget covers the training loop only (data collection, tokenizer training and tokenization come
before it).

    python scripts/train_small_lm.py --out /tmp/oscar_quality/qwen3-small --minutes 6
    python scripts/train_small_lm.py --out /tmp/tiny --device cpu --minutes 0.05 --layers 2 --hidden 64 \\
        --heads 4 --kv-heads 2 --head-dim 32 --intermediate 128 --vocab 512 --seq-len 128 --batch 4 \\
        --no-system-text --text-dir SOME_DIR --heldout-frac 0.2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import site
import sys
import sysconfig
import time

TEXT_EXTS = (".py", ".md", ".rst", ".txt")
SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", "node_modules"}
EOS = "<|endoftext|>"
PAD = "<|pad|>"


# ----------------------------------------------------------------------------- corpus
def default_text_dirs() -> list[str]:
    """The CPython standard library and the installed packages' directories that exist."""
    paths = sysconfig.get_paths()
    dirs = [paths.get("stdlib"), paths.get("purelib"), paths.get("platlib")]
    try:
        dirs += list(site.getsitepackages())
    except AttributeError:  # virtualenvs without site.getsitepackages
        pass
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    dirs.append(user)
    real = {}
    for d in dirs:
        if d and os.path.isdir(d):
            real.setdefault(os.path.realpath(d), d)
    return list(real.values())


def file_key(path: str) -> str:
    """Split key of a file: its last two path components (``pkg/module.py``)."""
    parts = os.path.normpath(path).split(os.sep)
    return "/".join(parts[-2:])


def _h(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")


def split_of(key: str, heldout_frac: float) -> str:
    """``"heldout"`` for a deterministic ``heldout_frac`` share of keys (sha256 of the key), else ``"train"``."""
    return "heldout" if (_h("split:" + key) % 1_000_000) < heldout_frac * 1_000_000 else "train"


def list_files(dirs: list[str], exclude: list[str] = (), max_file_bytes: int = 256 * 1024, min_file_bytes: int = 64
               ) -> list[tuple[str, int]]:
    """``(path, size)`` of the text files under ``dirs`` (each file once, nested roots walked once).

    Args:
        dirs: roots to walk (symlinked directories are not followed).
        exclude: directories to skip (e.g. the output directory).
        max_file_bytes, min_file_bytes: size limits of a file.
    """
    roots = [os.path.realpath(d) for d in dirs]
    skip = {os.path.realpath(e) for e in exclude}
    seen: set[str] = set()
    out = []
    for root in dict.fromkeys(roots):
        for dp, dns, fns in os.walk(root):
            real_dp = os.path.realpath(dp)
            dns[:] = sorted(d for d in dns if d not in SKIP_DIRS and not d.startswith(".")
                            and os.path.realpath(os.path.join(dp, d)) not in skip
                            and (os.path.realpath(os.path.join(dp, d)) not in roots
                                 or os.path.realpath(os.path.join(dp, d)) == real_dp))
            for fn in sorted(fns):
                if not fn.endswith(TEXT_EXTS):
                    continue
                p = os.path.join(dp, fn)
                rp = os.path.realpath(p)
                if rp in seen:
                    continue
                seen.add(rp)
                try:
                    size = os.path.getsize(p)
                except OSError:
                    continue
                if min_file_bytes <= size <= max_file_bytes:
                    out.append((p, size))
    return out


def read_text(path: str) -> str | None:
    """The file as UTF-8 text, or ``None`` if it is not plain text (undecodable, NUL bytes, or
    an average line longer than 200 characters: minified or data files)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if "\x00" in text:
        return None
    text = text.replace("\r\n", "\n").strip()
    lines = text.count("\n") + 1
    if not text or len(text) / lines > 200:
        return None
    return text


def collect_documents(dirs: list[str], *, max_bytes: int, heldout_frac: float, seed: int, exclude: list[str] = (),
                      max_file_bytes: int = 256 * 1024) -> list[dict]:
    """Documents ``{"text", "key", "split", "path"}`` from the text files under ``dirs``.

    Files are visited in a seeded hash order of their key and read until ``max_bytes`` of text
    are collected; identical contents are kept once. The split is :func:`split_of` of the key.

    Raises:
        SystemExit: no text, or an empty train or held-out split.
    """
    files = list_files(dirs, exclude, max_file_bytes)
    files.sort(key=lambda f: (_h(f"order:{seed}:{file_key(f[0])}"), f[0]))
    docs, hashes, total = [], set(), 0
    for path, _ in files:
        if total >= max_bytes:
            break
        text = read_text(path)
        if text is None:
            continue
        h = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if h in hashes:
            continue
        hashes.add(h)
        key = file_key(path)
        docs.append({"text": text, "key": key, "split": split_of(key, heldout_frac), "path": path})
        total += len(text.encode("utf-8"))
    n_train = sum(d["split"] == "train" for d in docs)
    if not docs or n_train == 0 or n_train == len(docs):
        raise SystemExit(f"train_small_lm: {len(docs)} documents ({n_train} train) under {dirs}: need text in both "
                         "splits (add --text-dir, raise --max-mb or --heldout-frac)")
    return docs


# ----------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (``tokenizers``) trained on ``texts``, as a ``PreTrainedTokenizerFast`` whose
    ``eos_token`` (also ``bos_token``) is ``<|endoftext|>`` and ``pad_token`` ``<|pad|>``; no special
    tokens are added when encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=EOS, eos_token=EOS, pad_token=PAD,
                                   model_max_length=1 << 30)


def encode_documents(tokenizer, texts: list[str], batch: int = 512, return_lengths: bool = False):
    """One ``uint16``/``int32`` numpy token stream: every document followed by the EOS token.

    With ``return_lengths``: ``(stream, lengths)``, the tokens of each document in the stream (EOS included)."""
    import numpy as np

    backend = tokenizer.backend_tokenizer
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    eos = tokenizer.eos_token_id
    dtype = np.uint16 if len(tokenizer) <= 65535 else np.int32
    chunks = []
    for i in range(0, len(texts), batch):
        for enc in encode(texts[i : i + batch], add_special_tokens=False):
            chunks.append(np.asarray(enc.ids + [eos], dtype=dtype))
    stream = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
    return (stream, [len(c) for c in chunks]) if return_lengths else stream


# ----------------------------------------------------------------------------- model
def build_config(args, tokenizer):
    """``Qwen3Config`` (``Qwen3MoeConfig`` with ``--moe``, ``LlamaConfig`` with ``--arch llama``) of the run.

    ``--moe`` with ``--arch llama`` is refused by :func:`parse_args`.
    """
    import transformers as tf

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    common = dict(vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  head_dim=args.head_dim, max_position_embeddings=args.max_positions,
                  rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                  tie_word_embeddings=args.tie_embeddings, bos_token_id=eos, eos_token_id=eos, pad_token_id=pad,
                  rms_norm_eps=1e-6, use_cache=True)
    if args.arch == "llama":
        # the same sizes without Qwen3's per-head RMSNorm on q and k (QK-norm): an ablation of whether
        # QK-norm is what leaves the K/V of these small models without outlier channels (docs/quality.md)
        return tf.LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if args.moe:
        return tf.Qwen3MoeConfig(**common, num_experts=args.experts, num_experts_per_tok=args.experts_per_tok,
                                 moe_intermediate_size=args.moe_intermediate, decoder_sparse_step=1,
                                 norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01)
    return tf.Qwen3Config(**common)


def _lr(step: int, progress: float, args) -> float:
    warm = min(1.0, (step + 1) / max(args.warmup_steps, 1))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return args.lr * warm * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cos)


def _batch(data, starts, seq_len, device):
    import torch

    idx = starts.unsqueeze(1) + torch.arange(seq_len, device=starts.device)
    return data[idx].to(device=device, dtype=torch.long, non_blocking=True)


def eval_starts(n_tokens: int, seq_len: int, n_seqs: int):
    """Start offsets (``torch.long``, on the CPU) of the ``n_seqs`` evenly spaced ``seq_len``-token
    windows of a held-out stream of ``n_tokens`` tokens that :func:`evaluate` scores (empty when the
    stream is not longer than ``seq_len``)."""
    import torch

    n = n_tokens - seq_len
    if n <= 0:
        return torch.zeros(0, dtype=torch.long)
    return torch.linspace(0, n - 1, steps=min(n_seqs, n)).long()


def window_files(starts, seq_len: int, doc_lengths: list[int]) -> int:
    """Distinct documents of an EOS-joined stream (document ``i`` is ``doc_lengths[i]`` tokens long)
    that the windows ``[s, s + seq_len)`` touch."""
    import bisect
    import itertools

    ends = list(itertools.accumulate(doc_lengths))  # document i covers [ends[i-1], ends[i])
    docs = set()
    for s in (int(x) for x in starts):
        first = bisect.bisect_right(ends, s)
        last = bisect.bisect_right(ends, s + seq_len - 1)
        docs.update(range(first, min(last, len(ends) - 1) + 1))
    return len(docs)


def evaluate(model, data, seq_len: int, n_seqs: int, batch: int, device, autocast) -> float:
    """Mean next-token loss over ``n_seqs`` evenly spaced windows of the held-out stream (:func:`eval_starts`)."""
    import torch

    starts = eval_starts(len(data), seq_len, n_seqs).to(data.device)
    if len(starts) == 0:
        return float("nan")
    tot, cnt = 0.0, 0
    model.eval()
    with torch.no_grad(), autocast():
        for i in range(0, len(starts), batch):
            x = _batch(data, starts[i : i + batch], seq_len, device)
            out = model(input_ids=x, labels=x, use_cache=False)
            tot += float(out.loss) * x.shape[0]
            cnt += x.shape[0]
    model.train()
    return tot / max(cnt, 1)


# ----------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    """Command-line arguments of the script (``--help`` lists them)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/small_lm",
                   help="checkpoint directory (created; default runs/small_lm, which .gitignore's /runs/ keeps out of git)")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget of the training loop (default 8)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps; the schedule runs over "
                                                                  "steps instead of time")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    # data
    p.add_argument("--text-dir", action="append", default=[], help="more text to train on (repeatable)")
    p.add_argument("--no-system-text", action="store_true", help="skip the stdlib and site-packages")
    p.add_argument("--max-mb", type=float, default=200.0, help="text to collect, MB (default 200)")
    p.add_argument("--max-file-kb", type=float, default=256.0, help="skip larger files (default 256 KB)")
    p.add_argument("--heldout-frac", type=float, default=0.05, help="share of files held out (default 0.05)")
    p.add_argument("--tokenizer-mb", type=float, default=16.0, help="train-split text the tokenizer is trained on")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--calib-mb", type=float, default=1.0, help="text written to calib.jsonl (train split)")
    p.add_argument("--heldout-mb", type=float, default=2.0, help="text written to heldout.jsonl (held-out split)")
    # model
    p.add_argument("--moe", action="store_true", help="Qwen3MoeConfig instead of Qwen3Config")
    p.add_argument("--arch", choices=("qwen3", "llama"), default="qwen3",
                   help="qwen3 (default; GQA, QK-norm, RoPE) or llama (the same sizes without QK-norm)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--experts-per-tok", type=int, default=2)
    p.add_argument("--moe-intermediate", type=int, default=512)
    p.add_argument("--max-positions", type=int, default=4096)
    p.add_argument("--rope-theta", type=float, default=1_000_000.0)
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=True)
    # optimisation
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=150)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-seqs", type=int, default=32)
    args = p.parse_args(argv)
    if args.moe and args.arch == "llama":
        p.error("--moe builds a Qwen3-MoE model and cannot be combined with --arch llama")
    return args


def main(argv=None) -> dict:
    """Run the training (module docstring); returns the summary written to ``train_summary.json``."""
    args = parse_args(argv)
    t_start = time.time()
    import numpy as np
    import torch

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(args.out, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    dirs = ([] if args.no_system_text else default_text_dirs()) + list(args.text_dir)
    docs = collect_documents(dirs, max_bytes=int(args.max_mb * 1e6), heldout_frac=args.heldout_frac, seed=args.seed,
                             exclude=[args.out], max_file_bytes=int(args.max_file_kb * 1024))
    train_docs = [d for d in docs if d["split"] == "train"]
    held_docs = [d for d in docs if d["split"] == "heldout"]
    n_bytes = {s: sum(len(d["text"].encode()) for d in ds) for s, ds in (("train", train_docs), ("heldout", held_docs))}
    log(f"corpus: {len(train_docs)} train files ({n_bytes['train'] / 1e6:.1f} MB), {len(held_docs)} held-out files "
        f"({n_bytes['heldout'] / 1e6:.1f} MB) from {len(dirs)} directories")

    rng = random.Random(args.seed)
    tok_texts, acc = [], 0
    for d in rng.sample(train_docs, len(train_docs)):
        if acc >= args.tokenizer_mb * 1e6:
            break
        tok_texts.append(d["text"])
        acc += len(d["text"])
    tokenizer = train_tokenizer(tok_texts, args.vocab)
    log(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens, trained on {acc / 1e6:.1f} MB")

    train_ids = encode_documents(tokenizer, [d["text"] for d in train_docs])
    held_ids, held_lengths = encode_documents(tokenizer, [d["text"] for d in held_docs[:2000]], return_lengths=True)
    held_eval_files = window_files(eval_starts(len(held_ids), args.seq_len, args.eval_seqs), args.seq_len, held_lengths)
    log(f"tokens: {len(train_ids)} train, {len(held_ids)} held-out "
        f"({n_bytes['train'] / max(len(train_ids), 1):.2f} bytes/token); the {args.eval_seqs} held-out loss windows "
        f"touch {held_eval_files} of {len(held_lengths)} held-out files")
    if len(train_ids) <= args.seq_len + 1:
        raise SystemExit(f"train_small_lm: only {len(train_ids)} training tokens for --seq-len {args.seq_len}")

    config = build_config(args, tokenizer)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {type(model).__name__}, {n_params / 1e6:.1f}M parameters, {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads}/{args.kv_heads} heads x {args.head_dim}")
    fwd = torch.compile(model) if args.compile else model

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "norm" not in n)]
    opt_kwargs = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            **opt_kwargs)
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)

    dtype = torch.int32
    train_t = torch.from_numpy(train_ids.astype(np.int32)).to(device=device, dtype=dtype)
    held_t = torch.from_numpy(held_ids.astype(np.int32)).to(device=device, dtype=dtype)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    budget = args.minutes * 60.0
    log_path = os.path.join(args.out, "train_log.jsonl")
    log_f = open(log_path, "w")
    step, tokens, last_loss = 0, 0, float("nan")
    t0 = time.time()
    while True:
        elapsed = time.time() - t0
        if args.max_steps is not None:
            if step >= args.max_steps:
                break
            progress = step / args.max_steps
        else:
            if elapsed >= budget and step > 0:
                break
            progress = elapsed / budget if budget > 0 else 1.0
        lr = _lr(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train_t) - args.seq_len, (args.batch,), generator=gen).to(device)
        x = _batch(train_t, starts, args.seq_len, device)
        with autocast():
            out = fwd(input_ids=x, labels=x, use_cache=False)
        loss = out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens += x.numel()
        if step % args.log_every == 0 or step == 1:
            last_loss = float(loss.detach())
            el = time.time() - t0
            rec = {"step": step, "loss": last_loss, "lr": lr, "grad_norm": float(gnorm), "tokens": tokens,
                   "elapsed_s": el, "tokens_per_s": tokens / max(el, 1e-9)}
            log_f.write(json.dumps(rec) + "\n")
            log_f.flush()
            log(f"step {step:6d}  loss {last_loss:.4f}  lr {lr:.2e}  |g| {float(gnorm):.2f}  "
                f"{rec['tokens_per_s'] / 1e3:.0f}K tok/s")
        if args.eval_every and step % args.eval_every == 0:
            hl = evaluate(model, held_t, args.seq_len, args.eval_seqs, args.batch, device, autocast)
            log_f.write(json.dumps({"step": step, "heldout_loss": hl, "heldout_ppl": math.exp(hl)}) + "\n")
            log(f"step {step:6d}  held-out loss {hl:.4f}  ppl {math.exp(hl):.2f}")
    train_s = time.time() - t0
    final_train = float(loss.detach())
    held_loss = evaluate(model, held_t, args.seq_len, args.eval_seqs, args.batch, device, autocast)
    log_f.write(json.dumps({"step": step, "heldout_loss": held_loss, "heldout_ppl": math.exp(held_loss), "final": True}) + "\n")
    log_f.close()
    log(f"done: {step} steps, {tokens / 1e6:.1f}M tokens in {train_s:.0f}s; train loss {final_train:.4f}, "
        f"held-out loss {held_loss:.4f} (ppl {math.exp(held_loss):.2f})")

    model.eval()
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    _write_jsonl(os.path.join(args.out, "calib.jsonl"), _sample(train_docs, args.calib_mb, args.seed + 1))
    _write_jsonl(os.path.join(args.out, "heldout.jsonl"), _sample(held_docs, args.heldout_mb, args.seed + 2))
    summary = {
        "out": args.out,
        "args": vars(args),
        "model_type": config.model_type,
        "parameters": n_params,
        "steps": step,
        "tokens_seen": tokens,
        "train_seconds": train_s,
        "total_seconds": time.time() - t_start,
        "final_train_loss": final_train,
        "heldout_loss": held_loss,
        "heldout_ppl": math.exp(held_loss),
        "corpus": {"dirs": dirs, "train_files": len(train_docs), "heldout_files": len(held_docs),
                   "train_bytes": n_bytes["train"], "heldout_bytes": n_bytes["heldout"],
                   "train_tokens": int(len(train_ids)), "heldout_tokens": int(len(held_ids)),
                   "heldout_eval_files": held_eval_files,
                   "heldout_keys_sha256": hashlib.sha256("\n".join(sorted(d["key"] for d in held_docs)).encode()).hexdigest()},
        "vocab_size": len(tokenizer),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if on_gpu else None,
    }
    with open(os.path.join(args.out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=2, sort_keys=True, default=str)
    log(f"saved checkpoint, tokenizer, calib.jsonl and heldout.jsonl to {args.out}")
    return summary


def _sample(docs: list[dict], mb: float, seed: int) -> list[dict]:
    """A seeded sample of ``docs`` holding about ``mb`` MB of text (at least one document)."""
    out, acc = [], 0
    for d in random.Random(seed).sample(docs, len(docs)):
        if out and acc >= mb * 1e6:
            break
        out.append(d)
        acc += len(d["text"].encode())
    return out


def _write_jsonl(path: str, docs: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d["text"], "key": d["key"], "split": d["split"]}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
    sys.exit(0)
