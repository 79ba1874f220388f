"""Differential privacy: client-level DP-FedAvg (adaptive clipping) and sample-level DP-SGD.

The config section lives in :mod:`hpcfl.privacy.section` (no torch); the mechanisms in
:mod:`hpcfl.privacy.private` and :mod:`hpcfl.privacy.sgd`; accounting through Opacus in
:mod:`hpcfl.privacy.accountant`; :func:`hpcfl.privacy.build.make_private` wires a run.
"""
