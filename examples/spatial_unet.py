"""A UNet segmenting images too large to keep whole on one device: each of 4 processes holds a quarter.

    polyshard run -n 4 examples/spatial_unet.py

The images (and their masks) are split by height and width on a 2 x 2 mesh (MindSpore's dataset
strategy ``(1, 1, 2, 2)``). Convolutions take the border rows and columns they need from their
neighbours, batch norm sums its statistics over the tiles, and the loss adds up the tiles' pixels,
so the run trains as one device would, each rank holding a quarter of the activations.
"""

import torch
import torch.distributed as dist

import polyshard as ps
from polyshard.models.unet import UNet

ps.init("h=2,w=2")
torch.manual_seed(0)
model = UNet(image_size=128)
g = torch.Generator().manual_seed(0)
images = torch.randn(4, 3, 128, 128, generator=g)                    # synthetic: nothing is downloaded
masks = (images.mean(1) > 0).long() + (images[:, 0] > 1).long()      # 3 classes per pixel
pm = ps.parallelize(model, example_inputs=(images, masks), dataset_strategy=((1, 1, 2, 2), (1, 2, 2)))
opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
tile_images, tile_masks = pm.local_batch(images, masks)              # this rank's 64 x 64 quarter
for step in range(20):
    loss = pm(tile_images, tile_masks)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if dist.get_rank() == 0 and step % 5 == 4:
        print(f"step {step + 1}: loss {loss.item():.4f}  (tile {tuple(tile_images.shape)})")
