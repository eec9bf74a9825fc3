import pytest

from tests.e2e.harness import Job


@pytest.fixture
def job(etcd, tmp_path, request):
    """A job of probe workers; a module marked `socket_probe` gets the torch-free probe."""
    socket_probe = request.node.get_closest_marker("socket_probe") is not None
    created = Job(etcd.endpoint, tmp_path, collective="socket" if socket_probe else "gloo")
    yield created
    created.stop_all()
