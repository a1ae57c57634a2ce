import argparse
import importlib.metadata

import pytest

from _support.server_args import oscar_server_parser
from sglang_oscar.config import OscarConfig
from sglang_oscar.plugin import flags


def test_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    ours = [ep for ep in eps if ep.name == "oscar"]
    assert ours and ours[0].value == "sglang_oscar.plugin:register"
    assert ours[0].load() is __import__("sglang_oscar.plugin", fromlist=["register"]).register


@pytest.fixture(scope="module")
def sglang_parser():
    from sglang.srt.plugins.hook_registry import HookRegistry

    import sglang_oscar.plugin as plugin

    plugin.register()
    plugin.register()  # idempotent
    n_hooks = sum(len(v) for k, v in HookRegistry._hooks.items() if k in plugin.HOOK_TARGETS)
    assert n_hooks == len(plugin.HOOK_TARGETS) + 1  # __post_init__ has a BEFORE and an AFTER hook
    parser = oscar_server_parser()  # registers once more (a no-op) and applies the hooks
    assert set(plugin.HOOK_TARGETS) <= HookRegistry._patched
    return parser


def test_sglang_parser_accepts_int2_and_oscar_flags(sglang_parser):
    ns = sglang_parser.parse_args([
        "--model-path", "m", "--kv-cache-dtype", "int2", "--kv-cache-quant-group-size", "64",
        "--oscar-rotation", "/r.safetensors", "--oscar-k-clip-ratio", "0.9", "--oscar-quantizer", "lloyd-max",
        "--oscar-sink-tokens", "32", "--oscar-recent-tokens", "128", "--oscar-scale-dtype", "float32",
        "--oscar-decode-engine", "triton", "--oscar-rotate-engine", "torch", "--oscar-fold-rotations", "on",
    ])
    assert ns.kv_cache_dtype == "int2" and ns.kv_cache_quant_group_size == 64
    cfg, _ = flags.resolve_config({f.dest: getattr(ns, f.dest) for f in flags.FLAGS}, environ={})
    assert cfg == OscarConfig(group_size=64, k_clip_ratio=0.9, sink_tokens=32, recent_tokens=128,
                              quantizer="lloyd-max", scale_dtype="float32", rotation_path="/r.safetensors",
                              decode_engine="triton", rotate_engine="torch", fold_rotations=True)
    cfg, _ = flags.resolve_config({}, environ={})
    assert cfg.decode_engine == "auto" and cfg.rotate_engine == "triton" and cfg.fold_rotations is False
    ns = sglang_parser.parse_args(["--model-path", "m", "--kv-cache-dtype", "int2", "--oscar-fold-rotations", "off"])
    cfg, _ = flags.resolve_config({f.dest: getattr(ns, f.dest) for f in flags.FLAGS}, environ={})
    assert cfg.fold_rotations is False
    assert flags.config_from_env({flags.CONFIG_ENV: flags.config_to_env(OscarConfig(fold_rotations="on"))}) \
        == OscarConfig(fold_rotations=True)  # the subprocesses see it
    with pytest.raises(SystemExit):
        sglang_parser.parse_args(["--model-path", "m", "--oscar-fold-rotations", "maybe"])
    with pytest.raises(ValueError, match="fold_rotations must be on or off"):
        OscarConfig(fold_rotations="maybe")
    with pytest.raises(SystemExit):
        sglang_parser.parse_args(["--model-path", "m", "--oscar-quantizer", "nf4"])
    with pytest.raises(SystemExit):
        sglang_parser.parse_args(["--model-path", "m", "--oscar-decode-engine", "cuda"])
    with pytest.raises(ValueError, match="decode_engine must be one of"):
        OscarConfig(decode_engine="cuda")
    with pytest.raises(SystemExit):
        sglang_parser.parse_args(["--model-path", "m", "--oscar-rotate-engine", "cuda"])
    with pytest.raises(ValueError, match="rotate_engine must be one of"):
        OscarConfig(rotate_engine="cuda")
    assert "--oscar-rotation" in sglang_parser.format_help()
    assert "--oscar-fold-rotations" in sglang_parser.format_help()


