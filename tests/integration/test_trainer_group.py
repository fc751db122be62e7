"""The FSDP2 trainer group on real Ray actors (2 ranks on gloo) with the tiny preset model.

One placement group for the module; the 2-rank group lives for the module, extra groups live inside
their test. Checks: a step moves the policy the way the advantages say; 2 ranks x micro-batches give the
1-rank big-batch result; the gathered weights are a loadable HF model; resume is exact.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.config.flags import LRDecayStyle
from relax.data.sample import Sample
from relax.presets.task import format_answer
from relax.training.actor import TrainerConfig
from relax.training.group import TrainerGroup, TrainerRankError
from relax.weights.buckets import make_buckets, materialize

pytestmark = pytest.mark.timeout(240)

NUM_BUNDLES = 4  # [0, 1]: the module's 2-rank group; [2, 3]: groups created inside a test


@pytest.fixture(scope="module")
def pg(ray_cluster):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"GPU": 1, "CPU": 1}] * NUM_BUNDLES, strategy="PACK")
    ray.get(group.ready(), timeout=60)
    try:
        yield group
    finally:
        remove_placement_group(group)


@pytest.fixture(scope="module")
def config(tiny_preset) -> TrainerConfig:
    return TrainerConfig(
        hf_checkpoint=str(tiny_preset.model_dir), lr=1e-3, weight_decay=0.01, clip_grad=1.0,
        use_tis=True, calculate_per_token_loss=True, micro_batch_size=2, seed=7,
        lr_decay_style=LRDecayStyle.COSINE, lr_decay_iters=50, min_lr=1e-4,  # a rate that differs every step
        use_dynamic_batch_size=True, max_tokens_per_gpu=48,  # micro-batches by a token budget, not by count
        balance_data=True,  # ranks by token count
    )


@pytest.fixture(scope="module")
def group2(pg, config):
    group = TrainerGroup(config, pg, bundle_indices=[0, 1], init_timeout_s=120, call_timeout_s=120)
    try:
        yield group
    finally:
        group.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_preset):
    return AutoTokenizer.from_pretrained(str(tiny_preset.model_dir))


def _prompt_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text)


def _sample(i: int, prompt: list[int], response: list[int], advantage: float, *, mask=None, rollout=()) -> Sample:
    return Sample(prompt_index=i, group_id=f"g{i}", sample_index=0, prompt_token_ids=tuple(prompt),
                  response_token_ids=tuple(response), response_text="", label="", weight_version=0,
                  rollout_step=0, rollout_log_probs=tuple(rollout), loss_mask=mask, advantage=advantage)


def _with_rollout_log_probs(group: TrainerGroup, samples: list[Sample], noise: float, seed: int) -> list[Sample]:
    """Attach engine-like log-probs: the trainer's own plus noise, so TIS weights are not all 1."""
    rng = random.Random(seed)
    lps = group.compute_log_probs(samples)
    return [
        Sample(**{**s.to_dict(), "rollout_log_probs": tuple(x + rng.uniform(-noise, noise) for x in lp)})
        for s, lp in zip(samples, lps, strict=True)
    ]


def _mixed_batch(tokenizer, n: int, seed: int) -> list[Sample]:
    """Different prompt and response lengths, partial loss masks, one sample with no loss token."""
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    out = []
    for i in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        prompt = _prompt_ids(tokenizer, f"What is {a} + {b}?" if i % 2 else f"Compute the sum of {a} and {b}.")
        response = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 9))]
        mask = [1] * len(response)
        if i % 3 == 1 and len(response) > 2:
            mask[0] = 0
        if i == 2:
            mask = [0] * len(response)
        out.append(_sample(i, prompt, response, rng.uniform(-1.5, 1.5), mask=mask))
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# --------------------------------------------------------------------------------------------------


