"""README.md against the command lines it documents (`python -m trainer <command>`, `python -m
app <command>`, `python -m worker.simulate`, `python -m trainer.rewards.serve`): every command
in its shell blocks parses, every `--flag` it names for a command (in a command line, or in
the trainer's list of each command's options) is one that command has, so a renamed or
removed flag fails here, and every option of every command is in the README. The parsers
only: no torch, no services, well under a second."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# the README's list of the trainer commands' options: the bullets after this line
OPTIONS_LIST = "Each command's options (`python -m trainer <command> --help`"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--")} - {
        "--help"}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """'trainer train', 'trainer sample', ..., 'app serve', ..., 'worker.simulate',
    'trainer.rewards.serve': each command's own parser."""
    from app.__main__ import build_parser as app_parser
    from trainer.cli import build_parser as trainer_parser
    from trainer.rewards.serve import build_parser as serve_parser
    from worker.simulate import build_parser as simulate_parser

    parsers = {f"trainer {name}": p for name, p in _subcommands(trainer_parser()).items()}
    parsers |= {f"app {name}": p for name, p in _subcommands(app_parser()).items()}
    parsers["worker.simulate"] = simulate_parser()
    parsers["trainer.rewards.serve"] = serve_parser()
    return parsers


PARSERS = _parsers()
WITH_SUBCOMMANDS = {"trainer", "app"}


def _command_lines() -> tuple[list[str], list[str]]:
    """The `python -m` lines of the shell blocks (continuation lines joined), and the inline
    code spans that hold a `python -m` command."""
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()
             if "python -m " in line]
    spans = re.findall(r"`([^`\n]*python -m [^`\n]*)`", README)
    return lines, spans


def _command_of(line: str) -> tuple[str, list[str]] | None:
    """('trainer sample', argv after it) for a line that runs one of the documented CLIs;
    None for another module (pytest) or a placeholder (`python -m app ...`)."""
    module, rest = re.search(r"python -m ([\w.]+)(.*)", line).groups()
    argv = shlex.split(rest, comments=True)
    if module in WITH_SUBCOMMANDS:
        if not argv or argv[0] in ("...", "<command>"):
            return None
        return f"{module} {argv[0]}", argv[1:]
    return (module, argv) if module in PARSERS else None


def test_every_readme_command_parses_and_uses_only_its_commands_flags():
    lines, spans = _command_lines()
    seen = set()
    for line in lines:
        found = _command_of(line)
        if found is None:
            continue
        command, argv = found
        assert command in PARSERS, f"README runs an unknown command: {line.strip()}"
        parser, seen = PARSERS[command], seen | {command}
        unknown = set(FLAG.findall(" ".join(argv))) - _flags(parser)
        assert not unknown, f"{command} has no {sorted(unknown)}: {line.strip()}"
        try:
            parser.parse_args(argv)
            refused = False
        except SystemExit:  # argparse said why on stderr
            refused = True
        assert not refused, f"{command} refuses the README's {line.strip()!r}"
    for span in spans:  # inline commands may be partial: their flags only
        found = _command_of(span)
        if found is None:
            continue
        command, argv = found
        assert command in PARSERS, f"README names an unknown command: {span}"
        unknown = set(FLAG.findall(" ".join(argv))) - _flags(PARSERS[command])
        assert not unknown, f"{command} has no {sorted(unknown)}: {span}"
    # the shell blocks run every trainer command, and each of the other CLIs
    assert {c for c in PARSERS if not c.startswith("app ")} <= seen, set(PARSERS) - seen
    assert {"app migrate", "app create-user", "app serve"} <= seen


def _options_list() -> list[tuple[list[str], str]]:
    """The trainer's list of each command's options: (commands, text) per bullet, the
    commands being those named in backticks before the bullet's first colon."""
    first = README.index("\n- ", README.index(OPTIONS_LIST))
    section = README[first:README.index("\n\n", first)]
    bullets = []
    for bullet in section.split("\n- ")[1:]:
        head = bullet.split(":", 1)[0]
        bullets.append((re.findall(r"`([a-z-]+)`", head), bullet))
    return bullets


def test_the_options_list_names_each_trainer_commands_flags_and_only_them():
    """A flag the list gives a command is that command's, and every flag of every trainer
    command is in the list under its command (`sample`'s --solver under the sampling
    options of `sample` and `evaluate`)."""
    listed: dict[str, set[str]] = {}
    for commands, text in _options_list():
        assert commands, text
        for name in commands:
            command = f"trainer {name}"
            assert command in PARSERS, f"the options list names no command {name!r}: {text}"
            flags = set(FLAG.findall(text))
            unknown = flags - _flags(PARSERS[command])
            assert not unknown, f"{command} has no {sorted(unknown)}"
            listed.setdefault(command, set()).update(flags)
    for command, parser in PARSERS.items():
        if command.startswith("trainer "):
            missing = _flags(parser) - listed.get(command, set())
            assert not missing, f"README's options list lacks {command} {sorted(missing)}"


def test_every_option_of_every_command_is_in_the_readme():
    """The other CLIs (app, worker.simulate, trainer.rewards.serve) have no list of their
    own: each of their flags is somewhere in the README, with every subcommand."""
    written = set(FLAG.findall(README))
    for command, parser in PARSERS.items():
        missing = _flags(parser) - written
        assert not missing, f"README does not mention {command} {sorted(missing)}"
        if " " in command:  # a subcommand: run as `python -m trainer NAME ...` somewhere
            assert f"python -m {command} " in README or f"python -m {command}`" in README, \
                command


def test_every_flag_has_help():
    """`--help` says what each option does: none is listed bare."""
    bare = [f"{command} {'/'.join(a.option_strings or [a.dest])}"
            for command, parser in PARSERS.items() for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
            and not a.help]
    assert not bare, bare
