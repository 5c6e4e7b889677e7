"""`miles-lp explain --plot`: the precision plan as a picture (decoder layer x role, colour = format).

``plan_grid(plan)`` is the data (tested); ``plot_plan(plan, path)`` draws it with matplotlib's Agg backend,
imported here and only here, lazily (inside ``plot_plan``), so that the policy and the CLI never need matplotlib otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from miles_lp.formats.spec import Format
from miles_lp.policy.plan import PrecisionPlan
from miles_lp.policy.roles import Role

#: Top-to-bottom row order: a layer's data flow (attention, then routing, then the MLP), model-level tensors at
#: the ends. Roles absent from the plan get no row.
ROW_ORDER: tuple[Role, ...] = (
    Role.EMBEDDING, Role.ATTENTION_QKV, Role.MLA_Q_A, Role.MLA_Q_B, Role.MLA_KV_A, Role.MLA_KV_B,
    Role.ATTENTION_OUT, Role.ROUTER, Role.ROUTER_BIAS, Role.SHARED_EXPERT_GATE, Role.DENSE_MLP,
    Role.SHARED_EXPERTS, Role.ROUTED_EXPERTS, Role.MTP_PROJ, Role.NORM, Role.BIAS, Role.LM_HEAD, Role.OTHER,
)

#: One colour per format, colour-blind safe (Okabe-Ito); BF16 a light grey so the low-precision cells stand out.
FORMAT_COLOURS: dict[Format, str] = {
    Format.BF16: "#d9d9d9", Format.MXFP8: "#0072b2", Format.NVFP4: "#e69f00",
    Format.FP8_BLOCK: "#009e73", Format.FP8_TENSOR: "#cc79a7",
}

MODEL_COLUMN = "model"  # tensors outside the decoder layers (embedding, final norm, lm_head)


@dataclasses.dataclass(frozen=True)
class Cell:
    """The tensors of one (role, column): parameters per format, and whether invariants decided them all."""

    params: dict[Format, int]
    invariant: bool

    def shares(self) -> list[tuple[Format, float]]:
        total = sum(self.params.values()) or 1
        return [(f, self.params[f] / total) for f in Format if f in self.params]


@dataclasses.dataclass(frozen=True)
class PlanGrid:
    roles: list[Role]  # rows, top to bottom
    columns: list[str]  # "model", then "0".."L-1", then "mtp0".. for MTP layers
    cells: dict[tuple[Role, str], Cell]
    params: dict[Format, int]  # totals per format


def _column(layer: int | None, num_layers: int) -> str:
    if layer is None:
        return MODEL_COLUMN
    return str(layer) if layer < num_layers else f"mtp{layer - num_layers}"


def plan_grid(plan: PrecisionPlan) -> PlanGrid:
    """Aggregate the plan per (role, decoder layer): parameters per format in each cell."""
    acc: dict[tuple[Role, str], dict[Format, int]] = {}
    decided_by_rule: set[tuple[Role, str]] = set()
    totals: dict[Format, int] = {}
    layers: set[int] = set()
    has_model = False
    for e in plan.entries.values():
        col = _column(e.layer, plan.num_layers)
        if e.layer is None:
            has_model = True
        else:
            layers.add(e.layer)
        n = math.prod(e.shape) if e.shape else 1
        per = acc.setdefault((e.role, col), {})
        per[e.format] = per.get(e.format, 0) + n
        totals[e.format] = totals.get(e.format, 0) + n
        if not e.rule.startswith("invariant:"):
            decided_by_rule.add((e.role, col))
    present = {role for role, _ in acc}
    roles = [r for r in ROW_ORDER if r in present]
    columns = ([MODEL_COLUMN] if has_model else []) + [_column(i, plan.num_layers) for i in sorted(layers)]
    cells = {k: Cell(v, k not in decided_by_rule) for k, v in acc.items()}
    return PlanGrid(roles, columns, cells, totals)


def plot_plan(plan: PrecisionPlan, path: str | Path, *, title: str | None = None) -> Path:
    """Write the plan grid as a PNG to ``path``. A cell holding several formats is split in proportion to the
    parameters in each (e.g. a layer whose experts differ); hatched cells are kept BF16 by the invariants
    (embeddings, norms, routers, ...), plain grey cells by a rule or the default."""
    # Agg canvas on a bare Figure, not pyplot: no process-global backend switch, no figure registry to leak.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    grid = plan_grid(plan)
    n_cols, n_rows = len(grid.columns), len(grid.roles)
    # x position per column, with an empty column of gap where the kind changes (model | layers | MTP), so
    # that the separators and the tick labels of neighbouring groups do not collide
    xs: list[float] = []
    for i, c in enumerate(grid.columns):
        gap = 1.0 if i and c.isdigit() != grid.columns[i - 1].isdigit() else 0.0
        xs.append((xs[-1] + 1.0 + gap) if xs else 0.0)
    width = min(max(6.0, 2.6 + 0.2 * xs[-1]), 22.0)
    height = 1.9 + 0.34 * n_rows
    fig = Figure(figsize=(width, height), dpi=130)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for (role, col), cell in grid.cells.items():
        x, y = xs[grid.columns.index(col)], grid.roles.index(role)
        bottom = y - 0.42
        for fmt, share in cell.shares():
            ax.add_patch(Rectangle((x - 0.42, bottom), 0.84, 0.84 * share, facecolor=FORMAT_COLOURS[fmt],
                                   edgecolor="none"))
            bottom += 0.84 * share
        if cell.invariant:
            ax.add_patch(Rectangle((x - 0.42, y - 0.42), 0.84, 0.84, fill=False, hatch="////",
                                   edgecolor="#8c8c8c", linewidth=0))
    ax.set_xlim(-0.6, xs[-1] + 0.6)
    ax.set_ylim(n_rows - 0.5, -0.5)  # first role at the top
    ax.set_yticks(range(n_rows), [r.value for r in grid.roles], fontsize=8)
    step = 1 if n_cols <= 24 else 5
    ticks = [i for i, c in enumerate(grid.columns) if not c.isdigit() or int(c) % step == 0
             or i == n_cols - 1 or not grid.columns[i + 1].isdigit()]  # also the last decoder layer
    ax.set_xticks([xs[i] for i in ticks], [grid.columns[i] for i in ticks], fontsize=7)
    for i in range(1, n_cols):  # dotted separator in the middle of each gap
        if xs[i] - xs[i - 1] > 1.0:
            ax.axvline((xs[i] + xs[i - 1]) / 2, color="#8c8c8c", linestyle=":", linewidth=0.8)
    ax.set_xlabel("decoder layer" + ("  (model: tensors outside the layers)" if MODEL_COLUMN in grid.columns
                                     else ""), fontsize=8)
    ax.tick_params(length=0)
    for side in ("top", "right", "left", "bottom"):
        ax.spines[side].set_visible(False)
    total = sum(grid.params.values()) or 1
    handles = [Patch(facecolor=FORMAT_COLOURS[f], label=f"{f.value}  {grid.params[f] / total:.1%} of params")
               for f in Format if f in grid.params]
    handles.append(Patch(facecolor=FORMAT_COLOURS[Format.BF16], hatch="////", edgecolor="#8c8c8c",
                         label="bf16 by invariant"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    head = title or "precision plan"
    mtp = f" + {plan.num_mtp_layers} MTP" if any(c.startswith("mtp") for c in grid.columns) else ""
    ax.set_title(f"{head}\n{plan.model_type}, {plan.num_layers} layers{mtp}, {len(plan.entries)} tensors  -  "
                 f"plan sha256 {plan.hash[:16]}", fontsize=9, loc="left")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png")
    return out