def test_train_step_follows_the_advantages(group2, tokenizer, tiny_preset) -> None:
    prompt = _prompt_ids(tokenizer, "What is 3 + 4?")
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    good = tokenizer.encode(format_answer(7)) + [eos]
    bad = tokenizer.encode(format_answer(12)) + [eos]
    batch = _with_rollout_log_probs(group2, [_sample(0, prompt, good, 1.0), _sample(1, prompt, bad, -1.0)],
                                    noise=0.0, seed=0)
    before = group2.compute_log_probs(batch)
    weights_before = group2.full_state_dict()

    metrics = group2.train_step(batch)

    after = group2.compute_log_probs(batch)
    assert sum(after[0]) > sum(before[0]) + 1e-3  # the positive response became likelier
    assert sum(after[1]) < sum(before[1]) - 1e-3  # the negative one less likely
    assert _max_diff(group2.full_state_dict(), weights_before) > 1e-4
    assert metrics["num_samples"] == 2 and metrics["num_tokens"] == len(good) + len(bad)
    assert metrics["grad_norm"] > 0 and metrics["step"] == 1
    assert abs(metrics["tis_mean"] - 1.0) < 1e-4  # rollout log-probs = trainer's: TIS weight 1
    for key in ("loss", "pg_loss", "clip_frac", "entropy", "wall_time_s"):
        assert key in metrics


def test_bad_samples_fail_on_the_driver_and_leave_the_group_usable(group2, tokenizer) -> None:
    good = _with_rollout_log_probs(group2, _mixed_batch(tokenizer, 2, seed=9), noise=0.0, seed=9)
    no_advantage = Sample(**{**good[0].to_dict(), "advantage": None})
    no_rollout = Sample(**{**good[1].to_dict(), "rollout_log_probs": ()})
    with pytest.raises(ValueError, match="no advantage"):
        group2.train_step([good[1], no_advantage])
    with pytest.raises(ValueError, match="use_tis needs them"):
        group2.train_step([good[0], no_rollout])
    assert len(group2.compute_log_probs(good)) == 2  # no rank was left waiting in a collective


def test_two_ranks_match_one_big_batch(group2, pg, config, tokenizer, tmp_path: Path) -> None:
    """2 ranks (samples balanced by tokens) x micro-batches of at most 48 tokens (and 2 samples) == 1 rank x one
    batch, for token- and sample-mean: the budget and the balance change the memory and the wait, not the
    gradient.

    The 1-rank group starts from the 2-rank group's checkpoint (weights *and* Adam moments), which also
    checks that checkpoints do not depend on the world size.
    """
    ckpt = group2.save(tmp_path / "shared", extra={"step": 1})
    one = TrainerGroup(dataclasses.replace(config, micro_batch_size=None, use_dynamic_batch_size=False), pg,
                       bundle_indices=[2],
                       init_timeout_s=120, call_timeout_s=120)
    try:
        assert one.load(ckpt) == {"step": 1}
        assert _max_diff(one.full_state_dict(), group2.full_state_dict()) == 0.0
        batch = _with_rollout_log_probs(group2, _mixed_batch(tokenizer, 7, seed=1), noise=0.2, seed=1)
        single = _mixed_batch(tokenizer, 1, seed=2)  # one sample on 2 ranks: rank 1 runs a dummy pass
        single = _with_rollout_log_probs(group2, single, noise=0.2, seed=2)
        for samples, aggregation in ((batch, "token_mean"), (batch, "sample_mean"), (single, "token_mean")):
            m2 = group2.train_step(samples, aggregation=aggregation)
            m1 = one.train_step(samples, aggregation=aggregation)
            for key in ("loss", "pg_loss", "grad_norm", "tis_mean", "entropy", "num_tokens", "num_samples"):
                assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), (aggregation, key)
            assert _max_diff(group2.full_state_dict(), one.full_state_dict()) < 1e-5, aggregation
    finally:
        one.shutdown()


def test_full_state_dict_is_a_loadable_hf_model(group2, tiny_preset, tmp_path: Path) -> None:
    state = group2.full_state_dict()
    with safe_open(str(tiny_preset.model_dir / "model.safetensors"), "pt") as f:
        assert set(state) == set(f.keys())  # exactly what save_pretrained wrote (tied lm_head dropped)
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in state.values())
    out = materialize(make_buckets(state, bucket_bytes=64 * 1024), tiny_preset.model_dir, tmp_path / "v1")
    model, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    loaded = model.state_dict()
    for name, tensor in state.items():
        assert torch.equal(loaded[name], tensor), name
    assert torch.equal(loaded["lm_head.weight"], state["model.embed_tokens.weight"])


