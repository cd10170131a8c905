"""How the exporter speaks to its user: ExportError for what stops an export,
_say for progress, notes and warnings on stderr, both under `hearth.aoti:`."""

import sys


class ExportError(Exception):
    """The model or the options cannot be exported; the message says why."""


def _say(message):
    print(f"hearth.aoti: {message}", file=sys.stderr, flush=True)
