"""Compute kernels: Triton kernels, each with a pure-torch twin in ``kernels.reference``.

Imports nothing from the rest of the project."""
