"""The router: an OpenAI-compatible front that forwards each request to one `tokenweir serve`
replica, chosen by a routing policy of tokenweir/routing (the simulator's own classes).

replicas.py  the replicas, their health and reported load, and the requests in flight on each
flight.py    one forwarded request: its upstream exchange, cancellable when its replica fails
forward.py   choosing, retrying once, and relaying (SSE or whole answers)
metrics.py   /metrics: every replica's, with a `replica` label, and the router's own
app.py       create_router_app(): routes, middleware (server/'s API key and body limit)
cli.py       `tokenweir router`; dp.py: `tokenweir serve --data-parallel-size N`
"""
