"""Everything that speaks to qemu-storage-daemon; QMP JSON never leaves this package."""
