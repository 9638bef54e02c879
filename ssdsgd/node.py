"""Entry point of the non-worker roles: ``python -m ssdsgd.node`` runs the scheduler or a
server, as SSDSGD_ROLE says (the launcher sets it; workers run the user's script)."""
import sys

from .kvstore import scheduler, server


def main():
    import os
    role = os.environ.get("SSDSGD_ROLE")
    if role == "scheduler":
        return scheduler.main()
    if role == "server":
        return server.main()
    print(f"ssdsgd.node: SSDSGD_ROLE must be scheduler or server, not {role!r} "
          "(workers run the training script itself)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