def test_resume_is_exact(group2, pg, config, tokenizer, tmp_path: Path) -> None:
    batch_a = _with_rollout_log_probs(group2, _mixed_batch(tokenizer, 6, seed=3), noise=0.2, seed=3)
    batch_b = _with_rollout_log_probs(group2, _mixed_batch(tokenizer, 5, seed=4), noise=0.2, seed=4)
    group2.train_step(batch_a)
    ckpt = group2.save(tmp_path / "ckpt", extra={"rollout_step": 12, "data_position": 345})
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer.json").is_file()
    expected_metrics = group2.train_step(batch_b)
    expected = group2.full_state_dict()

    fresh = TrainerGroup(config, pg, bundle_indices=[2, 3], init_timeout_s=120, call_timeout_s=120)
    try:
        assert fresh.load(ckpt) == {"rollout_step": 12, "data_position": 345}
        metrics = fresh.train_step(batch_b)
        assert metrics["step"] == expected_metrics["step"]
        # the schedule goes on from the checkpoint's step, not from its start
        schedule = config.lr_schedule()
        assert metrics["lr"] == expected_metrics["lr"] == pytest.approx(schedule.at(int(metrics["step"]) - 1))
        assert metrics["lr"] < config.lr
        assert metrics["loss"] == pytest.approx(expected_metrics["loss"], abs=1e-7)
        assert _max_diff(fresh.full_state_dict(), expected) <= 1e-6

        expected_error = r"failed in load_checkpoint: RuntimeError: rank 0: loading .*missing"
        with pytest.raises(TrainerRankError, match=expected_error):
            fresh.load(tmp_path / "missing")
    finally:
        fresh.shutdown()


def test_kl_and_entropy_terms_use_a_frozen_reference(pg, config, tokenizer) -> None:
    """With ``kl_loss_coef`` > 0 each rank also shards a reference copy; the loss carries both extra terms."""
    cfg = dataclasses.replace(config, kl_loss_coef=0.5, entropy_coef=0.01, use_tis=False)
    group = TrainerGroup(cfg, pg, bundle_indices=[2, 3], init_timeout_s=120, call_timeout_s=120)
    try:
        assert all(r["reference"] for r in group.info())
        batch = _mixed_batch(tokenizer, 5, seed=5)
        first = group.train_step(batch)
        assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # policy == reference before the first update
        second = group.train_step(batch[:1])  # one sample: rank 1 runs dummy passes through both models
        assert second["kl"] > 0
        for m in (first, second):
            assert m["loss"] - m["pg_loss"] == pytest.approx(0.5 * m["kl"] - 0.01 * m["entropy"], abs=1e-6)
        assert "tis_mean" not in first  # no rollout log-probs in this batch
    finally:
        group.shutdown()


def test_a_rank_killed_between_calls_is_found_by_the_liveness_check(pg, config) -> None:
    """Ray's memory monitor and the OOM killer end a rank with SIGKILL while the driver waits for the rollout
    (no call of its own in flight): ``raise_if_lost`` finds it within a couple of ping intervals, naming the rank."""
    import os
    import signal
    import time

    import ray

    with TrainerGroup(dataclasses.replace(config, micro_batch_size=None, use_dynamic_batch_size=False), pg,
                      bundle_indices=[2], init_timeout_s=120, call_timeout_s=120) as one:
        one.raise_if_lost()  # alive: nothing raised, a check goes out
        pid = ray.get(one._actors[0].info.remote())["pid"]  # the rank as Ray sees it
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        with pytest.raises(TrainerRankError, match="trainer rank 0 failed in its liveness check: ActorDiedError"):
            while time.monotonic() < deadline:
                one.raise_if_lost()
                time.sleep(0.1)  # the driver's own poll between checks (it waits on the rollout meanwhile)
