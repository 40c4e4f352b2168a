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
    return transport.default_endpoints(transport.runtime_dir(tmp_path / "run"))
