"""What `mlaserve serve` checks before it opens a port or starts the engine.

Each problem is a `ConfigError` with one line that names the option and says what to do: a
model path that is not a local checkpoint folder (with the hint that hub ids are not fetched),
a model type or config.json this server cannot run, a max_model_len beyond the model's, a
tokenizer folder without tokenizer files or whose class is code it ships (without
--trust-remote-code), a CUDA device that is not there, a chat template
file that cannot be read. Cheap: config.json and a few file names, never the weights, and no
transformers; torch is imported only for an explicit `--device cuda...` (the device check), as
`mlaserve serve` spawns the engine process right after this and the sooner the better.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mlaserve.config import ConfigError, ModelConfig
from mlaserve.config.model_folder import check_model_folder
from mlaserve.service.settings import Settings
from mlaserve.tokenizer.tokenizer_files import TOKENIZER_FILES, remote_code_class

__all__ = ["preflight"]


def preflight(settings: Settings) -> Settings:
    """Check the model, tokenizer, device and chat template; returns the settings with
    `--chat-template FILE` replaced by the template's text."""
    engine = settings.engine
    check_model_folder(engine.model_path, given=engine.model is not None)
    model_config = ModelConfig.from_pretrained(engine.model_path)  # ConfigError names the key
    engine.resolved_max_model_len(model_config)  # ConfigError: longer than the model allows
    tokenizer = engine.tokenizer_path
    if not any((tokenizer / name).is_file() for name in TOKENIZER_FILES):
        option = "tokenizer" if engine.tokenizer else "model"
        raise ConfigError(
            f"{option}: no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {str(tokenizer)!r}"
        )
    try:
        remote_code_class(tokenizer, engine.trust_remote_code)
    except ValueError as e:  # a tokenizer shipped as code, without --trust-remote-code
        raise ConfigError(str(e)) from None
    if engine.device not in ("auto", "cpu"):  # "auto" never fails; the others import torch
        engine.resolved_device()  # ConfigError when CUDA is asked for and absent
    template = settings.server.chat_template
    if template is not None:
        server = dataclasses.replace(settings.server, chat_template=_read_template(template))
        settings = dataclasses.replace(settings, server=server)
    return settings


def _read_template(value: str) -> str:
    """vLLM's --chat-template: a file holding the template, or the template itself."""
    if "{{" in value or "{%" in value:
        return value
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(
            f"chat_template: cannot read {value!r} ({e.strerror}); give a Jinja file or the "
            "template text itself"
        ) from None
