"""Helpers over real parts, shared by the test modules of `tests/` and `e2e/`, so that no test module imports another.

`tests/fakes` holds doubles for the unit tier; these drive the real things
the integration and e2e tiers run on (root, loop devices, QSD, cgroups,
the driver's own listeners), on top of `testing/harness.py`, which runs the
driver itself. Nothing here is a test, and nothing in `csi_qsd` imports it.

* `nvme_pools`: `FakeNVMe`, a loop device under a stable name standing
  in for a drive, and a device pool's capacity, extents and bytes on it.
* `writers`: `Writer`, a thread keeping a published filesystem in use with
  blocks it can check afterwards; `fs_bytes`.
* `written_blocks`: `BlockDevice`, writes that remember the granules they
  touched, and `check_delta`, GetMetadataDelta against the truth.
* `parallel_io`: private cgroups, verified fio jobs in each at once, and a
  published volume for them with its loop device's mode.
* `metrics_scrape`: `scrape`, one parsed /metrics exposition.
* `cli_process`: `csi-qsd` as a child process, and the qsd container's command.
* `shard_placement`: a claim namespace the driver places on a given shard.
* `fuzz_codes`: `ALLOWED`, the codes the spec allows each RPC, by which
  the fuzz test and the load bench judge every answer.
* `vhost_clients`: VM clients coming and going (`come_and_go`) while other
  volumes change (`graph_round`), for the vhost churn test and bench.
"""
