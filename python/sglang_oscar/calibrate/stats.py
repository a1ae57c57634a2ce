"""Streaming fp64 sufficient statistics of OSCAR fitting, and the statistics file.

Per MHA/GQA attention layer ``l`` and kv head ``h`` (``g = H_q / H_kv`` query heads per kv
head, ``Q_h`` its query heads, rows are post-RoPE):

* pass 1: ``Q_sum[h] = sum_{t, i in Q_h} q_{t,i}^T q_{t,i}`` with ``rows = T g``
  (:func:`..rotation.fit.query_second_moment_sums`), and the raw second moments
  ``K_sum[h] = sum_t k_{t,h}^T k_{t,h}``, ``V_sum[h] = sum_t v_{t,h}^T v_{t,h}``, and the first
  moments ``K_lin[h] = sum_t k_{t,h}``, ``V_lin[h] = sum_t v_{t,h}`` (centering means);
* pass 2 (needs the *final* ``C_h = Q_sum[h] / rows``): ``w_{t,h} = k_{t,h} C_h k_{t,h}^T``,
  ``VW_sum[h] = sum_t w_{t,h} v_{t,h}^T v_{t,h}``, ``W_sum[h] = sum_t w_{t,h}``
  (:func:`..rotation.fit.value_weighted_sums`), so ``S_h = VW_sum[h] / W_sum[h]``.

Per MLA layer: ``C_sum = sum_t c_t^T c_t`` of the latent ``c_kv`` (one pass).

Accumulators live on the device of the captured rows (bounded memory: ``O(H_kv D^2)`` per
layer, never the rows themselves) and are moved to the CPU when saved.

File: safetensors with float64 tensors ``q_sum.<l>``, ``k_sum.<l>``, ``v_sum.<l>``,
``v_wsum.<l>``, ``w_sum.<l>``, ``k_lin.<l>``, ``v_lin.<l>`` (MHA; files written before the first
moments lack ``*_lin`` and serve every fit except the centred ones) or ``c_sum.<l>`` (MLA), and the JSON metadata key
``oscar_stats``: ``format``, ``format_version``, ``geometry``, ``model`` (id/path, model_type,
dtype, config, ``fingerprint``: :func:`.model.config_fingerprint`), ``prompts`` (source,
sha256, tokens, seed, per-sequence hashes, ...), ``tokens_per_layer`` per pass, ``q_rows``,
``passes_done``, ``passes_needed``, optional ``checkpoint``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open

from .. import __version__
from ..fileio import save_safetensors
from ..rotation.fit import query_second_moment_sums, value_weighted_sums
from ..rotation.geometry import ModelGeometry
from . import CalibrationError

STATS_FORMAT = "sglang-oscar-stats"
STATS_VERSION = 1
META_KEY = "oscar_stats"
_MHA_TENSORS = ("q_sum", "k_sum", "v_sum", "v_wsum", "w_sum", "k_lin", "v_lin")


class CalibrationStats:
    """Accumulators of one model (see module docstring).

    Args:
        geometry: the model's attention geometry (shapes are checked against it on every add).
        meta: provenance (model, prompts, ...), stored in the file.
    """

    def __init__(self, geometry: ModelGeometry, meta: dict[str, Any] | None = None):
        self.geometry = geometry
        self.meta: dict[str, Any] = dict(meta or {})
        self.sums: dict[str, dict[int, torch.Tensor]] = {name: {} for name in (*_MHA_TENSORS, "c_sum")}
        self.q_rows: dict[int, int] = {}
        self.tokens: dict[int, dict[int, int]] = {1: {}, 2: {}}
        self.passes_done = 0
        self._qcov: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ properties
    @property
    def is_mla(self) -> bool:
        return self.geometry.attention_kind == "mla"

    @property
    def passes_needed(self) -> int:
        return 1 if self.is_mla else 2

    @property
    def complete(self) -> bool:
        return self.passes_done >= self.passes_needed

    def tokens_per_layer(self, pass_index: int = 1) -> dict[int, int]:
        """Tokens accumulated per layer in pass 1 (or 2); 0 for layers never seen."""
        return {lid: self.tokens[pass_index].get(lid, 0) for lid in self.geometry.layer_ids}

    # ------------------------------------------------------------------ accumulation
    def _add(self, name: str, layer_id: int, t: torch.Tensor) -> None:
        store = self.sums[name]
        if layer_id in store:
            store[layer_id] += t.to(store[layer_id].device)
        else:
            store[layer_id] = t.clone()

    def _check_mha(self, layer_id: int, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor) -> None:
        try:
            lg = self.geometry.layer(layer_id)
        except KeyError:
            raise CalibrationError(
                f"layer {layer_id} called attention but is not an attention layer of the geometry "
                f"({self.geometry.model_type}, layers {self.geometry.layer_ids[:8]}...)"
            ) from None
        want_k = (lg.num_kv_heads, lg.head_dim_k)
        want_v = (lg.num_kv_heads, lg.head_dim_v)
        if tuple(k.shape[1:]) != want_k or tuple(v.shape[1:]) != want_v:
            raise CalibrationError(
                f"layer {layer_id}: captured K {tuple(k.shape[1:])} / V {tuple(v.shape[1:])} [kv heads, head_dim] but the "
                f"model geometry has K {want_k} / V {want_v}: every kv head of every layer must be captured "
                "(spec lesson 25) -- unsupported attention layout"
            )
        if q is not None and q.shape[1] % lg.num_kv_heads:
            raise CalibrationError(f"layer {layer_id}: {q.shape[1]} query heads are not a multiple of {lg.num_kv_heads} kv heads")

    def _check_finite(self, layer_id: int, pass_index: int, **rows: torch.Tensor) -> None:
        """Raise if a captured tensor holds NaN/Inf: the sums would be poisoned (or, for the latent,
        silently written) and the fit would fail later without naming the layer."""
        for name, t in rows.items():
            if not bool(torch.isfinite(t).all()):
                raise CalibrationError(
                    f"layer {layer_id}: the captured {name} of pass {pass_index} contains NaN/Inf: the model's activations "
                    "overflow in this dtype (float16?) or its weights are damaged; the statistics file was not written. "
                    "Calibrate again in a wider dtype (--dtype bfloat16 or float32, with --restart), or check the "
                    "model's weights"
                )

    def add_pass1(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Accumulate pass-1 sums of rows ``q [N, H_q, D_k]``, ``k [N, H_kv, D_k]``, ``v [N, H_kv, D_v]``."""
        self._check_mha(layer_id, q, k, v)
        self._check_finite(layer_id, 1, query=q, key=k, value=v)
        qs, rows = query_second_moment_sums(q, k.shape[1])
        kd, vd = k.double(), v.double()
        self._add("q_sum", layer_id, qs)
        self._add("k_sum", layer_id, torch.einsum("thd,the->hde", kd, kd))
        self._add("v_sum", layer_id, torch.einsum("thd,the->hde", vd, vd))
        self._add("k_lin", layer_id, kd.sum(0))
        self._add("v_lin", layer_id, vd.sum(0))
        self.q_rows[layer_id] = self.q_rows.get(layer_id, 0) + rows
        self.tokens[1][layer_id] = self.tokens[1].get(layer_id, 0) + k.shape[0]

    def means(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-kv-head means of the post-RoPE keys and of the values over the pass-1 tokens:
        float64 ``([H_kv, D_k], [H_kv, D_v])`` = ``K_lin[h] / T``, ``V_lin[h] / T`` (the centering of
        ``RotationSet.k_mean`` / ``v_mean``).

        Raises:
            CalibrationError: no pass-1 tokens for the layer, or statistics written before first
                moments were recorded (recollect them with ``sglang-oscar calibrate``).
        """
        n = self.tokens[1].get(layer_id, 0)
        if n == 0:
            raise CalibrationError(f"layer {layer_id}: no pass-1 statistics")
        if layer_id not in self.sums["k_lin"] or layer_id not in self.sums["v_lin"]:
            raise CalibrationError(
                f"{self.meta.get('path', 'statistics')}: layer {layer_id} has no first moments (k_lin / v_lin): the file "
                "predates centering support; rerun `sglang-oscar calibrate --restart` (or into a new file) to fit centred rotations"
            )
        return self.sums["k_lin"][layer_id] / n, self.sums["v_lin"][layer_id] / n

    def query_covariance(self, layer_id: int) -> torch.Tensor:
        """``C_h = Q_sum[h] / rows`` (float64 ``[H_kv, D, D]``) from pass 1."""
        rows = self.q_rows.get(layer_id, 0)
        if rows == 0:
            raise CalibrationError(f"layer {layer_id} has no pass-1 query statistics")
        return self.sums["q_sum"][layer_id] / rows

    def add_pass2(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Accumulate score-weighted value sums with the final pass-1 query covariance."""
        if self.passes_done < 1:
            raise CalibrationError("pass 2 needs the final query covariance of a completed pass 1")
        self._check_mha(layer_id, None, k, v)
        self._check_finite(layer_id, 2, key=k, value=v)
        if layer_id not in self._qcov:
            self._qcov[layer_id] = self.query_covariance(layer_id).to(k.device)
        sums, wsum = value_weighted_sums(k, v, self._qcov[layer_id])
        self._add("v_wsum", layer_id, sums)
        self._add("w_sum", layer_id, wsum)
        self.tokens[2][layer_id] = self.tokens[2].get(layer_id, 0) + k.shape[0]

    def add_latent(self, layer_id: int, c: torch.Tensor) -> None:
        """Accumulate the latent second moment of ``c [N, R]`` (MLA)."""
        rank = self.geometry.kv_lora_rank
        if c.dim() != 2 or c.shape[-1] != rank:
            raise CalibrationError(f"layer {layer_id}: captured latent of shape {tuple(c.shape)}, expected [N, {rank}]")
        if layer_id not in self.geometry.layer_ids:
            raise CalibrationError(f"layer {layer_id} is not an MLA layer of the geometry")
        self._check_finite(layer_id, 1, latent=c)
        cd = c.double()
        self._add("c_sum", layer_id, cd.T @ cd)
        self.tokens[1][layer_id] = self.tokens[1].get(layer_id, 0) + c.shape[0]

    # ------------------------------------------------------------------ results
    def value_covariance(self, layer_id: int) -> torch.Tensor:
        """``S_h = VW_sum[h] / W_sum[h]`` (float64 ``[H_kv, D_v, D_v]``) from pass 2."""
        if layer_id not in self.sums["w_sum"]:
            raise CalibrationError(f"layer {layer_id} has no pass-2 (score-weighted value) statistics")
        w = self.sums["w_sum"][layer_id]
        if not bool((w > 0).all()):
            raise CalibrationError(f"layer {layer_id}: score weights sum to zero for some kv head (all-zero queries or keys)")
        return self.sums["v_wsum"][layer_id] / w[:, None, None]

    def latent_covariance(self, layer_id: int) -> torch.Tensor:
        """``c^T c / N`` (float64 ``[R, R]``)."""
        n = self.tokens[1].get(layer_id, 0)
        if n == 0:
            raise CalibrationError(f"layer {layer_id} has no latent statistics")
        return self.sums["c_sum"][layer_id] / n

    def spectrum(self) -> dict[int, dict[str, float]]:
        """How concentrated each layer's second moments are (a diagnostic of what a fitted rotation can gain).

        Per MHA/GQA layer with pass-1 statistics and per kv head ``h``, the eigenvalues ``lam`` of
        the query covariance ``C_h`` (the ``qqt`` objective) and of the raw key / value second
        moments ``K_sum[h] / T``, ``V_sum[h] / T`` give ``top1 = lam_max / sum(lam)`` (1 for a
        rank-one matrix, ``1/D`` for an isotropic one) and the participation ratio
        ``eff_dim = sum(lam)^2 / sum(lam^2)`` (the number of directions holding the energy: ``D``
        when isotropic, 1 when rank one). With one (scale, zero) pair per row a rotation changes the
        quantization error only through the rotated rows' range, and a Hadamard rotation already
        makes rows Gaussian-like unless a few directions hold most of the energy; our hypothesis
        (not yet checked against a trained-model run) is that a low ``eff_dim`` (or a high
        ``top1``) is where a covariance-aware rotation has something to gain.

        Returns:
            ``{layer_id: {"q_top1", "q_top1_max", "q_eff_dim", "k_...", "v_..."}}`` (floats; ``*_top1``
            and ``*_eff_dim`` averaged over kv heads, ``*_top1_max`` the largest head's); layers
            without pass-1 statistics and MLA models give no entry.
        """
        out: dict[int, dict[str, float]] = {}
        if self.is_mla:
            return out
        for lid in self.geometry.layer_ids:
            n = self.tokens[1].get(lid, 0)
            if n == 0 or lid not in self.sums["k_sum"] or self.q_rows.get(lid, 0) == 0:
                continue
            mats = {"q": self.query_covariance(lid), "k": self.sums["k_sum"][lid] / n, "v": self.sums["v_sum"][lid] / n}
            row: dict[str, float] = {}
            for name, m in mats.items():
                m = m.double().cpu()
                lam = torch.linalg.eigvalsh(0.5 * (m + m.transpose(-1, -2))).clamp_min(0.0)  # [H_kv, D] ascending
                total = lam.sum(-1).clamp_min(1e-300)
                top1 = lam[..., -1] / total
                eff = total ** 2 / (lam ** 2).sum(-1).clamp_min(1e-300)
                row[f"{name}_top1"] = float(top1.mean())
                row[f"{name}_top1_max"] = float(top1.max())
                row[f"{name}_eff_dim"] = float(eff.mean())
            out[lid] = row
        return out

    def check_complete(self) -> None:
        """Raise unless every attention layer has statistics of every pass."""
        if not self.complete:
            raise CalibrationError(
                f"statistics are incomplete ({self.passes_done} of {self.passes_needed} passes done): "
                "rerun `sglang-oscar calibrate` with the same arguments to resume"
            )
        for p in range(1, self.passes_needed + 1):
            missing = [lid for lid, n in self.tokens_per_layer(p).items() if n == 0]
            if missing:
                raise CalibrationError(
                    f"pass {p} captured no tokens for attention layers {missing[:8]} of {len(self.geometry.layers)}: "
                    "those layers never reached the attention interface (unsupported architecture?)"
                )

    @property
    def fingerprint(self) -> dict[str, Any]:
        """The calibrated model's :func:`.model.config_fingerprint` (from the metadata; computed
        from the stored config and model id for files written before fingerprints were stored)."""
        from .model import config_fingerprint

        model = self.meta.get("model", {})
        if model.get("fingerprint"):
            return dict(model["fingerprint"])
        return config_fingerprint(model.get("config") or {"model_type": self.geometry.model_type}, model.get("id"))

    def check_model(self, geometry: ModelGeometry, what: str = "the model", fingerprint: dict[str, Any] | None = None,
                    allow_other_model: bool = False) -> None:
        """Raise if these statistics were computed for another model.

        Args:
            geometry: the target's attention geometry (always compared; no override).
            what: how to name the target in messages.
            fingerprint: the target's :func:`.model.config_fingerprint` (compared when given).
            allow_other_model: accept a differing fingerprint (never a differing geometry).

        Raises:
            CalibrationError: naming both models.
        """
        from .model import check_same_model

        if geometry.cache_shapes() == self.geometry.cache_shapes():
            check_same_model(self.fingerprint, fingerprint,
                             f"statistics {self.meta.get('path', '')} (model {self.meta.get('model', {}).get('id', '?')})",
                             what, allow_other_model)
        else:
            def cache(g: ModelGeometry) -> str:  # an MLA layer caches one latent, not kv heads of head_dim
                if g.attention_kind == "mla":
                    return f"MLA latent kv_lora_rank {g.kv_lora_rank}"
                return (f"kv heads {sorted({x.num_kv_heads for x in g.layers})}, "
                        f"head_dims {sorted({x.head_dim_k for x in g.layers})}")

            mine, theirs = self.geometry, geometry
            raise CalibrationError(
                f"{self.meta.get('path', 'statistics')} were computed for {self.meta.get('model', {}).get('id', '?')} "
                f"({mine.model_type}, {len(mine.layers)} attention layers, {cache(mine)}) "
                f"but {what} is {theirs.model_type} with {len(theirs.layers)} attention layers, {cache(theirs)}"
                f"{_first_difference(mine, theirs)}: statistics from another model cannot be used; calibrate this model"
            )

    # ------------------------------------------------------------------ I/O
    def metadata(self) -> dict[str, Any]:
        """The JSON metadata written to the file: provenance (``meta``) plus format, geometry,
        tokens per layer and pass, query rows, passes done/needed (module docstring)."""
        meta = dict(self.meta)
        meta.pop("path", None)
        meta.update(
            format=STATS_FORMAT,
            format_version=STATS_VERSION,
            geometry=self.geometry.to_dict(),
            tokens_per_layer={str(p): {str(k): v for k, v in sorted(self.tokens[p].items())} for p in (1, 2)},
            q_rows={str(k): v for k, v in sorted(self.q_rows.items())},
            passes_done=self.passes_done,
            passes_needed=self.passes_needed,
            accumulator="float64",
            post_rope=True,
        )
        meta.setdefault("created_by", f"sglang-oscar {__version__}")
        return meta

    def save(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """Write the statistics file atomically (``path`` is replaced only when complete)."""
        tensors = {}
        for name, store in self.sums.items():
            for lid, t in store.items():
                tensors[f"{name}.{lid}"] = t.detach().to("cpu", torch.float64).contiguous()
        meta = self.metadata()
        if extra:
            meta.update(extra)
        os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
        save_safetensors(tensors, path, metadata={META_KEY: json.dumps(meta, sort_keys=True)})

    @classmethod
    def load(cls, path: str) -> CalibrationStats:
        """Read a statistics (or checkpoint) file.

        Raises:
            FileNotFoundError, CalibrationError: missing or not a statistics file.
        """
        if not os.path.exists(path):
            raise FileNotFoundError(f"statistics file {path} does not exist; create it with `sglang-oscar calibrate`")
        try:
            with safe_open(path, framework="pt") as f:
                raw = (f.metadata() or {}).get(META_KEY)
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as exc:
            raise CalibrationError(f"{path} is not a readable safetensors file: {exc}") from exc
        if not raw:
            raise CalibrationError(f"{path} has no '{META_KEY}' metadata: not an sglang-oscar statistics file")
        damaged = f"{path}: the '{META_KEY}' metadata is damaged"
        fix = "; recalibrate (`sglang-oscar calibrate ... --restart`)"
        try:
            meta = json.loads(raw)
        except ValueError as exc:
            raise CalibrationError(f"{damaged}: not valid JSON ({exc}){fix}") from None
        if not isinstance(meta, dict):
            raise CalibrationError(f"{damaged}: a JSON {type(meta).__name__}, not an object{fix}")
        if meta.get("format") != STATS_FORMAT or meta.get("format_version") != STATS_VERSION:
            raise CalibrationError(f"{path}: unsupported statistics format {meta.get('format')!r} v{meta.get('format_version')!r}")
        try:
            geometry = ModelGeometry.from_dict(meta["geometry"])
        except Exception as exc:  # missing key, wrong types: the file was edited or truncated
            raise CalibrationError(f"{damaged}: its geometry cannot be read ({type(exc).__name__}: {exc}){fix}") from None
        keep = {k: v for k, v in meta.items() if k not in ("geometry", "tokens_per_layer", "q_rows", "passes_done",
                                                          "passes_needed", "format", "format_version")}
        keep["path"] = path
        st = cls(geometry, keep)
        for name, t in tensors.items():
            prefix, _, lid = name.rpartition(".")
            if prefix not in st.sums or not lid.isdigit():
                raise CalibrationError(f"{path}: unexpected tensor {name!r}")
            if not bool(torch.isfinite(t).all()):
                raise CalibrationError(
                    f"{path}: tensor {name!r} contains NaN/Inf: the calibration captured non-finite activations (or the "
                    "file is damaged); recalibrate in a wider dtype (`sglang-oscar calibrate --dtype bfloat16` or "
                    "float32, with --restart)"
                )
            st.sums[prefix][int(lid)] = t
        try:
            st.tokens = {int(p): {int(k): int(v) for k, v in d.items()} for p, d in meta.get("tokens_per_layer", {}).items()}
            st.q_rows = {int(k): int(v) for k, v in meta.get("q_rows", {}).items()}
            st.passes_done = int(meta.get("passes_done", 0))
        except (AttributeError, TypeError, ValueError) as exc:
            raise CalibrationError(f"{damaged}: token counts cannot be read ({exc}){fix}") from None
        st.tokens.setdefault(1, {})
        st.tokens.setdefault(2, {})
        st._check_tensors_present()
        return st

    def _check_tensors_present(self) -> None:
        """Every layer with tokens of a pass has that pass's sums (``k_lin``/``v_lin`` may be missing:
        older files; :meth:`means` names that case).

        Raises:
            CalibrationError: naming the file, the tensor and the fix.
        """
        need = {1: ("c_sum",) if self.is_mla else ("q_sum", "k_sum", "v_sum"), 2: () if self.is_mla else ("v_wsum", "w_sum")}
        for p, names in need.items():
            for lid, n in self.tokens.get(p, {}).items():
                for name in names:
                    if n and lid not in self.sums[name]:
                        raise CalibrationError(
                            f"{self.meta.get('path', 'statistics')}: tensor '{name}.{lid}' is missing although layer {lid} "
                            f"has {n} pass-{p} tokens: the file is damaged; recalibrate (`sglang-oscar calibrate ... "
                            "--restart`)"
                        )


def _first_difference(mine: ModelGeometry, theirs: ModelGeometry) -> str:
    """``"; they differ in ..."``: the first of the compared shapes (:meth:`ModelGeometry.cache_shapes`)
    that differs, for geometries whose summaries read alike (other layer ids, windows, V head_dims)."""
    names = ("model_type", "num_hidden_layers", "query heads", "attention kind", "kv_lora_rank", "qk_rope_head_dim")
    a, b = mine.cache_shapes(), theirs.cache_shapes()
    for name, x, y in zip(names, a, b):
        if x != y:
            return f"; they differ in {name} ({x} vs {y})"
    ids_a, ids_b = [x[0] for x in a[-1]], [x[0] for x in b[-1]]
    if ids_a != ids_b:
        return f"; they differ in the attention layer ids ({ids_a[:8]} vs {ids_b[:8]})"
    fields = ("layer id", "kv heads", "head_dim K", "head_dim V", "sliding window")  # cache_shapes' per-layer tuple
    for la, lb in zip(a[-1], b[-1]):
        for name, x, y in zip(fields[1:], la[1:], lb[1:]):
            if x != y:
                return f"; they differ at attention layer {la[0]}: {name} {x} vs {y}"
    return ""
