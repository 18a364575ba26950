"""The paper's Section 5 on the stylized Kronecker quadratic: the worked example and the phase sweep.

    python experiments/quadratic.py [OUT_DIR]

Same as `curvlab quadratic --out OUT_DIR` with the defaults of docs/science.md section 7.
"""

import json
import sys
from pathlib import Path

from curvlab.output.files import write_quadratic
from curvlab.theory.quadratic import quadratic_study


def main(out: Path) -> None:
    study = quadratic_study()
    write_quadratic(study, out)  # quadratic.json and both figures
    print(json.dumps(study.closed_forms.to_dict(), indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("results/quadratic"))
