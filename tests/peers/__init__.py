"""Peers written from SGLang's side of its contract (../shared/SGLANG-CONTRACT.md), to test Relax against.

Two ends written by Relax prove only that they agree with each other, so these are written from the contract's
facts (routes, bodies, the way the weight-update process group is built), not from Relax's code: they import
nothing from ``relax``. ``sglang_trainer`` is a trainer as slime/verl/OpenRLHF build theirs; ``sglang_engine``
is an engine that joins and receives as SGLang's weight updater does.
"""
