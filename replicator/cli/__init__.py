"""``mtc``: the one console script. Each subcommand's module parses its flags into typed values."""

import argparse
import logging
import sys

import grpc

from csi_driver.identity import version
from replicator.cli import (
    coordinator_command,
    doctor_command,
    export_command,
    logs,
    node_commands,
    operator_commands,
)
from replicator.cli.arguments import Parser, log_level

log = logging.getLogger(__name__)


def _add_log_flags(
    parser: argparse.ArgumentParser, level: int | str = argparse.SUPPRESS, log_format: str = argparse.SUPPRESS
) -> None:
    parser.add_argument(
        "--log-level",
        type=log_level,
        default=level,
        metavar="LEVEL",
        help="debug, info, warning, error or critical, in any case (default info)",
    )
    parser.add_argument(
        "--log-format",
        choices=logs.FORMATS,
        default=log_format,
        help="text, or json: one object a line with time, level, logger, message (default text)",
    )


def parser() -> Parser:
    """``mtc``'s flags; ``--log-level`` and ``--log-format`` go before or after the subcommand."""
    main_parser = Parser(prog="mtc", description="Multi-tier checkpointing for ML training on Kubernetes.")
    main_parser.add_argument("--version", action="version", version=f"mtc {version()}")
    _add_log_flags(main_parser, logging.INFO, "text")
    sub = main_parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (node_commands, coordinator_command, operator_commands, export_command, doctor_command):
        module.add(sub)
    for command in sub.choices.values():  # the subcommand's value, when given, wins
        _add_log_flags(command)
    return main_parser


def main(argv: list[str] | None = None) -> int:
    """Runs one ``mtc`` subcommand.

    Returns:
      The exit code: 0, 1 when the command failed, 2 for bad flags (one line on stderr, no traceback).
    """
    try:
        args = parser().parse_args(argv)
    except SystemExit as done:  # a usage error (2, its line printed), or --help or --version (0)
        return done.code  # type: ignore[return-value]  # argparse exits with an int
    logs.configure(args.log_level, args.log_format)
    try:
        return args.run(args)
    except grpc.RpcError as err:
        print(f"{err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    except OSError as err:  # a file, socket or address the flags named: the user's to fix, so no traceback
        log.debug("mtc %s failed", args.command, exc_info=True)
        print(f"mtc {args.command}: {err}", file=sys.stderr)
        return 1
    except Exception:  # a bug: its traceback goes out as a log record, a JSON line under --log-format json
        log.exception("mtc %s failed", args.command)
        return 1
