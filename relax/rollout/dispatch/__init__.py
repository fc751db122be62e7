"""Generation: prompts to groups of samples, each request through the router to an engine and back.

Owns the generation loop (steps gated by staleness, prompts drawn, groups generated and buffered), the
``Dispatcher`` that sends one request with streaming, retries and migration, the pure rules of a request's
journey and of continuing an interrupted generation from its prefix (``journey``, ``migration``), and the
hand-off of a finished step to the trainer ranks. It may use routing and the pool, never the fleet (an engine's
coming and going reaches it as the router's answer) nor the control surface.
"""
