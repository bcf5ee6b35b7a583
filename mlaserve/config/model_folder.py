"""The one check that a model path is a local checkpoint folder, shared by `mlaserve serve`'s
preflight and the offline `LLM(...)`, so both say the same thing for a hub id (nothing is
downloaded; here is the `hf download` command)."""

from __future__ import annotations

from pathlib import Path

from mlaserve.config.error import ConfigError

__all__ = ["check_model_folder"]


def check_model_folder(path: Path, given: bool) -> None:
    """Raise `ConfigError` unless `path` holds a config.json. `given`: the user named the path
    (else it is the shipped default model, whose absence is a broken install)."""
    if (path / "config.json").is_file():
        return
    if not given:
        raise ConfigError(f"model: the shipped default model is missing from {str(path)!r}")
    what = "does not exist" if not path.exists() else "has no config.json"
    hint = ""
    # "org/name" that is not a folder here: a Hugging Face hub id.
    if not path.exists() and len(path.parts) == 2 and not path.is_absolute():
        hint = (
            "; mlaserve does not download from the Hugging Face hub: fetch it first, e.g. "
            f"`hf download {path.as_posix()} --local-dir DIR`, then give DIR as the model"
        )
    raise ConfigError(f"model: {str(path)!r} {what}; expected a local checkpoint folder{hint}")
