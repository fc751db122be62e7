"""The rollout's control surface: what operators, the autoscaler and the driver see and ask.

Owns the REST API and its bodies (``api``, ``api_models``), the ControlPlane actor that serves it (``server``), the
``ManagerClient`` every caller of the manager actor goes through, the views and scale entry points shared by the
manager and the in-process rollout (``backend``), Relax's ``/metrics`` and Prometheus service discovery,
and the run's status snapshot. It reads the fleet, the pool and scaling; nothing below it imports it.
"""
