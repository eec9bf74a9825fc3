"""Rendezvous: pure round rules (`protocol`) driven on etcd (`handler`)."""
