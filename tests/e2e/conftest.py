import pytest

from tests.e2e.harness import Job


@pytest.fixture
def job(etcd, tmp_path):
    created = Job(etcd.endpoint, tmp_path)
    yield created
    created.stop_all()
