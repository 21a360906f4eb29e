"""Fixtures shared by the router tests."""

from __future__ import annotations

import pytest

import ray_cluster  # tests/router/ray_cluster.py


@pytest.fixture(scope="session")
def ray_head():
    """(process, address) of one Ray head for the whole test process (ray_cluster.head):
    test_ray_remote.py and test_ray_points.py share it (scheduled on one xdist worker)."""
    if not ray_cluster.HAVE_RAY or ray_cluster.RAY is None:
        pytest.skip("ray, or its command, is not installed")
    with ray_cluster.head() as started:
        yield started
