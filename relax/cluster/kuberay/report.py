"""The answer the user reads: every finding, and for a plan whether it fits, as lines and a verdict."""

from __future__ import annotations

from dataclasses import dataclass

from relax.cluster.kuberay.documents import Document
from relax.cluster.kuberay.findings import Finding, Rule
from relax.cluster.kuberay.fit import describe_fit, plan_fit
from relax.cluster.kuberay.groups import cluster_groups
from relax.cluster.kuberay.rules import check_documents
from relax.cluster.kuberay.schema import source_release
from relax.config.plan import Plan


@dataclass(frozen=True)
class ManifestReport:
    findings: tuple[Finding, ...]
    lines: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.findings


def _cluster_specs(documents: list[Document]) -> list[tuple[str, dict]]:
    specs = [(d.label, d.body.get("spec") or {}) for d in documents if d.kind == "RayCluster"]
    specs += [(f"{d.label}: spec.rayClusterSpec", (d.body.get("spec") or {}).get("rayClusterSpec"))
              for d in documents if d.kind == "RayJob" and isinstance(d.body.get("spec"), dict)]
    return [(label, spec) for label, spec in specs if isinstance(spec, dict) and isinstance(
        spec.get("headGroupSpec"), dict)]


def manifest_report(documents: list[Document], node_group: str, plan: Plan | None = None) -> ManifestReport:
    """Findings of every rule (the plan's too, given one), with a verdict per RayCluster for the plan."""
    findings = tuple(check_documents(documents, node_group=node_group, plan=plan))
    lines: list[str] = []
    specs = _cluster_specs(documents) if plan is not None else []
    if plan is not None:
        if not specs:
            lines.append("no RayCluster among these manifests (a RayJob with clusterSelector only names one); "
                         "pass the RayCluster's manifest")
        lines += [describe_fit(plan_fit(plan, cluster_groups(spec)), label) for label, spec in specs]
    lines += [f.line() for f in findings if f.rule is not Rule.PLAN_FIT]
    kinds = sorted({d.kind for d in documents})
    verdict = "no problems" if not findings else f"{len(findings)} problem(s)"
    lines.append(f"checked {len(documents)} object(s) ({', '.join(kinds)}) against {source_release()} "
                 f"and Relax's rules: {verdict}")
    if plan is not None and not specs:  # nothing to fit the plan to: not a pass
        findings += (Finding(Rule.PLAN_FIT, "manifests", "no RayCluster to check"),)
    return ManifestReport(findings, tuple(lines))
