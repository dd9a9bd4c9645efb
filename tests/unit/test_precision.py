"""Half precision over captured programs: the model's own float32 casts, in each form torch.export records them and
inside the bodies of the higher-order ops it wraps regions in, compute in the half dtype; the loss in float32."""

import copy
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import polyshard as ps
from polyshard.runtime.precision import compute_casts_in
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
            assert loss.dtype == torch.float32  # the loss over float32 logits
            for one, step in ((loss, opt), (ref_loss, ref_opt)):
                one.backward()
                step.step()
                step.zero_grad()
            assert abs(loss.item() - ref_loss.item()) < 1e-2 * ref_loss.item(), (loss, ref_loss)


def test_the_loss_runs_over_its_logits_cast_to_float32():
    """A loss over bf16 logits (no cast in the model's code) runs as Megatron-LM, torchtitan and transformers run
    theirs: over the logits cast to float32, exactly; the same loss in bf16 differs (what the test tells apart)."""
    ps.init()
    torch.manual_seed(0)
    model = _Head()
    x, y = torch.randn(64, 16), torch.randint(0, 512, (64,))
    pm = ps.parallelize(copy.deepcopy(model), example_inputs=(x, y), settings={"precision": "bf16"})
    with tempfile.TemporaryDirectory() as scratch:
        make_optimizer(pm, 1e-2, scratch)  # casts the parameters to bf16
        compute_casts_in(pm, torch.bfloat16)  # again: the loss's cast is not doubled
        loss = pm(x, y)
    casts = [n for m in pm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes
             if n.op == "call_method" and n.args[1:] == (torch.float32,)]
    assert len(casts) == 1, casts
    logits = model.to(torch.bfloat16).head(x.to(torch.bfloat16))
    want = F.cross_entropy(logits.float(), y)
    assert loss.dtype == torch.float32 and torch.equal(loss, want), (loss, want)
    assert not torch.equal(F.cross_entropy(logits, y).float(), want)


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 512)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(x), y)


def test_the_loss_is_priced_as_it_runs_cast_to_float32():
    """What the cost model adds for a loss under bf16 over fp32 is what running it so adds, counted op by op (the
    logits cast up, their gradient cast down): a bf16 loss moves more than a float32 one, not half as much."""
    from polyshard.graph.capture import capture
    from polyshard.graph.ops import CROSS_ENTROPY, LOSS_DTYPE, op_name
    from polyshard.graph.upcast import _Traffic
    from polyshard.planner.cost.compute import TRAIN_FLOPS_PER_FORWARD, forward_bytes
    from polyshard.planner.propagate import propagate

    x, y = torch.randn(64, 16), torch.randint(0, 512, (64,))
    gm = capture(_Head(), (x, y))
    plan, modules = propagate(gm, (), lambda _: None), dict(gm.named_modules())
    loss = next(n for n in gm.graph.nodes if op_name(n) in CROSS_ENTROPY)
    priced = {size: forward_bytes(loss, plan.nodes[loss.name], modules, size) * TRAIN_FLOPS_PER_FORWARD
              for size in (2, 4)}
    counted = {}
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(64, 512, dtype=dtype, requires_grad=True)
        with _Traffic() as traffic:
            F.cross_entropy(logits.to(LOSS_DTYPE), y).backward()
        counted[dtype.itemsize] = traffic.bytes
    assert priced[2] > priced[4]
    assert priced[2] - priced[4] == pytest.approx(counted[2] - counted[4], rel=0.01), (priced, counted)
