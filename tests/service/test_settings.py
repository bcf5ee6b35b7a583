"""Options: CLI > MLASERVE_* environment > config file > defaults, typed from the dataclasses."""

from __future__ import annotations

import json

import pytest

from mlaserve.config import ConfigError, EngineConfig
from mlaserve.service.cli import build_parser
from mlaserve.service.settings import (
    Option,
    ServerConfig,
    load_config_file,
    load_settings,
    options,
)


def test_defaults_come_from_the_dataclasses() -> None:
    settings = load_settings({}, {})
    assert settings.engine == EngineConfig()
    assert settings.server == ServerConfig()
    assert set(settings.sources.values()) == {"default"}


def test_every_engine_field_is_an_option_with_flag_and_env() -> None:
    names = {o.name for o in options()}
    assert set(EngineConfig.field_names()) <= names
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for opt in options():
        assert opt.flag in help_text and opt.env in help_text


def test_precedence_cli_over_env_over_file(tmp_path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("max_num_seqs: 8\npage-size: 32\nport: 9001\nserved_model_name: file\n")
    env = {"MLASERVE_MAX_NUM_SEQS": "16", "MLASERVE_PORT": "9002", "MLASERVE_CONFIG": str(config)}
    settings = load_settings({"max_num_seqs": "32"}, env)
    assert settings.engine.max_num_seqs == 32 and settings.sources["max_num_seqs"] == "cli"
    assert settings.server.port == 9002 and settings.sources["port"] == "env MLASERVE_PORT"
    assert settings.engine.page_size == 32 and settings.sources["page_size"] == f"file {config}"
    assert settings.engine.served_model_name == "file"
    assert settings.sources["max_queue"] == "default"


def test_json_config_file_and_explicit_path_beat_env_path(tmp_path) -> None:
    good = tmp_path / "serve.json"
    good.write_text(json.dumps({"max_model_len": 128, "api_key": "k", "shutdown_timeout": 2.5}))
    settings = load_settings({}, {"MLASERVE_CONFIG": str(tmp_path / "missing.yaml")}, good)
    assert settings.engine.max_model_len == 128
    assert settings.server.api_key == "k" and settings.server.shutdown_timeout == 2.5


def test_optional_fields_take_none() -> None:
    settings = load_settings({"max_model_len": "none"}, {"MLASERVE_NUM_PAGES": "null"})
    assert settings.engine.max_model_len is None and settings.engine.num_pages is None


@pytest.mark.parametrize(
    ("cli", "env", "match"),
    [
        ({"page_size": "three"}, {}, r"page_size: cannot read 'three' as int \(cli\)"),
        ({}, {"MLASERVE_MAX_NUM_SEQS": "1.5"}, r"max_num_seqs.*env MLASERVE_MAX_NUM_SEQS"),
        ({"page_size": "3"}, {}, r"page_size: must be a power of two.*\(cli\)"),
        ({}, {"MLASERVE_PORT": "70000"}, r"port: .*\(env MLASERVE_PORT\)"),
        ({"log_level": "loud"}, {}, r"log_level"),
        ({"device": "tpu"}, {}, r"device"),
        ({"api_key": "  "}, {}, r"api_key"),
        ({"max_queue": "-1"}, {}, r"max_queue"),
    ],
)
def test_bad_values_name_the_option_and_source(cli, env, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_settings(cli, env)


def test_bad_config_files(tmp_path) -> None:
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("max_num_seqz: 4\n")
    with pytest.raises(ConfigError, match=r"unknown options.*max_num_seqz"):
        load_settings({}, {}, unknown)
    not_mapping = tmp_path / "list.yaml"
    not_mapping.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config_file(not_mapping)
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config_file(broken)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config_file(tmp_path / "nope.yaml")
    typed = tmp_path / "typed.yaml"
    typed.write_text("page_size: [64]\n")
    with pytest.raises(ConfigError, match=r"page_size.*file"):
        load_settings({}, {}, typed)


def test_unknown_env_variables_warn_but_do_not_fail() -> None:
    settings = load_settings({}, {"MLASERVE_MAX_NUM_SEQZ": "4", "OTHER": "x"})
    assert settings.warnings == ["ignoring MLASERVE_MAX_NUM_SEQZ: not an mlaserve option"]


def test_option_parsing_by_type() -> None:
    flag = Option("flag", ServerConfig, bool | None, None, "")
    assert flag.parse("yes", "env") is True and flag.parse("0", "env") is False
    assert flag.parse(True, "file") is True and flag.parse("none", "cli") is None
    with pytest.raises(ConfigError, match="flag"):
        flag.parse("maybe", "cli")
    number = Option("n", ServerConfig, int, 1, "")
    assert number.parse("12", "cli") == 12 and number.parse(3.0, "file") == 3
    with pytest.raises(ConfigError):
        number.parse(True, "file")
    with pytest.raises(ConfigError, match="a value is required"):
        number.parse(None, "file")
    extra = Option("extra", ServerConfig, dict, None, "")
    assert extra.parse('{"k": 1}', "env") == {"k": 1}


def test_describe_masks_the_api_key() -> None:
    settings = load_settings({"api_key": "very-secret"}, {})
    lines = settings.describe()
    assert "api_key = '***'  (cli)" in lines
    assert not any("very-secret" in line for line in lines)
    assert len(lines) == len(options())


def test_tokenizer_queue_is_derived_unless_given() -> None:
    assert load_settings({}, {}).server.tokenizer_queue is None  # AsyncEngine derives it
    assert load_settings({"tokenizer_queue": "16"}, {}).server.tokenizer_queue == 16
    assert load_settings({}, {"MLASERVE_TOKENIZER_QUEUE": "none"}).server.tokenizer_queue is None
    with pytest.raises(ConfigError, match=r"tokenizer_queue: must be >= 1, got 0 \(cli\)"):
        load_settings({"tokenizer_queue": "0"}, {})


def test_load_format_from_cli_and_env() -> None:
    args = vars(build_parser().parse_args(["serve", "--load-format", "dummy"]))
    assert args["load_format"] == "dummy"
    assert load_settings({"load_format": args["load_format"]}, {}).engine.load_format == "dummy"
    settings = load_settings({}, {"MLASERVE_LOAD_FORMAT": "dummy"})
    assert settings.engine.load_format == "dummy"
    assert settings.sources["load_format"] == "env MLASERVE_LOAD_FORMAT"
    with pytest.raises(ConfigError, match=r"load_format: expected one of .* \(cli\)"):
        load_settings({"load_format": "npz"}, {})
