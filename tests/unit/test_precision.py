"""Half precision over programs torch.export captured: the model's own float32 casts, in each form export records
them and inside the bodies of the higher-order ops it wraps regions in, compute in the half dtype."""

import copy
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import polyshard as ps
from polyshard.train.trainer import make_optimizer


class RotaryLM(nn.Module):
    """A rotary table built as transformers 5.17's Llama builds one: under ``no_grad`` (a higher-order op in the
    export), ``inv_freq.to(dtype=float, device=...)`` (aten.to.device) times ``positions.float()``
    (aten.to.dtype), with export's checks of both dtypes in the op's body."""

    def __init__(self, vocab: int = 32, dim: int = 16):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[1], device=h.device)[None].expand(input_ids.shape[0], -1)
        with torch.no_grad():
            inv = self.inv_freq[None, :, None].expand(positions.shape[0], -1, 1).to(dtype=torch.float, device=h.device)
            freqs = (inv @ positions[:, None, :].float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        half = h.shape[-1] // 2
        h = h * cos + torch.cat((-h[..., half:], h[..., :half]), dim=-1) * sin  # rotate_half, as transformers
        return F.cross_entropy(self.head(h).flatten(0, 1).float(), labels.flatten())


def test_casts_in_every_form_and_in_wrapped_regions_compute_in_bf16():
    ps.init()
    torch.manual_seed(0)
    ref = RotaryLM()
    model = copy.deepcopy(ref)
    batches = [{"input_ids": ids, "labels": ids.roll(-1, 1)} for ids in torch.randint(0, 32, (3, 4, 8))]
    pm = ps.parallelize(model, example_inputs=batches[0], settings={"precision": "bf16"})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with tempfile.TemporaryDirectory() as scratch:
        opt = make_optimizer(pm, 1e-2, scratch)
        for batch in batches:
            loss, ref_loss = pm(**batch), ref(**batch)
            assert loss.dtype == torch.bfloat16
            for one, step in ((loss, opt), (ref_loss, ref_opt)):
                one.backward()
                step.step()
                step.zero_grad()
            assert abs(loss.item() - ref_loss.item()) < 1e-2 * ref_loss.item(), (loss, ref_loss)
