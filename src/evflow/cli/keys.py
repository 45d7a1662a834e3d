"""``evflow keys DIR``: make CURVE key pairs for tcp channels.

::

    evflow keys keys/                  # keys/server.key(_secret), keys/client.key(_secret)
    evflow keys keys/ --names h1 h2 h3 # one pair per host

``NAME.key`` is the public key (give it to peers: a client's ``curveServerKey``, a
server's allow-list directory ``curveAllow``); ``NAME.key_secret`` is the pair, mode
0600, and stays on its host. See docs/farm.md.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "keys",
        help="make CURVE key pairs (NAME.key public, NAME.key_secret private)",
        description="Write CURVE key pairs into DIR (created with mode 0700).",
    )
    parser.add_argument("directory", metavar="DIR")
    parser.add_argument(
        "--names",
        nargs="+",
        default=["server", "client"],
        metavar="NAME",
        help="one key pair per name (default: server client)",
    )
    parser.set_defaults(func=_handle)


def _handle(args: argparse.Namespace) -> int:
    from evflow.transport.curve import create_keys

    for public, secret in create_keys(args.directory, list(args.names)):
        print(f"{public}  (public)   {secret}  (secret, mode 0600)")
    return 0
