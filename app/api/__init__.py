"""HTTP routers: parse, authorize, call a service, commit at the boundary."""
