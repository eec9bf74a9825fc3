"""etcd access: the client facade, leases and the embedded server."""
