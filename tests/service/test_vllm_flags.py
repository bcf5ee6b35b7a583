"""vLLM's `serve` flags (issue 45, item 3): every row of the table does what it says when
`mlaserve serve` parses it (the same option, mapped, accepted with no effect, or refused with
exit 2 naming the flag and the reason), and docs/vllm_flags.md is the table.

`python -m tests.service.test_vllm_flags` rewrites the docs' table from the module."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from mlaserve.config import EngineConfig
from mlaserve.config.vllm_flags import VLLM_FLAGS, VllmFlag
from mlaserve.service.cli import main, parse_settings
from mlaserve.service.settings import Settings, options

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm_flags.md"
BEGIN = "<!-- BEGIN TABLE: generated from mlaserve/config/vllm_flags.py -->"
END = "<!-- END TABLE -->"


def _settings(*argv: str) -> Settings:
    return parse_settings(["serve", *argv], {})[1]


def _values(settings: Settings) -> dict[str, Any]:
    engine = set(EngineConfig.field_names())
    return {
        o.name: getattr(settings.engine if o.name in engine else settings.server, o.name)
        for o in options()
    }


DEFAULTS = _values(_settings())


def _changed(settings: Settings) -> dict[str, Any]:
    return {k: v for k, v in _values(settings).items() if v != DEFAULTS[k]}


@pytest.mark.parametrize("row", VLLM_FLAGS, ids=lambda row: row.flag)
def test_every_row_behaves_as_the_table_says(row: VllmFlag, capsys) -> None:
    assert row.example and row.example[0] in (row.flag, *row.aliases)
    own = {o.name: o for o in options()}
    if row.kind == "same":  # one of our options, spelled as vLLM spells it
        assert row.name in own and own[row.name].flag == row.flag
    else:
        assert row.name not in own
    if row.kind == "refused":
        with pytest.raises(SystemExit) as exited:
            _settings(*row.example)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert f"mlaserve serve: error: {row.flag} is not supported: {row.why}" in err
        for value in row.noop_values:  # e.g. -dp 1: nothing to refuse
            settings = _settings(row.flag, value)
            assert _changed(settings) == {} and settings.notes == [
                f"{row.flag} {value}: accepted; the only setting mlaserve has"
            ]
        return
    settings = _settings(*row.example)
    values = _values(settings)
    assert {k: values[k] for k in row.expect} == dict(row.expect)
    assert set(_changed(settings)) <= set(row.expect)
    if row.kind == "noop":
        assert row.expect == {} and _changed(settings) == {}
    assert settings.notes == ([] if row.kind == "same" else [row.why])


def test_a_refused_flag_ends_main_like_argparse(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "-dp", "8"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error: --data-parallel-size is not supported" in err and "-tp N" in err


def test_vllm_speculative_methods_other_than_mtp_are_refused_naming_mtp() -> None:
    for spelling in ("mtp", "deepseek_mtp"):
        spec = _settings("--speculative-config", f'{{"method": "{spelling}"}}').engine.speculative
        assert spec is not None and spec.method == "mtp"
    with pytest.raises(ValueError, match=r"method 'eagle' is not supported.*deepseek_mtp"):
        _settings("--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}')


def test_prefix_caching_is_on_by_default_and_vllms_no_flag_turns_it_off() -> None:
    """vLLM's default and its `--no-enable-prefix-caching` spelling (issue 43)."""
    assert _settings().engine.enable_prefix_caching is True
    assert _settings("--enable-prefix-caching").engine.enable_prefix_caching is True
    settings = _settings("--no-enable-prefix-caching")
    assert settings.engine.enable_prefix_caching is False and settings.notes == []
    env = parse_settings(["serve"], {"MLASERVE_ENABLE_PREFIX_CACHING": "0"})[1]
    assert env.engine.enable_prefix_caching is False


def test_flags_combine_and_notes_keep_their_order() -> None:
    settings = _settings("--disable-log-stats", "--block-size", "16", "-pp", "1")
    assert settings.engine.page_size == 16
    assert [n.split(":")[0] for n in settings.notes] == [
        "--disable-log-stats", "--block-size", "--pipeline-parallel-size 1"
    ]  # fmt: skip


# ----- docs/vllm_flags.md -----

_ANSWER = {"same": "same option", "mapped": "mapped", "noop": "accepted, no effect",
           "refused": "refused"}  # fmt: skip


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_table() -> str:
    lines = [
        "| vLLM flag | mlaserve | example | what it does here |",
        "|---|---|---|---|",
    ]
    for row in VLLM_FLAGS:
        flags = ", ".join(f"`{f}`" for f in (row.flag, *row.aliases))
        example = " ".join(row.example)
        result = ", ".join(f"`{k} = {v!r}`" for k, v in row.expect.items())
        if row.kind == "refused":
            result = "exit 2"
        elif row.kind == "noop":
            result = "nothing changes"
        why = row.why.split(": ", 1)[1] if row.kind in ("mapped", "noop") else row.why
        why = why.removeprefix("accepted; ")
        if row.noop_values:
            why += f" ({', '.join(f'`{v}`' for v in row.noop_values)}: accepted, no effect)"
        lines.append(
            f"| {flags} | {_ANSWER[row.kind]} | `{_cell(example)}` → {_cell(result)} "
            f"| {_cell(why)} |"
        )
    return "\n".join(lines)


def _documented() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def test_the_docs_table_is_the_module_table() -> None:
    assert _documented() == render_table(), (
        "docs/vllm_flags.md is out of date: run `python -m tests.service.test_vllm_flags`"
    )


def _write_docs() -> None:
    text = DOC.read_text()
    head, tail = text.split(BEGIN)[0], text.split(END)[1]
    DOC.write_text(f"{head}{BEGIN}\n{render_table()}\n{END}{tail}")


if __name__ == "__main__":
    _write_docs()
    sys.exit(0)
