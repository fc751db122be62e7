"""``python -m relax.engines.vllm``: one vLLM engine as Relax runs it, the front on the port and vLLM behind it.

Launch mode (``--vllm-python``): the front starts vLLM itself on a socket in a fresh private directory, with a key
of its own, waits until it is healthy, serves, and stops it on the way out; everything after ``--`` goes to vLLM
(a flag given there wins over Relax's CPU choices, ``relax.engines.vllm.options``). Attach mode
(``--upstream-uds``): a vLLM already running on that socket (its key in ``RELAX_VLLM_UPSTREAM_KEY``).

Keys come from the environment, never argv: ``RELAX_ENGINE_API_KEY`` (generation) and
``RELAX_ENGINE_ADMIN_API_KEY`` (control), as for the built-in engine. A listener beyond loopback needs both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import signal
import sys
from pathlib import Path

import aiohttp

from relax import argtypes
from relax.config.checks import is_loopback_host
from relax.engines.keys import EngineKeys
from relax.engines.vllm.front import FrontState, Upstream, create_app, upstream_message
from relax.engines.vllm.options import VllmOptionError, cpu_model_problem, vllm_argv, vllm_env
from relax.engines.vllm.server_process import VllmProcess, VllmStartError

PROG = "python -m relax.engines.vllm"
KEY_ENV = ("RELAX_ENGINE_API_KEY", "RELAX_ENGINE_ADMIN_API_KEY", "RELAX_VLLM_UPSTREAM_KEY")
log = logging.getLogger("relax.engines.vllm")
#: Seconds a stop waits for requests in flight before it cancels them (as long as the built-in engine waits).
SHUTDOWN_GRACE_S = 1.0
#: Seconds vLLM gets to stop by itself when stopped mid-start (it may not handle SIGTERM yet; it serves nothing).
STARTING_GRACE_S = 5.0


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The front's flags, and vLLM's (everything after ``--``)."""
    ours, vllm_flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=argtypes.port, required=True)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--vllm-python", help="the Python of vLLM's environment: start vLLM behind the front")
    where.add_argument("--upstream-uds", help="the Unix socket of a vLLM already running (its --uds)")
    parser.add_argument("--model-path", required=True, help="the model vLLM serves (a Hugging Face directory)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda where /dev/nvidiactl exists and CUDA_VISIBLE_DEVICES is not empty")
    parser.add_argument("--weight-version", default="0", help="the label the weights start with (default 0)")
    parser.add_argument("--startup-timeout", type=argtypes.positive_float, default=600.0,
                        help="seconds for vLLM to become healthy (default 600)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser.parse_args(ours), vllm_flags


def on_cpu(device: str, environ: dict[str, str]) -> bool:
    if device != "auto":
        return device == "cpu"
    hidden = environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    return hidden or not os.path.exists("/dev/nvidiactl")


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args, vllm_flags = parse_args(list(sys.argv[1:] if argv is None else argv))
    keys = EngineKeys(os.environ.get("RELAX_ENGINE_API_KEY") or None,
                      os.environ.get("RELAX_ENGINE_ADMIN_API_KEY") or None)
    if not is_loopback_host(args.host) and not (keys.generation and keys.admin):
        return _fail(f"--host {args.host} is reachable from other machines; set RELAX_ENGINE_API_KEY and "
                     "RELAX_ENGINE_ADMIN_API_KEY, or listen on 127.0.0.1")
    if vllm_flags and not args.vllm_python:
        return _fail("vLLM flags after -- need --vllm-python (with --upstream-uds vLLM is already running)")
    cpu = on_cpu(args.device, dict(os.environ))
    process: VllmProcess | None = None
    if args.vllm_python:
        config_path = Path(args.model_path) / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            return _fail(f"--model-path {args.model_path}: no readable config.json ({exc})")
        problem = cpu_model_problem(config) if cpu else None
        if problem:
            return _fail(f"--model-path {args.model_path}: {problem}")
        workdir = VllmProcess.private_dir()
        socket, key = str(Path(workdir) / "vllm.sock"), secrets.token_hex(16)
        try:
            command = vllm_argv(args.vllm_python, args.model_path, socket, vllm_flags, on_cpu=cpu)
        except VllmOptionError as exc:
            os.rmdir(workdir)
            return _fail(str(exc))
        env = vllm_env({k: v for k, v in os.environ.items() if k not in KEY_ENV}, workdir, key, on_cpu=cpu)
    else:
        socket, key = args.upstream_uds, os.environ.get("RELAX_VLLM_UPSTREAM_KEY") or None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    upstream = Upstream(socket, key)
    state = FrontState(version=args.weight_version, model_path=args.model_path)
    if args.vllm_python:
        process = VllmProcess.start(command, env, workdir, socket)
    try:
        return asyncio.run(_run(args, keys, upstream, state, process))
    except VllmStartError as exc:
        return _fail(str(exc))
    finally:
        if process is not None:
            process.stop()


async def _run(args: argparse.Namespace, keys: EngineKeys, upstream: Upstream, state: FrontState,
               process: VllmProcess | None) -> int:
    import uvicorn

    try:
        if process is not None:
            # a stop asked for while vLLM starts ends the start (uvicorn handles the signals once it serves)
            loop, task = asyncio.get_running_loop(), asyncio.current_task()
            assert task is not None
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, task.cancel)
            try:
                took = await process.wait_healthy(lambda: _healthy(upstream), args.startup_timeout)
            except asyncio.CancelledError:
                log.info("stopped while vLLM was starting")
                await asyncio.to_thread(process.stop, STARTING_GRACE_S)  # nothing to drain: a short grace
                return 0
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            log.info("vLLM healthy after %.1f s", took)
        # vLLM labels its weights "default" until told otherwise: the front's label from the first token on
        answer = await upstream.call("POST", "/update_weight_version", json={"new_version": state.version})
        if answer.status != 200:
            raise VllmStartError(f"could not label vLLM's weights: {upstream_message(answer)}")
        async def stop_vllm() -> None:
            if process is not None:
                await asyncio.to_thread(process.stop)

        # on SIGTERM uvicorn waits for requests in flight, at most SHUTDOWN_GRACE_S (a stream held by a pause
        # never ends by itself; its caller retries elsewhere), then stops vLLM
        config = uvicorn.Config(create_app(upstream, keys, state, on_shutdown=stop_vllm), host=args.host,
                                port=args.port, log_level=args.log_level, access_log=False,
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        await uvicorn.Server(config).serve()
        return 0
    finally:
        await upstream.close()


async def _healthy(upstream: Upstream) -> bool:
    return (await upstream.call("GET", "/health", timeout=aiohttp.ClientTimeout(total=5))).status == 200


if __name__ == "__main__":
    sys.exit(main())
