"""Write a curvlab checkpoint as a sharded (DCP) checkpoint for N ranks (one included), under torchrun:

    torchrun --standalone --nproc_per_node 2 experiments/to_sharded.py runs/muon/ckpt_000300.pt runs/muon-dcp

Then ``torchrun --standalone --nproc_per_node 2 -m curvlab nds runs/muon-dcp --fsdp`` analyses it.
"""

import argparse

from curvlab.runs.checkpoint import load_checkpoint
from curvlab.runs.dcp import convert_to_sharded
from curvlab.util.distributed import distributed_context

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--data", default=None, help="the data directory, if it moved")
    args = ap.parse_args()
    with distributed_context():
        convert_to_sharded(load_checkpoint(args.checkpoint), args.out, args.data)
