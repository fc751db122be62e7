"""Loading new weights into a running built-in engine: version, outputs, in-flight requests.

(docs/architecture.md, "Weights and staleness".)
"""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from tests.integration.test_builtin_engine import _freeze_running, teacher_forced_logprobs


@pytest.fixture(scope="module")
def engine(tiny_preset, start_engine):
    return start_engine(tiny_preset.model_dir, max_running_requests=8, weight_version="0")


@pytest.fixture(scope="module")
def perturbed_dir(perturbed):
    """The preset model with different weights (what a training step would publish): the shared fixture's."""
    return perturbed[0]


@pytest.fixture(scope="module")
def mismatched_dir(tmp_path_factory):
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    out = tmp_path_factory.mktemp("weights-other")
    Qwen3ForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.fixture
async def client(engine):
    async with httpx.AsyncClient(base_url=engine.url, timeout=60, trust_env=False) as c:
        yield c


async def test_reload_changes_outputs_version_and_keeps_in_flight_requests(
    client, tiny_preset, perturbed_dir, mismatched_dir
) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_preset.model_dir))
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 5?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok.encode(text)
    greedy = {"input_ids": ids, "return_logprob": True,
              "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}}
    before = (await client.post("/generate", json=greedy)).json()
    assert before["meta_info"]["weight_version"] == "0"

    # a long request in flight across the reload, frozen in the batch so it cannot finish before the load
    (in_flight,) = await _freeze_running(client, [
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 230, "ignore_eos": True}}])
    try:
        r = await client.post("/update_weights_from_disk",
                              json={"model_path": str(perturbed_dir), "weight_version": "1"})
        assert r.status_code == 200 and r.json()["success"] is True
    finally:
        await client.post("/continue_generation")

    survivor = (await in_flight).json()
    assert survivor["meta_info"]["finish_reason"] == {"type": "length", "length": 230}
    assert survivor["meta_info"]["weight_version"] == "1"  # the newest version that made a token, as SGLang
    (old, new) = survivor["meta_info"]["weight_versions"]  # it crossed the load: two spans
    assert (old["version"], old["start"], new["version"], new["end"]) == ("0", 0, "1", 230)
    assert 0 < old["end"] == new["start"] < 230

    assert (await client.get("/model_info")).json()["weight_version"] == "1"
    after = (await client.post("/generate", json=greedy)).json()
    assert after["meta_info"]["weight_version"] == "1"
    before_lp = [lp for lp, _, _ in before["meta_info"]["output_token_logprobs"]]
    after_lp = [lp for lp, _, _ in after["meta_info"]["output_token_logprobs"]]
    assert before_lp != after_lp
    expected = teacher_forced_logprobs(perturbed_dir, ids, after["output_ids"], 1.0)
    assert max(abs(a - e) for a, e in zip(after_lp, expected, strict=True)) < 1e-4

    # weights of another shape are refused and the served version is untouched
    r = await client.post("/update_weights_from_disk", json={"model_path": str(mismatched_dir), "weight_version": "2"})
    assert r.status_code == 400 and "do not match" in r.json()["error"]["message"]
    assert (await client.get("/model_info")).json()["weight_version"] == "1"
    assert (await client.post("/generate", json=greedy)).json()["output_ids"] == after["output_ids"]
