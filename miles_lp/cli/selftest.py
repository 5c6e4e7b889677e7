"""``miles-lp selftest sync``: prove the weight-sync checks on the embedded stack by injecting each fault."""

from __future__ import annotations

from miles_lp import devices

HELP = "inject each known weight-sync failure into the embedded stack and show which check catches it"
DESCRIPTION = HELP + """

  miles-lp selftest sync                          # tiny Qwen3-MoE, MXFP8 + NVFP4 experts, reference engine
  miles-lp selftest sync --arch qwen3 --json out.json

A healthy sync first (it must be clean), then each fault on a fresh engine: lm_head quantized on the sampler;
a router rule matching gate_up_proj by substring; first/last BF16 layers disagreeing; stale derived layout;
a re-bound parameter; a dropped last bucket; missing scales; a loader skipping names; a different grid
(128x128 FP32-scale blocks, or the sampler re-quantizing BF16); NVFP4 gate/up with separate global scales.
Each runs in raise mode (the intended check must raise) and in warn mode (then the KL of the engine's
generations against the learner, rollout_corr/kl, is measured: what a divergence alarm would see).
Exit code 1 if any fault is missed or the healthy sync is flagged.
"""


def add_arguments(p) -> None:
    p.add_argument("what", choices=("sync",), help="what to self-test")
    p.add_argument("--arch", default="qwen3_moe", help="tiny model architecture (default qwen3_moe)")
    p.add_argument("--recipe", default=None,
                   help="recipe whose precision: section both sides run (default: recipes/policies/"
                        "qwen3-moe-mxfp8-nvfp4-experts.yaml for MoE models, recipes/policies/qwen3-mxfp8.yaml "
                        "for dense)")
    p.add_argument("--engine", default="reference", choices=("reference", "vllm"),
                   help="sampler backend (default reference)")
    p.add_argument("--only", action="append", default=None, metavar="TEXT",
                   help="run only the faults whose name contains TEXT (repeatable)")
    p.add_argument("--off", action="append", default=[], metavar="CHECK",
                   help="turn a check off (repeatable), e.g. --off self_check: its faults are then reported MISSED "
                        "and the exit code is 1 (shows the selftest can fail)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the table as JSON")
    p.add_argument("--device", type=devices.torch_device, default="cpu",
                   help="where the learner, the engine and the staging buffer run (default cpu; cuda: the sync's "
                        "kernel paths, C2 and C4 from one engine call with its cached digest launch)")
    p.add_argument("--workdir", default=None, help="where to build the tiny model and checkpoints (default: temp)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a shared CPU more threads are much slower)")


def run(args) -> int:
    import json
    import os
    import tempfile
    from pathlib import Path

    import torch

    from miles_lp.checkpoint.tiny import ARCHS
    from miles_lp.errors import BackendUnavailable, ConfigError
    from miles_lp.sync.selftest import format_table, passed, run_selftest

    if args.arch not in ARCHS:
        raise ConfigError(f"--arch '{args.arch}': not a tiny-model architecture; choose from {', '.join(ARCHS)}")
    if args.engine == "vllm":
        raise BackendUnavailable("--engine vllm: this table's faults are injected through the reference engine's "
                                 "hooks and are not mapped onto the vLLM backend's (set_faults) yet. The vLLM engine "
                                 "answers C1-C4 from inside its process, each shown able to fail by its own fault "
                                 "injection in `pytest -m slow tests/e2e/test_run_vllm.py`; here, run --engine "
                                 "reference")
    from miles_lp.sync.config import CHECKS

    bad = [c for c in args.off if c not in CHECKS]
    if bad:
        raise ConfigError(f"--off {bad[0]}: no such check; known: {', '.join(CHECKS)}")
    from miles_lp.sync.selftest import FAULTS

    unmatched = [o for o in args.only or () if not any(o in f.name for f in FAULTS)]
    if unmatched:  # a typo would otherwise test nothing and print PASS
        raise ConfigError(f"--only {unmatched[0]!r} matches no fault; the faults are: "
                          + "; ".join(f.name for f in FAULTS))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="miles-lp-selftest-") as tmp:
            workdir = Path(args.workdir) if args.workdir else Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            rows = run_selftest(args.arch, args.recipe, workdir=workdir, only=args.only, off=tuple(args.off),
                                device=args.device)
    finally:
        torch.set_num_threads(threads)  # when called in-process (tests), leave the caller's setting
    table = format_table(rows)
    print()
    print(table)
    ok = passed(rows)
    print(f"\nselftest sync: {'PASS' if ok else 'FAIL'} (healthy {rows[0].verdict}; "
          f"{sum(r.verdict == 'CAUGHT' for r in rows)} caught, {sum(r.verdict == 'MISSED' for r in rows)} missed, "
          f"{sum(r.verdict == 'N/A' for r in rows)} not applicable)")
    if args.json:
        out = Path(args.json)
        tmp_out = out.with_name(out.name + ".tmp")
        tmp_out.write_text(json.dumps({"arch": args.arch, "engine": args.engine, "device": args.device,
                                       "passed": ok,
                                       "rows": [r.as_dict() for r in rows]}, indent=2, default=str) + "\n")
        os.replace(tmp_out, out)
    return 0 if ok else 1