def test_weight_updates_are_refused_for_a_folded_model(sglang_parser):
    """--oscar-fold-rotations on: SGLang's in-place weight updates would load unfolded weights under a
    backend that reads them as folded; the AROUND hooks on WeightUpdater answer (False, reason naming
    the flag) for a model with folded layers and pass through otherwise."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    import sglang_oscar.plugin.serving as sv
    from sglang_oscar.backend.fold import FOLDED_MARK, folded_layer_ids

    attn = torch.nn.Module()
    attn.qkv_proj, attn.o_proj, attn.attn = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), SimpleNamespace(layer_id=7)
    model = torch.nn.Sequential(attn)
    updater = SimpleNamespace(get_model=lambda: model)
    calls = []

    def original(self, *args, **kwargs):
        calls.append(args)
        return True, "Success"

    assert folded_layer_ids(model) == frozenset()
    assert sv.around_weight_update(original, updater, "/new/weights") == (True, "Success") and calls == [("/new/weights",)]
    setattr(attn, FOLDED_MARK, (torch.eye(2), None))
    assert folded_layer_ids(model) == frozenset({7})
    ok, msg = sv.around_weight_update(original, updater, "/new/weights")
    assert not ok and "original:" in msg and "--oscar-fold-rotations on" in msg and "1 layers" in msg
    assert len(calls) == 1
    # installed on every WeightUpdater entry point (the class's functions are the hooked wrappers)
    assert set(sv.WEIGHT_UPDATE_HOOK_TARGETS) <= set(plugin_targets())
    ok, msg = WeightUpdater.update_weights_from_tensor(updater, named_tensors=[])
    assert not ok and msg.startswith("update_weights_from_tensor: ") and "--oscar-fold-rotations off" in msg
    for name in sv.WEIGHT_UPDATE_METHODS:
        ok, msg = getattr(WeightUpdater, name)(updater, *([None] * 5))
        assert not ok and msg.startswith(f"{name}: "), name


def plugin_targets():
    import sglang_oscar.plugin as plugin

    return plugin.HOOK_TARGETS


def test_env_aliases_and_precedence():
    env = {"SGLANG_OSCAR_K_CLIP_RATIO": "0.5", "SGLANG_MIXED_KV_RECENT_TOKENS": "512", "SGLANG_LLOYD_MAX": "1"}
    cfg, notes = flags.resolve_config({"oscar_k_clip_ratio": 0.8}, environ=env)
    assert cfg.k_clip_ratio == 0.8 and cfg.recent_tokens == 512 and cfg.quantizer == "lloyd-max"
    assert any("overrides environment alias SGLANG_OSCAR_K_CLIP_RATIO" in n for n in notes)
    assert any("SGLANG_MIXED_KV_RECENT_TOKENS" in n for n in notes)
    # the V alias beside the flag is unused: said in the log, as for the K alias
    cfg, notes = flags.resolve_config({"oscar_rotation": "r.safetensors"},
                                      environ={"SGLANG_OSCAR_V_ROTATION_PATH": "v.pt"})
    assert cfg.rotation_path == "r.safetensors" and cfg.rotation_v_path is None
    assert any("--oscar-rotation overrides environment alias SGLANG_OSCAR_V_ROTATION_PATH='v.pt'" in n for n in notes)
    with pytest.raises(ValueError, match="SGLANG_MIXED_KV_PREFIX_TOKENS"):
        flags.resolve_config({}, environ={"SGLANG_MIXED_KV_PREFIX_TOKENS": "many"})
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        flags.resolve_config({"oscar_v_clip_ratio": 3.0}, environ={})
    # upstream K/V .pt pair in one directory -> the directory
    # upstream K/V .pt pair -> both exact files, never a directory glob
    cfg, _ = flags.resolve_config({}, environ={"SGLANG_OSCAR_K_ROTATION_PATH": "/z/k_rotation_a.pt",
                                              "SGLANG_OSCAR_V_ROTATION_PATH": "/z/v_rotation_a.pt"})
    assert (cfg.rotation_path, cfg.rotation_v_path) == ("/z/k_rotation_a.pt", "/z/v_rotation_a.pt")
    with pytest.raises(ValueError, match="SGLANG_OSCAR_V_ROTATION_PATH is not"):
        flags.resolve_config({}, environ={"SGLANG_OSCAR_K_ROTATION_PATH": "/a/k.pt"})
    cfg, _ = flags.resolve_config({"oscar_rotation": "/r.safetensors"}, environ={"SGLANG_OSCAR_K_ROTATION_PATH": "/a/k.pt"})
    assert cfg.rotation_path == "/r.safetensors" and cfg.rotation_v_path is None
    # upstream scale dtype spellings, strict booleans
    cfg, _ = flags.resolve_config({}, environ={"SGLANG_MIXED_KV_SCALE_DTYPE": "fp32", "SGLANG_LLOYD_MAX": "0"})
    assert (cfg.scale_dtype, cfg.quantizer) == ("float32", "uniform")
    with pytest.raises(ValueError, match="SGLANG_LLOYD_MAX"):
        flags.resolve_config({}, environ={"SGLANG_LLOYD_MAX": "lloyd"})
    with pytest.raises(ValueError, match="SGLANG_MIXED_KV_SCALE_DTYPE"):
        flags.resolve_config({}, environ={"SGLANG_MIXED_KV_SCALE_DTYPE": "fp8"})


@pytest.mark.parametrize("group,scale_dtype,bits", [(1, "float16", 34), (2, "float16", 18), (4, "float32", 18),
                                                     (4, "float16", None), (8, "float32", None), (64, "float32", None)])
def test_a_group_whose_pairs_outweigh_bf16_is_refused(group, scale_dtype, bits):
    """2 code bits per element plus 16 x (pair dtype bytes) / G for the (scale, zero) pairs: at 16 bits
    or more the INT2 cache is no smaller than BF16's, and the launch refuses the group with the cost."""
    values = {"kv_cache_quant_group_size": group, "oscar_scale_dtype": scale_dtype}
    if bits is None:
        assert flags.resolve_config(values, environ={})[0].group_size == group
        return
    with pytest.raises(ValueError, match=rf"group-size {group} with {scale_dtype} .* costs {bits} bits "
                                         r".*pick a larger group.*--oscar-scale-dtype"):
        flags.resolve_config(values, environ={})


