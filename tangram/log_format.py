"""``tangram serve --log-format json``: one JSON object per log line, for log shippers (Loki, Elasticsearch) that
index fields rather than parse text. The action's fields come from ``tangram/log_context.py``."""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import orjson

from tangram.log_context import FIELDS, current_fields

#: ``--log-format`` values; "text" is the historical ``asctime levelname name: message`` line
LOG_FORMATS = ("text", "json")
LOG_FORMAT_ENV = "TANGRAM_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """A record as ``{"time", "level", "logger", "message"}`` plus the bound action's fields that are known, and
    ``exc_info`` (the traceback's text) when an exception was logged."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, str] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = current_fields()
        line.update((key, fields[key]) for key in FIELDS if key in fields)
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc_info"] = record.exc_text
        return orjson.dumps(line).decode()


def configure_logging(log_format: str) -> None:
    """The root logger at INFO, writing ``log_format`` lines ("text" or "json") to stderr."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
