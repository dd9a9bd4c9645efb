"""Rules for convolutional networks on images split by height and width (dims 2 and 3 of NCHW).

A window op (Conv2d, MaxPool2d) keeps its input's split where every tile's windows line up with its
output tile (polyshard.halo); lowering then exchanges the halo (polyshard.compiler.spatial). Other
windows gather the image first. Channels stay whole. A transposed convolution whose kernel equals its
stride, and nearest-neighbour upsampling by a whole factor, need no halo; bilinear upsampling by a whole
factor needs one row each side; a per-pixel cross-entropy adds up its tiles' losses.
"""

from __future__ import annotations

from torch import fx, nn

from polyshard.graph.capture import shape_of
from polyshard.errors import PolyshardError
from polyshard.halo import SPLIT_DIMS, halo, lines_up, pair
from polyshard.layout import Layout
from polyshard.plan import NodePlan
from polyshard.planner.rules.base import RuleContext


def window(node: fx.Node, module: nn.Module, ctx: RuleContext) -> NodePlan:
    """Conv2d or MaxPool2d: the image's split kept where the windows line up with the tiles."""
    x = node.args[0]
    src, shape = ctx.layout(x), shape_of(x)
    kernel, stride, padding, dilation = (pair(getattr(module, k)) for k in ("kernel_size", "stride", "padding",
                                                                            "dilation"))
    plain = not isinstance(module.padding, str) and not getattr(module, "ceil_mode", False) and \
        getattr(module, "padding_mode", "zeros") == "zeros"
    for d in (d for d in SPLIT_DIMS if plain and src.dims[d]):
        tile, reach = shape[d] // src.num_shards(d), halo(shape[d], src.num_shards(d), kernel[d - 2], stride[d - 2],
                                                           padding[d - 2])[:2]
        if max(reach) > tile:
            raise PolyshardError(f"`{node.target}` ({type(module).__name__}, kernel {kernel[d - 2]}) reaches "
                                 f"{max(reach)} rows past a tile of dim {d}, and the input {x.name} of shape "
                                 f"{tuple(shape)} in {src.num_shards(d)} tiles gives each {tile}; split dim {d} "
                                 f"into fewer tiles (at most {shape[d] // max(reach)}) or use larger images")
    kept = [d for d in SPLIT_DIMS if plain and src.dims[d] and lines_up(
        shape[d], src.num_shards(d), kernel[d - 2], stride[d - 2], padding[d - 2], dilation[d - 2])]
    for d in (d for d in SPLIT_DIMS if src.dims[d] and d not in kept):
        ctx.warn(f"`{node.target}` ({type(module).__name__}, kernel {kernel[d - 2]}, stride {stride[d - 2]}, padding "
                 f"{padding[d - 2]}) does not line up with tiles of {shape[d] // src.num_shards(d)} of the "
                 f"{shape[d]} rows of dim {d}; the image is gathered there. Tiles that divide by the stride, with "
                 "'same' padding (kernel - 1 = 2 x padding, or a 1x1 window), keep the split")
    need = _only(src, kept)
    params = {name: ctx.replicated(p.ndim) for name, p in module.named_parameters(recurse=False)}
    return NodePlan("spatial" if kept else "local", {x.name: need}, need, params=params)


def transposed(node: fx.Node, module: nn.ConvTranspose2d, ctx: RuleContext) -> NodePlan:
    """ConvTranspose2d whose kernel equals its stride (a UNet's up-convolution): each input pixel makes its
    own block of output pixels, so a tile makes its output tile with no halo."""
    x = node.args[0]
    src = ctx.layout(x)
    kernel, stride, padding, out_pad, dilation = (pair(getattr(module, k)) for k in (
        "kernel_size", "stride", "padding", "output_padding", "dilation"))
    kept = [d for d in SPLIT_DIMS if src.dims[d] and kernel[d - 2] == stride[d - 2] and not padding[d - 2]
            and not out_pad[d - 2] and dilation[d - 2] == 1]
    need = _only(src, kept)
    params = {name: ctx.replicated(p.ndim) for name, p in module.named_parameters(recurse=False)}
    return NodePlan("spatial" if kept else "local", {x.name: need}, need, params=params)


