"""AWQ search results as a file: one safetensors file of scales and clips per layer, the losses, alphas and
the AwqConfig in its JSON metadata, so that a search can be saved and replayed (calibrate.awq.apply_awq)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from calibrate.awq_config import AwqConfig, AwqLayerResult
from calibrate.outputs import OutputKind, prepare_output, set_ordinary_mode, temp_prefix
from model_zoo.errors import CorruptCheckpointError

FORMAT = "fllama.awq_search"
FORMAT_VERSION = 3  # 3: clip_objective, clip losses per output row; 2: scales["o"] per v_proj row, null alphas
META_KEY = "fllama"


def save_awq_results(path: str | Path, layers: Sequence[AwqLayerResult], cfg: AwqConfig,
                     meta: dict[str, Any] | None = None, force: bool = False) -> None:
    """One safetensors file: layers.{i}.scales.{group} and layers.{i}.clips.{attr}; losses, alphas and
    the AwqConfig in the JSON metadata. Written to a temporary file and renamed; an existing file is replaced
    only with force."""
    from safetensors.torch import save_file

    path = Path(path)
    prepare_output(path, OutputKind.FILE, force)  # also removes what killed runs left beside it
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, r in enumerate(layers):
        for kind, d in (("scales", r.scales), ("clips", r.clips)):
            tensors.update({f"layers.{i}.{kind}.{n}": t.detach().cpu().float().contiguous() for n, t in d.items()})
    info = {"format": FORMAT, "version": FORMAT_VERSION, "awq": asdict(cfg), "n_layers": len(layers),
            "layers": [{"losses": r.losses, "alphas": r.alphas, "input": r.chosen_input} for r in layers],
            **(meta or {})}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")  # cleaned if killed
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={META_KEY: json.dumps(info)})
        set_ordinary_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class AwqResults:
    layers: list[AwqLayerResult]
    config: AwqConfig
    meta: dict[str, Any]  # everything else save_awq_results was given (model identity, data provenance)


def load_awq_results(path: str | Path) -> AwqResults:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        info = json.loads(raw) if raw else {}
    except (OSError, ValueError, SafetensorError) as e:
        raise CorruptCheckpointError(f"cannot read AWQ search results {path}: {e}") from None
    if info.get("format") != FORMAT or info.get("version") not in (2, FORMAT_VERSION):
        raise CorruptCheckpointError(f"{path} is not an fllama AWQ search file (format {FORMAT} v{FORMAT_VERSION})")
    if info["version"] == 2:  # searched before the row objective existed
        info["awq"] = {**info["awq"], "clip_objective": "group"}
    layers = [AwqLayerResult(losses=dict(d["losses"]), alphas=dict(d["alphas"]), chosen_input=d.get("input"))
              for d in info["layers"]]
    for key, t in tensors.items():
        parts = key.split(".")
        if len(parts) != 4 or parts[0] != "layers" or parts[2] not in ("scales", "clips") \
                or not parts[1].isdigit() or int(parts[1]) >= len(layers):
            raise CorruptCheckpointError(f"{path}: unexpected tensor {key!r}")
        getattr(layers[int(parts[1])], parts[2])[parts[3]] = t
    meta = {k: v for k, v in info.items() if k not in ("format", "version", "awq", "n_layers", "layers")}
    return AwqResults(layers=layers, config=AwqConfig(**info["awq"]), meta=meta)
