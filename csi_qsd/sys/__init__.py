"""Host plumbing: subprocesses, mounts, loop devices, filesystems. Knows nothing of volumes."""
