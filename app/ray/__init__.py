"""`treadle serve --ray`: treadle replicas behind Ray Serve's HTTP proxy (the `ray` extra; docs/scaling.md).
`deployment` builds the Ray Serve application (the replicas, each running the very app `treadle serve`
runs, and the ingress that aggregates /health and /metrics); `router` chooses a replica by the longest
shared prompt prefix unless that replica is loaded. Nothing here is imported unless `--ray` is given, so
the server runs without Ray installed."""
