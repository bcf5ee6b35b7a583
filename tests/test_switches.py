"""The `MLASERVE_*` switches (`mlaserve/switches.py`) against the package and README.md's
"Switches" table: every switch the package names is declared, read only through the module, and
documented with the declared type, default and reader; bad integers fail naming the variable.

The package is scanned as text and parsed with `ast`, never imported for the scan.
`service/settings.py` is left out: its `MLASERVE_<OPTION>` variables are options, not switches.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from mlaserve import switches
from mlaserve.switches import SWITCHES, SwitchError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / "mlaserve"
README = ROOT / "README.md"
OPTIONS_MODULE = PACKAGE_DIR / "service" / "settings.py"
NAME = re.compile(r"MLASERVE_[A-Z0-9_]*[A-Z0-9]")
DECLARED = {switch.name: switch for switch in SWITCHES}

# Each int switch's reader, called with a default where the call site passes one.
INT_READERS = {
    "MLASERVE_GEMV_MAX_M": lambda: switches.gemv_max_m(fp8=False),
    "MLASERVE_GEMV_MAX_M_FP8": lambda: switches.gemv_max_m(fp8=True),
    "MLASERVE_HEAD_GEMV_MAX_M": lambda: switches.head_gemv_max_m(7),
    "MLASERVE_MOE_DECODE_MAX_TOKENS": lambda: switches.moe_decode_max_tokens(7),
    "MLASERVE_MOE_GROUPED_MAX_TOKENS": lambda: switches.moe_grouped_max_tokens(7),
    "MLASERVE_MLA_DECODE_ROWS": lambda: switches.mla_decode_rows(7),
    "MLASERVE_ALL_REDUCE_ONE_SHOT_MAX_BYTES": lambda: switches.all_reduce_one_shot_max_bytes(7),
    "MLASERVE_ALL_REDUCE_TWO_SHOT_MAX_BYTES": lambda: switches.all_reduce_two_shot_max_bytes(7),
}
BOOL_READERS = {
    "MLASERVE_PDL": switches.pdl,
    "MLASERVE_DECODE_PROLOGUE": switches.decode_prologue,
    "MLASERVE_FUSED_ROUTING": switches.fused_routing,
    "MLASERVE_SHARED_OVERLAP": switches.shared_overlap,
    "MLASERVE_JOINED_Q": switches.joined_q,
    "MLASERVE_ONE_GRAPH_PREFILL": switches.one_graph_prefill,
    "MLASERVE_PREFIX_SPLIT": switches.prefix_split,
    "MLASERVE_ABSORBED_HIT": switches.absorbed_hit,
    "MLASERVE_BACKGROUND_WARM_UP": switches.background_warm_up,
    "MLASERVE_COMPILE_PROCESSES": switches.compile_processes,
    "MLASERVE_TP_FP32_REDUCE": switches.tp_fp32_reduce,
    "MLASERVE_STEP_RING": switches.step_ring,
    "MLASERVE_ALL_REDUCE_NORM": switches.all_reduce_norm,
}


def package_sources() -> dict[Path, str]:
    return {
        path: path.read_text()
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if path != OPTIONS_MODULE
    }


def readme_table() -> dict[str, list[str]]:
    """Variable -> its row's cells (backticks stripped), from the "## Switches" section."""
    text = README.read_text()
    match = re.search(r"^## Switches[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, "README.md has no '## Switches' section"
    rows = {}
    for line in match.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `MLASERVE_"):
            name = cells[0].strip("`")
            assert name not in rows, f"README Switches table lists {name} twice"
            rows[name] = cells
    assert rows, "README.md's Switches section has no table rows"
    return rows


def test_every_switch_the_package_names_is_declared() -> None:
    undeclared = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path, source in package_sources().items()
        for name in set(NAME.findall(source))
        if name not in DECLARED
    )
    assert not undeclared, f"MLASERVE_* names not in mlaserve/switches.py: {undeclared}"


def test_only_the_switches_module_reads_the_environment_for_a_switch() -> None:
    """No `os.environ[...]`, `os.environ.get(...)` or `os.getenv(...)` of an `MLASERVE_` name
    outside switches.py: the call sites go through its readers."""
    found = []
    for path, source in package_sources().items():
        if path == PACKAGE_DIR / "switches.py":
            continue
        for node in ast.walk(ast.parse(source, filename=str(path))):
            if isinstance(node, ast.Subscript):
                target, args = node.value, [node.slice]
            elif isinstance(node, ast.Call):
                target, args = node.func, node.args[:1]
            else:
                continue
            reads_env = "environ" in ast.unparse(target) or "getenv" in ast.unparse(target)
            named = any(NAME.search(ast.unparse(arg)) for arg in args)
            if reads_env and named:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"MLASERVE_* switches read around mlaserve/switches.py: {found}"


