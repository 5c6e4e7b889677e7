"""Moved to :mod:`miles_lp.io.safetensors_io`. This name is the same module object (sys.modules) until every import
uses the new one: see docs/ARCHITECTURE.md, "What is left"."""

import sys

from miles_lp.io import safetensors_io as _moved

sys.modules[__name__] = _moved
