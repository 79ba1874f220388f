"""Test support that ships with the package (importable by a plugin author's tests too).

:mod:`hpcfl.testing.fake_accelerator` plays a CUDA device on the CPU, so a machine without a GPU
fails where a ``device: cuda`` run would.
"""
