"""The MLA device check's model under the model-level oracle, on CPU (docs/serving.md, MLA section).

Builds the check's tiny seeded DeepSeek-V3 (tests/e2e/mla_models.py; sharpened unless
``--unsharpened``, the model of the first device runs) and reports, as mean |d prompt log-prob| over ``--lens`` prompts
(mla_check's seeded prompts): the INT2 effect (oracle with mla_check's windows and G 128 vs the
unquantized fp32 model), the oracle's own BF16-vs-fp32 move, and the plain model's BF16-vs-fp32
difference. With ``--served mla_check.json`` (a device run's answers) also the int2 server (or
``--server``) against the fp32 and BF16-model oracles.

Run from the repository root (CPU, well under a minute):
  PYTHONPATH=python:. python scripts/mla_oracle_effect.py [--unsharpened] [--served DIR/mla_check.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile


def main(argv=None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from sglang_oscar.config import OscarConfig
    from sglang_oscar.rotation.geometry import ModelGeometry
    from sglang_oscar.rotation.latent import LatentRotationSet
    from tests.e2e import mla_models, mla_oracle, mla_servers
    from tests.e2e.checkpoints import random_prompt

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", default="400,900", help="prompt lengths (mla_check's prompts, in order)")
    ap.add_argument("--unsharpened", action="store_true", help="the model without checkpoints.sharpen")
    ap.add_argument("--served", default=None, help="mla_check.json of a device run")
    ap.add_argument("--server", default="int2", help="which server's answers to compare (default int2)")
    a = ap.parse_args(argv)
    path = tempfile.mkdtemp(prefix="mla-oracle-")
    if a.unsharpened:
        mla_models.sharpen = lambda model, *args, **kw: {}  # the model as the first device runs built it
    mla_models.build_model(path)
    rot = LatentRotationSet.data_free(ModelGeometry.from_hf_config(path)).r
    config = OscarConfig(sink_tokens=int(mla_servers.WINDOWS[1]), recent_tokens=int(mla_servers.WINDOWS[3]))
    prompts = [random_prompt(n, seed, mla_models.VOCAB) for seed, n in enumerate(int(x) for x in a.lens.split(","))]

    def logprobs(dtype, patched):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        if patched:
            mla_oracle.install(model, config, rot, hp_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
        return [mla_oracle.prompt_logprobs(model, p) for p in prompts]

    def mean(x, y):
        return float(torch.cat([(u - v).abs() for u, v in zip(x, y)]).mean())

    hf32, hf16 = logprobs(torch.float32, False), logprobs(torch.bfloat16, False)
    o32, o16 = logprobs(torch.float32, True), logprobs(torch.bfloat16, True)
    out = {"int2_effect": mean(o32, hf32), "oracle_bf16_vs_fp32": mean(o16, o32), "model_bf16_vs_fp32": mean(hf16, hf32)}
    if a.served:
        with open(a.served) as f:
            served = json.load(f)["servers"][a.server]
        got = [torch.tensor(g["input_logprobs"]) for g in served[: len(prompts)]]
        out.update(served_vs_oracle_fp32=mean(got, o32), served_vs_oracle_bf16=mean(got, o16),
                   served_vs_model_fp32=mean(got, hf32))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
