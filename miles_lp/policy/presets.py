"""Policies named by a command-line ``--format`` (``miles-lp convert`` / ``export`` / ``bench``), so a flag and a
recipe's ``precision:`` section compile through one parser."""

from __future__ import annotations


def policy_for_format(fmt: str, start_bf16: int = 0, end_bf16: int = 0, bf16_patterns: tuple[str, ...] = ()):
    """--format as a policy. ``mxfp8`` is ``policy_from_flags``; the expert formats add one rule
    ``{role: experts, format: nvfp4}`` after the BF16 exceptions (first match wins), on a BF16 or MXFP8 default."""
    from miles_lp.config import Where
    from miles_lp.policy import parse_policy, policy_from_flags

    if fmt == "mxfp8":
        return policy_from_flags("mxfp8", start_bf16=start_bf16, end_bf16=end_bf16, bf16_patterns=bf16_patterns)
    rules: list[dict] = []
    if start_bf16:
        rules.append({"layers": f"first {start_bf16}", "format": "bf16"})
    if end_bf16:
        rules.append({"layers": f"last {end_bf16}", "format": "bf16"})
    rules += [{"match": p, "format": "bf16"} for p in bf16_patterns]
    rules.append({"role": "experts", "format": "nvfp4"})
    default = "bf16" if fmt == "nvfp4-experts" else "mxfp8"
    return parse_policy({"default": default, "rules": rules}, Where("<flags>", "precision"))
