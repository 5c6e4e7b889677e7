"""``miles-lp verify``: check a converted checkpoint against its plan (and, with --source, its input)."""

from __future__ import annotations

HELP = "verify a converted checkpoint: tensors, engine config (C1), scales, and with --source the grid (C2)"
DESCRIPTION = HELP + """

Checks (each reports pass, FAIL, or skip with the reason):
  record   miles_lp_plan.json present, plan hash intact
  index    shard headers valid, index names exactly the stored tensors
  tensors  every tensor the plan and the declared scheme imply (e.g. compressed-tensors W4A4
           input_global_scale), with the target's dtype and shape, nothing else
  config   quantization_config / hf_quant_config.json equal the plan's emitters' output, and the engine's
           own skip-matching selects exactly the plan's quantized weights (C1, offline)
  scales   finite and in range (E8M0 != 0xFF, E4M3 finite and >= 0, global scales > 0, the static
           activation scale 1.0); every fused group (q/k/v, gate/up) stores ONE NVFP4 global scale and
           its largest block scale is 448 (global scale = group amax / 2688)
  source   (--source) the input files are the ones converted (sha256)
  grid     (--source) quantized bytes equal a second, independent reference codec's quantization of the
           source (fused groups from their joint amax); other tensors equal the source (C2)
  error    (--source) decoded weights within each format's element-wise bound
Exit code 0 only if no check fails.
"""


def add_arguments(p) -> None:
    p.add_argument("out", metavar="OUT", help="converted checkpoint folder")
    p.add_argument("--source", metavar="IN", default=None, help="the input HF checkpoint, to compare against")


def run(args) -> int:
    from miles_lp.checkpoint.verify import verify_checkpoint

    report = verify_checkpoint(args.out, source=args.source)
    print(report.format())
    return 0 if report.ok else 1
