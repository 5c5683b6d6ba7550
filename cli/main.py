"""`tierserve`: the project's console script. Each command group lives in its own module
and adds its subcommands here."""

from __future__ import annotations

import argparse
import sys

from cli import batch as batch_cli
from cli import cache as cache_cli
from cli import distill as distill_cli
from cli import router as router_cli


def parser() -> argparse.ArgumentParser:
    """Every command and its options (tests read a command's defaults here)."""
    top = argparse.ArgumentParser(prog="tierserve", description=__doc__)
    commands = top.add_subparsers(dest="group", required=True)
    batch_cli.add_commands(commands)
    cache_cli.add_commands(commands)
    distill_cli.add_commands(commands)
    router_cli.add_commands(commands)
    return top


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the chosen command; its exit status."""
    args = parser().parse_args(argv)
    status: int = args.run(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
