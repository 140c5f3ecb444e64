"""JAX adapter tests, in a pytest process of their own (tests/test_isolated_suites.py): JAX
reads ``XLA_FLAGS`` once, so eight host devices (for the sharding tests) must be asked for
before anything imports it."""

from __future__ import annotations

import os

DEVICES = 8
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={DEVICES}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

jax = pytest.importorskip("jax")
