"""The thin gRPC layer: validate a request, call the domain, build the response.

gRPC message types never leave this package; domain errors are mapped to
status codes in exactly one place, `errors.rpc`.
"""
