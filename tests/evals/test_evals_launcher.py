"""Server command composition, SGLang parser acceptance, and real launches of a stand-in
server script."""

from __future__ import annotations

import glob
import json
import os
import shlex
import socket
import sys
import textwrap
import time
from pathlib import Path

import pytest

from _support.processes import pid_alive
from _support.server_args import oscar_server_parser
from sglang_oscar.cli.main import main
from sglang_oscar.evals import launcher
from sglang_oscar.evals.recipe import load_recipe

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
FAKE_SGLANG = str(HERE / "evals_fake_sglang.py")

RECIPE = """
[model]
hf_id = "Qwen/Qwen3-8B"
family = "qwen3"
served = true
json_model_override_args = { max_position_embeddings = 131072, rope_scaling = { rope_type = "yarn", factor = 4.0 } }

[rotation]
method = "oscar"
path = "rot.safetensors"

[quant]
group_size = 128
k_clip_ratio = 0.96
v_clip_ratio = 0.92
sink_tokens = 128
recent_tokens = 2048
quantizer = "lloyd-max"
scale_dtype = "float16"
fold_rotations = true

[serve]
tp = 2
port = {port}
mem_fraction_static = 0.8
max_running_requests = 32
context_length = 131072
extra_args = ["--trust-remote-code", "--cuda-graph-max-bs", "32"]
env = { SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN = "1", FAKE_SGLANG_MODE = "ok" }

[eval]
tasks = ["gpqa"]
seeds = [0, 1]
max_tokens = 2048
threads = 4
"""

UNSERVED = """
[model]
hf_id = "moonshotai/Kimi-K3"
family = "kimi_k3"
served = false

[rotation]
method = "hadamard"

[serve]
tp = 8
extra_args = ["--trust-remote-code"]
"""

