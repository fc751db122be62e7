"""The sampler's rules and, above all, the log-probabilities it reports."""

from __future__ import annotations

import torch

from relax.engines.builtin.sampling import sample


def _run(logits, temperature, top_p=1.0, top_k=-1, seed=0):
    rows = logits.shape[0]
    return sample(
        logits,
        torch.full((rows,), float(temperature)),
        torch.full((rows,), float(top_p)),
        torch.full((rows,), int(top_k), dtype=torch.long),
        generator=torch.Generator().manual_seed(seed),
    )


def test_greedy_picks_argmax_and_reports_unscaled_logprob() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    out = _run(logits, temperature=0.0)
    assert out.token_ids.tolist() == [1]
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1)[:, 1])


def test_logprob_is_full_vocab_temperature_scaled_even_with_truncation() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    out = _run(logits, temperature=0.7, top_p=0.5, top_k=5)
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, out.token_ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(out.logprobs, expected, atol=1e-6)


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 30)
    out = _run(logits, temperature=1.0, top_k=1)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_restricts_support() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]]).repeat(200, 1)
    out = _run(logits, temperature=2.0, top_k=2)
    assert set(out.token_ids.tolist()) <= {0, 1}
    assert set(out.token_ids.tolist()) == {0, 1}


def test_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0).repeat(400, 1)
    out = _run(logits, temperature=1.0, top_p=0.75)
    # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: tokens 0 and 1 only
    assert set(out.token_ids.tolist()) == {0, 1}


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().unsqueeze(0).repeat(5000, 1)
    out = _run(logits, temperature=1.0)
    freq = torch.bincount(out.token_ids, minlength=3).float() / 5000
    assert torch.allclose(freq, probs, atol=0.03)


def test_per_row_settings_are_independent() -> None:
    logits = torch.tensor([[0.0, 3.0, 0.0], [0.0, 3.0, 0.0]])
    out = sample(
        logits,
        torch.tensor([0.0, 1.0]),
        torch.tensor([1.0, 1.0]),
        torch.tensor([-1, -1]),
        generator=torch.Generator().manual_seed(0),
    )
    assert out.token_ids[0].item() == 1
    assert torch.allclose(out.logprobs[1], torch.log_softmax(logits[1], -1)[out.token_ids[1]])
