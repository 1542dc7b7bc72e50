"""The gateway's HTTP plumbing: connections and their limits, corked writes, the hot routes, the worker
processes, request bodies, disconnects, and the client that talks to the engines."""