def test_declarations_are_complete_and_their_readers_exist() -> None:
    assert len(DECLARED) == len(SWITCHES), "a switch is declared twice"
    assert set(INT_READERS) | set(BOOL_READERS) | {"MLASERVE_FUSED_OPS"} == set(DECLARED)
    for switch in SWITCHES:
        assert switch.type in ("bool", "int", "0/1"), switch
        assert (switch.type == "int") == (switch.name in INT_READERS), switch
        assert (PACKAGE_DIR / switch.read_in).is_file(), switch
        assert "switches." in (PACKAGE_DIR / switch.read_in).read_text(), switch


def test_every_declared_switch_is_in_the_readme_table_as_declared() -> None:
    rows = readme_table()
    assert set(rows) == set(DECLARED), "README Switches table and mlaserve/switches.py differ"
    for name, cells in rows.items():
        switch = DECLARED[name]
        assert len(cells) == 5, f"README Switches row of {name}: {cells}"
        assert cells[1] == switch.type, name
        assert cells[2] == switch.default, name
        assert cells[3] == switch.meaning, name
        assert cells[4] == f"`{switch.read_in}`", name


def test_defaults_match_the_table(monkeypatch) -> None:
    """Unset: bool switches on, `MLASERVE_FUSED_OPS` automatic, int switches the caller's
    default (None for the GEMV overrides); each constant the table quotes has that value."""
    for switch in SWITCHES:
        monkeypatch.delenv(switch.name, raising=False)
    for name, read in BOOL_READERS.items():
        assert DECLARED[name].default.startswith("on"), name
        assert read() is True, name
    assert switches.fused_ops() is None
    assert DECLARED["MLASERVE_FUSED_OPS"].default.startswith("unset")
    assert switches.gemv_max_m(fp8=False) is None and switches.gemv_max_m(fp8=True) is None
    for name in (
        "MLASERVE_HEAD_GEMV_MAX_M",
        "MLASERVE_MOE_DECODE_MAX_TOKENS",
        "MLASERVE_MOE_GROUPED_MAX_TOKENS",
    ):
        assert INT_READERS[name]() == 7, name
    assert switches.mla_decode_rows(4) == 4
    assert switches.all_reduce_one_shot_max_bytes(16) == 16
    assert switches.all_reduce_two_shot_max_bytes(32) == 32
    quoted = 0
    for switch in SWITCHES:
        module = None
        for constant, value in re.findall(
            r"`([A-Z][A-Z0-9_]+)` = (\d+)", switch.default + " " + switch.meaning
        ):
            module = module or importlib.import_module(
                "mlaserve." + switch.read_in.removesuffix(".py").replace("/", ".")
            )
            assert getattr(module, constant) == int(value), f"{switch.name}: {constant}"
            quoted += 1
    assert quoted >= 5  # the MoE and MLA limits


def test_switches_are_read_when_called(monkeypatch) -> None:
    """No caching in the readers: a test may set a switch between two reads."""
    for name, read in BOOL_READERS.items():
        monkeypatch.setenv(name, "0")
        assert read() is False, name
        monkeypatch.setenv(name, "1")
        assert read() is True, name
        monkeypatch.setenv(name, "")  # only "0" turns a bool switch off
        assert read() is True, name
    for flag, want in (("0", False), ("1", True), ("", None), ("yes", None)):
        monkeypatch.setenv("MLASERVE_FUSED_OPS", flag)
        assert switches.fused_ops() is want, flag
    for name, read in INT_READERS.items():
        monkeypatch.setenv(name, "0")
        assert read() == 0, name
        monkeypatch.setenv(name, "12")
        assert read() == 12, name
    monkeypatch.setenv("MLASERVE_GEMV_MAX_M", "")  # empty: the measured limits, as before
    assert switches.gemv_max_m(fp8=False) is None


@pytest.mark.parametrize("name", sorted(INT_READERS))
@pytest.mark.parametrize("value", ["four", "2.5"])
def test_a_bad_integer_raises_naming_the_variable(name: str, value: str, monkeypatch) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SwitchError, match=f"{name}='{re.escape(value)}': not an integer"):
        INT_READERS[name]()
    assert issubclass(SwitchError, ValueError)  # what `int(...)` raised before


def test_switches_module_is_a_leaf() -> None:
    tree = ast.parse((PACKAGE_DIR / "switches.py").read_text())
    imported = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [name for name in imported if name.startswith("mlaserve")], imported
