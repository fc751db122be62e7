"""The engines' lifecycle: scale-out, bring-up, joins, drains, evictions, failures and their replacement.

Owns :class:`~relax.rollout.fleet.lifecycle.EngineFleet` (the shell that carries every transition out: launch,
health, first refit, into and out of the router, drain, stop), the :class:`~relax.rollout.fleet.executor.ScaleExecutor`
that runs the plans of ``rollout.scaling`` for every caller, and the pure rules beside them: bring-up phases and why
a bring-up stopped (``bringup``), which engines a drain notice evicts and with what budget (``eviction``), how joins
are recorded (``joins``). It may use the pool, routing, the refit and scaling; it never imports dispatch (the
requests in flight reach it only as the router's counts) or the control surface.
"""
