"""Shared check for the command-line tools' flag validation."""
import pytest


def assert_flag_rejected(parse, flags: list[str], named: str, capsys) -> None:
    """`parse(flags)` exits with argparse's usage status 2 and a message naming `named`."""
    with pytest.raises(SystemExit) as exc:
        parse(flags)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
