"""Stand-in for ``python -m sglang.launch_server`` in launcher tests.

Accepts the SGLang argv (unknown flags ignored), writes it as JSON to the file named by
FAKE_SGLANG_ARGV_FILE (if set), then behaves according to FAKE_SGLANG_MODE:
  ok (default)   serve /health, /v1/models and chat completions until terminated;
                 GPQA answers: the right letter with --kv-cache-dtype auto, 'A' with int2
  crash          print an error and exit with status 3
  never-healthy  serve /health with 503 forever
  exit:N         exit with status N at once (non-zero node ranks)
  reject-one     like ok, but always rejects GPQA question 5 with HTTP 400
  orphan-helper  start a helper process in the server's process group, then exit 0
                 (the helper writes its pid to FAKE_SGLANG_HELPER_PID_FILE and sleeps)
"""

import argparse
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from evals_fakes import FakeOpenAIServer, completion, error_body, right_letter  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--kv-cache-dtype", default="auto")
    args, _ = p.parse_known_args()
    argv_file = os.environ.get("FAKE_SGLANG_ARGV_FILE")
    if argv_file:
        with open(argv_file, "w") as fh:
            json.dump(sys.argv[1:], fh)
    mode = os.environ.get("FAKE_SGLANG_MODE", "ok")
    print(f"fake sglang starting on {args.host}:{args.port} mode {mode}", flush=True)
    if mode == "crash":
        print("RuntimeError: CUDA out of memory (fake)", flush=True)
        return 3
    if mode.startswith("exit:"):
        return int(mode.split(":", 1)[1])
    if mode == "orphan-helper":
        import subprocess

        subprocess.Popen([sys.executable, "-c",
                          "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); "
                          "time.sleep(120)", os.environ["FAKE_SGLANG_HELPER_PID_FILE"]])
        return 0

    def respond(body):
        prompt = body["messages"][-1]["content"]
        if mode == "reject-one" and "Question number 5:" in prompt:
            return (400, error_body("this prompt is always rejected (fake)"))
        letter = right_letter(prompt) if args.kv_cache_dtype == "auto" else "A"
        return completion(f"<think>ok</think>Answer: {letter}", model=args.model_path)

    server = FakeOpenAIServer(respond, model=args.model_path, host=args.host, port=args.port,
                              health_status=503 if mode == "never-healthy" else 200)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
    server.start()
    print("fake sglang ready", flush=True)
    try:
        while True:
            time.sleep(0.2)
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
