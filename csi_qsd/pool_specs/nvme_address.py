"""The spelling of a userspace NVMe device: `nvme://DOMAIN:BUS:DEVICE.FUNCTION[/NAMESPACE]`.

Apart from the pool so that the configuration can validate it without
importing the pool (which needs the configuration). Strict on purpose: the
address is handed to QSD, which takes the whole PCI function from the host.
"""

from __future__ import annotations

import dataclasses
import re

SCHEME = "nvme://"
# domain:bus:device.function, as sysfs and QEMU spell it (device 00-1f, function 0-7)
PCI_ADDRESS_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[01][0-9a-f]\.[0-7]\Z")
MAX_NAMESPACE = 0xFFFFFFFE  # NVMe NSIDs are 1..2^32-2; 0 and 0xffffffff are not namespaces


@dataclasses.dataclass(frozen=True)
class NvmeAddress:
    """A namespace of a PCI NVMe controller: `nvme://0000:01:00.0/1`."""

    pci: str
    namespace: int = 1

    @classmethod
    def parse(cls, text: str) -> "NvmeAddress":
        """Parse `nvme://DDDD:BB:DD.F[/NSID]` (NSID defaults to 1); raises ValueError naming what is wrong."""
        if not text.startswith(SCHEME):
            raise ValueError(f"{text!r}: an NVMe address starts with {SCHEME}")
        pci, slash, namespace = text[len(SCHEME):].partition("/")
        pci = pci.lower()
        if not PCI_ADDRESS_RE.match(pci):
            raise ValueError(f"{text!r}: PCI address must be DOMAIN:BUS:DEVICE.FUNCTION, e.g. 0000:01:00.0")
        if not slash:
            return cls(pci)
        if not namespace.isdigit() or not 1 <= int(namespace) <= MAX_NAMESPACE:
            raise ValueError(f"{text!r}: namespace must be a number from 1 to {MAX_NAMESPACE}")
        return cls(pci, int(namespace))

    def __str__(self) -> str:
        return f"{SCHEME}{self.pci}/{self.namespace}"
