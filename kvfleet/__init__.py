"""kvfleet: the product's command line (`kvfleet engine|router|up|bench|profile|capacity|...`, cli.py). The
serving parts live in engine/, router/, contract/ and deploy/; cli.py dispatches to them. What lives here: what
both servers share (draining.py, http_limits.py) and the commands that judge a serving stack on your traffic:
bench/ (`kvfleet bench`), profile.py, capacity.py, with the seeded workloads (workload.py) and the locations
of the peers and shared traces (peers.py) they and the benchmarks under loadtest/ use."""
