"""Broadcast buckets received straight into the served weights (``engines.builtin.weight_arena``)."""

from __future__ import annotations

import torch

from relax.engines.builtin.model_impl import ModelImpl
from relax.engines.builtin.model_runner import load_model
from relax.engines.builtin.weight_arena import build_arena
from relax.weights.flat_bucket import BucketSpec, flatten

CPU = torch.device("cpu")


def _model(tiny_preset) -> torch.nn.Module:
    return load_model(tiny_preset.model_dir, CPU, ModelImpl.NATIVE)


def _bucket(model: torch.nn.Module, names: list[str], scale: float) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {name: state[name] * scale for name in names}


def test_a_bucket_broadcast_into_the_arena_is_the_served_weights(tiny_preset) -> None:
    model = _model(tiny_preset)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n in before if n != "lm_head.weight"]  # the tied head follows the embedding
    spec = BucketSpec.of({n: before[n] for n in names})
    arena = build_arena(model, spec, CPU)
    assert arena is not None and arena.intact()
    assert all(torch.equal(model.state_dict()[n], before[n]) for n in names)  # moved, not changed
    new = _bucket(model, names, 0.5)
    wire, _ = flatten(new, spec)
    arena.buffer.copy_(wire)  # what group.broadcast(arena.buffer) does on a receiving engine
    served = model.state_dict()
    assert all(torch.equal(served[n], new[n]) for n in names)
    assert torch.equal(served["lm_head.weight"], new["model.embed_tokens.weight"])  # still tied


def test_layouts_the_model_cannot_live_in_are_refused_before_anything_moves(tiny_preset) -> None:
    model = _model(tiny_preset)
    state = model.state_dict()
    pointers = {n: t.data_ptr() for n, t in state.items()}
    tied = BucketSpec.of({"model.embed_tokens.weight": state["model.embed_tokens.weight"],
                          "lm_head.weight": state["lm_head.weight"]})  # two names, one tensor
    other_dtype = BucketSpec.of({"model.norm.weight": state["model.norm.weight"].to(torch.bfloat16)})
    unknown = BucketSpec.of({"model.no_such.weight": torch.zeros(3)})
    for spec in (tied, other_dtype, unknown):
        assert build_arena(model, spec, CPU) is None
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == pointers


def test_an_arena_whose_tensors_were_replaced_is_no_longer_intact(tiny_preset) -> None:
    model = _model(tiny_preset)
    spec = BucketSpec.of({"model.norm.weight": model.state_dict()["model.norm.weight"]})
    arena = build_arena(model, spec, CPU)
    assert arena is not None and arena.intact()
    model.model.norm.weight.data = model.model.norm.weight.data.clone()
    assert not arena.intact()
