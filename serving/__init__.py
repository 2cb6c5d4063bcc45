"""What kvfleet's two HTTP servers (the engine's and the router's) share: connection limits and timeouts
(`http_limits`) and drain on SIGTERM (`draining`). It sits below both; it imports only `contract/`."""
