from __future__ import annotations

from pathlib import Path

import pytest

from mlaserve.config.engine_config import default_model_path
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


def _deepseek_style(folder: Path) -> Path:
    """The tiny tokenizer as DeepSeek-V3 ships its config: "LlamaTokenizerFast" over a
    ByteLevel tokenizer.json, special tokens as AddedToken objects, an `added_tokens_decoder`."""
    import json

    config = json.loads((folder / "tokenizer_config.json").read_text())
    spec = json.loads((folder / "tokenizer.json").read_text())
    for key in ("bos_token", "eos_token"):
        config[key] = {"__type": "AddedToken", "content": config[key], "lstrip": False,
                       "normalized": True, "rstrip": False, "single_word": False}  # fmt: skip
    config["add_bos_token"], config["add_eos_token"], config["legacy"] = True, False, True
    fields = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    config["added_tokens_decoder"] = {
        str(t["id"]): {k: t[k] for k in fields} for t in spec["added_tokens"]
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("kind", ["default-model", "generic", "llama-labelled", "deepseek-style"])
def test_deferred_transformers_decodes_as_transformers_does(tmp_path: Path, kind: str) -> None:
    """The engine's tokenizer (`defer_transformers=True`) decodes with the `tokenizers` library
    and reads the special tokens from the folder: on every folder kind the server meets, it
    gives what transformers' tokenizer gives, for every id (specials included, skipped or not);
    and its `hf`, loaded on first use, is the same tokenizer."""
    import random

    if kind == "default-model":
        folder = default_model_path()
    else:
        label = "PreTrainedTokenizerFast" if kind == "generic" else "LlamaTokenizerFast"
        folder = write_tokenizer(tmp_path, label, CHAT_TEMPLATE)
        if kind == "deepseek-style":
            _deepseek_style(folder)
    eager = Tokenizer.from_pretrained(folder)
    deferred = Tokenizer.from_pretrained(folder, defer_transformers=True)
    assert deferred._hf is None  # the folder qualifies: nothing of transformers loaded yet
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "vocab_size"):
        assert getattr(deferred, name) == getattr(eager, name), name
    assert deferred.eos_token_id is not None
    rng = random.Random(0)
    n = eager.vocab_size
    batches = [list(range(n))] + [[rng.randrange(n) for _ in range(12)] for _ in range(300)]
    batches.append(eager.encode(TEXT))
    for ids in batches:
        for skip in (True, False):
            assert deferred.decode(ids, skip) == eager.decode(ids, skip), (ids, skip)
        assert deferred.convert_ids_to_tokens(ids) == eager.convert_ids_to_tokens(ids)
    assert [deferred.id_to_piece(i) for i in range(n)] == [eager.id_to_piece(i) for i in range(n)]
    assert deferred.max_piece_chars == eager.max_piece_chars
    assert deferred.encode(TEXT) == eager.encode(TEXT)  # loads `hf`
    assert type(deferred.hf) is type(eager.hf) and deferred.all_special_ids == eager.all_special_ids


@pytest.mark.parametrize(
    "change",
    ["eos not special", "decoder disagrees", "special map disagrees", "extra token"],
)
def test_deferred_transformers_loads_at_once_where_it_could_differ(
    tmp_path: Path, change: str
) -> None:
    """Where transformers could change what decoding skips (a special token tokenizer.json does
    not mark special, an `added_tokens_decoder` or special_tokens_map.json that disagrees, a
    token named only in a list), the deferred tokenizer is transformers' own, loaded at once, and
    agrees with it."""
    import json

    folder = _deepseek_style(write_tokenizer(tmp_path, "LlamaTokenizerFast", CHAT_TEMPLATE))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if change == "eos not special":
        config["eos_token"] = "hello"
    elif change == "decoder disagrees":
        first = next(iter(config["added_tokens_decoder"].values()))
        first["special"] = False
    elif change == "special map disagrees":
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<pad>"}))
    else:
        config["additional_special_tokens"] = ["hello"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    eager = Tokenizer.from_pretrained(folder)
    deferred = Tokenizer.from_pretrained(folder, defer_transformers=True)
    assert deferred._hf is not None and deferred._deferred is None
    ids = list(range(eager.vocab_size))
    assert deferred.eos_token_id == eager.eos_token_id
    assert deferred.decode(ids, True) == eager.decode(ids, True)


def test_engine_process_decodes_without_importing_transformers() -> None:
    """The engine's imports and its tokenizer (the default model's, as `LLMEngine` loads it)
    leave transformers unimported: 1.5 s of a warm start's engine process on the GPU host
    (issue 44). A fresh interpreter shows what got imported."""
    import subprocess
    import sys

    probe = (
        "import sys; import mlaserve.llm_engine; from mlaserve.tokenizer import Tokenizer, "
        "IncrementalDetokenizer; from mlaserve.config.engine_config import default_model_path; "
        "tok = Tokenizer.from_pretrained(default_model_path(), defer_transformers=True); "
        "d = IncrementalDetokenizer(tok, [5, 6, 7]); d.step([8, 9, 10]); d.flush(); "
        "print(sorted(m for m in ('transformers', 'jinja2') if m in sys.modules), tok.eos_token_id)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    imported, eos = done.stdout.rsplit(" ", 1)
    assert imported == "[]", done.stdout
    assert int(eos) == Tokenizer.from_pretrained(default_model_path()).eos_token_id


def test_deferred_transformers_refuses_a_rebuild_from_the_slow_class(tmp_path: Path) -> None:
    """`from_slow` makes transformers rebuild tokenizer.json from the slow (sentencepiece)
    class: nothing read from the files would then be what it decodes with."""
    import json

    import tokenizers

    from mlaserve.tokenizer.tokenizer import _special_token_ids

    folder = _deepseek_style(write_tokenizer(tmp_path, "LlamaTokenizerFast", CHAT_TEMPLATE))
    backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert _special_token_ids(folder, backend) is not None
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "from_slow": True}))
    assert _special_token_ids(folder, backend) is None
