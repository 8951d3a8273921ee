"""Hugging Face hub ids ("org/name" or "org/name@revision"): download a snapshot, then load it as a directory."""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from model_zoo.errors import CorruptCheckpointError, ModelSourceError
from model_zoo.loaders.tensors import meta_tensor

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")
# What an HF-dir load reads; never *.bin, *.pt or *.gguf (large duplicates in many repos).
ALLOW_PATTERNS = {
    "all": ["*.json", "*.safetensors", "tokenizer*", "*.jinja"],
    "no-weights": ["*.json", "tokenizer*", "*.jinja"],  # config + tokenizer, for random weights
    "config": ["config.json"],
}


def looks_like_hub_id(source: str) -> bool:
    return bool(HUB_ID.match(source)) and ".." not in source


def download(source: str, *, files: str = "all") -> Path:
    """The local snapshot directory of a hub model (from the cache, or downloaded); files: ALLOW_PATTERNS key."""
    from huggingface_hub import snapshot_download

    repo_id, _, revision = source.partition("@")
    with hub_errors(source):
        path = Path(snapshot_download(repo_id, revision=revision or None, allow_patterns=ALLOW_PATTERNS[files]))
    if not (path / "config.json").is_file():
        raise ModelSourceError(f"hub model {source!r} has no config.json (not a transformers model)")
    if files == "all" and not any(path.glob("*.safetensors")):
        raise ModelSourceError(f"hub model {source!r} has no safetensors weights (fllama downloads *.safetensors)")
    return path


def hub_headers(source: str) -> dict[str, torch.Tensor]:
    """A hub model's tensors as meta tensors, from its safetensors headers: ranged reads, no weight downloaded."""
    from huggingface_hub import get_safetensors_metadata
    from huggingface_hub.errors import NotASafetensorsRepoError, SafetensorsParsingError

    repo_id, _, revision = source.partition("@")
    with hub_errors(source):
        try:
            md = get_safetensors_metadata(repo_id, revision=revision or None)
        except NotASafetensorsRepoError:
            raise ModelSourceError(f"hub model {source!r} has no safetensors weights") from None
        except SafetensorsParsingError as e:
            raise CorruptCheckpointError(f"hub model {source!r}: a safetensors header does not parse ({e})") from None
    return {name: meta_tensor(t.dtype, list(t.shape), f"hub model {source}: tensor {name}")
            for f in md.files_metadata.values() for name, t in f.tensors.items()}


@contextmanager
def hub_errors(source: str) -> Iterator[None]:
    """The hub client's errors as one line each."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, \
        RepositoryNotFoundError, RevisionNotFoundError

    repo_id, _, revision = source.partition("@")
    try:
        yield
    except LocalEntryNotFoundError:
        raise ModelSourceError(f"hub model {source!r} is not in the local Hugging Face cache and the hub cannot be "
                               "reached (offline or no network); it is not a local path either") from None
    except GatedRepoError:
        raise ModelSourceError(f"hub model {source!r} is gated: accept its licence on the hub and set HF_TOKEN") \
            from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"no hub model {repo_id!r} (or it is private: set HF_TOKEN); "
                               "it is not a local path either") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"hub model {repo_id!r} has no revision {revision!r}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelSourceError(f"cannot download hub model {source!r}: {e}") from None
