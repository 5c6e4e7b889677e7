"""Moved to :mod:`miles_lp.export.schemes`. This name is the same module object (sys.modules) until every
import uses the new one: see docs/ARCHITECTURE.md, "What is left"."""

import sys

from miles_lp.export import schemes as _moved

sys.modules[__name__] = _moved
