"""Who serves what: the routable set of engines and the in-flight count of each.

Owns the pure :class:`~relax.rollout.routing.router.Router` (least in flight, group stickiness, exact counts that
survive an engine's removal, the retry policy for a failed request) and the mirror that keeps an external SGLang
router's worker list equal to it. The fleet decides who joins and leaves the router; dispatch asks it for an
engine per request. It may use the pool and nothing else of the rollout.
"""
