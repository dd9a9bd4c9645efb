"""Layouts enumerated for exhaustive tests."""

import itertools

from polyshard.layout import Layout


def all_layouts(axes, ndim):
    """Every layout where each axis is replicated, partial, or splits one dim (mesh order)."""
    out = []
    for roles in itertools.product(["R", "P"] + list(range(ndim)), repeat=len(axes)):
        dims = [[] for _ in range(ndim)]
        partial = []
        for (name, _), role in zip(axes, roles):
            if role == "P":
                partial.append(name)
            elif role != "R":
                dims[role].append(name)
        out.append(Layout(axes, tuple(map(tuple, dims)), tuple(partial)))
    return out
