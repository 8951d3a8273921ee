"""CalibStats: what calibration captured, per capture point, saved as one safetensors file.

File layout (docs/calibration.md): for each capture point P (e.g. "layers.3.qkv"), the tensors
P.hist [n] float64 (counts of |x|), P.edges [n + 1] float64, P.amax [1] float64 (max |x|),
P.max_abs [C] float32 and P.mean_abs [C] float32 (per input channel); the safetensors metadata holds
one key "fllama" whose value is a JSON object (format, version, model identity, text source, samples,
seq_len, tokens, calibration parameters, fllama version). The file says what it is; its name never does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from calibrate.collectors import ChannelStatsCollector, HistogramCollector
from calibrate.methods import CalibConfig, CalibMethod
from calibrate.outputs import temp_prefix
from calibrate.ranges import compute_amax
from model_zoo.config import LlamaConfig
from model_zoo.errors import CorruptCheckpointError, FllamaError

FORMAT = "fllama.calib_stats"
FORMAT_VERSION = 1
META_KEY = "fllama"

# The input of q/k/v (after input_layernorm), of o_proj, of gate/up (after post_attention_layernorm), of down_proj.
POINT_KINDS: tuple[str, ...] = ("qkv", "o", "gate_up", "down")
_TENSORS = ("hist", "edges", "amax", "max_abs", "mean_abs")

# LlamaConfig fields that change activations; name, max_positions and token ids do not.
_SHAPE_FIELDS = ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "ffn_size", "vocab_size", "head_dim",
                 "rope_theta", "norm_eps", "tie_embeddings")


def point_name(layer: int, kind: str) -> str:
    if kind not in POINT_KINDS:
        raise ValueError(f"unknown capture point kind {kind!r}; kinds: {', '.join(POINT_KINDS)}")
    return f"layers.{layer}.{kind}"


@dataclass
class PointStats:
    """Statistics of one capture point's activations x [tokens, C]."""

    hist: torch.Tensor  # [n] float64 counts of |x|
    edges: torch.Tensor  # [n + 1] float64
    amax: float  # max |x| (exact, not rounded to a bin edge)
    max_abs: torch.Tensor  # [C] float32 per input channel
    mean_abs: torch.Tensor  # [C] float32 per input channel

    @classmethod
    def from_collectors(cls, hist: HistogramCollector, channels: ChannelStatsCollector) -> "PointStats":
        if hist.hist is None or channels.max_abs is None:
            raise FllamaError("a capture point collected no activations")
        return cls(
            hist=hist.hist.detach().to("cpu", torch.float64),
            edges=hist.edges.to(torch.float64),
            amax=float(channels.max_abs.max()),
            max_abs=channels.max_abs.detach().to("cpu", torch.float32),
            mean_abs=channels.mean_abs.detach().to("cpu", torch.float32),
        )


def config_hash(config: LlamaConfig) -> str:
    shape = {f: getattr(config, f) for f in _SHAPE_FIELDS}
    if config.rope_scaling is not None:  # scaled RoPE changes the activations; plain RoPE keeps the old hashes
        shape["rope_scaling"] = dataclasses.asdict(config.rope_scaling)
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def model_identity(config: LlamaConfig) -> dict[str, Any]:
    return {"name": config.name, "config_hash": config_hash(config), "n_layers": config.n_layers,
            "hidden_size": config.hidden_size}


def fllama_version() -> str:
    try:
        from importlib.metadata import version
        return version("fllama")
    except Exception:  # not installed as a distribution (running from a checkout)
        return "0+unknown"


def make_meta(config: LlamaConfig, calib: CalibConfig, *, source: str, samples: int, seq_len: int,
              tokens: int, **extra: Any) -> dict[str, Any]:
    """The metadata a calibration run records (extra keys are kept as given; they must be JSON)."""
    return {"format": FORMAT, "version": FORMAT_VERSION, "model": model_identity(config), "source": source,
            "samples": samples, "seq_len": seq_len, "tokens": tokens, "bins": calib.bins,
            "calib": calib.to_dict(), "fllama_version": fllama_version(), **extra}


