"""Rollout engines: one ``Engine`` protocol (``miles_lp.rollout.engine``) and its backends."""