def upsample(node: fx.Node, module: nn.Upsample | None, ctx: RuleContext) -> NodePlan:
    """Upsampling by a whole factor (an ``nn.Upsample``, or ``F.interpolate`` when ``module`` is None):
    nearest-neighbour makes each pixel's own block, so a tile makes its output tile; bilinear (corners not
    aligned) blends each output pixel from its input neighbours, one row past the tile each side. Other
    modes, and a fixed output size (the whole image's), gather."""
    x = node.args[0]
    src = ctx.layout(x)
    mode, factor = upsampling(node, module)
    need = _only(src, SPLIT_DIMS if mode in ("nearest", "bilinear") else ())
    return NodePlan("spatial" if mode == "bilinear" and not need.is_replicated else "local", {x.name: need}, need)


def upsampling(node: fx.Node, module: nn.Upsample | None) -> tuple[str, tuple[int, int]]:
    """(mode, whole factor per dim) of an upsampling a tile can make alone or with a one-row halo; mode ""
    for any other (a fixed size, a fractional factor, aligned corners, antialiasing, another mode)."""
    given = vars(module) if module is not None else dict(zip(("input", "size", "scale_factor", "mode",
                                                                  "align_corners"), node.args))
    given = given | ({} if module is not None else node.kwargs)
    factor = given.get("scale_factor")
    factor = tuple(factor) if isinstance(factor, (tuple, list)) else (factor,) * 2
    mode = given.get("mode", "nearest")
    if given.get("size") is not None or any(f is None or f != int(f) for f in factor) or given.get("antialias") \
            or (mode == "bilinear" and given.get("align_corners")) or mode not in ("nearest", "bilinear"):
        return "", (1, 1)
    return mode, tuple(int(f) for f in factor)


def cross_entropy(node: fx.Node, ctx: RuleContext) -> NodePlan | None:
    """Cross-entropy of per-pixel logits (N, C, H, W) against targets (N, H, W), both split alike by height
    and width: each tile's losses summed, over the count of all tiles' counted pixels. None otherwise."""
    logits, target = node.args[:2]
    src = ctx.layout(logits)
    if src is None or src.ndim != 4 or not any(src.dims[d] for d in SPLIT_DIMS) or not _plain_loss(node):
        return None
    need = _only(src, SPLIT_DIMS)
    return NodePlan("spatial", {logits.name: need, target.name: need.with_dims([need.dims[0], *need.dims[2:]])},
                    ctx.replicated(0))


def _plain_loss(node: fx.Node) -> bool:
    """F.cross_entropy called with its defaults, ignore_index aside."""
    given = dict(node.kwargs)
    given.pop("ignore_index", None)
    return len(node.args) == 2 and all(given.get(k, v) == v for k, v in (
        ("weight", None), ("reduction", "mean"), ("label_smoothing", 0.0), ("size_average", None), ("reduce", None)))


def batch_norm(node: fx.Node, module: nn.Module, ctx: RuleContext) -> NodePlan:
    """BatchNorm2d: the image stays split, statistics summed over the tiles (and the data-parallel rows)."""
    x = node.args[0]
    need = _only(ctx.layout(x), SPLIT_DIMS)
    params = {name: ctx.replicated(p.ndim) for name, p in module.named_parameters(recurse=False)}
    return NodePlan("spatial" if not need.is_replicated else "local", {x.name: need}, need, params=params)


def global_pool(node: fx.Node, module: nn.AdaptiveAvgPool2d, ctx: RuleContext) -> NodePlan | None:
    """AdaptiveAvgPool2d to one pixel: each tile's mean, added up over the tiles; the result replicated.
    None for other output sizes (the caller gathers)."""
    if pair(module.output_size) != (1, 1):
        return None
    x = node.args[0]
    need = _only(ctx.layout(x), SPLIT_DIMS)
    return NodePlan("spatial" if not need.is_replicated else "local", {x.name: need}, ctx.replicated(need.ndim))


def _only(layout: Layout, dims) -> Layout:
    """``layout`` with only ``dims`` left split (and no partial sums)."""
    return layout.with_dims([d if i in dims else () for i, d in enumerate(layout.dims)])


SPATIAL_MODULES = {nn.Conv2d: window, nn.MaxPool2d: window, nn.ConvTranspose2d: transposed,
                   nn.BatchNorm2d: batch_norm, nn.AdaptiveAvgPool2d: global_pool, nn.Upsample: upsample}
