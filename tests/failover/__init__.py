"""Tests against a real Patroni + etcd cluster that they start and stop themselves."""
