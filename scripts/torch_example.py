"""A tiny GPT trained in PyTorch on jaxpt's input pipeline (data/torch.py), the loop docs/pytorch.md "From
PyTorch" shows. On CPU, two ranks:

    torchrun --nproc-per-node 2 scripts/torch_example.py --steps 40 --out /tmp/torch_example

Each rank reads its share of every global batch (packed rows, documents masked from each other
through segment_ids). At the end rank 0 saves the model and every rank its data position (JSON);
run again with more --steps, at any number of ranks, and it continues where it stopped. Any further
arguments are Hydra overrides, as train.py takes them (data.paths=..., tokenizer.path=...).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 128, layers: int = 2, heads: int = 4, max_len: int = 2048):
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, segment_ids, positions):
        n = input_ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=input_ids.device).tril()
        # a token sees the earlier tokens of its own document only (rows pack several)
        seen = causal & (segment_ids[:, :, None] == segment_ids[:, None, :])
        mask = ~seen.repeat_interleave(self.heads, dim=0)        # True: masked, [batch * heads, n, n]
        return self.head(self.blocks(self.tok(input_ids) + self.pos(positions), mask=mask))


def main() -> None:
    from data.torch import Batches

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("/tmp/torch_example"))
    args, overrides = parser.parse_known_args()
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank()
    batches = Batches(["data.seq_len=128", "data.global_batch_size=8", *overrides])    # rank, world: from dist
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(TinyGPT(batches.vocab_size))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start = 0
    if (args.out / "model.pt").exists():     # resume: the model, and the data after its last batch
        saved = torch.load(args.out / "model.pt")
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
        # every old rank's state: right whatever the number of ranks was
        batches.load_state_dict([json.loads(p.read_text()) for p in args.out.glob("data_rank*.json")])
    for step in range(start + 1, args.steps + 1):
        batch = next(batches)                # this rank's rows: [global_batch / world, seq_len] each
        logits = model(batch["input_ids"], batch["segment_ids"], batch["positions"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())    # -100: no loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step in (start + 1, args.steps)):
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    dist.barrier()                           # every rank has read the old data positions
    if rank == 0:
        for old in args.out.glob("data_rank*.json"):
            old.unlink()
        torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": args.steps},
                   args.out / "model.pt")
    dist.barrier()
    (args.out / f"data_rank{rank}.json").write_text(json.dumps(batches.state_dict()))
    batches.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