def test_config_travels_through_env():
    cfg = OscarConfig(group_size=32, quantizer="lloyd-max", decode_engine="gluon")
    env = {flags.CONFIG_ENV: flags.config_to_env(cfg)}
    assert flags.config_from_env(env) == cfg
    assert flags.config_from_env({}) is None
    # a damaged variable names itself and the way out
    for raw, what in (("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ('{"sink": 4}', "unexpected keyword"),
                      ('{"sink_tokens": -1}', "sink_tokens")):
        with pytest.raises(ValueError, match=what) as e:
            flags.config_from_env({flags.CONFIG_ENV: raw})
        assert what == "sink_tokens" or (flags.CONFIG_ENV in str(e.value) and "unset it" in str(e.value))


@pytest.mark.parametrize("field,value", [
    ("sink_tokens", True), ("recent_tokens", 2.0), ("group_size", False), ("group_size", "32"),
    ("k_clip_ratio", "0.9"), ("v_clip_ratio", True), ("k_clip_ratio", None),
])
def test_config_refuses_loosely_typed_values(field, value):
    """The Python API refuses what the CLI flags cannot produce: bools for counts, strings for numbers."""
    with pytest.raises(ValueError, match=field):
        OscarConfig(**{field: value})


def test_config_accepts_numpy_scalars():
    import numpy as np

    cfg = OscarConfig(sink_tokens=np.int64(8), k_clip_ratio=np.float32(0.9), group_size=np.int32(32))
    assert cfg.sink_tokens == 8 and abs(cfg.k_clip_ratio - 0.9) < 1e-6 and cfg.group_size == 32
    assert (type(cfg.sink_tokens), type(cfg.k_clip_ratio), type(cfg.group_size)) == (int, float, int)
    assert flags.config_from_env({flags.CONFIG_ENV: flags.config_to_env(cfg)}) == cfg  # JSON-serialisable


def test_from_cli_args_hook_attaches_config(monkeypatch):
    import sglang_oscar.plugin as plugin

    class FakeArgs:
        kv_cache_dtype = "int2"
        model_path = "m"

    ns = argparse.Namespace(kv_cache_dtype="int2", **{f.dest: None for f in flags.FLAGS})
    ns.oscar_sink_tokens = 8
    monkeypatch.setenv(flags.CONFIG_ENV, "")  # restored (unset) after the test
    out = plugin._around_from_cli_args(lambda cls, a: FakeArgs(), object, ns)
    assert out._oscar_config.sink_tokens == 8
    # the attribute SGLang's scheduler reports in /server_info, which eval reads to identify int2 servers
    from sglang_oscar.evals.client import OSCAR_STATE_KEY

    assert vars(out)[OSCAR_STATE_KEY] is out._oscar_config
    assert flags.config_from_env().sink_tokens == 8
    # with every hook applied, an int2 launch passes; the unreadable model config "m" only warns
    if not plugin.missing_hooks():
        assert plugin._after_post_init("r", out) == "r"
    plain = FakeArgs()
    plain.kv_cache_dtype = "auto"
    assert plugin._after_post_init("r", plain) == "r"
    # OSCAR flags without int2 are refused rather than ignored
    ns.kv_cache_dtype = "auto"
    with pytest.raises(ValueError, match="--oscar-sink-tokens: OSCAR flags apply only with --kv-cache-dtype int2"):
        plugin._around_from_cli_args(lambda cls, a: plain, object, ns)
    ns.oscar_sink_tokens = None
    assert plugin._around_from_cli_args(lambda cls, a: plain, object, ns) is plain


def test_refusals_name_the_flag_and_the_alternative():
    from types import SimpleNamespace

    import sglang_oscar.plugin as plugin
    from sglang.srt.server_args import ServerArgs

    from sglang_oscar.plugin.refusals import REFUSALS, refusal_messages

    fields = ServerArgs.__dataclass_fields__
    for r in REFUSALS:  # every rule reads a real ServerArgs field, with an accepted default
        assert r.field in fields, r.field
        assert not r.unsupported(fields[r.field].default), r.field
    args = SimpleNamespace(kv_cache_dtype="int2", model_path="m", speculative_algorithm="EAGLE",
                           attention_backend="fa3", pp_size=2)
    msgs = refusal_messages(args)
    assert len(msgs) == 3
    assert any("--speculative-algorithm 'EAGLE'" in m for m in msgs)
    assert any("--attention-backend 'fa3'" in m and "--attention-backend triton" in m for m in msgs)
    with pytest.raises(ValueError, match="--pp-size 2: use tensor parallelism"):
        plugin._after_post_init(None, args)
    for path in ("dummy", "none"):  # no model path is exempt from the refusals
        with pytest.raises(ValueError, match="--pp-size 2"):
            plugin._after_post_init(None, SimpleNamespace(**{**vars(args), "model_path": path}))
    assert refusal_messages(SimpleNamespace(attention_backend="triton", pp_size=1)) == []
    # accepted by SGLang, then a crash after the weights load (canary) or silently unused (FP8 scales)
    (canary,) = refusal_messages(SimpleNamespace(kv_canary="log"))
    assert "--kv-canary 'log'" in canary and "drop the flag" in canary
    (scales,) = refusal_messages(SimpleNamespace(kv_canary="none", quantization_param_path="kv_scales.json"))
    assert "--quantization-param-path 'kv_scales.json'" in scales and "FP8 KV-cache scales" in scales
    (ray,) = refusal_messages(SimpleNamespace(kv_canary="none", use_ray=True))
    assert "--use-ray True" in ray and "launch without --use-ray" in ray
