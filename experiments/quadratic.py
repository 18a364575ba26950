"""The paper's Section 5 on the stylized Kronecker quadratic: the worked example and the phase sweep.

    python experiments/quadratic.py [OUT_DIR]

Same as `curvlab quadratic --out OUT_DIR` with the defaults of docs/science.md section 7.
"""

import json
import sys
from pathlib import Path

from curvlab.output.plots import quadratic_phase, quadratic_trajectories
from curvlab.studies.quadratic import quadratic_study
from curvlab.util.atomic import atomic_write_text


def main(out: Path) -> None:
    result = quadratic_study()
    atomic_write_text(out / "quadratic.json", json.dumps(result))
    quadratic_trajectories(result, out / "quadratic_trajectories")
    quadratic_phase(result, out / "quadratic_phase")
    print(json.dumps(result["example"]["closed_forms"], indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results/quadratic"))
