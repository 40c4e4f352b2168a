"""Fixtures shared by the socket-level tests (controller/, reliability/)."""

import pytest
import zmq

from specctl.controller import transport


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def endpoints(tmp_path):
    """Default ipc endpoints inside a private runtime dir of this test."""
    return transport.default_endpoints(transport.runtime_dir(tmp_path / "run"))
