"""Serving over the network: the public gRPC service, admission control, Prometheus,
the router and the role servers of a multi-process deployment, the launcher, the client."""
