"""Host plumbing: subprocesses, mounts, loop devices, filesystems, durable files, locks. Knows nothing of volumes.

Everything here is a thin, typed wrapper over a system call or a host tool,
so the layers above read as what they do, not how Linux spells it.

May import: errors.
"""
