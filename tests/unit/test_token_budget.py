"""Micro-batches by a token budget (``--use-dynamic-batch-size --max-tokens-per-gpu``, ``training.sharding``):
each holds at most the budget, padding included; every rank runs the same number; the recipe's flags give
micro-batches of at most 9,216 tokens."""

from __future__ import annotations

import random
from pathlib import Path

from relax.config.flags import parse_args
from relax.training.actor import TrainerConfig
from relax.training.sharding import BatchPlan, micro_batch_count, micro_batches, pack_by_tokens, shard_batch
from tests.unit.test_plan import recipe_qwen3_4b_args


def padded(pack: list[int], lengths: list[int]) -> int:
    return len(pack) * max(lengths[i] for i in pack)


def test_every_sample_once_and_no_micro_batch_over_the_budget_padding_included() -> None:
    rng = random.Random(3)
    for _ in range(200):
        lengths = [rng.randint(1, 700) for _ in range(rng.randint(1, 64))]
        budget = rng.randint(700, 4000)
        packs = pack_by_tokens(lengths, budget)
        assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
        assert all(padded(p, lengths) <= budget for p in packs)
        assert all(p == sorted(p) for p in packs)


def test_a_sample_over_the_budget_is_alone_and_the_count_cap_holds() -> None:
    assert pack_by_tokens([100, 5000, 100, 100], 300) == [[1], [0, 2, 3]]
    assert pack_by_tokens([10] * 5, 1000, max_count=2) == [[0, 1], [2, 3], [4]]
    assert pack_by_tokens([60, 10, 10, 10], 100) == [[0], [1, 2, 3]]  # similar lengths share: little padding


def sample(prompt: int, response: int) -> dict:
    return {"prompt_token_ids": [1] * prompt, "response_token_ids": [2] * response, "advantage": 1.0,
            "group_id": "g", "sample_index": 0}


def test_every_rank_runs_the_most_micro_batches_any_rank_needs() -> None:
    plan = BatchPlan(world_size=2, max_tokens=1000)
    batch = shard_batch([sample(100, 800)] * 3 + [sample(100, 100)] * 3, plan)
    assert [len(micro_batches(s, plan)) for s in batch.shards] == [3, 1]  # rank 0: three of 900; rank 1: one
    assert batch.num_micro_batches == micro_batch_count(batch.shards, plan) == 3
    by_count = BatchPlan(world_size=2, micro_batch_size=2)  # without a budget: by sample count, as before
    assert shard_batch([sample(1, 1)] * 7, by_count).num_micro_batches == 2


def test_the_recipe_flags_give_micro_batches_of_at_most_9216_tokens(tmp_path: Path) -> None:
    yaml = tmp_path / "a.yaml"
    yaml.write_text("enabled: true\nmin_engines: 4\nmax_engines: 8\n")
    config = TrainerConfig.from_args(parse_args(recipe_qwen3_4b_args(str(yaml))))
    assert config.token_budget == 9216
    plan = BatchPlan(world_size=4, max_tokens=config.token_budget)
    rng = random.Random(0)  # the recipe's step: 256 samples of a few hundred prompt and up to 8k response tokens
    samples = [sample(rng.randint(100, 600), rng.randint(50, 8192)) for _ in range(256)]
    for shard in shard_batch(samples, plan).shards:
        lengths = [len(s["prompt_token_ids"]) + len(s["response_token_ids"]) for s in shard]
        assert all(padded(p, lengths) <= 9216 for p in micro_batches(shard, plan))


def test_balance_data_evens_the_ranks_token_counts_and_keeps_every_sample_once() -> None:
    lengths = [900, 120, 110, 100, 90, 80, 70, 60]
    samples = [sample(10, n - 10) | {"sample_index": i} for i, n in enumerate(lengths)]
    even = shard_batch(samples, BatchPlan(world_size=2))
    balanced = shard_batch(samples, BatchPlan(world_size=2, balance_tokens=True))

    def tokens(shards: list[list[dict]]) -> list[int]:
        return [sum(len(s["prompt_token_ids"]) + len(s["response_token_ids"]) for s in shard) for shard in shards]

    assert tokens(even.shards) == [1230, 300]
    assert tokens(balanced.shards) == [900, 630]  # the long sample alone on one rank: as even as it gets
    assert sorted(s["sample_index"] for shard in balanced.shards for s in shard) == list(range(8))
    assert balanced.denominator == even.denominator
