"""Other libraries' log records of an agent-function run go to the run directory, not the console.

An agent framework runs in the training process and logs its own errors (the OpenAI Agents SDK
logs every failed model call, a tracing warning per episode): dozens of lines a step would bury
the step lines. While a run whose ``agent.function`` runs in-process trains, the console's
handlers keep postrl's own records only, and every other library's go to
``runs/NAME/agent_output.log``, with their time and logger.
"""

from __future__ import annotations

import logging
from pathlib import Path

AGENT_OUTPUT_LOG = "agent_output.log"


def _ours(record: logging.LogRecord) -> bool:
    return record.name == "postrl" or record.name.startswith("postrl.")


def _foreign(record: logging.LogRecord) -> bool:
    return not _ours(record)


class ForeignLogs:
    """A context: console handlers pass postrl's records only; the others go to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: logging.FileHandler | None = None
        self.console: list[logging.Handler] = []

    def __enter__(self) -> ForeignLogs:
        root = logging.getLogger()
        self.console = list(root.handlers)
        for handler in self.console:
            handler.addFilter(_ours)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.file = logging.FileHandler(self.path)
        self.file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.file.addFilter(_foreign)
        root.addHandler(self.file)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        for handler in self.console:
            handler.removeFilter(_ours)
        if self.file is not None:
            root.removeHandler(self.file)
            self.file.close()
