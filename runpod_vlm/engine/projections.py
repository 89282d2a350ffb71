"""Projections that read the same input (a decoder layer's query, key and value; its MLP's gate and up) as one
matrix product in the compiled decode step. At 64 rows on the H200 the query, key and value took three launches,
16 us a layer, and the gate and up two of 11 us (bench/results/profile-graph-step-cuda-fbf5012.txt).

At load, each group's weights move into one tensor and every projection's weight becomes a view of its rows:
memory and eager code are unchanged. The compiled step runs on a view of the model whose projections are slices
of their group's product (`with_shared_products`); dynamo traces that product once per slice, and
`OneProductPerInput` keeps one copy of it for inductor, which by itself keeps all three (it does not merge
repeated matrix products)."""

from __future__ import annotations

import functools
import itertools
import logging

from runpod_vlm.engine.compile import decoder_layers

log = logging.getLogger("runpod-vlm")

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # the names transformers' families use


def share_weights(model) -> int:
    """Each group of linear projections in the decoder layers that can join (plain ones of the same input size, dtype
    and device, all with a bias or none; or FP8's, engine/fp8.py) takes its weights from one tensor, and keeps the
    layer over all of it beside them; returns the number of groups joined."""
    joined = 0
    for layer in decoder_layers(model):
        for parent in layer.modules():
            for names in GROUPS:
                joined_group = _joined([getattr(parent, name, None) for name in names])
                if joined_group is None:
                    continue
                product, slices = joined_group
                # A plain attribute (no submodule): a view of the model shares it, and nothing counts it twice.
                vars(parent).setdefault("shared_products", []).append((names, product, slices))
                joined += 1
    if joined:
        log.info("%d groups of projections share one weight each (one product a group in the compiled step)", joined)
    return joined


def _joined(members: list):
    """The layer over `members`' weights and each member's rows of it (its weight becoming a view of them), or None
    where they do not join."""
    import torch

    kind = type(members[0])
    if any(type(member) is not kind for member in members):
        return None
    # Plain layers join here, FP8's join themselves (Fp8Linear.joined); other quantized layers do not.
    join = _joined_linear if kind is torch.nn.Linear else getattr(kind, "joined", None)
    if join is None:
        return None
    ends = list(itertools.accumulate(member.out_features for member in members))
    slices = [slice(end - member.out_features, end) for member, end in zip(members, ends)]
    product = join(members, slices)
    return None if product is None else (product, slices)


def _joined_linear(members: list, slices: list[slice]):
    """One plain linear layer over `members`' weights, one after the other, each member's weight and bias becoming
    views of its `slices` rows; None where they do not join (input sizes, dtypes, devices or biases differ)."""
    import torch

    first = members[0]
    if not all(
        member.in_features == first.in_features
        and member.weight.dtype == first.weight.dtype
        and member.weight.device == first.weight.device
        and (member.bias is None) == (first.bias is None)
        for member in members
    ):
        return None
    with torch.no_grad():
        weight = torch.cat([member.weight for member in members])
        bias = torch.cat([member.bias for member in members]) if first.bias is not None else None
    product = torch.nn.Linear(weight.shape[1], weight.shape[0], bias is not None, device="meta")
    product.weight = torch.nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        product.bias = torch.nn.Parameter(bias, requires_grad=False)
    for member, rows in zip(members, slices):
        member.weight = torch.nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            member.bias = torch.nn.Parameter(bias[rows], requires_grad=False)
    return product


@functools.cache
def _slice_of_product():
    """The module class of one projection of a group: its columns of the group's product (made here: this package
    imports torch only when it runs)."""
    import torch

    class SliceOfProduct(torch.nn.Module):
        def __init__(self, product, columns: slice):
            super().__init__()
            self.product, self.start, self.end = product, columns.start, columns.stop

        def forward(self, hidden_states):
            return self.product(hidden_states)[..., self.start : self.end]

    return SliceOfProduct


def with_shared_products(view) -> int:
    """In `view` (a copy of the model's module tree, `compile.model_view`), each group joined by `share_weights`
    becomes slices of one product over the group's whole weight; returns the number of groups."""
    groups = 0
    for layer in decoder_layers(view):
        for parent in layer.modules():
            for names, product, slices in vars(parent).get("shared_products", ()):
                for name, columns in zip(names, slices):
                    parent._modules[name] = _slice_of_product()(product, columns)
                groups += 1
    return groups


@functools.cache
def one_product_per_input():
    """The pre-grad graph pass (for torch.compile's `options`) that keeps the first of repeated linear products of
    the same input, weight and bias (torch's, or this package's ops: FP8's): a group's slices each traced it."""
    import torch
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    linear = {torch._C._nn.linear, torch.nn.functional.linear}

    class OneProductPerInput(CustomGraphPass):
        def __call__(self, graph) -> None:
            first: dict = {}
            for node in list(graph.nodes):
                if node.op != "call_function" or not (node.target in linear or _ours(node.target)):
                    continue
                key = (node.target, node.args, tuple(sorted(node.kwargs.items())))
                kept = first.setdefault(key, node)
                if kept is not node:
                    node.replace_all_uses_with(kept)
                    graph.erase_node(node)

        def uuid(self) -> bytes:  # inductor's cache keys compiled graphs by it
            return get_hash_for_files((__file__,))

    # Pickled by its name in this module (`__getattr__`): torch 2.11 pickles inductor's options into its cache keys,
    # and a class of a function's own could not be, which left every graph uncached (no compile artifacts).
    OneProductPerInput.__qualname__ = OneProductPerInput.__name__
    return OneProductPerInput()


def _ours(target) -> bool:
    """Whether `target` is one of this package's torch ops (`runpod_vlm::...`, products without side effects)."""
    return getattr(target, "namespace", None) == "runpod_vlm"


def __getattr__(name: str):
    if name == "OneProductPerInput":  # made at first use: this package imports torch only when it runs
        return type(one_product_per_input())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
