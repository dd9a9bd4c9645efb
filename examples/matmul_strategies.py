"""Semi-auto operator parallel on plain tensors. Run: polyshard run -n 4 examples/matmul_strategies.py"""

import torch
import torch.distributed as dist

import polyshard as ps

ps.init()  # 1-D mesh of all ranks
torch.manual_seed(0)
x, w, v = torch.randn(8, 6), torch.randn(6, 10), torch.randn(10, 4)

rows = ps.shard(torch.matmul, in_strategy=((2, 1), (1, 1)))      # rows of x split; leftover devices repeat
cols = ps.shard(torch.matmul, in_strategy=((1, 1), (1, 2)))      # columns of v split
contract = ps.shard(torch.matmul, in_strategy=((1, 2), (2, 1)))  # contraction split: partial sums

z = cols(rows(x, w), v)  # polyshard gathers the rows between the two matmuls by itself
p = contract(x, w)
z_full, p_full = z.full_tensor(), p.full_tensor()  # collectives: every rank takes part
if dist.get_rank() == 0:
    print("(x @ w) @ v:", z.placements, "matches:", torch.allclose(z_full, x @ w @ v, atol=1e-5))
    print("x @ w with k split:", p.placements, "matches:", torch.allclose(p_full, x @ w, atol=1e-5))
dist.destroy_process_group()
