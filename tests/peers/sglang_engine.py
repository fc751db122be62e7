"""An engine that takes weight updates as SGLang 0.5.23's weight updater does: a stand-in for a real SGLang server.

Run as ``python -m tests.peers.sglang_engine --model-dir D``; it prints ``READY <port>`` once it listens on
127.0.0.1. Routes, from the contract: ``/health``, ``/model_info`` (``weight_version``), ``/pause_generation``,
``/continue_generation``, ``/init_weights_update_group`` (joins as rank ``rank_offset`` through the
``tcp://`` rendezvous, answers once the group exists), ``/begin_weight_update`` / ``/end_weight_update`` (the
session an update must run in), ``/update_weights_from_distributed`` (receives by broadcast from rank 0: one
per tensor in ``names`` order, or one uint8 buffer with ``load_format: "flattened_bucket"``; dtype names as
``getattr(torch, name)`` reads them; a tensor whose byte offset is not a multiple of its element size is
refused; the version is applied on success), ``/destroy_weights_update_group``. One route of its own,
``POST /peer/logprobs {"input_ids": [...]}``, returns the served model's teacher-forced log-probs of each
token after the first, so a test can check what was loaded.

``--stall-after-buckets N``: the update call after N buckets never reads its broadcast (a hung or dying
engine, for the tests that then kill it).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.peers.sglang_group import sglang_process_group


class PeerState:
    def __init__(self, model_dir: str, stall_after: int | None) -> None:
        # the served weights by checkpoint name; a model is built only to answer /peer/logprobs
        self.params = {name: tensor.float() for f in sorted(Path(model_dir).glob("*.safetensors"))
                       for name, tensor in load_file(str(f)).items()}
        self.model_dir = model_dir
        self.weight_version = "default"
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.in_session = False
        self.paused = False
        self.buckets = 0
        self.stall_after = stall_after
        self.lock = threading.Lock()


def _receive(state: PeerState, body: dict[str, Any]) -> dict[str, torch.Tensor]:
    group = state.groups[body["group_name"]]
    names, shapes = body["names"], body["shapes"]
    dtypes = [getattr(torch, d) for d in body["dtypes"]]
    if body.get("load_format") == "flattened_bucket":
        sizes = [int(torch.Size(s).numel()) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)]
        offset = 0
        for name, size, dtype in zip(names, sizes, dtypes, strict=True):
            if offset % dtype.itemsize:
                raise ValueError(f"{name} starts at byte {offset}, not aligned to {dtype}")
            offset += size
        flat = torch.empty(offset, dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=group)
        out, at = {}, 0
        for name, shape, dtype, size in zip(names, shapes, dtypes, sizes, strict=True):
            out[name] = flat[at:at + size].view(dtype).view(shape)
            at += size
        return out
    out = {}
    for name, shape, dtype in zip(names, shapes, dtypes, strict=True):
        tensor = torch.empty(shape, dtype=dtype)
        dist.broadcast(tensor, src=0, group=group)
        out[name] = tensor
    return out


def make_handler(state: PeerState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet: the test reads stdout for READY
            pass

        def _answer(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path in ("/health", "/health_generate"):
                self._answer(200, {})
            elif self.path == "/model_info":
                self._answer(200, {"model_path": state.model_dir, "weight_version": state.weight_version})
            else:
                self._answer(404, {"error": self.path})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            try:
                self._answer(200, self._route(body))
            except Exception as exc:  # noqa: BLE001 - SGLang answers a failed update with success false and a 400
                self._answer(400, {"success": False, "message": f"{type(exc).__name__}: {exc}"})

        def _route(self, body: dict[str, Any]) -> Any:
            path = self.path
            if path == "/pause_generation":
                state.paused = True
                return {"success": True}
            if path == "/continue_generation":
                state.paused = False
                return {"success": True}
            if path == "/init_weights_update_group":
                name = body.get("group_name", "weight_update_group")
                state.groups[name] = sglang_process_group(
                    body["master_address"], int(body["master_port"]), int(body["rank_offset"]),
                    int(body["world_size"]), name, body.get("backend", "nccl"), 30.0)
                return {"success": True, "message": "Succeeded to initialize custom process group."}
            if path == "/begin_weight_update":
                state.in_session = True
                return {"success": True}
            if path == "/end_weight_update":
                state.in_session = False
                return {"success": True}
            if path == "/update_weights_from_distributed":
                if not state.in_session:
                    raise RuntimeError("must run between begin_weight_update() and end_weight_update()")
                if state.stall_after is not None and state.buckets >= state.stall_after:
                    print("STALLED", flush=True)
                    time.sleep(3600)
                with state.lock:
                    received = _receive(state, body)
                    for name, tensor in received.items():
                        known = state.params.get(name)
                        if known is not None and known.shape != tensor.shape:
                            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, served {tuple(known.shape)}")
                        state.params[name] = tensor.float().clone()
                    state.buckets += 1
                    if body.get("weight_version") is not None:
                        state.weight_version = str(body["weight_version"])
                return {"success": True, "message": "Succeeded to update parameter online."}
            if path == "/destroy_weights_update_group":
                group = state.groups.pop(body.get("group_name", "weight_update_group"))
                dist.destroy_process_group(group)
                return {"success": True}
            if path == "/peer/logprobs":
                from transformers import AutoModelForCausalLM

                ids = torch.tensor([body["input_ids"]])
                with state.lock, torch.no_grad():
                    model = AutoModelForCausalLM.from_pretrained(state.model_dir, dtype=torch.float32).eval()
                    model.load_state_dict(state.params, strict=False)  # a tied head follows its embedding
                    logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
                return [logprobs[i - 1, tok].item() for i, tok in enumerate(body["input_ids"]) if i > 0]
            raise KeyError(f"no route {path}")

    return Handler


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--stall-after-buckets", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(PeerState(args.model_dir, args.stall_after_buckets)))
    print(f"READY {server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
