"""``relax kuberay check PATH...``: check KubeRay manifests offline before ``kubectl apply``.

Each PATH is a manifest file or a kustomize directory (rendered with ``kubectl kustomize``). Every finding is one
line naming the object, the field and what to change; the exit status is 0 when there are none, 1 otherwise,
2 when a PATH cannot be read. Whether a run's plan fits is the driver's ``--dry-run --ray-cluster-manifest``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from relax.config.flags import ConfigError


def add_kuberay_parser(subparsers: Any) -> None:
    kuberay = subparsers.add_parser("kuberay", help="check KubeRay manifests offline (schema and Relax's rules)")
    sub = kuberay.add_subparsers(dest="kuberay_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate RayCluster/RayJob manifests or kustomize directories")
    check.add_argument("paths", nargs="+", metavar="PATH", help="a manifest file or a kustomize directory")
    check.add_argument("--node-group", default=None,
                       help="marker prefix G of the stable group ({G}_gpu, {G}_cpu; default "
                            "$RELAX_INITIAL_NODE_GROUP, else stable)")
    check.set_defaults(func=_cmd_check)


def _cmd_check(args: argparse.Namespace) -> int:
    from relax.cluster.kuberay.render import load_manifests
    from relax.cluster.kuberay.report import manifest_report
    from relax.config.plan import node_group_name

    status = 0
    try:
        group = node_group_name({"RELAX_INITIAL_NODE_GROUP": args.node_group} if args.node_group else os.environ)
    except ConfigError as error:
        print(f"relax kuberay check: error: {error}", file=sys.stderr)
        return 2
    for path in args.paths:
        try:
            documents = load_manifests(path)
        except ConfigError as error:
            print(f"relax kuberay check: error: {error}", file=sys.stderr)
            return 2
        report = manifest_report(documents, node_group=group)
        print("\n".join(report.lines))
        status = status or (0 if report.ok else 1)
    return status