HADAMARD_NO_PATH = """
[model]
hf_id = "MiniMaxAI/MiniMax-M3"
family = "minimax_m3"
served = true

[rotation]
method = "hadamard"

[serve]
tp = 8
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_recipe(tmp_path: Path, text: str = RECIPE, port: int = 30000, rotation: bool = True,
                name: str = "qwen3-8b") -> Path:
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    p = d / "recipe.toml"
    p.write_text(textwrap.dedent(text).replace("{port}", str(port)))
    if rotation:
        (d / "rot.safetensors").write_bytes(b"fake")
    return p


# ----------------------------------------------------------------------------- argv


def test_int2_argv_exact(tmp_path):
    p = make_recipe(tmp_path)
    cmd = launcher.build_server_command(load_recipe(p), "int2")
    rot = str((p.parent / "rot.safetensors").resolve())
    assert cmd.argv == [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", "Qwen/Qwen3-8B", "--tp-size", "2",
        "--host", "127.0.0.1", "--port", "30000",
        "--kv-cache-dtype", "int2", "--kv-cache-quant-group-size", "128",
        "--oscar-rotation", rot,
        "--oscar-k-clip-ratio", "0.96", "--oscar-v-clip-ratio", "0.92",
        "--oscar-sink-tokens", "128", "--oscar-recent-tokens", "2048",
        "--oscar-quantizer", "lloyd-max", "--oscar-scale-dtype", "float16", "--oscar-fold-rotations", "on",
        "--attention-backend", "triton",
        "--context-length", "131072", "--mem-fraction-static", "0.8",
        "--max-running-requests", "32",
        "--json-model-override-args",
        '{"max_position_embeddings":131072,"rope_scaling":{"factor":4.0,"rope_type":"yarn"}}',
        "--trust-remote-code", "--cuda-graph-max-bs", "32",
    ]
    assert cmd.env == {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1", "FAKE_SGLANG_MODE": "ok"}
    assert cmd.server_args[:2] == ["--model-path", "Qwen/Qwen3-8B"]
    assert cmd.base_url == "http://127.0.0.1:30000"


@pytest.mark.parametrize("value, flag", [('"sliding"', "sliding"), ('"5, 0"', "0,5"), ("[11, 5]", "5,11"),
                                         ('"none"', None)])
def test_skip_layers_key_becomes_the_flag(tmp_path, value, flag):
    text = RECIPE.replace("fold_rotations = true", f"fold_rotations = true\nskip_layers = {value}")
    r = load_recipe(make_recipe(tmp_path, text))
    argv = launcher.build_server_command(r, "int2").argv
    if flag is None:
        assert "--oscar-skip-layers" not in argv
    else:
        assert argv[argv.index("--oscar-skip-layers") + 1] == flag
        assert argv.index("--oscar-skip-layers") == argv.index("--oscar-fold-rotations") + 2
    assert "--oscar-skip-layers" not in launcher.build_server_command(r, "bf16").argv


def test_bf16_arm_is_the_same_launch_without_int2_flags(tmp_path):
    r = load_recipe(make_recipe(tmp_path))
    int2 = launcher.build_server_command(r, "int2").argv
    bf16 = launcher.build_server_command(r, "bf16").argv
    assert "--kv-cache-dtype" in bf16 and bf16[bf16.index("--kv-cache-dtype") + 1] == "auto"
    assert not any(a.startswith("--oscar-") or a == "--kv-cache-quant-group-size" for a in bf16)
    # everything else identical and in the same order
    strip = {"--kv-cache-quant-group-size", "--oscar-rotation", "--oscar-k-clip-ratio",
             "--oscar-v-clip-ratio", "--oscar-sink-tokens", "--oscar-recent-tokens",
             "--oscar-quantizer", "--oscar-scale-dtype", "--oscar-fold-rotations"}
    rest = []
    skip = False
    for a in int2:
        if skip:
            skip = False
            continue
        if a in strip:
            skip = True
            continue
        rest.append("auto" if a == "int2" else a)
    assert rest == bf16


def test_unset_optional_flags_are_omitted(tmp_path):
    p = make_recipe(tmp_path, HADAMARD_NO_PATH, rotation=False)
    argv = launcher.build_server_command(load_recipe(p), "int2").argv
    for flag in ("--oscar-rotation", "--kv-cache-quant-group-size", "--oscar-quantizer",
                 "--oscar-scale-dtype", "--oscar-fold-rotations", "--context-length", "--mem-fraction-static",
                 "--json-model-override-args", "--nnodes", "--dist-timeout"):
        assert flag not in argv
    assert argv[argv.index("--oscar-sink-tokens") + 1] == "64"
    assert argv[argv.index("--oscar-recent-tokens") + 1] == "256"
    assert all(a != "" for a in argv)


def test_served_false_refuses_int2_but_serves_bf16(tmp_path, capsys):
    p = make_recipe(tmp_path, UNSERVED, rotation=False, name="kimi-k3")
    r = load_recipe(p)
    with pytest.raises(ValueError) as ei:
        launcher.build_server_command(r, "int2")
    msg = str(ei.value)
    assert "moonshotai/Kimi-K3" in msg and "[model].served = false" in msg and "kimi_k3" in msg
    assert "--kv bf16 (eval-recipe: --arms bf16)" in msg
    assert launcher.build_server_command(r, "bf16").argv[-1] == "--trust-remote-code"
    assert main(["serve", "--recipe", str(p), "--dry-run"]) == 2
    assert "has not passed its H200 end-to-end checks" in capsys.readouterr().err
    assert main(["serve", "--recipe", str(p), "--kv", "bf16", "--dry-run"]) == 0


def test_extra_args_may_not_repeat_recipe_flags(tmp_path):
    for bad, pattern in [
        ('"--port", "1"', r"--port, which comes from \[serve\].port"),
        ('"--host=0.0.0.0"', r"--host"),
        ('"--tp-size", "4"', r"\[serve\].tp"),
        ('"--mem-fraction", "0.5"', r"abbreviation of --mem-fraction-static"),
        ('"--attention-back", "fa3"', r"abbreviation of --attention-backend"),
        ('"--dist-time", "60"', r"abbreviation of --dist-timeout"),
        ('"--oscar-k-clip-ratio", "0.5"', r"OSCAR flags come from"),
        ('"--nnodes", "2"', r"serve --nnodes"),
        ('"--trust-remote-code", "--trust-remote-code"', r"repeats --trust-remote-code"),
    ]:
        text = HADAMARD_NO_PATH + f"extra_args = [{bad}]\n"
        r = load_recipe(make_recipe(tmp_path, text, rotation=False))
        with pytest.raises(ValueError, match=pattern):
            launcher.build_server_command(r, "bf16")


def test_attention_backend_default_yields_to_extra_args(tmp_path):
    text = HADAMARD_NO_PATH + 'extra_args = ["--attention-backend", "fa3"]\n'
    argv = launcher.build_server_command(load_recipe(make_recipe(tmp_path, text, rotation=False)), "bf16").argv
    assert argv.count("--attention-backend") == 1
    assert argv[argv.index("--attention-backend") + 1] == "fa3"


def test_multi_node_flags_added_once_with_dist_timeout(tmp_path):
    r = load_recipe(make_recipe(tmp_path))
    argv = launcher.build_server_command(
        r, "int2", nnodes=2, node_rank=1, dist_init_addr="10.1.2.3:5000"
    ).argv
    for flag, value in (("--nnodes", "2"), ("--node-rank", "1"),
                        ("--dist-init-addr", "10.1.2.3:5000"), ("--dist-timeout", "3600")):
        assert argv.count(flag) == 1
        assert argv[argv.index(flag) + 1] == value
    assert argv.count("--host") == 1
    # user extra_args appended after the multi-node flags cannot override them (refused above);
    # a user --dist-timeout replaces the default
    text = RECIPE.replace('"--trust-remote-code",', '"--trust-remote-code", "--dist-timeout", "7200",')
    r2 = load_recipe(make_recipe(tmp_path, text, name="other"))
    argv2 = launcher.build_server_command(r2, "int2", nnodes=2, node_rank=0,
                                          dist_init_addr="10.1.2.3:5000").argv
    assert argv2.count("--dist-timeout") == 1 and argv2[argv2.index("--dist-timeout") + 1] == "7200"
    # single-node: no multi-node flags at all
    assert "--nnodes" not in launcher.build_server_command(r, "int2").argv


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(nnodes=2, node_rank=1), "needs --node-rank and --dist-init-addr"),
        (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"), r"must be in \[0, 2\)"),
        (dict(node_rank=1, dist_init_addr="h:1"), "need --nnodes > 1"),
        (dict(dist_init_addr=""), "need --nnodes > 1"),  # an unset shell variable
        (dict(nnodes=2, node_rank=1, dist_init_addr=""), r"must be HOST:PORT .* got ''"),
        (dict(nnodes=2, node_rank=1, dist_init_addr="garbage"), r"must be HOST:PORT .* got 'garbage'"),
        (dict(nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:99999"), r"must be HOST:PORT"),
    ],
)
def test_multi_node_validation(tmp_path, kw, pattern):
    r = load_recipe(make_recipe(tmp_path))
    with pytest.raises(ValueError, match=pattern):
        launcher.build_server_command(r, "int2", **kw)


def test_missing_rotation_file_fails_for_real_launch_warns_in_dry_run(tmp_path, capsys):
    p = make_recipe(tmp_path, rotation=False)
    with pytest.raises(FileNotFoundError, match="rot.safetensors does not exist"):
        launcher.build_server_command(load_recipe(p), "int2")
    assert main(["serve", "--recipe", str(p)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", "--recipe", str(p), "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "# warning:" in out.err and "--oscar-rotation" in out.out
    # oscar without any path: refused (a missing rotation at 2 bits is collapse)
    text = RECIPE.replace('path = "rot.safetensors"\n', "")
    with pytest.raises(ValueError, match="needs \\[rotation\\].path"):
        launcher.build_server_command(load_recipe(make_recipe(tmp_path, text, name="nopath")), "int2")


def test_dry_run_prints_shell_quoted_command_with_env(tmp_path, capsys):
    p = make_recipe(tmp_path)
    assert main(["serve", "--recipe", str(p), "--dry-run", "--port", "31111"]) == 0
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    words = shlex.split(line)
    assert words[0] == "env"
    assert words[1:3] == ["FAKE_SGLANG_MODE=ok", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1"]
    expected = launcher.build_server_command(load_recipe(p), "int2", port=31111).argv
    assert words[3:] == expected
    assert words[words.index("--port") + 1] == "31111"


# ----------------------------------------------------------------------------- SGLang parser


@pytest.fixture(scope="module")
def sglang_parser():
    return oscar_server_parser(allow_abbrev=False)  # full flag names only


def _repo_recipes() -> list[str]:
    return sorted(glob.glob(str(REPO / "recipes" / "*" / "recipe.toml")))


def _check_parses(parser, recipe_path: Path, capsys, extra: list[str] = ()) -> int:
    """serve --dry-run for every arm the recipe allows; SGLang's parser must accept it."""
    r = load_recipe(recipe_path)
    arms = ["bf16", "int2"] if r.model.served else ["bf16"]
    for kv in arms:
        assert main(["serve", "--recipe", str(recipe_path), "--kv", kv, "--dry-run", *extra]) == 0
        words = shlex.split(capsys.readouterr().out.strip())
        i = words.index("sglang.launch_server")
        assert words[i - 1] == "-m"
        ns = parser.parse_args(words[i + 1:])
        assert ns.model_path == r.model.hf_id
        assert ns.tp_size == r.serve.tp
        assert ns.kv_cache_dtype == ("int2" if kv == "int2" else "auto")
        if kv == "int2":
            assert ns.oscar_k_clip_ratio == r.quant.k_clip_ratio
            assert ns.oscar_recent_tokens == r.quant.recent_tokens
            assert ns.kv_cache_quant_group_size == r.quant.group_size
    return len(arms)


