"""``/weights_checker`` on the built-in engine: SGLang 0.5.23's checksum action, in SGLang's answer shape.

A refit is verified by comparing what the engine serves with what the trainer published
(``relax.weights.digest``), so both engines must answer the same question the same way: per served tensor
the first 8 bytes of the SHA-256 of its bytes, and ``per_gpu_checksum`` over all of them. The built-in engine
serves the Hugging Face model, so its names are HF names (layout ``hf``); a tensor held under two names (a tied
``lm_head``) is reported once, under the name a checkpoint keeps (the embedding), as a publication carries it.

Only ``checksum`` is implemented; SGLang's ``snapshot``/``compare``/``reset_tensors`` are debugging actions that
Relax does not use, refused with a 400 naming the one that is.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, StrictBool

from relax.weights.digest import ChecksumLayout, layout_checksums, version_digest

__all__ = ["WeightsCheckerBody", "served_state", "weights_checksum_answer"]

_HEAD = "lm_head.weight"


class WeightsCheckerBody(BaseModel):
    """SGLang's ``CheckWeightsReqInput``."""

    model_config = ConfigDict(extra="forbid")

    action: str = "checksum"
    allow_quant_error: StrictBool = False
    skip_tensor_list: list[str] | None = None
    selector: str = "all"


def served_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors by HF name, one name per storage (a tied head goes under the embedding's name)."""
    by_storage: dict[tuple[int, int], list[str]] = {}
    state = model.state_dict()
    for name, tensor in state.items():
        by_storage.setdefault((tensor.data_ptr(), tensor.numel()), []).append(name)
    keep = [next((n for n in names if n != _HEAD), names[0]) for names in by_storage.values()]
    return {name: state[name] for name in keep}


def weights_checksum_answer(model: torch.nn.Module, body: WeightsCheckerBody) -> dict[str, Any] | None:
    """The answer to ``body`` (None: an action this engine does not implement)."""
    if body.action != "checksum":
        return None
    state = {n: t for n, t in served_state(model).items()
             if not any(skip in n for skip in body.skip_tensor_list or ())}
    checksums = layout_checksums(state, ChecksumLayout.HF)
    overall = version_digest(checksums)
    # parallelism_info is a list, as SGLang 0.5.23 answers it (one entry per runner role; here the target only)
    rank = {"checksums": checksums, "per_gpu_checksum": overall,
            "parallelism_info": [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                  "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]}
    return {"success": True, "message": f"checksum computed for {len(checksums)} tensors", "ranks": [rank],
            "per_engine_checksum": hashlib.sha256(overall.encode()).hexdigest()}
