"""One rank of tests/test_data_torch.py's two-rank test:
`torchrun --nproc-per-node 2 tests/torch_ranks.py OUT OVERRIDE...`.

Joins a real torch.distributed gloo group, reads its batches through torchdata's
StatefulDataLoader over Batches (rank and world from the group, the listing made once on rank 0),
saves the loader's state after FIRST batches, reads AFTER more, and writes OUT/rank<r>.npz (the
batches) and OUT/rank<r>.json (the loader's state, as JSON: what a checkpoint would keep)."""
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from data.torch import Batches  # noqa: E402

FIRST, AFTER = 2, 2


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = Batches(overrides)
    loader = StatefulDataLoader(batches, batch_size=None)
    it = iter(loader)
    got = [next(it) for _ in range(FIRST)]
    state = loader.state_dict()
    got += [next(it) for _ in range(AFTER)]
    np.savez(out / f"rank{rank}.npz", **{f"{i}/{k}": v.numpy() for i, b in enumerate(got) for k, v in b.items()})
    (out / f"rank{rank}.json").write_text(json.dumps({"state": state, "rank": batches.rank, "world": batches.world,
                                                      "pid": os.getpid()}))
    batches.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
