"""Kubernetes resource quantities (``512Mi``, ``2Gi``, ``1e9``) as integer bytes.

The accepted grammar follows ``k8s.io/apimachinery/pkg/api/resource``: a decimal number with an
optional binary suffix (Ki..Ei), decimal suffix (k, M, G, T, P, E) or exponent (``e9``).
Our own code because the ``kubernetes`` client (``utils.parse_quantity``) is not otherwise a
dependency of the agent, and a syntactic bound must come before any arithmetic anyway.
"""

import re
from decimal import Decimal, InvalidOperation

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
# Checked before any arithmetic: at most 24 characters and an exponent of at most two digits, so a
# hostile "1e999999999" is refused at once instead of costing seconds of Decimal work.
_QUANTITY = re.compile(
    r"(?P<number>[0-9]{1,20}(?:\.[0-9]{0,20})?|\.[0-9]{1,20})(?P<suffix>[KMGTPE]i|[kMGTPE]|[eE][0-9]{1,2})?", re.ASCII
)
_MAX_TEXT = 24


def parse_quantity(text: str) -> int:
    """Parses a Kubernetes quantity into bytes.

    Args:
      text: e.g. ``"512Mi"``, ``"2Gi"``, ``"60000Mi"``, ``"1G"``, ``"1e9"``, ``"4096"``.

    Returns:
      The number of bytes, an ``int`` >= 0.

    Raises:
      ValueError: the text is not a quantity (or longer than 24 characters, or with an exponent over
        99), is negative, or names a fractional byte count.
    """
    match = _QUANTITY.fullmatch(text.strip()) if isinstance(text, str) and len(text) <= _MAX_TEXT else None
    if not match:
        raise ValueError(
            f"{str(text)[:32]!r} is not a Kubernetes quantity of at most {_MAX_TEXT} characters (examples: 512Mi, 2Gi, 1e9)"
        )
    try:
        number = Decimal(match["number"])
    except InvalidOperation as err:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"{text!r} is not a Kubernetes quantity") from err
    suffix = match["suffix"] or ""
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        multiplier = Decimal(10) ** int(suffix[1:])
    else:
        multiplier = Decimal(_BINARY.get(suffix) or _DECIMAL[suffix])
    value = number * multiplier
    if value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of bytes")
    return int(value)


def format_bytes(count: int) -> str:
    """Renders a byte count for humans, e.g. ``1073741824`` -> ``"1.0 GiB"``."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
