"""``miles-lp report``'s tokens per second is tokens over time across the window."""

import math

from miles_lp.report.summary import rate


class _Run:
    def __init__(self, rows):
        self.rows = rows


def test_rate_is_total_tokens_over_total_time_not_the_mean_of_ratios():
    # 100 tokens in 1 s and 100 tokens in 4 s: 200 / 5 = 40 tok/s (the mean of ratios would say 62.5)
    run = _Run([{"tokens/generate": 100, "timing_s/step": 1.0}, {"tokens/generate": 100, "timing_s/step": 4.0}])
    assert rate(run, "tokens/generate", "timing_s/step", 10) == 40.0
    assert rate(run, "tokens/generate", "timing_s/step", 1) == 25.0  # the window: the last step only
    bad = _Run([{"tokens/generate": 5, "timing_s/step": 0.0}, {"timing_s/step": 2.0}])
    assert math.isnan(rate(bad, "tokens/generate", "timing_s/step", 10))
