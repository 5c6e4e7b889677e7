"""What the measuring tools (``evaluate``, ``mismatch``, ``engines``) print: one JSON document on stdout, and the
same text in ``--out`` when given, written beside it first and renamed so a stopped tool leaves no half file."""

from __future__ import annotations

import json
import os
from typing import Any


def print_json(result: Any, out: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        tmp = f"{out}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, out)
