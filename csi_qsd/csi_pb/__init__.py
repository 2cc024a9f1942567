"""Generated protobuf and gRPC bindings (see scripts/gen_proto.py): CSI v1.12, and kubelet's plugin registration."""
