"""Test doubles shipped with Relax: stand-ins that let tests and benchmarks run without the real thing.

Importing this package is cheap: it imports nothing; import the module you need (``relax.testing.<module>``).
The local elastic Ray cluster behind ``relax cluster up`` is product code: ``relax.cluster.local_elastic``.
"""
