"""Kademlia membership (issue #3): signed peer records and stage discovery."""
