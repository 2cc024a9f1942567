"""Generated CSI v1.12 protobuf and gRPC bindings (see scripts/gen_proto.py)."""
