"""Generated protobuf and gRPC bindings of CSI v1.12 (see scripts/gen_proto.py)."""
