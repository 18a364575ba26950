"""Make a preset's entry of the committed learning-rate table (curvlab/jobs/lr_table.json) by the full search.

    python experiments/lr_table.py PRESET [OUT_DIR]

The reproduction's `lr_source="table"` presets read their learning rates from that table and only check
them on a 3-point grid, so a ten-minute run need not repeat the search. Rerun this when a preset's model,
data or horizon changes, and commit the table.
"""

import json
import sys
from pathlib import Path

from curvlab.jobs.presets import PRESETS
from curvlab.jobs.reproduce import search_lr_table

if __name__ == "__main__":
    name = sys.argv[1]
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("results") / f"lr-table-{name}"
    print(json.dumps(search_lr_table(PRESETS[name], out)["chosen"], indent=1))
