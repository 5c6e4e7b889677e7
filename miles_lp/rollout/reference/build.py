"""The reference engine's build and load (``ReferenceEngine``'s first job).

The transformers model is built from ``config.json`` with no random init: every parameter is loaded, and a tensor
the model lacks or a parameter the checkpoint lacks is a ``CheckpointError``. Every ``nn.Linear`` becomes an
``EngineLinear`` and every fused experts module an ``EngineExperts`` of per-expert ``EngineLinear`` (the
checkpoint's own names), in the format the engine reads from ``quantization_config`` (``rollout.checkpoint``).
The tensor index built here (name -> owning module, attribute, the tensor captured at load, the spec an update
must match) is what the updates write through and the checks read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles_lp.errors import CheckpointError
from miles_lp.formats.spec import Format
from miles_lp.rollout.checkpoint import EngineCheckpoint, iter_tensors
from miles_lp.rollout.engine import EngineError, WeightUpdateError
from miles_lp.rollout.layers import EngineExpert, EngineExperts, EngineLinear, share_input_caches
from miles_lp.rollout.reference.faults import EngineFaults


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device '{spec}': no CUDA device is available here; use device='cpu'")
    return dev


def resolve_dtype(spec: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(spec, torch.dtype):
        return spec
    if spec in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
    if spec not in table:
        raise EngineError(f"dtype must be auto, fp32 or bf16, got {spec!r}")
    return table[spec]


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def is_fused_experts(module: torch.nn.Module) -> bool:
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.nn.Parameter) and gu.dim() == 3 and isinstance(down, torch.nn.Parameter)
            and down.dim() == 3)


def set_child(root: torch.nn.Module, dotted: str, new: torch.nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


class ReferenceBuild:
    """``ReferenceEngine``'s build and load. Reads ``ckpt``, ``device``, ``act_dtype``, ``faults`` and
    ``activation_mode`` (set by the engine's ``__init__`` first); sets ``hf_config``, ``layout``, ``_cache_kwarg``
    and the tensor index: ``_owner`` / ``_captured`` / ``_expected`` by on-disk name, and the flat lookups the
    checks read (``_entry``, ``_entries``, ``_owner_names``, ``_params_only``, ``_homes``, ``_idicts``,
    ``_attrs``)."""

    ckpt: EngineCheckpoint
    device: torch.device
    act_dtype: torch.dtype
    faults: EngineFaults
    activation_mode: str
    model: torch.nn.Module

    def _build_model(self) -> torch.nn.Module:
        import transformers

        cfg = transformers.AutoConfig.for_model(**self.ckpt.config)
        self.hf_config = cfg
        with _no_init_weights(), torch.device(self.device):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=self.act_dtype)
        model.eval()
        import inspect

        # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        ck = self.ckpt
        from miles_lp.policy import get_layout

        # in-memory (transformers-5) names -> the checkpoint's canonical names (Mixtral: mlp.experts.gate_up_proj
        # holds block_sparse_moe.experts.{e}.w1/w3; mlp.gate is block_sparse_moe.gate)
        self.layout = get_layout(ck.config)
        tied = bool(getattr(cfg, "tie_word_embeddings", False)) and "lm_head.weight" not in ck.tensors
        if tied:
            model.tie_weights()  # lm_head reads the embedding's tensor (from_config under no_init_weights leaves them apart)
            if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
                raise CheckpointError("tie_word_embeddings is set but transformers did not tie lm_head to the embedding")
        quantized_weights = set(ck.formats)
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear):
                if name == "lm_head" and tied:
                    continue  # shares the embedding's tensor (loaded once, under its embedding name)
                canon = self._canonical(f"{name}.weight")
                set_child(model, name, self._engine_linear(canon[: -len(".weight")], module.in_features,
                                                            module.out_features, module.bias is not None))
                quantized_weights.discard(canon)
            elif is_fused_experts(module):
                if getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
                    raise CheckpointError(f"'{name}': experts module {type(module).__name__} (transposed or biased "
                                          "experts) is not supported by the reference engine")
                e_count, two_i, hidden = module.gate_up_proj.shape
                inter = two_i // 2
                gu = self.layout.describe(f"{name}.gate_up_proj").members  # (e0.gate, e0.up, e1.gate, ...)
                dn = self.layout.describe(f"{name}.down_proj").members
                if len(gu) != 2 * e_count or len(dn) != e_count:
                    raise CheckpointError(f"'{name}': the layout names {len(gu)} gate/up and {len(dn)} down tensors "
                                          f"for {e_count} experts")
                experts = [EngineExpert(self._engine_linear(strip_weight(gu[2 * e]), hidden, inter, False),
                                        self._engine_linear(strip_weight(gu[2 * e + 1]), hidden, inter, False),
                                        self._engine_linear(strip_weight(dn[e]), inter, hidden, False))
                           for e in range(e_count)]
                quantized_weights.difference_update([*gu, *dn])
                apply_gate = None
                if getattr(type(module), "_apply_gate", None) is not None and \
                        type(module)._apply_gate.__name__ != "_default_apply_gate":
                    apply_gate = module._apply_gate  # the architecture's own gating (keeps the old module alive)
                    module.gate_up_proj = module.down_proj = None  # ... but not its empty fused tensors
                set_child(model, name, EngineExperts(experts, module.act_fn, apply_gate))
        model.requires_grad_(False)  # a sampler: no autograd state on any tensor
        share_input_caches(model)
        if quantized_weights:
            raise CheckpointError(f"the quantization config quantizes {len(quantized_weights)} weight(s) the model "
                                  f"has no linear layer for, e.g. {sorted(quantized_weights)[:3]}")
        return model

    def _canonical(self, name: str) -> str:
        """The checkpoint name of in-memory tensor ``name`` (itself unless the layout maps it to one other)."""
        members = self.layout.describe(name).members  # unknown names describe as themselves
        return members[0] if len(members) == 1 else name

    def _engine_linear(self, name: str, k: int, n: int, bias: bool) -> EngineLinear:
        """An ``EngineLinear`` for the checkpoint module ``name`` (its canonical prefix, without ``.weight``)."""
        ck = self.ckpt
        wname = f"{name}.weight"
        fmt = ck.format_of(wname)
        h = ck.tensors.get(wname)
        wdtype = getattr(torch, h.dtype) if (h is not None and fmt is Format.BF16) else torch.bfloat16
        serve = None
        if name == "lm_head" and self.faults.quantize_lm_head and fmt is Format.BF16:
            serve = Format.MXFP8
        return EngineLinear(f"{name}.", k, n, disk_format=fmt, target=ck.target, bias=bias, weight_dtype=wdtype,
                            activation_scale=ck.activation_scale.get(wname, "token"), act_dtype=self.act_dtype,
                            device=self.device, serve_format=serve, activation_mode=self.activation_mode)

    def _index_tensors(self) -> None:
        """name -> (owner module, attribute, tensor captured now, owning EngineLinear or None), on-disk names."""
        self._owner: dict[str, tuple[torch.nn.Module, str, EngineLinear | None]] = {}
        self._captured: dict[str, torch.Tensor] = {}
        seen: dict[int, str] = {}
        for mname, module in self.model.named_modules():
            local = list(module.named_parameters(recurse=False)) + [
                (b, t) for b, t in module.named_buffers(recurse=False) if b not in module._non_persistent_buffers_set]
            for attr, t in local:
                if isinstance(module, EngineLinear):
                    full = module.prefix + attr  # the checkpoint's name, whatever the module path
                else:
                    full = self._canonical(f"{mname}.{attr}" if mname else attr)
                if id(t) in seen:  # a tied tensor: loaded and updated under its first name
                    continue
                seen[id(t)] = full
                self._owner[full] = (module, attr, module if isinstance(module, EngineLinear) else None)
                self._captured[full] = t
        self._expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for full, (_module, attr, layer) in self._owner.items():
            t = self._captured[full]
            if layer is not None:
                dtype, shape = layer.canonical_specs()[attr]
            else:
                h = self.ckpt.tensors.get(full)
                dtype = getattr(torch, h.dtype) if h is not None else t.dtype
                shape = tuple(t.shape)
            self._expected[full] = (dtype, shape)
        # name -> (module.__dict__, attribute, module): the live lookup without a frame per tensor (``introspect.live_gather``)
        self._entry = {n: (m.__dict__, a, m) for n, (m, a, _) in self._owner.items()}
        self._entries = list(self._entry.values())
        self._owner_names = list(self._entry)
        # the same lookups as C-level maps when every tensor is a registered parameter (the usual case): its
        # module's ``_parameters`` dict, unless the instance dict shadows the name (then ``introspect.live_gather``)
        homes = [m.__dict__["_parameters"] for m, a, _ in self._owner.values()]
        self._params_only = all(a in h for h, (_, a, _) in zip(homes, self._owner.values(), strict=True))
        self._homes = homes
        self._idicts = [m.__dict__ for m, _, _ in self._owner.values()]
        self._attrs = [a for _, a, _ in self._owner.values()]
        self._fp_plans: dict[int, tuple] = {}  # id(groups) -> (groups, names, entries, dtypes): C2's engine side

    def _load_all(self) -> None:
        ck = self.ckpt
        unknown = sorted(set(ck.tensors) - set(self._owner))
        if unknown:
            raise CheckpointError(f"{ck.root}: {len(unknown)} tensor(s) the engine's model has no parameter for, e.g. "
                                  f"{unknown[:3]} (is config.json's quantization_config the one this checkpoint was "
                                  "written with?)")
        missing = sorted(set(self._owner) - set(ck.tensors))
        if missing:
            raise CheckpointError(f"{ck.root}: {len(missing)} parameter(s) of the model are not in the checkpoint, "
                                  f"e.g. {missing[:3]}; the engine loads every tensor (no random init)")
        for name, h in ck.tensors.items():
            self._check(name, getattr(torch, h.dtype), h.shape, where=f"{ck.root}")
        with torch.no_grad():
            for name, t in iter_tensors(ck):
                self._captured[name].copy_(t)

    def _check(self, name: str, dtype: torch.dtype, shape: Sequence[int], where: str) -> None:
        exp = self._expected.get(name)
        if exp is None:
            raise WeightUpdateError(f"{where}: unknown parameter '{name}' (names are the checkpoint's on-disk tensor "
                                    f"names for target {self.ckpt.target})")
        if dtype != exp[0]:
            raise WeightUpdateError(f"{where}: '{name}' has dtype {str(dtype).removeprefix('torch.')}, the engine "
                                    f"holds {str(exp[0]).removeprefix('torch.')}")
        if tuple(shape) != tuple(exp[1]):
            raise WeightUpdateError(f"{where}: '{name}' has shape {list(shape)}, the engine holds {list(exp[1])}")


def strip_weight(name: str) -> str:
    """``<module>.weight`` -> ``<module>`` (a layout member's module prefix)."""
    return name[: -len(".weight")]
