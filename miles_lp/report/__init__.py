"""Seeing and measuring runs: ``miles-lp report`` plots and tables, the cost fit (seed 000's
t = F + c*T per stage, CONTRACT 8) and the matching experiment (seed 000's Table 2)."""
