#!/usr/bin/env python
"""Run every miles-lp codec on CPU and on CUDA over representative inputs; compare the bytes.

Prints a table of (format, case, bytes compared, mismatches) and exits 1 on any mismatch, 2 when the
second device is missing. Needs only torch:

    PYTHONPATH=. python scripts/check_formats_cuda.py            # from the repo root
    python scripts/check_formats_cuda.py --device-b cpu          # a dry run of the table on CPU only
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device-a", default="cpu")
    p.add_argument("--device-b", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import torch

    from miles_lp.formats.crosscheck import compare_devices

    if args.device_b.startswith("cuda") and not torch.cuda.is_available():
        print("check_formats_cuda: no CUDA device is visible; nothing was compared", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}; {args.device_a} vs {args.device_b}"
          + (f" ({torch.cuda.get_device_name()})" if args.device_b.startswith("cuda") else ""))
    header = f"{'format':22s} {'case':26s} {'bytes':>10s} {'mismatches':>10s}"
    print(header)
    print("-" * len(header))
    total = bad = rows = 0
    for row in compare_devices(args.device_a, args.device_b, seed=args.seed):
        flag = "" if row.mismatches == 0 else "   <-- MISMATCH"
        print(f"{row.format:22s} {row.case:26s} {row.bytes_compared:10d} {row.mismatches:10d}{flag}")
        total += row.bytes_compared
        bad += row.mismatches
        rows += 1
    print("-" * len(header))
    print(f"{rows} comparisons, {total} bytes, {bad} mismatched: {'OK' if bad == 0 else 'FAILED'}")
    return 0 if bad == 0 and rows else 1


if __name__ == "__main__":
    sys.exit(main())
