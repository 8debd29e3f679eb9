"""The README is a user's guide that stays true: its sections in a newcomer's order, short,
its configuration table the config dataclass's, every command line it shows accepted by
its program, every file it names present."""
import dataclasses
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from conftest import BIN, PYTHON, ROOT
from elastic.config import TrainConfig
from regatta.cli import parse_args

README = (ROOT / "README.md").read_text()
ORDER = ["Your own training script", "Coming from Horovod", "Launching", "The dashboard and the store",
         "Configuration", "How it works", "Measured", "Troubleshooting", "Layout"]
# Where a path a README may name lives: the project's folders, and files at its top.
PROJECT = ("regatta", "elastic", "monitor", "webui", "jobs", "examples", "hostfiles", "bench",
           "docs", "tests", "tools")


def test_the_sections_come_in_a_newcomers_order_and_it_stays_short():
    headings = re.findall(r"(?m)^## (.+)$", README)
    assert headings == ORDER
    assert README.index("make demo") < README.index("## Your own training script")
    assert len(README.splitlines()) <= 350
    assert not re.search("(?i)sit" "ting", README)   # split: the project greps for the word


def test_the_configuration_table_is_train_configs():
    section = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"(?m)^\| `(\w+)` \| ([^|]+) \|", section)
    table = {name: default.strip() for name, default in rows if name in {f.name for f in dataclasses.fields(TrainConfig)}}
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert list(table) == list(fields)
    for name, default in fields.items():
        shown = table[name]
        expected = f'"{default}"' if isinstance(default, str) else str(default).lower() \
            if isinstance(default, bool) else repr(default)
        assert shown == expected, (name, shown, expected)


def command_lines() -> list[list[str]]:
    """Every command of the README's ``sh`` blocks, continuation lines joined, comments cut."""
    lines = []
    for block in re.findall(r"```sh\n(.*?)```", README, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            words = shlex.split(command, comments=True)
            if words:
                lines.append(words)
    return lines


def python_target(words: list[str]) -> tuple[list[str], list[str]] | None:
    """``(["-m", module] or [path], its arguments)`` of the Python program a line runs."""
    for i, word in enumerate(words):
        if word.endswith("python"):
            if words[i + 1:i + 3] == ["-m", "elastic.launch.shim"]:   # it runs what follows
                i += 2
            if words[i + 1] == "-m":
                return words[i + 1:i + 3], words[i + 3:]
            return words[i + 1:i + 2], words[i + 2:]
        if word.endswith(".sbatch"):      # the batch script takes a target, then its arguments
            rest = words[i + 1:]
            if not rest:
                return ["-m", "jobs.digits"], []
            target = [rest[0]] if rest[0].endswith(".py") else ["-m", rest[0]]
            return target, rest[1:]
    return None


_options: dict[tuple, set] = {}


def options_of(program: list[str]) -> set[str]:
    """The long options a program's ``--help`` lists."""
    key = tuple(program)
    if key not in _options:
        done = subprocess.run([*program, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (program, done.stderr[-2000:])
        _options[key] = set(re.findall(r"--[a-z][a-z0-9-]*", done.stdout))
    return _options[key]


def flags(words: list[str]) -> list[str]:
    return [w.split("=", 1)[0] for w in words if w.startswith("--") and len(w) > 2]


@pytest.mark.parametrize("words", command_lines(), ids=lambda w: " ".join(w)[:60])
def test_every_command_line_is_accepted_by_its_program(words):
    assert command_lines(), "the README shows no command"
    if words[0] in ("make",):
        assert f"\n{words[1]}:" in (ROOT / "Makefile").read_text()
        return
    if words[0] == "regatta":
        parse_args(words[1:])             # exits 2 on an unknown flag or a bad value
    if words[0] == "horovodrun":
        program_flags = words[:next(i for i, w in enumerate(words) if w.endswith("python"))]
        assert set(flags(program_flags)) <= options_of([str(BIN / "horovodrun")])
    target = python_target(words)
    if target is not None and words[0] != "regatta":
        program, args = target
        if program[0] == "-m":
            assert (ROOT / (program[1].replace(".", "/") + ".py")).exists(), program
        known = options_of([PYTHON, *program])
        assert set(flags(args)) <= known, (program, set(flags(args)) - known)


def named_paths() -> set[str]:
    """Project paths the README names, in code blocks and in backticks."""
    found = set()
    for token in re.findall(r"[\w./-]+", README):
        head = token.split("/", 1)[0]
        if "/" in token and head in PROJECT and not token.endswith("/.."):
            found.add(token.rstrip(".,:)"))
    return found


def test_every_file_it_names_exists():
    paths = named_paths()
    assert "examples/files_cnn.py" in paths and "hostfiles/slurm_discover.sh" in paths
    missing = sorted(p for p in paths if not (ROOT / p).exists() and "<" not in p and "*" not in p)
    assert missing == []


def measured_rows() -> list[tuple[str, list[str], str]]:
    """The "Measured" table: (what, the command's words, date); "same" is the row above's."""
    section = README.split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows, command = [], None
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("what", "---"):
            continue
        if cells[1] != "same":
            command = shlex.split(cells[1].strip("`"))
        rows.append((cells[0], command, cells[2]))
    return rows


@pytest.mark.parametrize("row", measured_rows(), ids=lambda r: r[0][:50])
def test_every_measured_figure_names_a_date_and_a_command_that_runs(row):
    what, command, date = row
    assert re.fullmatch(r"20\d\d-\d\d-\d\d", date), (what, date)
    assert command and command[0].startswith("bench/") and (ROOT / command[0]).exists(), (what, command)
    known = options_of([PYTHON, command[0]])
    assert set(flags(command[1:])) <= known, (what, set(flags(command[1:])) - known)


def test_the_measured_table_is_read():
    assert len(measured_rows()) >= 8