def test_sglang_parser_accepts_dry_run_commands_of_test_recipes(tmp_path, sglang_parser, capsys):
    p = make_recipe(tmp_path)
    assert _check_parses(sglang_parser, p, capsys) == 2
    ns_multi = _check_parses(
        sglang_parser, p, capsys,
        extra=["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:5000"],
    )
    assert ns_multi == 2
    assert _check_parses(sglang_parser, make_recipe(tmp_path, UNSERVED, rotation=False, name="k3"), capsys) == 1
    assert _check_parses(sglang_parser, make_recipe(tmp_path, HADAMARD_NO_PATH, rotation=False, name="m3"), capsys) == 2


def test_the_repo_has_its_nine_recipes():
    """Guards the parametrised test below against passing vacuously (no recipe found)."""
    names = {Path(p).parent.name for p in _repo_recipes()}
    assert len(names) >= 9, names
    assert {"Qwen3-8B", "Qwen3-32B", "GLM-5.2-FP8", "Kimi-K3", "MiniMax-M3"} <= names


@pytest.mark.parametrize("recipe_path", _repo_recipes())
def test_sglang_parser_accepts_every_repo_recipe(recipe_path, sglang_parser, capsys):
    assert _check_parses(sglang_parser, Path(recipe_path), capsys) >= 1


