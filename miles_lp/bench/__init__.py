"""Benchmarks behind `miles-lp bench`; each module: HELP, add_arguments(p), run(args)."""
