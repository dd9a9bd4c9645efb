"""A transformers Llama, unmodified, on 4 processes: 2 data-parallel x 2 tensor-parallel.

    polyshard run -n 4 examples/train_hf_llama.py

The model is built from a config (random weights; nothing is downloaded) and called as its users
call it: ``model(input_ids=..., labels=...).loss``. polyshard captures it with torch.export, splits
q/k/v and the MLP's gate/up column-wise and o/down row-wise, and averages gradients over dp.
"""

import torch
import torch.distributed as dist

import polyshard as ps
from polyshard.models import hf

ps.init("dp=2,tp=2")
torch.manual_seed(0)
model = hf.build("llama")                                  # LlamaForCausalLM, 2 layers, grouped-query attention
batch = hf.batch(model, rows=8, seq=32)                    # {"input_ids": ..., "labels": ...}
pm = ps.parallelize(model, example_inputs={k: v[:4] for k, v in batch.items()})  # one rank's rows
opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
for step in range(20):
    ids, labels = pm.local_batch(batch["input_ids"], batch["labels"])
    loss = pm(input_ids=ids, labels=labels).loss           # the model's own output type and loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {loss.item():.4f}")
if dist.get_rank() == 0:
    print(pm.plan.summary())
