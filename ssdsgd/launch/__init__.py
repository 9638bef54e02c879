"""Launchers: start a scheduler, S servers and N workers, watch them, stop them all.

A launcher is a small class with one interface (``start`` a role's process, ``stop`` it);
``local`` runs everything on this machine. ``job.run_job`` holds what every launcher
shares: ports, environment, output prefixes, failure handling, no orphans.
"""
