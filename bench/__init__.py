"""Everything that measures treadle or loads a server, one module per benchmark: `treadle bench NAME`
runs `bench.NAME.main` (serve: the streaming load generator for any OpenAI-compatible server; soak:
misbehaving clients, then checks that nothing failed or leaked; engine, pool, kv: the engine, the thread
pool and the KV cache in process), `python -m bench.ray_replay` replays conversations against
`treadle serve --ray`, and bench/side_by_side.py runs the serving load against treadle and its peers
(the `*_peer.py` launchers). The server never imports this package; the benchmarks and the tests share
its readers of server-sent events and Prometheus text."""
