"""Rollout replicas on other nodes.

`host` serves one node's replicas over aiohttp (`python -m rpk.cluster.host`), `remote`
is its client (`RemoteReplica`, `NodeTransport`), `nodes` starts the hosts on followers and
finds them through the rendezvous store, `supervise` watches them and names a lost node.
The fleet itself (`rpk.engine`) knows replicas only through their Protocol.
"""
