"""Text of a LoRA fine-tuning comparison (:class:`curvlab.studies.adapters.FinetuneResult`): its table of
AdamW-over-variant ratios at matched validation loss, and the report section around it that ``curvlab finetune``
writes alone and ``curvlab reproduce`` appends to its ``report.md``."""

from __future__ import annotations

import math

from curvlab.output.cells import seeds_and_levels_cell, value_cell

FINETUNE_ROWS = (
    *("nds_ratio", "nds_ratio_median", "first_order_ratio", "curvature_penalty_ratio"),
    *("curvature_penalty_ratio_median", "update_norm_ratio", "rho_within_adamw", "rho_within_variant"),
    *("taylor_adamw_median", "taylor_variant_median"),
)


def finetune_table(result) -> list[str]:
    """The markdown table of a fine-tuning comparison (:class:`curvlab.studies.adapters.FinetuneResult`):
    every entry with its interval, its seeds and its levels over all seeds."""
    lines = ["| quantity | comparison | value [95% CI] | seeds, levels in all |", "|---|---|---:|---:|"]
    for c in result.comparisons:
        for name in FINETUNE_ROWS:
            e = result.entry(name, c.variant)
            quantity = e.quantity.replace("variant", c.variant)
            lines.append(f"| {quantity} | adamw/{c.variant} | {value_cell(e)} | {seeds_and_levels_cell(e)} |")
    return lines


def finetune_section(result) -> list[str]:
    """The report section of a fine-tuning comparison: table, learning rates, final losses, caveats."""
    t = result.timing
    lines = [
        "## Curvature of adapter steps (LoRA fine-tuning)",
        "",
        "AdamW over each Muon variant at matched validation loss (s = 1), adapter parameters only, one block "
        "per adapted layer (A and B together); ratios of sums over seeds and levels with 95% seed-level "
        "intervals (t on per-seed log ratios, or Fieller's).",
        "",
        *finetune_table(result),
        "",
        "Tuned learning rates: " + ", ".join(f"{a} {lr:g}" for a, lr in result.chosen_lr.items()) + ".",
        "Final validation loss (per seed): "
        + "; ".join(f"{a} {', '.join(f'{x:.3f}' for x in v)}" for a, v in result.final_loss.items())
        + ".",
    ]
    if "total" in t:
        lines.append(
            f"Wall time {t['total']:.0f} s on {t.get('threads', '?')} thread(s), "
            f"load average {t.get('load', math.nan):.1f}"
            + (f", over {t['invocations']:.0f} invocations." if t.get("invocations", 1) > 1 else ".")
        )
    refused = sum(len(c.refused) for c in result.comparisons)
    if refused:
        lines.append(f"{refused} level(s) or seed(s) found no match (see finetune.json, `refused`).")
    lines += ["", "Caveats:", "", *(f"- {n}" for n in result.notes)]
    return lines
