"""The process's log output: ``--log-level`` and ``--log-format`` (``text`` or ``json``), set once in ``main``."""

import datetime
import json
import logging

FORMATS = ("text", "json")
_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLines(logging.Formatter):
    """One JSON object a line: ``time`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``, ``message``,
    and ``exception`` (the traceback's text) or ``stack`` when the record carries one."""

    def format(self, record: logging.LogRecord) -> str:
        time = datetime.datetime.fromtimestamp(record.created, datetime.UTC)
        line = {
            "time": time.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line)


def configure(level: int, log_format: str) -> None:
    """Sends every logger's records at ``level`` and above to stderr, as ``log_format`` (one of ``FORMATS``)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if log_format == "json" else logging.Formatter(_TEXT))
    logging.basicConfig(level=level, handlers=[handler])
