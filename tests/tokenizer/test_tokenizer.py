from __future__ import annotations

from pathlib import Path

import pytest

from mlaserve.tokenizer import ChatTemplateError, Tokenizer
from tests.tokenizer.tiny_tokenizer import CHAT_TEMPLATE, write_tokenizer

TEXT = "héllo wörld 你好 🙂"


def test_round_trip_and_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_token_id  # the post-processor adds BOS
    assert tok.encode(TEXT, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + TEXT
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id} <= set(tok.all_special_ids)
    assert tok.vocab_size == len(tok.hf) and tok.vocab_size <= 320


def test_pieces(tok: Tokenizer) -> None:
    ids = tok.encode("hello world", add_special_tokens=False)
    pieces = tok.convert_ids_to_tokens(ids)
    assert "".join(pieces).replace("Ġ", " ") == "hello world"
    assert "".join(tok.id_to_piece(i) for i in ids) == "hello world"
    assert tok.id_to_piece(tok.eos_token_id or 0) == "<eos>"


def test_chat_template(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": TEXT},
    ]
    text = tok.render_chat_template(messages)
    assert text == f"<bos><|system|>be brief<eos><|user|>{TEXT}<eos><|assistant|>"
    ids = tok.apply_chat_template(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1  # the template's BOS only, none added on top
    no_prompt = tok.render_chat_template(messages, add_generation_prompt=False)
    assert not no_prompt.endswith("<|assistant|>")


def test_chat_template_errors(tok: Tokenizer, tmp_path: Path) -> None:
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="messages"):
        tok.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])
    bare = Tokenizer.from_pretrained(write_tokenizer(tmp_path, "PreTrainedTokenizerFast", None))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_byte_level_tokenizer_labelled_llama_keeps_spaces(tmp_path: Path) -> None:
    # DeepSeek-V2/V3 ship a ByteLevel tokenizer.json under tokenizer_class "LlamaTokenizerFast".
    tok = Tokenizer.from_pretrained(write_tokenizer(tmp_path, "LlamaTokenizerFast", CHAT_TEMPLATE))
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_pretrained(tmp_path / "nope")


@pytest.mark.parametrize("declared", ["PreTrainedTokenizerFast", "TokenizersBackend"])
def test_declared_generic_fast_class_loads_without_auto_classes(
    tmp_path: Path, declared: str
) -> None:
    """The shipped default model declares PreTrainedTokenizerFast, and transformers 5 saves a
    tokenizers-backed folder as TokenizersBackend (bench/make_checkpoint.py's): both load as
    AutoTokenizer would load them, without importing transformers' auto classes (their
    modelling and generation imports are seconds of every engine and server start: 6.2 s of
    V3-lite's start on an H200). A fresh interpreter shows what got imported."""
    import json
    import shutil
    import subprocess
    import sys

    from mlaserve.config.engine_config import default_model_path

    folder = default_model_path()
    if declared != "PreTrainedTokenizerFast":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(folder / name, tmp_path / name)
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
        config["tokenizer_class"] = declared
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        folder = tmp_path
    probe = (
        "import sys; from mlaserve.tokenizer import Tokenizer; "
        f"tok = Tokenizer.from_pretrained({str(folder)!r}); "
        "print(type(tok.hf).__name__, 'transformers.models.auto' in sys.modules, "
        f"tok.encode({TEXT!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    name, auto_imported, ids = done.stdout.split(" ", 2)
    assert auto_imported == "False", done.stdout
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert name == type(reference).__name__
    assert ids.strip() == str(reference.encode(TEXT))
