"""The command line: `csi-qsd serve`, `snapshot-metadata-router`, `qsd-run`, `qsd-stop` and `volume …`.

One module per command (`serve`, `metadata_router`, `qsd_run`,
`qsd_stop`, `volume` with its actions in `volume_actions`), each with
`add_parser` and `run`; `entry` wires them into one parser and `main`.
`common` holds what several share (the flag ⇄ `CSI_QSD_*` rule, the flags
of serve and qsd-run, the `Config` they build), `arg_types` the flag value
parsers, `for_people` how an answer or an error reaches a person. `client`
is the CSI protocol from the caller's side, for people and tools, and
`present` shows its answers as tables or JSON lines. This is the only
package that reads flags and environment variables.

May import: errors, validate, sys, qcow2, params, catalog, pool_specs, qsd, pools, publish, exports, copy_terms, controller, node, config, transport, csi, backup, router, server, metrics.
"""

from csi_qsd.cli.common import config_from, env_name
from csi_qsd.cli.entry import build_parser, main
from csi_qsd.cli.for_people import error_line, for_a_person
from csi_qsd.cli.metadata_router import router_config_from

__all__ = ["build_parser", "config_from", "env_name", "error_line", "for_a_person", "main", "router_config_from"]
