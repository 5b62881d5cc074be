"""What the CLI tests share: running `python -m trainer` in-process and reading its refusal."""

from __future__ import annotations

import pytest

from trainer.cli import main


def cli_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """main(argv) refuses with exit code 2 and no traceback; its error lines, one a problem."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), err
    return lines