def test_sglang_parser_rejects_what_sglang_would_reject(sglang_parser):
    with pytest.raises(SystemExit):
        sglang_parser.parse_args(["--model-path", "m", "--kv-cache-dtype", "int3"])


def test_recipe_env_aliases_match_plugin_flags():
    from sglang_oscar.evals.recipe import FLAG_ENV_ALIASES
    from sglang_oscar.plugin import flags

    plugin_envs = {f.env for f in flags.FLAGS if f.env} | {flags.V_ROTATION_ENV}
    assert set(FLAG_ENV_ALIASES) == plugin_envs
    # and the launcher only emits --oscar-* flags that the plugin defines
    plugin_opts = {f.option for f in flags.FLAGS}
    emitted = {"--oscar-rotation", "--oscar-k-clip-ratio", "--oscar-v-clip-ratio",
               "--oscar-sink-tokens", "--oscar-recent-tokens", "--oscar-quantizer",
               "--oscar-scale-dtype", "--oscar-fold-rotations", "--kv-cache-quant-group-size"}
    assert emitted <= plugin_opts


# ----------------------------------------------------------------------------- real launches


@pytest.fixture
def fake_sglang(monkeypatch):
    monkeypatch.setattr(launcher, "SERVER_ENTRY", [FAKE_SGLANG])


