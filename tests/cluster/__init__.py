"""Test harnesses for what a single machine hides: a Hugging Face cache in the hub's layout, and a Ray
cluster whose nodes have their own network namespaces (own loopback, own address)."""
