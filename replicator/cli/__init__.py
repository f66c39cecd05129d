"""``mtc``: the one console script. Each subcommand's module parses its flags into typed values."""

import argparse
import logging
import sys

import grpc

from replicator.cli import coordinator_command, node_commands, operator_commands


def main(argv: list[str] | None = None) -> int:
    """Runs one ``mtc`` subcommand.

    Returns:
      The exit code: 0, 1 when the command failed, 2 for bad flags.
    """
    parser = argparse.ArgumentParser(prog="mtc", description="Multi-tier checkpointing for ML training on Kubernetes.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (node_commands, coordinator_command, operator_commands):
        module.add(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except grpc.RpcError as err:
        print(f"{err.code().name}: {err.details()}", file=sys.stderr)
        return 1
