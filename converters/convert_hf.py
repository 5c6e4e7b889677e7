#!/usr/bin/env python
"""Thin entry point: ``python converters/convert_hf.py ARGS`` == ``miles-lp convert ARGS``.

For users coming from Miles' ``tools/convert_hf_to_*.py``; the same code and the same options
(``--extra-high-precision-layers-hf`` is accepted as an alias of ``--bf16-pattern``).
"""

import sys

from miles_lp.cli import main

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