def _fake_recipe(tmp_path, mode: str, port: int, name: str = "fake") -> Path:
    text = RECIPE.replace('FAKE_SGLANG_MODE = "ok"', f'FAKE_SGLANG_MODE = "{mode}"')
    return make_recipe(tmp_path, text, port=port, name=name)


def test_serve_waits_for_health_and_passes_only_recipe_env(tmp_path, fake_sglang, monkeypatch):
    port = free_port()
    argv_file = tmp_path / "argv.json"
    monkeypatch.setenv("FAKE_SGLANG_ARGV_FILE", str(argv_file))
    r = load_recipe(_fake_recipe(tmp_path, "ok", port))
    cmd = launcher.build_server_command(r, "int2")
    log = tmp_path / "server.log"
    with launcher.Server(cmd, log) as server:
        server.start()
        server.wait_healthy(timeout=30, interval=0.1)
        import urllib.request

        with urllib.request.urlopen(cmd.base_url + "/v1/models", timeout=5) as resp:
            assert json.load(resp)["data"][0]["id"] == "Qwen/Qwen3-8B"
        assert json.loads(argv_file.read_text()) == cmd.server_args
    assert server.proc.poll() is not None  # stopped
    assert "fake sglang ready" in log.read_text()


def test_serve_crash_reports_log_tail(tmp_path, fake_sglang):
    r = load_recipe(_fake_recipe(tmp_path, "crash", free_port()))
    cmd = launcher.build_server_command(r, "bf16")
    server = launcher.Server(cmd, tmp_path / "s.log").start()
    with pytest.raises(launcher.LaunchError) as ei:
        server.wait_healthy(timeout=30, interval=0.1)
    msg = str(ei.value)
    assert "exited with status 3" in msg and "CUDA out of memory (fake)" in msg


def test_serve_health_timeout_stops_server(tmp_path, fake_sglang):
    r = load_recipe(_fake_recipe(tmp_path, "never-healthy", free_port()))
    server = launcher.Server(launcher.build_server_command(r, "bf16"), tmp_path / "s.log").start()
    t0 = time.monotonic()
    with pytest.raises(launcher.LaunchError, match="did not answer .*/health within 2 s"):
        server.wait_healthy(timeout=2, interval=0.2)
    assert time.monotonic() - t0 < 20
    assert server.proc.poll() is not None


def test_serve_refuses_busy_port(tmp_path, fake_sglang):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = load_recipe(_fake_recipe(tmp_path, "ok", port))
        with pytest.raises(launcher.LaunchError, match=f"port {port} .* already in use"):
            launcher.Server(launcher.build_server_command(r, "bf16"), None).start()


def test_serve_cli_rank0_returns_when_healthy_and_worker_rank_returns_its_status(
        tmp_path, fake_sglang, capsys):
    port = free_port()
    p = _fake_recipe(tmp_path, "ok", port)
    log = tmp_path / "rank0.log"
    rc = main(["serve", "--recipe", str(p), "--kv", "bf16", "--log-file", str(log),
               "--health-timeout", "30"])
    out = capsys.readouterr().out
    assert rc == 0 and f"healthy: http://127.0.0.1:{port}" in out
    pid = int(out.split("(pid ")[1].split(",")[0])
    os.killpg(pid, 15)  # the detached server keeps running until stopped
    for _ in range(100):
        if not launcher.port_in_use("127.0.0.1", port):
            break
        time.sleep(0.05)
    # a worker rank: runs its server and exits with its status, never waits for health
    p2 = _fake_recipe(tmp_path, "exit:7", free_port(), name="worker")
    rc = main(["serve", "--recipe", str(p2), "--kv", "bf16", "--nnodes", "2", "--node-rank", "1",
               "--dist-init-addr", "127.0.0.1:5000", "--log-file", str(tmp_path / "w.log")])
    assert rc == 7


# ----------------------------------------------------------------------------- review fixes


