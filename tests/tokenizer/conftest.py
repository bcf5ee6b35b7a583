from __future__ import annotations

from pathlib import Path

import pytest

from mlaserve.tokenizer import Tokenizer
from tests.tokenizer.tiny_tokenizer import CHAT_TEMPLATE, write_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok"), "PreTrainedTokenizerFast", CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tok(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tokenizer_dir)
