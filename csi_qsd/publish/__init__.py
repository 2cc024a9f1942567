"""How a staged volume reaches a pod: a filesystem, a block device file or a vhost-user socket.

May import: errors, sys.
"""
