"""structlog set-up: readable on a terminal, one JSON object per line otherwise."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(level: str | None = None, service: str = "") -> None:
    level_name = (level or os.environ.get("ORKA_LOG_LEVEL", "info")).upper()
    numeric = getattr(logging, level_name, logging.INFO)
    renderer: structlog.typing.Processor
    if sys.stderr.isatty():
        renderer = structlog.dev.ConsoleRenderer(colors=True)
    else:
        renderer = structlog.processors.JSONRenderer()
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if service:
        processors.append(_add_service(service))
    structlog.configure(
        processors=[*processors, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def _add_service(service: str) -> structlog.typing.Processor:
    def add(_: object, __: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
        event.setdefault("service", service)
        return event

    return add
