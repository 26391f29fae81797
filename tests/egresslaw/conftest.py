"""What the CLI tests share."""

from __future__ import annotations

import pytest

from egresslaw.cli import main


@pytest.fixture
def cli(capsys):
    """Run `egresslaw ARGS…` in this process: (exit code, stdout, stderr); arguments may be paths."""

    def run(*argv):
        code = main([str(a) for a in argv])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
