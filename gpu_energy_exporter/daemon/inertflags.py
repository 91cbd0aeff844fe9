"""Flags given to a collector that is disabled: one warning per such collector, naming the flag that enables
it (issue 31). Pure, over the flag table (``daemon.config.FLAGS``): never reads a file or the clock."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_energy_exporter.daemon.config import Config


def inert_flags(ns: argparse.Namespace, environ: Mapping[str, str], cfg: Config) -> list[str]:
    """One warning per disabled collector whose flags were given (on the command line or in the environment):
    they have no effect, and the warning names the flag that enables the collector. Pure, over the flag
    table: a flag belongs to the collector its ``collector`` names."""
    from gpu_energy_exporter.daemon.config import COLLECTORS, FLAGS

    given: dict[str, list[str]] = {}
    for flag in FLAGS:
        if not flag.collector or cfg.enabled(flag.collector):
            continue
        if getattr(ns, flag.dest, None) is not None:
            given.setdefault(flag.collector, []).append("--" + flag.name)
        elif flag.env in environ:
            given.setdefault(flag.collector, []).append(flag.env)
    warnings = []
    for c in COLLECTORS:
        if c.name not in given:
            continue
        names = given[c.name]
        verb = "has" if len(names) == 1 else "have"
        if getattr(ns, c.dest, None) is False:
            why, fix = f"--no-collector.{c.name}", f"remove --no-collector.{c.name}"
        elif c.env in environ:
            why, fix = f"{c.env}={environ[c.env]}", f"set {c.env}=true or pass --collector.{c.name}"
        else:
            why, fix = "its default", f"add --collector.{c.name}"
        warnings.append(f"{', '.join(names)} {verb} no effect: the {c.name} collector is disabled ({why}); "
                        f"{fix} to use {'it' if len(names) == 1 else 'them'}")
    return warnings