def _one_error_line(err: str, verb: str = "serve") -> str:
    """The CLI's error line (after any progress lines); no traceback anywhere."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith(f"sglang-oscar {verb}: error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_serve_cli_launch_failures_are_one_line_errors_exit_2(tmp_path, fake_sglang, capsys):
    # busy port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = _fake_recipe(tmp_path, "ok", port, name="busy")
        assert main(["serve", "--recipe", str(p), "--kv", "bf16"]) == 2
        assert "already in use" in _one_error_line(capsys.readouterr().err)
    # crash before healthy: the error line, then the log tail
    p = _fake_recipe(tmp_path, "crash", free_port(), name="crash")
    assert main(["serve", "--recipe", str(p), "--kv", "bf16", "--log-file",
                 str(tmp_path / "crash.log")]) == 2
    err = capsys.readouterr().err
    assert "exited with status 3" in _one_error_line(err)
    assert "CUDA out of memory (fake)" in err
    # health timeout
    p = _fake_recipe(tmp_path, "never-healthy", free_port(), name="slow")
    assert main(["serve", "--recipe", str(p), "--kv", "bf16", "--health-timeout", "1",
                 "--log-file", str(tmp_path / "slow.log")]) == 2
    assert "did not answer" in _one_error_line(capsys.readouterr().err)


def test_launch_error_is_a_cli_error():
    import ast
    import inspect

    from sglang_oscar import serving_launcher
    from sglang_oscar.cli.main import CLIError
    from sglang_oscar.errors import CLIError as shared_cli_error

    assert CLIError is shared_cli_error  # the public name stays importable from cli.main
    assert issubclass(launcher.LaunchError, CLIError)
    # the server launcher does not import the CLI (CLIError lives in sglang_oscar.errors)
    tree = ast.parse(inspect.getsource(serving_launcher))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.startswith("sglang_oscar.cli") for m in imported), imported


def test_health_check_ignores_http_proxy(tmp_path):
    """With http_proxy pointing at a dead proxy (and no no_proxy), the health check of a
    local server still reaches it (a fresh process: urllib reads the proxies once)."""
    import subprocess

    from evals_fakes import FakeOpenAIServer

    dead_proxy = f"http://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k.lower() != "no_proxy"}
    env.update({v: dead_proxy for v in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY")})
    with FakeOpenAIServer(lambda body: {}) as srv:
        code = ("import sys; from sglang_oscar import serving_launcher; "
                "print(serving_launcher.http_ok(sys.argv[1] + '/health', timeout=5))")
        res = subprocess.run([sys.executable, "-c", code, srv.base_url], env=env,
                             capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "True"


def test_stop_kills_helpers_of_an_exited_server(tmp_path, fake_sglang, monkeypatch):
    pid_file = tmp_path / "helper.pid"
    monkeypatch.setenv("FAKE_SGLANG_HELPER_PID_FILE", str(pid_file))
    r = load_recipe(_fake_recipe(tmp_path, "orphan-helper", free_port()))
    server = launcher.Server(launcher.build_server_command(r, "bf16"), tmp_path / "s.log").start()
    assert server.proc.wait(timeout=30) == 0  # the main process is gone
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    helper = int(pid_file.read_text())
    assert pid_alive(helper)
    server.stop(grace=5)
    deadline = time.monotonic() + 5
    while pid_alive(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(helper), "the server's helper process survived stop()"


@pytest.mark.parametrize("args, pattern", [
    (["--port", "0"], "--port must be >= 1"),
    (["--port", "99999"], "--port must be <= 65535"),
    (["--nnodes", "0"], "--nnodes must be >= 1"),
    (["--node-rank", "-1"], "--node-rank must be >= 0"),
    (["--health-timeout", "0"], "--health-timeout must be > 0"),
])
def test_serve_cli_rejects_out_of_range_numbers(tmp_path, capsys, args, pattern):
    p = make_recipe(tmp_path)
    assert main(["serve", "--recipe", str(p), "--dry-run", *args]) == 2
    assert pattern in _one_error_line(capsys.readouterr().err)
