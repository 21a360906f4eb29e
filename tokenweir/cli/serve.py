"""`tokenweir serve`: one engine (tokenweir/server), or with --data-parallel-size N > 1, N
replicas behind the router (tokenweir/router/dp.py). The choice is made here, above both
packages, so that neither imports the other's entry point."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    if args.data_parallel_size < 1:
        raise SystemExit(f"tokenweir serve: --data-parallel-size must be >= 1, got "
                         f"{args.data_parallel_size}")
    if args.data_parallel_size > 1:
        from tokenweir.router.dp import run_data_parallel

        return run_data_parallel(args)
    from tokenweir.server.cli import run_serve

    return run_serve(args)
