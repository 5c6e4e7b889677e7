"""The reference every reader is compared with: a transformers forward of the DEQUANTIZED weights.

`dequantized_checkpoint(out, src, dst)` decodes every quantized weight of a converted checkpoint with our
codecs (``miles_lp.formats``, through ``miles_lp.export.naming.decode_components`` for the target's names)
and saves a BF16 checkpoint with the source's config; `prompt_logprobs(model, prompts)` is
``log_softmax`` of the logits at the tokens that follow (what vLLM returns as ``prompt_logprobs``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from miles_lp.formats.spec import Format


def _load_all(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def dequantized_state_dict(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """Canonical HF names -> BF16 tensors, quantized weights decoded exactly as the codecs define."""
    from miles_lp.export import naming
    from miles_lp.formats import MXFP8Tensor, NVFP4Tensor

    ckpt = Path(ckpt)
    record = json.loads((ckpt / "miles_lp_plan.json").read_text())
    target, entries = record["target"], record["plan"]["entries"]
    disk = _load_all(ckpt)
    sd: dict[str, torch.Tensor] = {}
    for name, row in entries.items():
        fmt = Format(row[0])
        if not fmt.quantized:
            if name in disk:
                sd[name] = disk[name]
            continue
        c = naming.decode_components(target, fmt, name, disk)
        if fmt is Format.MXFP8:
            q = MXFP8Tensor(c["data"], c["scale"])
        else:
            k = c["data"].shape[-1] * 2
            q = NVFP4Tensor(c["data"], c["scale"], c["global_scale"], torch.zeros(()),
                            (*c["data"].shape[:-1], k))
        sd[name] = q.dequantize(torch.bfloat16)
    return sd


def dequantized_checkpoint(ckpt: str | Path, src: str | Path, dst: str | Path) -> Path:
    """A BF16 HF checkpoint holding the dequantized weights of ``ckpt`` and the config of ``src``."""
    from safetensors.torch import save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in dequantized_state_dict(ckpt).items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        if (Path(src) / f).exists():
            shutil.copy2(Path(src) / f, dst / f)
    return dst


def planned_formats(ckpt: str | Path) -> dict[str, Format]:
    """``{module name: format}`` of the quantized linear modules, from the converter's record."""
    record = json.loads((Path(ckpt) / "miles_lp_plan.json").read_text())
    return {n.rsplit(".", 1)[0]: Format(row[0]) for n, row in record["plan"]["entries"].items()
            if Format(row[0]).quantized}


def quantize_activations(model, formats: dict[str, Format], only: frozenset[Format] | None = None) -> list:
    """Forward pre-hooks that quantize-dequantize each quantized linear's input as the declared scheme says:
    MXFP8 dynamic (1x32 blocks, TE's rule), NVFP4 with the static global scale the checkpoint carries
    (``input_scale`` / ``input_global_scale`` = S_enc 1, i.e. amax 2688) and dynamic block scales.
    ``only``: quantize the inputs of modules in these formats only (vLLM's MXFP8 emulation leaves activations in
    BF16, its NVFP4 one does not). Returns the hook handles (``.remove()`` them to get the weights-only
    reference back)."""
    from miles_lp.export.naming import INPUT_SCALE_VALUE
    from miles_lp.formats import quantize_mxfp8, quantize_nvfp4

    static_amax = torch.tensor(2688.0 * INPUT_SCALE_VALUE)

    def hook_for(fmt):
        def hook(mod, args):
            x = args[0]
            x2 = x.reshape(-1, x.shape[-1])
            if fmt is Format.MXFP8:
                q = quantize_mxfp8(x2, axis=-1)
            else:
                q = quantize_nvfp4(x2, scale_scope="tensor", amax=static_amax)
            return (q.dequantize(x.dtype).reshape(x.shape), *args[1:])
        return hook

    return [model.get_submodule(m).register_forward_pre_hook(hook_for(f)) for m, f in formats.items()
            if only is None or f in only]


def prompt_logprobs(model, prompts: list[list[int]]) -> list[list[float]]:
    """log p(token t | tokens < t) for t >= 1 of each prompt, from an fp32 log_softmax of the logits."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            logits = model(input_ids=ids).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            out.append([float(lp[i, p[i + 1]]) for i in range(len(p) - 1)])
    return out


def load_hf(path: str | Path, **kwargs):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16, **kwargs)
    return model.eval()


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |a - b| over every position (NaN if any side is NaN: a NaN is never "close")."""
    worst = 0.0
    for ra, rb in zip(a, b, strict=True):
        for x, y in zip(ra, rb, strict=True):
            d = abs(x - y)
            if d != d:
                return float("nan")
            worst = max(worst, d)
    return worst
