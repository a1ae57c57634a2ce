"""Check i: bad input (a rotation of another model, a missing rotation, a bad group size,
unsupported flags; a Gemma-4 rotation with one head_dim for every layer, a centred GPT-OSS
rotation, a Qwen3-Next rotation for its linear-attention layers) makes the launch exit non-zero
before loading weights, naming the problem."""

from __future__ import annotations

import time

from .client import last_error
from .config import FAIL, PASS, WEIGHT_LOAD_MARK
from .results import CheckResult
from .run import Run


BAD_INPUT_EXPECT: dict[str, list[list[str]]] = {
    # every inner list: at least one of its words must appear in the error message (case-insensitive)
    "bad-rotation-other-model": [["rotation"], ["layer", "head", "geometry", "shape", "another model"]],
    "bad-rotation-missing": [["no_such_rotation"], ["not exist", "no such file", "not found", "missing"]],
    "bad-group-size": [["group"], ["48"]],
    "bad-flag-flashinfer": [["flashinfer"], ["attention-backend", "attention_backend"]],
    "bad-flag-dp-attention": [["dp-attention", "dp_attention"]],
    # a Gemma-4 file giving its full layers the sliding layers' head_dim: the first full layer is named
    "bad-rotation-one-head-dim": [["rotation"], ["head_dim"], ["(full)"]],
    # GPT-OSS: a centred file (k_mean / v_mean) for a model with attention-sink logits
    "bad-rotation-centred": [["rotation"], ["sink"], ["centre", "center"]],
    # Qwen3-Next: rotations for its Gated-DeltaNet layers too (they have no KV cache)
    "bad-rotation-linear-layers": [["rotation"], ["linear-attention"]],
}


def check_i(run: Run) -> CheckResult:
    """Every bad launch of :data:`BAD_INPUT_EXPECT`: non-zero exit within ``--i-max-seconds``, before
    weight loading, with an error line holding one word of each expected group. A family's own
    cases (``<family>-bad-...``, :attr:`~.servers.ServerSpec.case`) count like the generic ones."""
    rows, ok = [], True
    for name, srv in list(run.servers.items()):
        expect = BAD_INPUT_EXPECT.get(getattr(srv.spec, "case", "") or name)
        if expect is None:
            continue
        deadline = srv.t_start + run.args.fail_timeout
        while srv.alive() and time.time() < deadline and WEIGHT_LOAD_MARK not in srv.log_text():
            time.sleep(0.5)  # a launch that reaches weight loading has failed this case already
        rc = srv.proc.poll() if srv.proc is not None else None  # None: never started (busy port)
        if rc is not None:
            rc = srv.wait_exit(run.args.fail_timeout + 60)  # returns at once; waits for the exit time stamp
        else:
            srv.stop()
        log = srv.log_text()
        msg = last_error(log)
        low = msg.lower()
        named = all(any(w.lower() in low for w in group) for group in expect)
        loaded = WEIGHT_LOAD_MARK in log
        secs = None if rc is None or srv.t_exit is None else srv.t_exit - srv.t_start
        good = rc not in (None, 0) and not loaded and named and secs is not None and secs <= run.args.i_max_seconds
        ok &= good
        rows.append({"case": name, "flags": srv.spec.args, "exit_code": rc, "seconds": secs,
                     "weights_loaded": loaded, "names_problem": named, "message": msg, "pass": good})
    fails = [r["case"] for r in rows if not r["pass"]]
    secs = [r["seconds"] for r in rows if r["seconds"] is not None]
    measured = (f"{len(rows) - len(fails)}/{len(rows)} refused before loading weights, naming the problem"
                + (f" ({min(secs):.0f}-{max(secs):.0f} s)" if secs else "")
                + (f"; failed: {', '.join(fails)}" if fails else ""))
    return CheckResult("i", PASS if ok else FAIL, measured, {"cases": rows})