@dataclass
class CalibStats:
    points: dict[str, PointStats]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def calib_config(self) -> CalibConfig:
        """The parameters recorded at calibration time (defaults where none were recorded)."""
        return CalibConfig.from_dict(self.meta["calib"]) if "calib" in self.meta else CalibConfig()

    def ranges(self, cfg: CalibConfig | None = None) -> dict[str, dict[str, float]]:
        """amax per capture point, then per method name ("max", "percentile", "mse", "entropy").

        "max" is the exact max |x| collected; the others come from the histogram with cfg's parameters.
        """
        cfg = cfg or self.calib_config
        out: dict[str, dict[str, float]] = {}
        for name, p in self.points.items():
            out[name] = {m.value: (p.amax if m is CalibMethod.MAX else compute_amax(m, p.hist, p.edges, cfg))
                         for m in cfg.methods}
        return out

    def check_model(self, config: LlamaConfig, *, check_name: bool = True) -> None:
        """Raise FllamaError when these statistics were collected on another model."""
        have = self.meta.get("model", {})
        want = model_identity(config)
        same = have.get("config_hash") == want["config_hash"] and (not check_name or have.get("name") == want["name"])
        if not same:
            raise FllamaError(
                f"the calibration stats come from another model: {_describe(have)}, "
                f"but the model given is {_describe(want)}; run `fllama calibrate` on this model")

    def save(self, path: str | os.PathLike, *, force: bool = False) -> Path:
        """Write atomically (temp file in the same directory, fsync, rename); refuse to overwrite unless force."""
        from safetensors.torch import save as st_save

        path = Path(path)
        if path.is_dir():
            raise FllamaError(f"{path} is a directory; give a file path for the stats")
        if path.exists() and not force:
            raise FllamaError(f"{path} already exists; use --force to overwrite it")
        path.parent.mkdir(parents=True, exist_ok=True)
        data = st_save(self._tensors(), metadata={META_KEY: json.dumps(self.meta, sort_keys=True)})
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")  # cleaned if killed
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes it private; a stats file is an ordinary output
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)
        return path

    def _tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, p in self.points.items():
            out[f"{name}.hist"] = p.hist.to("cpu", torch.float64).contiguous()  # [n]
            out[f"{name}.edges"] = p.edges.to("cpu", torch.float64).contiguous()  # [n + 1]
            out[f"{name}.amax"] = torch.tensor([p.amax], dtype=torch.float64)  # [1]
            out[f"{name}.max_abs"] = p.max_abs.to("cpu", torch.float32).contiguous()  # [C]
            out[f"{name}.mean_abs"] = p.mean_abs.to("cpu", torch.float32).contiguous()  # [C]
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CalibStats":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FllamaError(f"stats file not found: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                raw_meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise CorruptCheckpointError(f"{path} is not a readable safetensors file ({e})") from None
        meta = _parse_meta(path, raw_meta)
        return cls(points=_parse_points(path, tensors), meta=meta)


def _parse_meta(path: Path, raw: dict[str, str]) -> dict[str, Any]:
    if META_KEY not in raw:
        raise CorruptCheckpointError(f"{path} has no fllama metadata: it is not a calibration stats file")
    try:
        meta = json.loads(raw[META_KEY])
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(f"{path}: the fllama metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        kind = meta.get("format") if isinstance(meta, dict) else None
        raise CorruptCheckpointError(f"{path} is not a calibration stats file (format {kind!r}, expected {FORMAT!r})")
    if meta.get("version", 0) > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{path} has stats format version {meta['version']}; this fllama reads up to {FORMAT_VERSION}")
    return meta


def _parse_points(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, PointStats]:
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        name, _, part = key.rpartition(".")
        if part not in _TENSORS or not name:
            raise CorruptCheckpointError(f"{path}: unexpected tensor {key!r}")
        grouped.setdefault(name, {})[part] = t
    points: dict[str, PointStats] = {}
    for name in sorted(grouped, key=_point_order):
        g = grouped[name]
        missing = [p for p in _TENSORS if p not in g]
        if missing:
            raise CorruptCheckpointError(f"{path}: capture point {name!r} lacks {', '.join(missing)}")
        if g["edges"].numel() != g["hist"].numel() + 1 or g["max_abs"].shape != g["mean_abs"].shape:
            raise CorruptCheckpointError(f"{path}: capture point {name!r} has inconsistent tensor shapes")
        points[name] = PointStats(hist=g["hist"].double(), edges=g["edges"].double(), amax=float(g["amax"][0]),
                                  max_abs=g["max_abs"].float(), mean_abs=g["mean_abs"].float())
    return points


def _point_order(name: str) -> tuple:
    """layers.2.o before layers.10.qkv; inside a layer, the order of the data flow."""
    parts = name.split(".")
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in POINT_KINDS:
        return (0, int(parts[1]), POINT_KINDS.index(parts[2]), "")
    return (1, 0, 0, name)


def _describe(identity: dict[str, Any]) -> str:
    return (f"{identity.get('name', '?')!r} ({identity.get('n_layers', '?')} layers, hidden "
            f"{identity.get('hidden_size', '?')}, config {identity.get('config_hash', '?')})")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)
