"""A tokenizer shipped as Python code (Kimi-K2's, Moonlight's): refused with the flag named
unless `trust_remote_code`, then loaded through its own class, and streamed byte by byte
without a broken character (the detokenizer's window path: such a tokenizer has no Rust
backend for DecodeStream)."""

from __future__ import annotations

import pytest

from mlaserve.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.tokenizer.remote_code_tokenizer import CLASS, write_remote_code_tokenizer

TEXT = "héllo wörld 你好 🙂"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory):
    return write_remote_code_tokenizer(tmp_path_factory.mktemp("remote-code-tok"))


def test_a_tokenizer_shipped_as_code_needs_trust_remote_code(folder) -> None:
    with pytest.raises(ValueError, match=rf"{CLASS}.*--trust-remote-code"):
        Tokenizer.from_pretrained(folder)


def test_with_trust_remote_code_its_own_class_loads_and_round_trips(folder) -> None:
    tok = Tokenizer.from_pretrained(folder, trust_remote_code=True)
    assert type(tok.hf).__name__ == "BytesTokenizer" and tok.backend_tokenizer is None
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert len(ids) == 1 + len(TEXT.encode())  # one id per byte
    assert tok.decode(ids) == TEXT
    prompt = tok.render_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    assert prompt == "<bos><user>hi<eos><assistant>"


def test_it_streams_byte_by_byte_without_a_broken_character(folder) -> None:
    tok = Tokenizer.from_pretrained(folder, trust_remote_code=True)
    ids = tok.encode(TEXT, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, tok.encode("prompt"), skip_special_tokens=True)
    deltas = [det.step([i]) for i in ids] + [det.flush()]
    assert "".join(deltas) == TEXT == det.text
    assert not any("\ufffd" in d for d in deltas), deltas
