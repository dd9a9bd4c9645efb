"""A GPT on dp=2 x tp=2, written as for one device. Run: polyshard run -n 4 examples/train_gpt.py"""

import torch
import torch.distributed as dist

import polyshard as ps
from polyshard import models
from polyshard.data.corpus import TokenBatches, load_corpus

mesh = ps.init({"dp": 2, "tp": 2})
model = models.build("gpt-tiny", seed=0)
ps.shard(model.blocks[0].mlp.fc, in_strategy=((1, 1, 1), (2, 1)))  # optional: pin one module
pm = ps.parallelize(model)
opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
batches = TokenBatches(load_corpus(), batch_size=8, seq_len=model.cfg.seq_len, seed=0)
for step in range(20):
    x, y = pm.local_batch(*next(batches))  # every rank draws the same global batch, keeps its rows
    loss = pm(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0 and step % 5 == 0:
        print(f"step {step} loss {loss.item():.4f}")
if dist.get_rank() == 0:
    print(pm.plan.summary())
del pm, opt
dist.barrier()
dist.destroy_process_group()
