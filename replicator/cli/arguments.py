"""argparse types shared by the subcommands: each refuses a bad value with a message naming it."""

import argparse

from csi_driver.quantity import parse_quantity


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def quantity(text: str) -> int:
    try:
        return parse_quantity(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value
