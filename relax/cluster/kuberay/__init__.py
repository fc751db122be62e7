"""KubeRay manifests, read offline: the RayCluster and RayJob a Relax run is deployed with on Kubernetes.

What it owns: reading manifests (``documents``), KubeRay v1.7.0's own schema in strict mode (``schema``, over the
vendored ``schemas/``), the rules KubeRay checks in Go and the ones the recipe needs (``rules``), the Ray
resources a RayCluster gives each group as the operator derives them (``groups``), the grace a platform
really gives a pod (``grace``), and whether a run's plan fits a cluster (``fit``, in the words of the live
start-up check). Everything but ``documents`` and ``cli`` is pure: no Kubernetes API server, no network, no
cluster; what a manifest says is all it reads.
"""
